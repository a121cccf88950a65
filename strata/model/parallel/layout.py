"""How one model splits over T x P ranks: T tensor-parallel ranks in each of P pipeline stages.

Ranks are numbered stage-major: rank = stage * T + tp_rank. Rank 0 (stage 0, tp rank 0) runs in
the serving process and feeds every step to the others; the last stage's tp rank 0 samples.

    P = 2, T = 2:   stage 0: ranks 0 1   (layers 0 .. 14)
                    stage 1: ranks 2 3   (layers 15 .. 29, final norm, LM head, sampling on 2)

Within a stage every split is as even as it can be, the first ranks taking the remainder:
query heads, MLP rows and vocabulary rows. Query heads need not split along KV-head groups:
a rank holds every KV head one of its query heads reads, so a KV head may be held by two ranks
(SmolLM2, 9 heads over 3 KV heads, T = 2: ranks get 5 + 4 heads and both hold KV head 1).
A size that cannot work is refused with the sizes that can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.model.shard import RankShard


def even_split(n: int, parts: int) -> list[range]:
    """`n` items in `parts` consecutive ranges whose sizes differ by at most one (larger first)."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True, slots=True)
class RankCoords:
    stage: int
    tp_rank: int


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """T x P ranks; `pipeline_layers` overrides the even split of layers over stages."""

    tensor_size: int = 1
    pipeline_size: int = 1
    pipeline_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.tensor_size < 1 or self.pipeline_size < 1:
            raise ConfigError(f"tensor ({self.tensor_size}) and pipeline ({self.pipeline_size}) "
                              "parallel sizes must be at least 1")
        layers = self.pipeline_layers
        if layers is not None and (len(layers) != self.pipeline_size or min(layers) < 1):
            raise ConfigError(
                f"pipeline layers {list(layers)} must give each of the {self.pipeline_size} "
                "stages at least one layer (one number per stage, e.g. 15,15)")

    @property
    def world_size(self) -> int:
        return self.tensor_size * self.pipeline_size

    @property
    def name(self) -> str:
        """`tp1`, `tp2`, `pp2`, `tp2xpp2`: how status lines and metrics show the layout."""
        parts = [f"tp{self.tensor_size}"] if self.tensor_size > 1 else []
        parts += [f"pp{self.pipeline_size}"] if self.pipeline_size > 1 else []
        return "x".join(parts) or "tp1"

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0 .. {self.world_size - 1}")
        return RankCoords(*divmod(rank, self.tensor_size))

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        """The tensor-parallel group of `stage`, in tp-rank order."""
        return [self.rank_of(stage, t) for t in range(self.tensor_size)]

    @property
    def sampling_rank(self) -> int:
        """The rank that samples: tp rank 0 of the last stage."""
        return self.rank_of(self.pipeline_size - 1, 0)

    def validate(self, config: ModelConfig) -> None:
        """Raise a ConfigError that lists the sizes that work when this layout cannot."""
        limits = {"attention heads": config.num_attention_heads,
                  "MLP rows": config.intermediate_size, "vocabulary rows": config.vocab_size}
        for what, count in limits.items():
            if self.tensor_size > count:
                raise ConfigError(
                    f"--tensor-parallel-size {self.tensor_size} cannot split the model's "
                    f"{count} {what} (each rank needs at least one); valid sizes: "
                    f"{_sizes(min(limits.values()))}")
        num_layers = config.num_hidden_layers
        if self.pipeline_size > num_layers:
            raise ConfigError(
                f"--pipeline-parallel-size {self.pipeline_size} cannot split the model's "
                f"{num_layers} layers (each stage needs at least one); valid sizes: "
                f"{_sizes(num_layers)}")
        if self.pipeline_layers is not None and sum(self.pipeline_layers) != num_layers:
            raise ConfigError(
                f"pipeline layers {list(self.pipeline_layers)} add up to "
                f"{sum(self.pipeline_layers)}, but the model has {num_layers} layers; e.g. "
                f"{','.join(str(len(r)) for r in even_split(num_layers, self.pipeline_size))}")

    def stage_layers(self, config: ModelConfig) -> list[range]:
        """The layers of each stage."""
        if self.pipeline_layers is None:
            return even_split(config.num_hidden_layers, self.pipeline_size)
        starts = [sum(self.pipeline_layers[:i]) for i in range(self.pipeline_size + 1)]
        return [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]

    def describe(self, config: ModelConfig) -> dict[str, Any]:
        """How `config`'s KV splits over the ranks: the KV heads of each tp rank and the layers
        of each stage, as [start, stop) (what a P/D handshake shows of an instance)."""
        return {"name": self.name, "tensor_size": self.tensor_size,
                "pipeline_size": self.pipeline_size,
                "kv_heads_per_rank": [_bounds(self.shard(t, config).kv_heads)
                                      for t in range(self.tensor_size)],
                "layers_per_stage": [_bounds(r) for r in self.stage_layers(config)]}

    def shard(self, rank: int, config: ModelConfig) -> RankShard:
        """What `rank` holds of `config`'s model (validate first)."""
        stage, tp = self.coords(rank).stage, self.coords(rank).tp_rank
        t = self.tensor_size
        q_heads = even_split(config.num_attention_heads, t)[tp]
        group = config.num_attention_heads // config.num_key_value_heads
        kv_heads = range(q_heads.start // group, (q_heads.stop - 1) // group + 1)
        return RankShard(
            q_heads=q_heads, kv_heads=kv_heads,
            intermediate=even_split(config.intermediate_size, t)[tp],
            vocab=even_split(config.vocab_size, t)[tp],
            layers=self.stage_layers(config)[stage],
            num_layers=config.num_hidden_layers, group_size=group,
        )


def _bounds(r: range) -> list[int]:
    return [r.start, r.stop]


def _sizes(limit: int) -> str:
    return f"1 .. {limit}" if limit > 3 else ", ".join(str(i) for i in range(1, limit + 1))


def parse_pipeline_layers(text: str) -> tuple[int, ...]:
    """`15,15` -> (15, 15); errors say what to write."""
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--pipeline-layers {text!r} must be layer counts separated by "
                          "commas, one per stage (e.g. 15,15)") from None
    return layers
