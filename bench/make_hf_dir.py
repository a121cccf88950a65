"""Write the default model (GGUF Q4_1, dequantized to bf16) as a Hugging Face directory.

Strata, vLLM and HF transformers then all load the *same* weights file:
    .venv/bin/python bench/make_hf_dir.py [--out .bench/smollm2-hf]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".bench" / "smollm2-hf"
CACHE_DIR = Path("/tmp/strata-cache")


def hf_config(cfg: object) -> dict:
    c = cfg  # strata ModelConfig
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,  # type: ignore[attr-defined]
        "intermediate_size": c.intermediate_size,  # type: ignore[attr-defined]
        "num_hidden_layers": c.num_hidden_layers,  # type: ignore[attr-defined]
        "num_attention_heads": c.num_attention_heads,  # type: ignore[attr-defined]
        "num_key_value_heads": c.num_key_value_heads,  # type: ignore[attr-defined]
        "head_dim": c.head_dim, "max_position_embeddings": 2048,  # type: ignore[attr-defined]
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,  # type: ignore[attr-defined]
        "tie_word_embeddings": c.tie_word_embeddings,  # type: ignore[attr-defined]
        "bos_token_id": c.bos_token_id,  # type: ignore[attr-defined]
        "eos_token_id": list(c.eos_token_ids)[0],  # type: ignore[attr-defined]
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "bfloat16", "rope_scaling": None,
    }


def make_hf_dir(out: Path = DEFAULT_OUT) -> Path:
    """Export once; later calls return the existing directory."""
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model("smollm2", cache_dir=CACHE_DIR, progress=False)
    m = load_model(path, dtype="bfloat16", cache_dir=CACHE_DIR)
    weights = {k: v.contiguous() for k, v in m.weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(m.config), indent=1))
    (out / "tokenizer.json").write_text(m.tokenizer.to_json())
    tok_cfg = {"bos_token": m.tokenizer.bos_token, "eos_token": m.tokenizer.eos_token,
               "chat_template": m.tokenizer.chat_template, "model_max_length": 2048,
               "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": m.config.bos_token_id, "eos_token_id": list(m.config.eos_token_ids)}))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    print(make_hf_dir(ap.parse_args().out))
