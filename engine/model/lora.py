"""LoRA adapters (Hu et al. 2021) on the shared network: loading and checking PEFT adapter
directories, and the grouped delta a step adds to the base products.

An adapter is a PEFT directory: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, `rank_pattern`, `alpha_pattern`) and `adapter_model.safetensors` holding, per
targeted projection, `...layers.{i}.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r].
A projection's output becomes W·x + s · B·A·x with s = alpha / r (alpha / √r with rsLoRA).

The network runs fused matrices (`engine.model.transformer`): Q | K | V as `wqkv` (Q and K rows in
interleaved-RoPE order), gate | up as `w13`. `load_adapter` turns an adapter into the same
layout, one pair per fused matrix: A_f [R, in] the targeted parts' A stacked, B_f [out, R]
block-diagonal (each part's B · s in its rows and its own R columns, Q and K rows reordered as
the base weights are), so that B_f · A_f · x is every part's delta at once and one shrink and one
expand run per fused matrix. Every family of the registry maps its Hugging Face module names to
the loader's (`hf_layer_names` / `HF_LAYER_NAMES`), Phi-3's fused `qkv_proj` and `gate_up_proj`
included; a mixture-of-experts layer's experts take no adapter (transformers' experts are not
`nn.Linear`s, so PEFT does not target them).

A step's rows are grouped by adapter (`LoraBatch`, built by the model runner from the plan):
each fused matrix's delta is one grouped shrink and one grouped expand over every adapter row of
the step (punica's SGMV, S-LoRA), added to the base product's output, whatever `LinearMethod`
computed it. On a bf16 CPU with genserve's kernels the whole delta of a fused matrix is one
`lora_delta_` call (engine/kernels/csrc/lora_delta.cpp: gather, shrink, expand and add in place,
over each adapter's matrices in one buffer, `kernel_tables`, which holds each part's block of
B_f and not its zeros, in bf16, or `kernel_tables_q8`, in int8 with fp32 scales, where
`EngineConfig.lora_dtype` asks for 8-bit pairs): each row's bits are those of its row alone, whatever its neighbours'
adapters, and pure-decode steps keep the C++ decode loop, which runs the same call
(`engine.runner.decode_loop`). Elsewhere one product per adapter group
(`engine.model.linear.linear`). Rows of the base model take no delta: their bits are the base
model's.

Which adapters are served and which are resident where the products run is the runner's
(`engine.runner.lora`: `LoraRegistry`, `LoraSlots`).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch

from engine import kernels
from engine.model.config import ModelArgs
from engine.model.linear import linear
from engine.model.registry import family_for
from engine.model.rope import interleave_rope_rows

# Largest rank an adapter's projection may have (vLLM's --max-lora-rank default range).
MAX_LORA_RANK = 64
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The fused matrices an adapter may change, and the loader names (`engine.model.weights`) that
# make their rows, in row order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
    "attention.wo": ("attention.wo",),
    "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
    "feed_forward.w2": ("feed_forward.w2",),
}
# Checkpoint-fused loader names (Phi-3) -> the fused matrix whose every row they cover.
_WHOLE = {"attention.wqkv_checkpoint": "attention.wqkv", "feed_forward.w13_checkpoint": "feed_forward.w13"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraMatrix:
    """One fused matrix's adapter pair, in the model dtype.

    Attributes:
        a: [R, in], the targeted parts' lora_A stacked (R = the sum of their ranks).
        b: [out, R], block-diagonal: each part's lora_B times its scale in the part's rows (the
            fused matrix's row order, RoPE-interleaved for Q and K) and its own R columns.
        parts: per targeted part, (lo, hi, r_lo, r_hi): its rows [lo, hi) of b and its columns
            [r_lo, r_hi) (rows of a); b is zero outside these blocks. Empty: one part, all of b.
    """

    a: torch.Tensor
    b: torch.Tensor
    parts: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(eq=False)
class LoraAdapter:
    """A loaded adapter: host copies of its fused pairs.

    Attributes:
        name: served name; path: its directory; lora_id: the load's id (`LoraRequest.lora_id`).
        rank: its largest rank; alpha: `lora_alpha`; targets: the Hugging Face module names it
            changes (sorted).
        matrices: (layer index, fused matrix name: "attention.wqkv", "attention.wo",
            "feed_forward.w13", "feed_forward.w2") -> `LoraMatrix`, on the CPU.
        unloaded: set by `LoraRegistry.unload`; requests already holding it finish on it.
    """

    name: str
    path: str
    lora_id: int
    rank: int
    alpha: float
    targets: tuple[str, ...]
    matrices: dict[tuple[int, str], LoraMatrix]
    unloaded: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of its host copies."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.matrices.values())


def _module_map(args: ModelArgs) -> list[dict[str, str]]:
    """Per layer: Hugging Face module name (`self_attn.q_proj` ...) -> loader name
    (`attention.wq` ...) of every projection an adapter may target there."""
    module = family_for([args.architecture], args.architecture).module
    targetable = set(_WHOLE) | {p for parts in FUSED_PARTS.values() for p in parts}
    out = []
    for i in range(args.n_layers):
        names = module.hf_layer_names(args, i) if hasattr(module, "hf_layer_names") else module.HF_LAYER_NAMES
        out.append({hf: ours for hf, ours in names.items() if ours in targetable
                    and not (args.is_sparse(i) and ours.startswith("feed_forward."))})
    return out


def _sizes(args: ModelArgs) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Fused matrix -> (input width, its parts' output rows)."""
    hd = args.head_dim
    return {"attention.wqkv": (args.dim, (args.n_heads * hd, args.n_kv_heads * hd, args.n_kv_heads * hd)),
            "attention.wo": (args.n_heads * hd, (args.dim,)),
            "feed_forward.w13": (args.dim, (args.intermediate_size, args.intermediate_size)),
            "feed_forward.w2": (args.intermediate_size, (args.dim,))}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: the first key that matches the end of the
    module's full name (`re.match(rf"(.*\\.)?({key})$", name)`), else `default`."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(directory: pathlib.Path) -> dict:
    """`adapter_config.json` of `directory`, checked for what genserve serves.

    Raises:
        ValueError: the directory or the file is missing, not JSON, not a LoRA config, or asks for
            what is not served (DoRA, trained biases, `modules_to_save`, `target_parameters`
            (LoRA on a mixture of experts' stacked experts), a rank above
            `MAX_LORA_RANK` or below 1); the message names the file and the field.
    """
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter {directory}: no such directory")
    if not path.is_file():
        raise ValueError(f"LoRA adapter {directory}: missing {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON adapter config ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "lora_bias"):
        if config.get(flag):
            raise ValueError(f"{path}: {flag} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("target_parameters"):
        raise ValueError(f"{path}: target_parameters {config['target_parameters']} (LoRA on parameters, such as a "
                         "mixture of experts' stacked experts) is not supported; target the projections")
    if config.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save {config['modules_to_save']} is not supported")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    for r in ranks:
        if not isinstance(r, int) or not 1 <= r <= MAX_LORA_RANK:
            raise ValueError(f"{path}: rank r = {r!r} is not an integer in 1..{MAX_LORA_RANK}")
    return config


def load_adapter(directory: str | pathlib.Path, args: ModelArgs, dtype: torch.dtype, name: str = "",
                 lora_id: int = 0) -> LoraAdapter:
    """Read and check a PEFT LoRA directory for the model `args` describes, in `dtype`, on the CPU.

    Args:
        directory: holds `adapter_config.json` and `adapter_model.safetensors`.
        args: the base model (its family names the projections; its shapes are checked).
        dtype: the serving dtype of the pairs (the scale is applied in fp32 first).
        name, lora_id: what the adapter is served as (`LoraRequest`).
    Returns:
        The `LoraAdapter`, its pairs in the fused layout (module docstring).
    Raises:
        ValueError: a missing file; a config genserve does not serve (`read_adapter_config`); a
            `target_modules` entry the model has no projection of (the message lists those it
            has); a tensor of a module or layer the model lacks, or of a kind other than
            lora_A / lora_B; a lora_A without its lora_B; a rank that is not the config's
            (`r`, or its `rank_pattern`); an input or output width that is not the model's. Each
            message names the file and the tensor or field.
    """
    from safetensors import SafetensorError, safe_open

    directory = pathlib.Path(directory)
    config = read_adapter_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {directory}: missing {WEIGHTS_FILE}")
    modules = _module_map(args)
    leaves = sorted({hf.rpartition(".")[2] for layer in modules for hf in layer})
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        for t in targets:
            if t not in leaves and not any(t == hf or hf.endswith("." + t) for layer in modules for hf in layer):
                raise ValueError(f"{directory / CONFIG_FILE}: target module {t!r}: {args.architecture} has no "
                                 f"such projection an adapter can change (it has {', '.join(leaves)})")
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{weights}: not a readable safetensors file ({e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{weights}: tensor {key!r} is not a lora_A / lora_B weight of a decoder layer "
                             "(embeddings, DoRA magnitudes and saved modules are not served)")
        layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
        if layer >= args.n_layers or module not in modules[layer]:
            raise ValueError(f"{weights}: tensor {key!r}: the model has no projection {module!r} in layer "
                             f"{layer} ({args.n_layers} layers; projections {', '.join(sorted(modules[0]))})")
        pairs.setdefault((layer, module), {})[kind] = tensor
    if not pairs:
        raise ValueError(f"{weights}: no lora_A / lora_B tensors")
    r_default, alpha_default = config.get("r", 8), float(config.get("lora_alpha", 8))
    sizes = _sizes(args)
    parts: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    max_rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        full = f"model.layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{weights}: {full} has no {missing}.weight")
        a, b = ab["A"], ab["B"]
        r = _pattern_value(config.get("rank_pattern"), full, r_default)
        alpha = float(_pattern_value(config.get("alpha_pattern"), full, alpha_default))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{weights}: {full}: rank of lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                             f"is not the config's r = {r}")
        ours = modules[layer][module]
        fused = _WHOLE.get(ours) or next(f for f, ps in FUSED_PARTS.items() if ours in ps)
        width, rows = sizes[fused]
        if ours in _WHOLE:
            lo, hi = 0, sum(rows)
        else:
            j = FUSED_PARTS[fused].index(ours)
            lo, hi = sum(rows[:j]), sum(rows[:j + 1])
        if a.shape[1] != width or b.shape[0] != hi - lo:
            raise ValueError(f"{weights}: {full}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                             f"the model's projection (in {width}, out {hi - lo})")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        parts.setdefault((layer, fused), []).append((lo, hi, a.float(), b.float() * scale))
        max_rank = max(max_rank, r)
    matrices = {}
    for (layer, fused), pieces in parts.items():
        width, rows = sizes[fused]
        total = sum(p[2].shape[0] for p in pieces)
        a_f = torch.zeros(total, width)
        b_f = torch.zeros(sum(rows), total)
        col = 0
        blocks = []
        for lo, hi, a, b in pieces:
            r = a.shape[0]
            a_f[col:col + r] = a
            b_f[lo:hi, col:col + r] = b
            blocks.append((lo, hi, col, col + r))
            col += r
        if fused == "attention.wqkv":             # Q and K rows as the fused base weight has them
            q, k, v = b_f.split(rows)
            b_f = torch.cat([interleave_rope_rows(q, args.n_heads, args.rotary_dim),
                             interleave_rope_rows(k, args.n_kv_heads, args.rotary_dim), v])
        # (the RoPE order moves rows within Q and within K: each part keeps its rows [lo, hi))
        matrices[(layer, fused)] = LoraMatrix(a_f.to(dtype).contiguous(), b_f.to(dtype).contiguous(),
                                              tuple(blocks))
    targets_found = sorted({module.rpartition(".")[2] for _, module in pairs})
    return LoraAdapter(name or directory.name, str(directory), lora_id, max_rank, alpha_default,
                       tuple(targets_found), matrices)


# The fused matrices in `lora_delta_`'s slot order (slot = 4 · layer + kind), which is also the
# order of `decode_layers`' products.
KINDS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
# `lora_delta_`'s table: per slot a_off, R, K, parts, then (lo, hi, r_lo, r_hi, b_off) per part
# (engine/kernels/csrc/genserve_ops.h, LORA_MAX_PARTS and LORA_SLOT_FIELDS).
_MAX_PARTS = 3
_SLOT_FIELDS = 4 + 5 * _MAX_PARTS
# Columns per block of a part's B in that buffer (lora_delta.cpp's COLS).
_BLOCK_COLS = 64


@dataclass(eq=False)
class ResidentLora:
    """An adapter's pairs where the products run (`LoraSlots`).

    Attributes:
        adapter: the host adapter.
        matrices: (layer, fused matrix) -> (a [R, in], b [out, R]) on the device.
        kernel: (blob, table) for `lora_delta_` (`kernel_tables`, or `kernel_tables_q8` for
            8-bit pairs) on a bf16 CPU where it is built (`kernel_path`); else None.
    """

    adapter: LoraAdapter
    matrices: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    kernel: tuple[torch.Tensor, torch.Tensor] | None = None


def kernel_path(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether adapters' deltas run `lora_delta_` here (bf16 on a CPU where it is built)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and kernels.lora_delta_available()


def kernel_tables(adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """`adapter`'s bf16 pairs as `lora_delta_` reads them (engine/kernels/csrc/lora_delta.cpp).

    Returns:
        blob: bf16 [values], every fused matrix's a [R, in] (row-major) and, per part, its block
            of b in runs of 64 columns (the last narrower), each in the VNNI pair order
            [ceil(r_p / 2)][cols][2] (an odd rank's last pair holding a zero); only the parts'
            blocks, not b's zeros.
        table: int64 [4 · layers, 19], row 4 · layer + kind (`KINDS`): a_off, R, K, parts, then
            lo, hi, r_lo, r_hi, b_off per part (offsets in values of blob); R = 0 where the
            adapter leaves the matrix alone.
    Raises:
        ValueError: a matrix of more than 3 parts, or a part's rank above 128.
    """
    layers = 1 + max(layer for layer, _ in adapter.matrices)
    table = torch.zeros(4 * layers, _SLOT_FIELDS, dtype=torch.int64)
    pieces, size = [], 0
    for (layer, name), m in sorted(adapter.matrices.items()):
        a = m.a.to(torch.bfloat16)
        parts = m.parts or ((0, m.b.shape[0], 0, m.a.shape[0]),)
        if len(parts) > _MAX_PARTS or any(r1 - r0 > 128 for _, _, r0, r1 in parts):
            raise ValueError(f"LoRA adapter {adapter.name}: {name} of layer {layer} has {len(parts)} parts "
                             f"of ranks {[r1 - r0 for _, _, r0, r1 in parts]} (the kernel takes 3, up to 128)")
        entry = [size, a.shape[0], a.shape[1], len(parts)]
        pieces.append(a.reshape(-1))
        size += a.numel()
        for lo, hi, r0, r1 in parts:
            b = m.b[lo:hi, r0:r1].to(torch.bfloat16)
            if b.shape[1] % 2:
                b = torch.cat([b, b.new_zeros(b.shape[0], 1)], 1)
            entry += [lo, hi, r0, r1, size]
            for block in b.split(_BLOCK_COLS):                   # [pairs][cols][2] per 64 columns
                pieces.append(block.reshape(block.shape[0], -1, 2).transpose(0, 1).reshape(-1))
                size += pieces[-1].numel()
        table[4 * layer + KINDS.index(name), :len(entry)] = torch.tensor(entry)
    return torch.cat(pieces).contiguous(), table


def _q8_rows(m: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `m` [rows, width] (fp32) rounded to int8 with a scale per row (max |row| / 127,
    nearest even), the rows padded with zero rows to a multiple of `groups`: (q int8, scale fp32)."""
    pad = -m.shape[0] % groups
    m = torch.cat([m, m.new_zeros(pad, m.shape[1])]) if pad else m
    scale = m.abs().amax(dim=1) / 127
    q = torch.where(scale[:, None] > 0, m / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp(-127, 127).to(torch.int8), scale


def kernel_tables_q8(adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """`adapter`'s pairs in `lora_delta_`'s 8-bit format (engine/kernels/csrc/lora_delta.cpp):
    A and B rounded to int8 with an fp32 scale per rank and per output column, for models whose
    block products already round their inputs to 8 bits (`EngineConfig.lora_dtype`).

    Returns:
        blob: uint8 [bytes], per fused matrix and part one record (padded to 64 bytes): A
            [ceil(r/16)][K/32][8][16][4] as q + 128, its scales [16 · ceil(r/16)] fp32, B
            [ceil(n/16)][ceil(r/4)][16][4] as q + 128, its scales [16 · ceil(n/16)] fp32 (r: the
            part's rank, n: its output columns; zero rows and columns past them).
        table: int64 [4 · layers, 19] as `kernel_tables`' (a_off: the first part's record;
            b_off: each part's record; offsets in bytes).
    Raises:
        ValueError: a matrix of more than 3 parts, a part's rank above 128, or an input width
            that is not a multiple of 32.
    """
    layers = 1 + max(layer for layer, _ in adapter.matrices)
    table = torch.zeros(4 * layers, _SLOT_FIELDS, dtype=torch.int64)
    pieces, size = [], 0
    for (layer, name), m in sorted(adapter.matrices.items()):
        parts = m.parts or ((0, m.b.shape[0], 0, m.a.shape[0]),)
        width = m.a.shape[1]
        if len(parts) > _MAX_PARTS or any(r1 - r0 > 128 for _, _, r0, r1 in parts) or width % 32:
            raise ValueError(f"LoRA adapter {adapter.name}: {name} of layer {layer} has {len(parts)} parts "
                             f"of ranks {[r1 - r0 for _, _, r0, r1 in parts]} and input width {width} "
                             "(the 8-bit kernel takes 3, up to 128, and a multiple of 32)")
        entry = [size, m.a.shape[0], width, len(parts)]
        for lo, hi, r0, r1 in parts:
            aq, a_scale = _q8_rows(m.a[r0:r1].float(), 16)                        # [r16, K]
            a_bytes = (aq.view(-1, 16, width // 32, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1)
                       .to(torch.int16) + 128).to(torch.uint8)
            b = m.b[lo:hi, r0:r1].float()
            b = torch.cat([b, b.new_zeros(b.shape[0], -b.shape[1] % 4)], 1)       # ranks to a multiple of 4
            bq, b_scale = _q8_rows(b, 16)                                        # [n16, r4]
            b_bytes = (bq.view(-1, 16, bq.shape[1] // 4, 4).permute(0, 2, 1, 3).reshape(-1)
                       .to(torch.int16) + 128).to(torch.uint8)
            record = torch.cat([a_bytes, a_scale.view(torch.uint8), b_bytes, b_scale.view(torch.uint8)])
            record = torch.cat([record, record.new_zeros(-record.numel() % 64)])
            entry += [lo, hi, r0, r1, size]
            pieces.append(record)
            size += record.numel()
        table[4 * layer + KINDS.index(name), :len(entry)] = torch.tensor(entry)
    return torch.cat(pieces).contiguous(), table


def make_resident(adapter: LoraAdapter, device: torch.device, dtype: torch.dtype,
                  int8: bool = False) -> ResidentLora:
    """`adapter`'s pairs on `device`, with its `kernel_tables` where `kernel_path` says (its
    `kernel_tables_q8` with `int8`, where every input width is a multiple of 32)."""
    matrices = {k: (m.a.to(device), m.b.to(device)) for k, m in adapter.matrices.items()}
    if not kernel_path(dtype, device):
        return ResidentLora(adapter, matrices)
    q8 = int8 and all(m.a.shape[1] % 32 == 0 for m in adapter.matrices.values())
    return ResidentLora(adapter, matrices, kernel_tables_q8(adapter) if q8 else kernel_tables(adapter))


class LoraBatch:
    """One step's rows grouped by adapter, and the delta each fused matrix adds (module docstring).

    Args:
        groups: per adapter, its `ResidentLora` and its rows of the flat batch (ascending).
        device: where the step runs.

    Attributes:
        kernel_args: (rows int64 [N], the adapter rows grouped; offsets [G + 1]; blobs; tables):
            `lora_delta_`'s arguments but y, x and the slot, when every adapter has its
            `kernel_tables`; else None. The C++ decode loop takes them too (`DecodeLoop.run`).

    Build with `LoraBatch.from_rows`; None when no row has an adapter.
    """

    def __init__(self, groups: list[tuple[ResidentLora, list[int]]], device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self._selections: dict[tuple[bool, ...], tuple[torch.Tensor, list[int], list[ResidentLora]]] = {}
        self.kernel_args = None
        if all(res.kernel is not None for res, _ in groups):
            rows = [r for _, group in groups for r in group]
            offsets = [0]
            for _, group in groups:
                offsets.append(offsets[-1] + len(group))
            self.kernel_args = (torch.tensor(rows, dtype=torch.int64), offsets,
                                [res.kernel[0] for res, _ in groups], [res.kernel[1] for res, _ in groups])

    @classmethod
    def from_rows(cls, row_adapters: list[ResidentLora | None], device: torch.device) -> "LoraBatch | None":
        """Group the rows by adapter (adapters in first-row order, rows ascending within one).

        Args:
            row_adapters: [T] per flat-batch row, the `ResidentLora` it runs on, or None (base).
            device: where the step runs.
        """
        by: dict[int, tuple[ResidentLora, list[int]]] = {}
        for row, res in enumerate(row_adapters):
            if res is not None:
                by.setdefault(id(res), (res, []))[1].append(row)
        return cls(list(by.values()), device) if by else None

    @property
    def num_rows(self) -> int:
        """Rows that run on an adapter."""
        return sum(len(rows) for _, rows in self.groups)

    def _select(self, key: tuple[int, str]) -> tuple[torch.Tensor, list[int], list[ResidentLora]] | None:
        """The rows (int64 [N], grouped) whose adapter changes `key`, their group offsets and
        adapters; cached per set of groups (the same for most matrices)."""
        present = tuple(key in res.matrices for res, _ in self.groups)
        if not any(present):
            return None
        hit = self._selections.get(present)
        if hit is None:
            rows, offsets, adapters = [], [0], []
            for (res, group), on in zip(self.groups, present):
                if on:
                    rows.extend(group)
                    offsets.append(len(rows))
                    adapters.append(res)
            index = torch.tensor(rows, dtype=torch.int64).to(self.device)
            hit = self._selections[present] = (index, offsets, adapters)
        return hit

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, matrix: str) -> torch.Tensor:
        """y [T, out] (the base product of x [T, in], same dtype) plus each adapter row's delta
        B·A·x of fused matrix `matrix` ("attention.wqkv" ...) in layer `layer`, in place; rows of
        the base model or of adapters that do not change this matrix are left as they are.
        Returns y."""
        if self.kernel_args is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            rows, offsets, blobs, tables = self.kernel_args
            return torch.ops.genserve.lora_delta_(y, x, rows, offsets, blobs, tables,
                                                  4 * layer + KINDS.index(matrix))
        sel = self._select((layer, matrix))
        if sel is None:
            return y
        index, offsets, adapters = sel
        xs = x.index_select(0, index)                                            # [N, in]
        key = (layer, matrix)
        delta = torch.cat([linear(linear(xs[lo:hi], res.matrices[key][0]), res.matrices[key][1])
                           for res, lo, hi in zip(adapters, offsets, offsets[1:])])
        return y.index_add_(0, index, delta)
