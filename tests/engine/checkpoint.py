"""Write small Hugging Face Llama checkpoints for tests: config.json, sharded safetensors with an
index, and a tokenizer.json (GPT-2 byte-level from the embedded GGUF, or a Llama-2-style
SentencePiece BPE built here with `tokenizers`)."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from engine.model.config import ModelArgs

HF_LEAF = {
    "attention_norm": "input_layernorm", "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def hf_name(ours: str) -> str:
    """Our state-dict name -> transformers' LlamaForCausalLM name."""
    if ours.startswith("layers."):
        _, i, leaf = ours.split(".", 2)
        return f"model.layers.{i}.{HF_LEAF[leaf.removesuffix('.weight')]}.weight"
    return {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}[ours]


def write_checkpoint(directory: pathlib.Path, args: ModelArgs, state: dict[str, torch.Tensor],
                     tokenizer: Tokenizer, *, shards: int = 2, dtype: torch.dtype = torch.float16,
                     eos_token_id: int | None = None, bos_token_id: int | None = None) -> pathlib.Path:
    """`state` (our names) as an HF checkpoint in `directory`, split over `shards` files."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
              "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
              "num_key_value_heads": args.n_kv_heads, "intermediate_size": args.intermediate_size,
              "vocab_size": args.vocab_size, "max_position_embeddings": args.max_context,
              "rope_theta": args.rope_theta, "rms_norm_eps": args.norm_eps,
              "tie_word_embeddings": args.tie_embeddings, "torch_dtype": str(dtype).removeprefix("torch."),
              "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    (directory / "config.json").write_text(json.dumps(config))
    names = [n for n in state if not (args.tie_embeddings and n == "output.weight")]
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({hf_name(n): state[n].to(dtype).contiguous() for n in part}, str(directory / file))
        weight_map.update({hf_name(n): file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer.json in small: BPE with byte fallback (<0x00>..<0xFF>), "▁" for a
    space prepended and replacing spaces, <s> prepended by the post-processor, decoder
    Replace("▁", " ") + ByteFallback + Fuse + Strip(1 leading space). Ids: <unk> 0, <s> 1, </s> 2,
    bytes 3..258, then "▁", "h", "e", "l", "o", "▁h", "▁he", "ll", "▁hell", "▁hello" (259..268)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("▁", "h", "e", "l", "o", "▁h", "▁he", "ll", "▁hell", "▁hello"):
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                              fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tk
