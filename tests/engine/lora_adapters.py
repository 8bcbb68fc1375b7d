"""Tiny PEFT LoRA adapters for the tiny checkpoints of `tests.engine.hf_families`, built offline
inside the tests, and PEFT's own logits to compare genserve's to.

PEFT initialises lora_B to zero (an adapter that changes nothing); `build_adapter` redraws every
lora_A and lora_B from a seeded generator so each adapter moves the logits. `write_adapter` writes one for
a model known only by its `ModelArgs` (a random or GGUF model: no transformers checkpoint), its
matrices drawn directly.
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


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """(in, out) of each Llama-style projection PEFT names (`self_attn.q_proj` ...) for the model
    `args` (`engine.model.config.ModelArgs`) describes."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {"self_attn.q_proj": (args.dim, q), "self_attn.k_proj": (args.dim, kv),
            "self_attn.v_proj": (args.dim, kv), "self_attn.o_proj": (q, args.dim),
            "mlp.gate_proj": (args.dim, args.intermediate_size), "mlp.up_proj": (args.dim, args.intermediate_size),
            "mlp.down_proj": (args.intermediate_size, args.dim)}


def write_adapter(directory: pathlib.Path, args, layers: dict[int, tuple[str, ...]], r: int = 8,
                  seed: int = 0, std: float = 0.01) -> pathlib.Path:
    """Write a PEFT LoRA directory of rank `r` for the model `args` describes into `directory`,
    on the projections `layers` names per layer index ("self_attn.q_proj", ...; shapes from
    `projection_shapes`), lora_A and lora_B drawn with standard deviation `std` from a generator
    seeded by `seed`. Returns `directory`."""
    import json

    from safetensors.torch import save_file

    shapes = projection_shapes(args)
    directory.mkdir(parents=True, exist_ok=True)
    modules = sorted({m.rpartition(".")[2] for ms in layers.values() for m in ms})
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": modules}))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, ms in layers.items():
        for m in ms:
            width, out = shapes[m]
            prefix = f"base_model.model.model.layers.{layer}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, width, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, r, generator=g) * std
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory
