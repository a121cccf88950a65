"""Tiny random models for tests: an HF directory and its GGUF conversion.

`make_tiny_model_dir` writes what a Hugging Face checkpoint holds (config, safetensors weights of
a randomly initialised transformers model, a byte-level BPE tokenizer.json, a ChatML chat template,
generation_config.json). `write_tiny_gguf` converts such a directory the way llama.cpp's
convert_hf_to_gguf.py does. Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from strata.sim.tokenizer import byte_alphabet

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
          ("Ġ", "w"), ("l", "l"), ("e", "ll"), ("h", "ell"), ("Ġ", "s"), ("o", "r"), ("a", "t")]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VOCAB_SIZE = 300
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "phi3": "Phi3ForCausalLM"}


def make_tiny_tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json: 256 byte tokens, a few merges, 3 special tokens."""
    vocab = {tok: i for i, tok in enumerate(byte_alphabet())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return str(tk.to_str())


def tiny_hf_config(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """config.json contents of the tiny model (ids of the special tokens follow the merges)."""
    first_special = 256 + len(MERGES)
    cfg: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": arch,
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": first_special + 1,
        "eos_token_id": first_special,  # <|endoftext|>; generation_config adds <|im_end|>
        "hidden_act": "silu",
    }
    return cfg | overrides


def make_tiny_model_dir(
    path: Path, arch: str = "llama", *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a complete tiny HF model directory at `path` and return it."""
    import transformers

    cfg = tiny_hf_config(arch, **config_overrides)
    hf_config = transformers.AutoConfig.for_model(
        arch, **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(make_tiny_tokenizer_json(), encoding="utf-8")
    tok_cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
               "chat_template": CHATML_TEMPLATE}
    _write_json(path / "tokenizer_config.json", tok_cfg)
    im_end = 256 + len(MERGES) + 2
    _write_json(path / "generation_config.json",
                {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [im_end]})
    return path


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2), encoding="utf-8")


def hf_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf `LlamaModel.permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def write_tiny_gguf(
    hf_dir: Path,
    out: Path,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    omit_keys: Sequence[str] = (),
    omit_tensors: Sequence[str] = (),
    add_bos_token: bool = False,
    sampling: dict[str, float] | None = None,
    extra_keys: Mapping[str, str | int | float] | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Convert a tiny llama HF directory to GGUF at `out`, as convert_hf_to_gguf.py does
    (Llama-3 rope scaling becomes the `rope_freqs` tensor of per-frequency divisors).

    `omit_keys` / `omit_tensors` (GGUF names) leave metadata or tensors out, `extra_keys` /
    `extra_tensors` add some (a str, int or float key is written as a string, uint32 or float32),
    to test errors; `sampling` adds `general.sampling.<key>` float fields (temp, top_p,
    penalty_repeat).
    """
    cfg = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(out, "llama")
    _write_hparams(writer, cfg, hf_dir.name, tensor_type)
    _write_vocab(writer, hf_dir, cfg["vocab_size"])
    writer.add_add_bos_token(add_bos_token)
    for key, value in (sampling or {}).items():
        writer.add_float32(f"general.sampling.{key}", value)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        data = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            data = hf_permute(data, heads, heads)
        elif name.endswith("k_proj.weight"):
            data = hf_permute(data, heads, kv_heads)
        qtype = tensor_type if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        if gguf_name(name) in omit_tensors:
            continue
        writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    factors = llama3_rope_factors(cfg)
    if factors is not None and "rope_freqs.weight" not in omit_tensors:
        writer.add_tensor("rope_freqs.weight", factors)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    for key, value in (extra_keys or {}).items():
        writer.add_key_value(key, value, _GGUF_TYPES[type(value)])
    for key in omit_keys:
        del writer.kv_data[0][key]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


_GGUF_TYPES = {str: gguf.GGUFValueType.STRING, int: gguf.GGUFValueType.UINT32,
               float: gguf.GGUFValueType.FLOAT32}


def llama3_rope_factors(cfg: Mapping[str, Any]) -> np.ndarray | None:
    """What convert_hf_to_gguf.py writes as `rope_freqs` for a Llama-3 scaled config: for each
    frequency, the number llama.cpp divides it by (float32, head_dim / 2 of them)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return None
    theta = cfg.get("rope_theta") or rope["rope_theta"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, old_context = rope["factor"], rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any], name: str, qtype: Any) -> None:
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]  # transformers 5
    w.add_rope_freq_base(rope)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    file_types = {gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
                  gguf.GGMLQuantizationType.F16: gguf.LlamaFileType.MOSTLY_F16,
                  gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
    w.add_file_type(file_types[qtype])


def _write_vocab(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    reverse = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):  # padded to the config's vocab size, as the converter does
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in reverse:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    gen_cfg = json.loads((hf_dir / "generation_config.json").read_text())
    eos = gen_cfg["eos_token_id"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(tok_cfg["bos_token"]))
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_chat_template(tok_cfg["chat_template"])
