"""PEFT LoRA adapters applied per row of a batch, never merged into the base weights.

An adapter is a directory holding `adapter_config.json` and `adapter_model.safetensors`, as
PEFT's `save_pretrained` writes it. `load_adapter` checks it against the base model (target
modules, rank, shapes, base model name) and refuses it by name. Its identity is its name plus
the sha256 of its two files (`LoraAdapter.digest`): the engine folds the digest into the
prefix-cache names of the request's blocks, so two adapters (or one name reloaded with other
weights) never share KV with each other or with the base.

The model runs each base matmul once over every row, then adds, for each adapter present in the
step, the low-rank product `(x[rows] @ A.T) @ B.T` of its rows (`apply`). The fused q/k/v and
gate/up projections get one stacked A (the modules' A concatenated) and a block-diagonal B, so
one pair of matmuls covers all three (two) modules; the scaling is folded into B.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from strata.errors import LoraError
from strata.model.config import ModelConfig
from strata.model.shard import RankShard
from strata.protocol.lora import adapter_digest

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_RANK = 64
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True, slots=True)
class LoraPair:
    a: Tensor  # (r', in)
    b: Tensor  # (out, r'), scaling folded in


@dataclass(slots=True)
class LoraLayer:
    """One layer's pairs for the model's fused linears (None: no module of it is adapted)."""

    qkv: LoraPair | None
    o: LoraPair | None
    gate_up: LoraPair | None
    down: LoraPair | None


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    digest: str  # sha256 over adapter_config.json then adapter_model.safetensors
    rank: int
    scaling: float
    layers: list[LoraLayer]

    @property
    def num_bytes(self) -> int:
        """Bytes of its weights (what residency costs)."""
        pairs = [p for x in self.layers for p in (x.qkv, x.o, x.gate_up, x.down) if p is not None]
        return sum(t.numel() * t.element_size() for p in pairs for t in (p.a, p.b))


def moved(adapter: LoraAdapter, dtype: torch.dtype, device: str) -> LoraAdapter:
    """The adapter with its weights in `dtype` on `device` (the model's)."""
    def mv(p: LoraPair | None) -> LoraPair | None:
        return None if p is None else LoraPair(p.a.to(device=device, dtype=dtype),
                                               p.b.to(device=device, dtype=dtype))
    layers = [LoraLayer(mv(x.qkv), mv(x.o), mv(x.gate_up), mv(x.down)) for x in adapter.layers]
    return LoraAdapter(adapter.name, adapter.path, adapter.digest, adapter.rank, adapter.scaling,
                       layers)


def sharded(adapter: LoraAdapter, config: ModelConfig, shard: RankShard) -> LoraAdapter:
    """What one rank of a parallel model holds of `adapter`: each pair cut as the rank's base
    weights are (strata/model/parallel/shard_loader.shard_slices), so that the product a rank
    adds (strata.model.lora_batch) is exactly its share of the adapter's.

        qkv, gate_up   column-parallel: B's rows of the rank's q heads, KV heads (a KV head that
                       two ranks hold, both hold its rows) and v heads; of its gate and up rows.
                       A whole: every rank sees the whole input.
        o, down        row-parallel: A's columns of the rank's input slice (its q heads, its MLP
                       rows); B whole. Each rank's (x_r @ A_r.T) @ B.T joins its partial output
                       before the all-reduce, whose sum over ranks is x @ A.T @ B.T.

    Layers of other pipeline stages are empty, so `adapter.layers` keeps the whole model's
    indices (the model names layers by their global number). A cut copies values and never
    rounds them; the whole model's shard gets `adapter` itself."""
    if shard.is_full(config):
        return adapter
    hd, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q, kv, mlp = shard.rows(hd)  # the cuts of the rank's base weights (shard_slices)
    qkv_rows = [q, _shift(kv, heads * hd), _shift(kv, (heads + kv_heads) * hd)]
    gate_up_rows = [mlp, _shift(mlp, config.intermediate_size)]

    def cut(pair: LoraPair | None, rows: list[slice] | None, cols: slice | None
            ) -> LoraPair | None:
        if pair is None:
            return None
        a = pair.a if cols is None else pair.a[:, cols]
        b = pair.b if rows is None else torch.cat([pair.b[r] for r in rows])
        return LoraPair(a.contiguous(), b.contiguous())

    empty = LoraLayer(None, None, None, None)
    layers = [LoraLayer(cut(x.qkv, qkv_rows, None), cut(x.o, None, q),
                        cut(x.gate_up, gate_up_rows, None), cut(x.down, None, mlp))
              if i in shard.layers else empty for i, x in enumerate(adapter.layers)]
    return LoraAdapter(adapter.name, adapter.path, adapter.digest, adapter.rank, adapter.scaling,
                       layers)


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def file_digest(path: str | Path) -> str:
    """sha256 of the adapter's config then weights files (strata/protocol/lora.py)."""
    return adapter_digest(path)


def _out_in(config: ModelConfig, module: str) -> tuple[int, int]:
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size),
            "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q),
            "gate_proj": (c.intermediate_size, c.hidden_size),
            "up_proj": (c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size)}[module]


def load_adapter(name: str, path: str | Path, config: ModelConfig, *,
                 base_model: str = "", max_rank: int = DEFAULT_MAX_RANK,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoraAdapter:
    """Read and check a PEFT LoRA adapter for `config`; raises `LoraError` naming `name`."""
    root = Path(path)
    try:
        cfg = json.loads((root / "adapter_config.json").read_text())
        tensors = load_file(str(root / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r} at {str(root)!r} cannot be read: {exc}") from exc

    def refuse(why: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r} refused: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type is {cfg.get('peft_type')!r}, only LORA is supported")
    rank = int(cfg.get("r", 0))
    if not 0 < rank <= max_rank:
        raise refuse(f"rank {rank} is over the limit --max-lora-rank {max_rank}"
                     if rank > max_rank else f"rank {rank} is not positive")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise refuse(f"target modules {unknown} are not supported (supported: "
                     f"{list(TARGET_MODULES)})")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise refuse("bias training and modules_to_save are not supported")
    for field in ("layers_to_transform", "rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise refuse(f"{field} is not supported")
    if cfg.get("use_dora"):
        raise refuse("DoRA is not supported")
    known = cfg.get("base_model_name_or_path") or ""
    if base_model and known and _short(known) != _short(base_model):
        raise refuse(f"it was trained for {known!r}, the base model is {base_model!r}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        try:
            layer = int(parts[parts.index("layers") + 1])
            module, kind = parts[-3], parts[-2]
        except (ValueError, IndexError):
            raise refuse(f"tensor {key!r} is not a LoRA weight of a decoder layer") from None
        if module not in TARGET_MODULES:
            raise refuse(f"tensor {key!r} targets unknown module {module!r}")
        if kind not in ("lora_A", "lora_B") or not 0 <= layer < config.num_hidden_layers:
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight of layers 0.."
                         f"{config.num_hidden_layers - 1}")
        found.setdefault((layer, module), {})[kind] = tensor
    for (layer, module), weights in found.items():
        out, inp = _out_in(config, module)
        want = {"lora_A": (rank, inp), "lora_B": (out, rank)}
        for kind, shape in want.items():
            got = weights.get(kind)
            if got is None:
                raise refuse(f"layer {layer} {module} has no {kind}")
            if tuple(got.shape) != shape:
                raise refuse(f"layer {layer} {module}.{kind} has shape {list(got.shape)}, the "
                             f"base model needs {list(shape)}")

    def pair(layer: int, modules: tuple[str, ...]) -> LoraPair | None:
        present = [m for m in modules if (layer, m) in found]
        if not present:
            return None
        a = torch.cat([_pair_or_zero(found, layer, m, rank, config)[0] for m in modules])
        bs = [_pair_or_zero(found, layer, m, rank, config)[1] for m in modules]
        b = torch.block_diag(*bs) * scaling
        return LoraPair(a.to(device=device, dtype=dtype).contiguous(),
                        b.to(device=device, dtype=dtype).contiguous())

    layers = [LoraLayer(qkv=pair(i, _ATTN[:3]), o=pair(i, ("o_proj",)),
                        gate_up=pair(i, ("gate_proj", "up_proj")), down=pair(i, ("down_proj",)))
              for i in range(config.num_hidden_layers)]
    return LoraAdapter(name=name, path=str(root), digest=file_digest(root), rank=rank,
                       scaling=scaling, layers=layers)


def _pair_or_zero(found: dict[tuple[int, str], dict[str, Tensor]], layer: int, module: str,
                  rank: int, config: ModelConfig) -> tuple[Tensor, Tensor]:
    pair = found.get((layer, module))
    if pair is not None:
        return pair["lora_A"].float(), pair["lora_B"].float()
    out, inp = _out_in(config, module)
    return torch.zeros(rank, inp), torch.zeros(out, rank)


def _short(name: str) -> str:
    """A model id without a local directory's path: the last two path parts."""
    return "/".join(name.rstrip("/").split("/")[-2:])
