"""The model's own sampling defaults, applied where a request leaves a field out (as vLLM does
with `--generation-config auto`, its default).

From a Hugging Face directory: `generation_config.json`'s `temperature`, `top_p`, `top_k`,
`repetition_penalty` and `max_new_tokens` (the fields vLLM reads). From a GGUF file: llama.cpp's
`general.sampling.temp`, `.top_p`, `.top_k` and `.penalty_repeat`. Fields the model does not set
stay None (Strata's own defaults apply); a value of the wrong type is ignored with the reason
logged, never a failed load. Pure Python: the server and the CLI read it without torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_GGUF_FIELDS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                "general.sampling.top_k": "top_k",
                "general.sampling.penalty_repeat": "repetition_penalty"}
_INTS = ("top_k", "max_tokens")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # caps the default (the room left), never an explicit value

    def as_dict(self) -> dict[str, float | int]:
        """The fields the model sets (shown by /v1/models)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @staticmethod
    def from_fields(fields: dict[str, Any], source: str) -> GenerationDefaults:
        """From {strata field name: value}; values of the wrong type are dropped."""
        kept: dict[str, float | int] = {}
        for name, value in fields.items():
            wants_int = name in _INTS
            if isinstance(value, bool) or not isinstance(value, int | float) or (
                    wants_int and not float(value).is_integer()):
                log.warning("%s: ignoring sampling default %s = %r (not a number)", source, name,
                            value)
                continue
            kept[name] = int(value) if wants_int else float(value)
        return GenerationDefaults(**kept)  # type: ignore[arg-type]


def read_generation_defaults(source: Path) -> GenerationDefaults:
    """The defaults of a model directory or `.gguf` file (none when it sets none)."""
    if source.is_dir():
        file = source / "generation_config.json"
        try:
            data = json.loads(file.read_text(encoding="utf-8")) if file.exists() else {}
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable, no sampling defaults: %s", file, e)
            return GenerationDefaults()
        fields = {ours: data[hf] for hf, ours in _HF_FIELDS.items()
                  if isinstance(data, dict) and data.get(hf) is not None}
        return GenerationDefaults.from_fields(fields, str(file))
    return GenerationDefaults.from_fields(_gguf_fields(source), str(source))


def generation_defaults_of(mode: str, model: GenerationDefaults,
                           alias: GenerationDefaults | None) -> GenerationDefaults:
    """--generation-config: `auto` takes the model file's defaults, else its alias's (a file
    that sets none); `none` takes none."""
    if mode != "auto":
        return GenerationDefaults()
    return model if model.as_dict() or alias is None else alias


def _gguf_fields(path: Path) -> dict[str, Any]:
    from strata.model.gguf_file import read_gguf  # the header only; tensors stay mapped

    fields = read_gguf(path).fields
    return {ours: fields[key] for key, ours in _GGUF_FIELDS.items() if key in fields}


__all__ = ["GenerationDefaults", "generation_defaults_of", "read_generation_defaults"]
