"""Weight loaders: the embedded GGUF (SmolLM2-135M-Instruct, Q4_1) and Hugging Face safetensors;
and random weights of a named shape (``random_shape``, ``random_weights``) for benchmarks.

Both loaders (and ``random_weights``) return ``(ModelArgs, state_dict)`` with one naming scheme, the torch ``nn.Linear``
convention (weight shape ``[out_features, in_features]``) and the Hugging Face Llama row layout
(RoPE by ``rotate_half``: within a head, the first ``head_dim / 2`` rows are the real parts, the
last ``head_dim / 2`` the imaginary parts):

==========================================  =========================  ==========================
name                                        shape                      GGUF / HF source name
==========================================  =========================  ==========================
``tok_embeddings.weight``                   ``[vocab, dim]``           ``token_embd`` / ``model.embed_tokens``
``layers.{i}.attention_norm.weight``        ``[dim]``                  ``blk.i.attn_norm`` / ``input_layernorm``
``layers.{i}.attention.wq.weight``          ``[n_heads*hd, dim]``      ``attn_q`` / ``self_attn.q_proj``
``layers.{i}.attention.wk.weight``          ``[n_kv_heads*hd, dim]``   ``attn_k`` / ``self_attn.k_proj``
``layers.{i}.attention.wv.weight``          ``[n_kv_heads*hd, dim]``   ``attn_v`` / ``self_attn.v_proj``
``layers.{i}.attention.wo.weight``          ``[dim, n_heads*hd]``      ``attn_output`` / ``self_attn.o_proj``
``layers.{i}.ffn_norm.weight``              ``[dim]``                  ``ffn_norm`` / ``post_attention_layernorm``
``layers.{i}.feed_forward.w1.weight``       ``[ffn, dim]`` (gate)      ``ffn_gate`` / ``mlp.gate_proj``
``layers.{i}.feed_forward.w3.weight``       ``[ffn, dim]`` (up)        ``ffn_up`` / ``mlp.up_proj``
``layers.{i}.feed_forward.w2.weight``       ``[dim, ffn]`` (down)      ``ffn_down`` / ``mlp.down_proj``
``norm.weight``                             ``[dim]``                  ``output_norm`` / ``model.norm``
``output.weight``                           ``[vocab, dim]``           ``output`` / ``lm_head``
==========================================  =========================  ==========================

The HF names are the Llama family's; each family module of ``engine.model`` lists its own
(``HF_LAYER_NAMES``). The options of ``ModelArgs`` add ``layers.{i}.attention.w{q,k,v,o}.bias``
(``[out]``), ``layers.{i}.attention.{q,k}_norm.weight`` (``[head_dim]``, ``self_attn.{q,k}_norm``),
and Gemma's sandwich norms ``layers.{i}.post_attention_norm.weight`` (``post_attention_layernorm``)
and ``layers.{i}.post_ffn_norm.weight`` (``post_feedforward_layernorm``; there
``pre_feedforward_layernorm`` is ``ffn_norm``). Norm weights hold w of w·x̂: a checkpoint's
``norm_offset`` (Gemma's 1 + w) is added at load.

A mixture-of-experts layer (``ModelArgs.moe``) has, instead of ``feed_forward.w{1,2,3}``, the
router ``layers.{i}.feed_forward.router.weight`` ``[n_experts, dim]`` (``ffn_gate_inp`` /
``mlp.gate``, ``block_sparse_moe.gate``) and each expert's
``layers.{i}.feed_forward.experts.{e}.w{1,2,3}.weight`` (``[expert_size, dim]``, ``[dim,
expert_size]``). Checkpoints that stack the experts (a GGUF's ``ffn_{gate,up,down}_exps``
``[n_experts, out, in]``, transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``) are split
per expert at load (``split_stacked_experts``).

For a tied model (``ModelArgs.tie_embeddings``) ``output.weight`` is the same tensor object as
``tok_embeddings.weight``.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.gguf_file import open_gguf
from engine.model.config import ModelArgs
from engine.model.gguf_config import GGUF_LAYER_NAMES, GGUFMetadata, common_config
from engine.model.registry import family_for_config, family_for_gguf
from engine.model.rope import unpermute_rope_rows

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

# The llama architecture's GGUF leaf names (``blk.{i}.<leaf>.weight`` -> ``layers.{i}.<ours>.weight``)
# of the matrices and norms the Q4_1 path reads raw (`load_gguf_q4_1`).
_GGUF_LAYER_NAMES = {leaf: GGUF_LAYER_NAMES[leaf] for leaf in (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}


def load_gguf(source: "str | pathlib.Path | gguf.GGUFReader | None" = None,
              dtype: torch.dtype = torch.float32) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Read a GGUF of any registered family (`engine.model.registry`: llama, qwen2, qwen3,
    gemma2, gemma3, phi3) into ``ModelArgs`` and a dequantized state dict.

    The metadata becomes the ``config.json`` dict the family reads
    (`engine.model.gguf_config.common_config` plus the family's ``gguf_config``), so a GGUF and a
    checkpoint directory decide every option in one place. Every tensor is dequantized with
    ``gguf.quants.dequantize`` (numpy, float32: F32, F16, BF16, Q4_0 … Q8_0, Q2_K … Q6_K, the IQ
    and TQ types) and cast to ``dtype``; norm weights stay float32 (the network keeps them so).
    Q and K rows of a llama-architecture file are un-permuted back to the Hugging Face layout
    (see :func:`unpermute_rope_rows`); other families' files keep it. Norm weights are stored as
    the multiplier itself (llama.cpp's converter folds Gemma's 1 + w in). Names and shapes are
    in the module docstring. Files over 1 GiB log a progress line per layer.

    Args:
        source: the ``.gguf`` file, a reader from :func:`open_gguf`, or ``None`` for
            :func:`default_gguf_path`.
        dtype: floating dtype of every returned matrix (``torch.float32`` default; ``bfloat16``
            halves memory, values are rounded once from the float32 dequantization).

    Returns:
        ``(args, state_dict)``; ``args.tie_embeddings`` is True when the file has no
        ``output.weight``, and then ``state_dict["output.weight"] is state_dict["tok_embeddings.weight"]``.

    Raises:
        FileNotFoundError: no file at ``source`` (or the default package is missing).
        ValueError: not a readable GGUF, an architecture or option no family serves (named), a
            tensor type the ``gguf`` package cannot dequantize (naming the tensor and the type),
            or a tensor whose shape disagrees with the metadata.
        KeyError: a required metadata key or tensor is missing.
    """
    import gguf  # imported here: only the loaders need it

    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    path = pathlib.Path(getattr(reader.data, "filename", None) or "model.gguf")
    tensors = {t.name: t for t in reader.tensors}

    def read(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(f"{path.name}: tensor {name!r} missing")
        t = tensors[name]
        try:
            # [.., out, in]: GGUF lists dims innermost first; numpy order is reversed
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{path.name}: tensor {name!r} has type {t.tensor_type.name}, which the "
                             f"gguf package cannot dequantize ({e})") from e
        expected = tuple(int(d) for d in reversed(t.shape))
        if array.shape != expected:
            array = array.reshape(expected)
        if not array.flags.writeable or array.dtype != np.float32:  # F32 is a view of the mmap
            array = array.astype(np.float32, copy=True)
        return array

    fields = {name: field.contents() for name, field in reader.fields.items()
              if not name.startswith("tokenizer.ggml.")}      # the vocabulary is the tokenizer's
    arch = fields.get("general.architecture")
    if arch is None:
        raise KeyError(f"{path.name}: metadata key 'general.architecture' missing")
    family = family_for_gguf(arch, path.name)                  # ValueError unless registered
    meta = GGUFMetadata(fields=fields, arch=arch, source=path.name,
                        tensor_shapes={n: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()},
                        read_tensor=read)
    module = family.module
    config = common_config(meta, module.ARCHITECTURES[0])
    if hasattr(module, "gguf_config"):
        config = module.gguf_config(meta, config)
    if config["architectures"][0] not in module.ARCHITECTURES:    # llama files with experts: Mixtral
        module = family_for_config(config, path.name).module
    args = module.config_from_hf(config, path.name)
    layer_names = {**GGUF_LAYER_NAMES, **getattr(module, "GGUF_LAYER_NAMES", {})}
    permuted = getattr(module, "GGUF_PERMUTED_QK", False)
    progress = path.is_file() and path.stat().st_size > 1 << 30

    def load(name: str) -> torch.Tensor:
        array = torch.from_numpy(read(name))
        return array if name.endswith("norm.weight") else array.to(dtype)

    state: dict[str, torch.Tensor] = {"tok_embeddings.weight": load("token_embd.weight")}
    for i in range(args.n_layers):
        for leaf, ours in layer_names.items():
            for kind in ("weight", "bias"):
                name = f"blk.{i}.{leaf}.{kind}"
                if name not in tensors:
                    continue              # which are required is checked below, by expected_shapes
                w = load(name)
                if permuted and leaf in ("attn_q", "attn_k"):
                    w = unpermute_rope_rows(w, args.n_heads if leaf == "attn_q" else args.n_kv_heads)
                state[f"layers.{i}.{ours}.{kind}"] = w
        if progress:
            logger.info("%s: layer %d of %d dequantized", path.name, i + 1, args.n_layers)
    state["norm.weight"] = load("output_norm.weight")
    state["output.weight"] = (state["tok_embeddings.weight"] if args.tie_embeddings
                              else load("output.weight"))
    if hasattr(module, "split_fused"):
        module.split_fused(state, args)
    split_stacked_experts(state, args, path.name)
    missing = sorted(name for name, _ in expected_shapes(args) if name not in state)
    if missing:
        raise KeyError(f"{path.name}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    _check_shapes(args, state, source=path.name)
    return args, state


# Bytes of one Q4_1 block of 32 weights: fp16 scale d, fp16 min m, 16 bytes of 4-bit q (ggml's
# block_q4_1; gguf.quants.Q4_1 dequantizes it as d * q + m).
Q4_1_BLOCK_BYTES = 20
# Bytes of one Q8_0 block of 32 weights: fp16 scale d, 32 int8 q (ggml's block_q8_0;
# gguf.quants.Q8_0 dequantizes it as d * q).
Q8_0_BLOCK_BYTES = 34


def load_gguf_q4_1(source: "str | pathlib.Path | gguf.GGUFReader | None" = None
                   ) -> dict[str, torch.Tensor]:
    """The block matrices of a llama GGUF as their raw Q4_1 blocks, undequantized.

    Each is a uint8 tensor [out, in / 32 · 20]: row r holds the Q4_1 blocks of weight row r in
    order along the input dimension, 20 bytes per 32 weights (``Q4_1_BLOCK_BYTES``). Names are
    :func:`load_gguf`'s for the seven matrices of each layer (``layers.{i}.attention.wq.weight``
    ...), and the rows are in its order: Q and K rows un-permuted with
    :func:`unpermute_rope_rows`, which moves whole rows (and so whole rows of blocks).
    ``gguf.quants.dequantize`` of these blocks, cast as :func:`load_gguf` casts, is exactly what
    :func:`load_gguf` returns for them.

    Args:
        source: the ``.gguf`` file, a reader from :func:`open_gguf`, or ``None`` for
            :func:`default_gguf_path`.

    Returns:
        ``{name: blocks}`` for every ``layers.{i}.attention.w{q,k,v,o}`` and
        ``layers.{i}.feed_forward.w{1,2,3}`` weight.

    Raises:
        FileNotFoundError: no file at ``source``.
        ValueError: not a llama-architecture file, or a block matrix of it is not Q4_1 (the
            message names it and its type).
        KeyError: a required metadata key or tensor is missing.
    """
    import gguf  # imported here: only the loaders need it

    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch != "llama":
        raise ValueError(f"raw Q4_1 blocks are served for llama-architecture files only, not {arch!r}")

    def field(key: str) -> int:
        if key not in reader.fields:
            raise KeyError(f"GGUF metadata key {key!r} missing")
        return int(reader.fields[key].contents())

    n_layers, n_heads = field("llama.block_count"), field("llama.attention.head_count")
    n_kv_heads = (field("llama.attention.head_count_kv")
                  if "llama.attention.head_count_kv" in reader.fields else n_heads)
    blocks: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        for leaf, ours in _GGUF_LAYER_NAMES.items():
            if ours.endswith("norm"):
                continue
            name = f"blk.{i}.{leaf}.weight"
            if name not in tensors:
                raise KeyError(f"tensor {name!r} missing")
            t = tensors[name]
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                raise ValueError(f"{name} is {t.tensor_type.name}, not Q4_1: its 4-bit blocks "
                                 "cannot be served as they are")
            w = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))   # [out, bytes]
            if leaf == "attn_q":
                w = unpermute_rope_rows(w, n_heads)
            elif leaf == "attn_k":
                w = unpermute_rope_rows(w, n_kv_heads)
            blocks[f"layers.{i}.{ours}.weight"] = w
    return blocks


def load_gguf_output_q8_0(source: "str | pathlib.Path | gguf.GGUFReader | None" = None
                          ) -> torch.Tensor | None:
    """The output projection of a llama GGUF as its raw Q8_0 blocks, or None if it is stored
    otherwise.

    The tensor is ``output.weight``, or for a tied model ``token_embd.weight``, as
    :func:`load_gguf` takes it: uint8 [vocab, dim / 32 · 34], row r the Q8_0 blocks of vocabulary
    row r along the model dimension (``Q8_0_BLOCK_BYTES`` per 32 weights).
    ``gguf.quants.dequantize`` of these blocks, cast as :func:`load_gguf` casts, is exactly the
    output weight :func:`load_gguf` returns.

    Args:
        source: the ``.gguf`` file, a reader from :func:`open_gguf`, or ``None`` for
            :func:`default_gguf_path`.
    Raises:
        FileNotFoundError: no file at ``source``.
        KeyError: neither ``output.weight`` nor ``token_embd.weight`` is in the file.
    """
    import gguf  # imported here: only the loaders need it

    reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
    tensors = {t.name: t for t in reader.tensors}
    name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    if name not in tensors:
        raise KeyError("tensor 'token_embd.weight' missing")
    t = tensors[name]
    if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        return None
    return torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))     # [vocab, bytes]


def load_safetensors(directory: str | pathlib.Path, dtype: torch.dtype = torch.bfloat16,
                     device: torch.device | str = "cpu") -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Read a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``, sharded or
    not, fp32 / bf16 / fp16) of any registered family (`engine.model.registry`).

    The family's module turns ``config.json`` into ``ModelArgs`` (refusing what it cannot serve)
    and names the tensors: HF names (``model.layers.N.self_attn.q_proj.weight`` ...) map to ours
    (module docstring); fused checkpoint tensors (Phi-3) are split; norm weights are kept in
    fp32 with the checkpoint's ``norm_offset`` added (Gemma's 1 + w). HF safetensors are already
    in the ``rotate_half`` row layout, so nothing is permuted. Tensors are read one at a time and
    cast to ``dtype`` so the peak memory is about the returned state dict (Llama-2-7B: ~13.5 GB
    in bf16, ~27 GB in fp32). Keys such as ``rotary_emb.inv_freq`` are ignored.

    Args:
        directory: holds ``config.json`` and one or more ``*.safetensors`` shards.
        dtype: floating dtype of every returned matrix (norm weights stay fp32).
        device: where the returned tensors live (each shard tensor is read on the CPU and moved
            there one at a time, so the host holds one tensor at a time beyond the page cache).

    Returns:
        ``(args, state_dict)``; with ``tie_word_embeddings`` (``lm_head.weight`` then ignored),
        ``state_dict["output.weight"] is state_dict["tok_embeddings.weight"]``.

    Raises:
        FileNotFoundError: no ``config.json`` or no ``*.safetensors`` in ``directory``.
        ValueError: an architecture or option no family serves (the message names it and what is
            supported), or a tensor whose shape disagrees with the config.
        KeyError: a required tensor is missing (``lm_head.weight`` counts only when untied).
    """
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    config = json.loads(config_path.read_text())
    family = family_for_config(config, str(config_path))
    args = family.module.config_from_hf(config, str(config_path))

    wanted = {"model.embed_tokens.weight": "tok_embeddings.weight",
              "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}
    for i in range(args.n_layers):
        layer_names = (family.module.hf_layer_names(args, i) if hasattr(family.module, "hf_layer_names")
                       else family.module.HF_LAYER_NAMES)
        for leaf, ours in layer_names.items():
            for kind in ("weight", "bias"):
                wanted[f"model.layers.{i}.{leaf}.{kind}"] = f"layers.{i}.{ours}.{kind}"
            wanted[f"model.layers.{i}.{leaf}"] = f"layers.{i}.{ours}"   # stacked experts: no suffix

    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    name = wanted[key]
                    tensor = f.get_tensor(key)
                    if name.endswith("norm.weight"):         # fp32, the (1 + w) form folded in
                        tensor = tensor.float() + args.norm_offset
                    else:
                        tensor = tensor.to(dtype)
                    state[name] = tensor.to(device)
    if hasattr(family.module, "split_fused"):
        family.module.split_fused(state, args)
    split_stacked_experts(state, args, str(directory))
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]  # a tied checkpoint may omit lm_head
    missing = sorted(name for name, _ in expected_shapes(args) if name not in state)
    if missing:
        raise KeyError(f"{directory}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    _check_shapes(args, state, source=str(directory))
    return args, state


# Stacked-expert tensors the loaders read ([n_experts, out, in]) -> the per-expert leaves they hold.
_STACKED_EXPERTS = {"experts_w1_stacked": ("w1",), "experts_w3_stacked": ("w3",),
                    "experts_w2_stacked": ("w2",), "experts_w13_stacked": ("w1", "w3")}


def split_stacked_experts(state: dict[str, torch.Tensor], args: ModelArgs, source: str) -> None:
    """Split stacked expert tensors into per-expert matrices, in place:
    ``layers.{i}.feed_forward.experts_w{1,3,2}_stacked`` ``[n_experts, out, in]`` (a GGUF's
    ``ffn_{gate,up,down}_exps``) and ``experts_w13_stacked`` ``[n_experts, 2·expert_size, dim]``
    (gate rows then up rows: transformers 5's ``mlp.experts.gate_up_proj``) become
    ``layers.{i}.feed_forward.experts.{e}.w{1,3,2}.weight``.

    Raises:
        ValueError: a stacked tensor's expert count is not ``args.moe.n_experts`` (named).
    """
    for name in [n for n in state if "_stacked" in n]:
        prefix, _, leaf = name.removesuffix(".weight").rpartition(".")
        stacked = state.pop(name)
        n_experts = args.moe.n_experts if args.moe is not None else 0
        if stacked.dim() != 3 or stacked.shape[0] != n_experts:
            raise ValueError(f"{source}: {name} has shape {tuple(stacked.shape)}, expected "
                             f"[{n_experts}, out, in] from the config")
        parts = _STACKED_EXPERTS[leaf]
        for e, matrix in enumerate(stacked.unbind(0)):
            for part, rows in zip(parts, matrix.chunk(len(parts))):
                state[f"{prefix}.experts.{e}.{part}.weight"] = rows.contiguous()


def expected_shapes(args: ModelArgs) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every state-dict name with the shape ``args`` implies (module docstring table), the
    options' tensors included: Q/K/V biases (``qkv_bias``), the output projection's bias
    (``o_bias``), per-head q/k norms [head_dim] (``qk_norm``), the sandwich norms
    (``layers.{i}.post_attention_norm.weight``, ``post_ffn_norm``) and a mixture-of-experts
    layer's router and experts (``moe``) in place of its dense MLP."""
    hd, ffn = args.head_dim, args.intermediate_size
    yield "tok_embeddings.weight", (args.vocab_size, args.dim)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        yield p + "attention_norm.weight", (args.dim,)
        yield p + "attention.wq.weight", (args.n_heads * hd, args.dim)
        yield p + "attention.wk.weight", (args.n_kv_heads * hd, args.dim)
        yield p + "attention.wv.weight", (args.n_kv_heads * hd, args.dim)
        yield p + "attention.wo.weight", (args.dim, args.n_heads * hd)
        if args.qkv_bias:
            yield p + "attention.wq.bias", (args.n_heads * hd,)
            yield p + "attention.wk.bias", (args.n_kv_heads * hd,)
            yield p + "attention.wv.bias", (args.n_kv_heads * hd,)
        if args.o_bias:
            yield p + "attention.wo.bias", (args.dim,)
        if args.qk_norm:
            yield p + "attention.q_norm.weight", (hd,)
            yield p + "attention.k_norm.weight", (hd,)
        yield p + "ffn_norm.weight", (args.dim,)
        if args.sandwich_norm:
            yield p + "post_attention_norm.weight", (args.dim,)
            yield p + "post_ffn_norm.weight", (args.dim,)
        if args.is_sparse(i):
            yield p + "feed_forward.router.weight", (args.moe.n_experts, args.dim)
            mlps = [(f"{p}feed_forward.experts.{e}.", args.moe.expert_size) for e in range(args.moe.n_experts)]
        else:
            mlps = [(p + "feed_forward.", ffn)]
        for m, hidden in mlps:
            yield m + "w1.weight", (hidden, args.dim)
            yield m + "w3.weight", (hidden, args.dim)
            yield m + "w2.weight", (args.dim, hidden)
    yield "norm.weight", (args.dim,)
    yield "output.weight", (args.vocab_size, args.dim)


def _check_shapes(args: ModelArgs, state: dict[str, torch.Tensor], source: str) -> None:
    for name, shape in expected_shapes(args):
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(state[name].shape)}, "
                             f"expected {shape} from the metadata")


# Shapes of other families at the design's 7B-class scale, for the CUDA path's checks, in
# config.json form: Qwen3-8B as published; Gemma-3-12B's text model (published inside a
# Gemma3ForConditionalGeneration checkpoint's text_config), in transformers 4.x spelling;
# Qwen3-30B-A3B as published (48 layers, every MLP a mixture of 128 experts of 768, top 8:
# 30.5 x 10^9 parameters, 3.3 x 10^9 active per token).
_HF_SHAPES = {
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    "gemma-3-12b": dict(architectures=["Gemma3ForCausalLM"], hidden_size=3840, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=15360,
                        vocab_size=262208, max_position_embeddings=131072, sliding_window=1024,
                        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1e6,
                        rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
                        rms_norm_eps=1e-6),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960,
                          rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def random_shape(name: str) -> ModelArgs:
    """The ``ModelArgs`` of a random model's shape name (``genserve.common.model_source.RANDOM_SHAPES``).

    "llama-2-7b" and "smollm2-135m" are ``ModelArgs.llama2_7b()`` / ``smollm2_135m()``; "tiny"
    (2 layers, dim 128, 4 query heads and 2 KV heads of 32, SwiGLU 256, vocabulary 512) is for
    CPU dry runs and tests; "qwen3-8b", "gemma-3-12b" and "qwen3-30b-a3b" (mixture of experts:
    128 of 768, top 8, in all 48 layers) are those models' text configs read by their family
    modules (every option of the family on).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    shapes = {
        "llama-2-7b": ModelArgs.llama2_7b,
        "smollm2-135m": ModelArgs.smollm2_135m,
        "tiny": lambda: ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256,
                                  vocab_size=512, max_context=4096, rope_theta=10000.0, norm_eps=1e-5),
        **{shape: (lambda c=config, n=shape: family_for_config(c, n).module.config_from_hf(c, n))
           for shape, config in _HF_SHAPES.items()},
    }
    if name not in shapes:
        raise ValueError(f"unknown random model shape {name!r}; one of {', '.join(shapes)}")
    return shapes[name]()


def random_weights(args: ModelArgs, dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str = "cpu", seed: int = 0,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """A random-initialised state dict of shape ``args`` (loader names, module docstring table).

    Matrices are drawn from N(0, ``std``²) (0.02: transformers' ``initializer_range`` default for
    Llama), norm weights are ones, each tensor drawn directly on ``device`` by one generator seeded
    with ``seed``, in ``expected_shapes`` order: the same seed on the same device gives the same
    weights. A tied shape shares ``tok_embeddings.weight`` as ``output.weight``. Llama-2-7B in fp16
    takes 13.5 GB.

    Args:
        args: the model's shape.
        dtype: floating dtype of every tensor.
        device: where the tensors are created.
        seed: the generator's seed.
        std: standard deviation of the matrices' entries.

    Returns:
        The state dict, as :func:`load_safetensors` returns it.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(args):
        if name == "output.weight" and args.tie_embeddings:
            state[name] = state["tok_embeddings.weight"]
        elif name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            w = torch.empty(shape, dtype=dtype, device=device)
            state[name] = w.normal_(0.0, std, generator=generator)
    return state
