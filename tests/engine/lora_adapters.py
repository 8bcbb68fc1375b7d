"""Tiny PEFT LoRA adapters for the tiny checkpoints of `tests.engine.hf_families`, built offline
inside the tests, and PEFT's own logits to compare genserve's to.

PEFT initialises lora_B to zero (an adapter that changes nothing); `build_adapter` redraws every
lora_A and lora_B from a seeded generator so each adapter moves the logits.
"""

from __future__ import annotations

import pathlib

import torch
import transformers as tf

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_LORA_STD = 0.1


def _base(checkpoint: pathlib.Path) -> torch.nn.Module:
    return tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                   attn_implementation="eager").eval()


@torch.no_grad()
def build_adapter(checkpoint: pathlib.Path, directory: pathlib.Path, seed: int, r: int = 8,
                  targets: tuple[str, ...] = ALL_TARGETS, alpha: float = 16.0, rslora: bool = False,
                  **config) -> pathlib.Path:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) of rank `r` on
    `targets` for the checkpoint at `checkpoint` into `directory`, every lora_A / lora_B drawn
    from a generator seeded by `seed`; returns `directory`. `config`: more `LoraConfig` fields."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_base(checkpoint), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora,
        **config))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.normal_(0.0, _LORA_STD, generator=g)
    model.save_pretrained(directory)
    return pathlib.Path(directory)


@torch.no_grad()
def peft_logits(checkpoint: pathlib.Path, adapter: pathlib.Path | None, token_ids: list[int]) -> torch.Tensor:
    """PEFT's logits fp32 [len(token_ids), vocab] for `token_ids` teacher-forced as one sequence,
    the base model from `checkpoint` (fp32, eager attention) with the adapter at `adapter` (None:
    the base alone)."""
    from peft import PeftModel

    model = _base(checkpoint)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()
