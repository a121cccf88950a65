"""A step's LoRA adapters run as two matmuls per fused linear, whatever their number.

Each adapter adds `(x[rows] @ A.T) @ B.T` to its rows of a linear's output (strata.model.lora).
Run adapter by adapter, that is a gather, two matmuls and a scatter per adapter, per fused
linear, per layer: with 4 adapters, 16 small matmuls a layer whose fixed cost (tens of
microseconds each in bf16) outweighed the base model's own matmuls in decode (bench/lora.py:
0.38-0.57x the base's throughput at 4 adapters, 2026-12-06).

Here the step's adapters are stacked instead, in the spirit of Punica's SGMV: A of every
adapter concatenated along the rank (sum of ranks, in), B side by side (out, sum of ranks), both
packed like the base weights (strata.model.linear). Then for every row of the step

    u = x @ A_all.T          one matmul over every row
    u *= mask                each row keeps only its own adapter's columns (base rows: none)
    out += u @ B_all.T       one matmul

Zeroed columns add exact zeros, so a row gets its own adapter's product and nothing else; the
extra work is the other adapters' few columns (a rank is 8-64 against thousands of features).
The stacks are built per layer on first use and kept for later steps with the same adapters
(`StackCache`); the mask is built once per step for each column layout.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from strata.model.linear import Linear, linear, pack_linear_weight
from strata.model.lora import LoraAdapter, LoraPair

SITES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True, slots=True)
class StackedSite:
    """One fused linear's pairs of the step's adapters, stacked along the rank."""

    a: Linear  # (sum of ranks, in)
    b: Linear  # (out, sum of ranks)
    column_slots: tuple[int, ...]  # the adapter slot (index in the stack) of each rank column


class AdapterStack:
    """Adapters in a fixed order (their slots) with each layer's pairs stacked on first use."""

    def __init__(self, adapters: tuple[LoraAdapter, ...]) -> None:
        self.adapters = adapters
        self._sites: dict[tuple[int, str], StackedSite | None] = {}

    @property
    def digests(self) -> tuple[str, ...]:
        return tuple(a.digest for a in self.adapters)

    def site(self, layer: int, which: str) -> StackedSite | None:
        key = (layer, which)
        if key not in self._sites:
            self._sites[key] = self._stack(layer, which)
        return self._sites[key]

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
        return StackedSite(pack_linear_weight(a), pack_linear_weight(b), columns)


class StackCache:
    """The stacks of the last few adapter sets (a stack copies its adapters' weights, so a few
    at most: a steady load runs one set step after step). `forget` drops every stack holding a
    removed adapter, so its memory goes with it."""

    def __init__(self, capacity: int = 2) -> None:
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
    _masks: dict[tuple[int, ...], Tensor] = field(default_factory=dict)

    def apply(self, out: Tensor, x: Tensor, layer: int, which: str) -> Tensor:
        """`out[r] += (x[r] @ A.T) @ B.T` with row r's adapter; base rows untouched."""
        site = self.stack.site(layer, which)
        if site is None:
            return out
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
    return StepLoras(stacks.get(tuple(a for a, _ in ordered)), slots.to(device), whole)


def apply(out: Tensor, x: Tensor, loras: StepLoras | None, layer: int, which: str) -> Tensor:
    """`StepLoras.apply`, or `out` as it is when the step runs no adapter."""
    return out if loras is None else loras.apply(out, x, layer, which)


__all__ = ["SITES", "AdapterStack", "StackCache", "StackedSite", "StepLoras", "apply",
           "step_loras"]
