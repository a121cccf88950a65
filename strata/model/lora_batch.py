"""A step's LoRA adapters run as two matmuls per fused linear, whatever their number.

Each adapter adds `(x[rows] @ A.T) @ B.T` to its rows of a linear's output (strata.model.lora).
Run adapter by adapter, that is a gather, two matmuls and a scatter per adapter, per fused
linear, per layer: with 4 adapters, 16 small matmuls a layer whose fixed cost (tens of
microseconds each in bf16) outweighed the base model's own matmuls in decode (bench/lora.py:
0.38-0.57x the base's throughput at 4 adapters, 2026-12-06).

Here the step's adapters are stacked instead, in the spirit of Punica's SGMV: A of every
adapter concatenated along the rank (sum of ranks, in), B side by side (out, sum of ranks).
Then for every row of the step

    u = x @ A_all.T          one matmul over every row
    u *= mask                each row keeps only its own adapter's columns (base rows: none)
    out += u @ B_all.T       one matmul

Zeroed columns add exact zeros, so a row gets its own adapter's product and nothing else; the
extra work is the other adapters' few columns (a rank is 8-64 against thousands of features).
The stacks are built per layer on first use and kept for later steps with the same adapters
(`StackCache`); the mask is built once per step for each column layout. A new stack's
matrices are plain; once its set of adapters has run `PACK_AFTER_STEPS` steps they are packed
like the base weights (strata.model.linear: 10-40 % off each call), a few per step: a pack
costs about 0.2 ms a matrix and SmolLM2 has 240 of them per set, a 130 ms stall had a new set
packed them all at once (measured 2026-12-06), and sets change often under many adapters.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from strata.model.linear import Linear, linear, pack_linear_weight
from strata.model.lora import LoraAdapter, LoraPair

PACK_AFTER_STEPS = 8  # a set of adapters that ran this many steps gets its matrices packed
PACKS_PER_STEP = 8  # ... this many a step (about 0.2 ms each), so no step stalls


@dataclass(frozen=True, slots=True)
class StackedSite:
    """One fused linear's pairs of the step's adapters, stacked along the rank."""

    a: Linear  # (sum of ranks, in)
    b: Linear  # (out, sum of ranks)
    column_slots: tuple[int, ...]  # the adapter slot (index in the stack) of each rank column
    is_packed: bool = False


class AdapterStack:
    """Adapters in a fixed order (their slots) with each layer's pairs stacked on first use."""

    def __init__(self, adapters: tuple[LoraAdapter, ...]) -> None:
        self.adapters = adapters
        self.num_steps = 0  # steps that ran this set
        self._sites: dict[tuple[int, str], StackedSite | None] = {}

    def site(self, layer: int, which: str) -> StackedSite | None:
        """The stacked pairs of one fused linear (None: no adapter of the set adapts it)."""
        key = (layer, which)
        if key not in self._sites:
            self._sites[key] = self._stack(layer, which)
        return self._sites[key]

    def pack(self, layer: int, which: str) -> StackedSite:
        """Pack one site's matrices (it exists and is not packed yet)."""
        site = self._sites[(layer, which)]
        assert site is not None and isinstance(site.a, Tensor) and isinstance(site.b, Tensor) \
            and not site.is_packed, "invariant pack_once: plain matrices, packed once"
        packed = StackedSite(pack_linear_weight(site.a), pack_linear_weight(site.b),
                             site.column_slots, is_packed=True)
        self._sites[(layer, which)] = packed
        return packed

    def _stack(self, layer: int, which: str) -> StackedSite | None:
        pairs: list[tuple[int, LoraPair]] = []
        for slot, adapter in enumerate(self.adapters):
            pair: LoraPair | None = getattr(adapter.layers[layer], which)
            if pair is not None:
                pairs.append((slot, pair))
        if not pairs:
            return None
        a = torch.cat([p.a for _, p in pairs]).contiguous()
        b = torch.cat([p.b for _, p in pairs], dim=1).contiguous()
        columns = tuple(slot for slot, p in pairs for _ in range(p.a.shape[0]))
        return StackedSite(a, b, columns)


class StackCache:
    """The stacks of the last few adapter sets (a stack copies its adapters' weights, so a few
    at most: a steady load runs one set step after step). `forget` drops every stack holding a
    removed adapter, so its memory goes with it."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._stacks: OrderedDict[tuple[str, ...], AdapterStack] = OrderedDict()

    def get(self, adapters: tuple[LoraAdapter, ...]) -> AdapterStack:
        key = tuple(a.digest for a in adapters)
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = AdapterStack(adapters)
            while len(self._stacks) > self.capacity:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(key)
        return stack

    def forget(self, digest: str) -> None:
        for key in [k for k in self._stacks if digest in k]:
            del self._stacks[key]


@dataclass(slots=True)
class StepLoras:
    """The step's adapters: their stack and the slot of each token row (-1: the base)."""

    stack: AdapterStack
    row_slots: Tensor  # (T,) long
    every_row_one_adapter: bool  # one adapter and no base row: no mask needed
    packs_left: int = 0  # matrices this step may still pack (PACKS_PER_STEP once the set is old)
    _masks: dict[tuple[int, ...], Tensor] = field(default_factory=dict)

    def apply(self, out: Tensor, x: Tensor, layer: int, which: str) -> Tensor:
        """`out[r] += (x[r] @ A.T) @ B.T` with row r's adapter; base rows untouched."""
        site = self.stack.site(layer, which)
        if site is None:
            return out
        if not site.is_packed and self.packs_left > 0:
            site = self.stack.pack(layer, which)
            self.packs_left -= 1
        u = linear(x, site.a)
        if not self.every_row_one_adapter:
            u.mul_(self._mask(site.column_slots, u.dtype))
        return out.add_(linear(u, site.b))

    def _mask(self, column_slots: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        mask = self._masks.get(column_slots)
        if mask is None:
            columns = torch.tensor(column_slots, dtype=torch.long, device=self.row_slots.device)
            mask = (self.row_slots[:, None] == columns[None, :]).to(dtype)
            self._masks[column_slots] = mask
        return mask


def step_loras(stacks: StackCache, rows: list[tuple[LoraAdapter, list[int]]],
               num_rows: int, device: str) -> StepLoras | None:
    """The step's `StepLoras` from each adapter's token rows (None: every row is the base's)."""
    if not rows:
        return None
    ordered = sorted(rows, key=lambda r: r[0].digest)  # one stack per set, whatever the order
    slots = torch.full((num_rows,), -1, dtype=torch.long)
    for slot, (_, idx) in enumerate(ordered):
        slots[idx] = slot
    whole = len(ordered) == 1 and len(ordered[0][1]) == num_rows
    stack = stacks.get(tuple(a for a, _ in ordered))
    stack.num_steps += 1
    packs = PACKS_PER_STEP if stack.num_steps > PACK_AFTER_STEPS else 0
    return StepLoras(stack, slots.to(device), whole, packs)


def apply(out: Tensor, x: Tensor, loras: StepLoras | None, layer: int, which: str) -> Tensor:
    """`StepLoras.apply`, or `out` as it is when the step runs no adapter."""
    return out if loras is None else loras.apply(out, x, layer, which)


__all__ = ["PACKS_PER_STEP", "PACK_AFTER_STEPS", "AdapterStack", "StackCache",
           "StackedSite", "StepLoras", "apply", "step_loras"]
