"""A tiny random Llama and two random PEFT LoRA adapters for it, plus HF+PEFT references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_models import make_tiny_model_dir


def make_adapter(base: Path, out: Path, *, seed: int, r: int, alpha: float,
                 targets: list[str], use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of `base` with random (nonzero) A and B, saved at `out`."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                          use_rslora=use_rslora, task_type="CAUSAL_LM")
    lora = peft.get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    lora.save_pretrained(out)
    return out


def make_models(root: Path) -> dict[str, Path]:
    base = make_tiny_model_dir(root / "base", initializer_range=0.2)
    a = make_adapter(base, root / "lora-a", seed=1, r=4, alpha=8,
                     targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"])
    b = make_adapter(base, root / "lora-b", seed=2, r=8, alpha=4,
                     targets=["q_proj", "v_proj", "down_proj"], use_rslora=True)
    return {"base": base, "a": a, "b": b}


def hf_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers (+ PEFT when `adapter`), float32."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None  # the engine side runs with ignore_eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]
