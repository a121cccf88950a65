"""The stacked per-row LoRA products (strata.model.lora_batch) against the per-adapter formula."""

from __future__ import annotations

import torch

from strata.model.lora import LoraAdapter, LoraLayer, LoraPair
from strata.model.lora_batch import StackCache, step_loras

IN, OUT = 16, 12


def adapter(name: str, rank: int, seed: int, *, has_o: bool = True) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)

    def pair() -> LoraPair:
        return LoraPair(torch.randn(rank, IN, generator=gen), torch.randn(OUT, rank, generator=gen))
    return LoraAdapter(name, "", f"digest-{name}", rank, 1.0,
                       [LoraLayer(qkv=pair(), o=pair() if has_o else None, gate_up=None,
                                  down=None)])


def reference(out: torch.Tensor, x: torch.Tensor, rows: list[tuple[LoraAdapter, list[int]]],
              which: str) -> torch.Tensor:
    want = out.clone()
    for a, idx in rows:
        pair = getattr(a.layers[0], which)
        if pair is not None:
            for r in idx:
                want[r] += (x[r] @ pair.a.T) @ pair.b.T
    return want


def test_each_row_gets_its_own_adapter_and_base_rows_nothing() -> None:
    a, b = adapter("a", 4, 1), adapter("b", 8, 2, has_o=False)  # other ranks, other modules
    rows = [(a, [0, 3, 4]), (b, [1, 5])]  # rows 2 and 6 are the base's
    x, out = torch.randn(7, IN), torch.randn(OUT * 7).view(7, OUT)
    step = step_loras(StackCache(), rows, 7, "cpu")
    assert step is not None and not step.every_row_one_adapter
    for which in ("qkv", "o"):
        got = step.apply(out.clone(), x, 0, which)
        torch.testing.assert_close(got, reference(out, x, rows, which))
        assert torch.equal(got[[2, 6]], out[[2, 6]])  # exactly untouched
    assert step.stack.site(0, "gate_up") is None
    assert torch.equal(step.apply(out.clone(), x, 0, "gate_up"), out)


def test_one_adapter_on_every_row_needs_no_mask_and_none_means_the_base() -> None:
    a = adapter("a", 4, 3)
    x, out = torch.randn(3, IN), torch.randn(3, OUT)
    step = step_loras(StackCache(), [(a, [0, 1, 2])], 3, "cpu")
    assert step is not None and step.every_row_one_adapter
    torch.testing.assert_close(step.apply(out.clone(), x, 0, "qkv"),
                               reference(out, x, [(a, [0, 1, 2])], "qkv"))
    assert step_loras(StackCache(), [], 3, "cpu") is None


def test_stacks_are_kept_per_adapter_set_whatever_the_order_and_forgotten_on_removal() -> None:
    a, b, c = adapter("a", 4, 1), adapter("b", 4, 2), adapter("c", 4, 3)
    cache = StackCache(capacity=2)
    first = step_loras(cache, [(a, [0]), (b, [1])], 2, "cpu")
    again = step_loras(cache, [(b, [0]), (a, [1])], 2, "cpu")
    assert first is not None and again is not None and first.stack is again.stack
    step_loras(cache, [(c, [0])], 1, "cpu")
    step_loras(cache, [(a, [0])], 1, "cpu")  # a third set: the oldest ({a, b}) goes
    newest = step_loras(cache, [(a, [0]), (b, [1])], 2, "cpu")
    assert newest is not None and newest.stack is not first.stack
    cache.forget("digest-a")
    after = step_loras(cache, [(a, [0]), (b, [1])], 2, "cpu")
    assert after is not None and after.stack is not newest.stack


def test_a_set_that_keeps_running_is_packed_a_few_matrices_a_step_with_the_same_result() -> None:
    from strata.model.lora import moved
    from strata.model.lora_batch import PACK_AFTER_STEPS

    a, b = (moved(adapter(n, r, seed), torch.bfloat16, "cpu") for n, r, seed in
            (("a", 4, 1), ("b", 8, 2)))
    rows = [(a, [0, 2]), (b, [1])]
    x, out = torch.randn(3, IN).bfloat16(), torch.randn(3, OUT).bfloat16()
    cache = StackCache()
    first = step_loras(cache, rows, 3, "cpu")
    assert first is not None and first.packs_left == 0  # a new set runs plain
    want = first.apply(out.clone(), x, 0, "qkv")
    for _ in range(PACK_AFTER_STEPS):
        step = step_loras(cache, rows, 3, "cpu")
    assert step is not None and step.packs_left > 0
    got = step.apply(out.clone(), x, 0, "qkv")
    assert step.stack.site(0, "qkv").is_packed  # type: ignore[union-attr]
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-2)
