"""Engine configuration: every dial of the scheduler and the KV pool, with its unit.

The defaults are the design's numbers (docs/design.md): 16-token blocks, a row cap
of 32, a 256-token prefill token budget per step, an 8,192-token context limit, a 5 % free-block margin at
admission, 8 rows per API key while others wait, and 2 device-seconds of queued work before 429.
"""

from __future__ import annotations

from dataclasses import dataclass

BATCHING_MODES = ("continuous", "continuous_unchunked", "static", "dynamic")
DTYPES = ("bfloat16", "float32", "float16")
DEVICES = ("auto", "cpu", "cuda")
WEIGHTS = ("auto", "bf16", "q4", "int8", "q4q8")
KV_CACHE_DTYPES = ("auto", "int8")
LORA_DTYPES = ("auto", "model", "int8")
PREFIX_CACHE_SCOPES = ("key", "global")
CAPS_ALONE = (("tpot_target_ms", 1.0), ("gap_target_ms", 1.0))
"""`EngineConfig` overrides under which the design's token caps alone size each step's prefill:
TPOT and gap targets of 1 ms, within which no step is predicted, so nothing beyond the caps joins
(`engine.core.sched.step_budget`). The serve flags: `--tpot-target-ms 1 --gap-target-ms 1`.
Benchmarks use it to measure the chunk they ask for; the policy comparisons use it as the baseline."""


@dataclass(slots=True)
class EngineConfig:
    """Static settings of one engine instance.

    Attributes:
        block_size: tokens per KV block (16, the design's PagedAttention block).
        max_rows: row cap, the most requests in one step (32; set by the TPOT target).
        prefill_token_budget: prompt tokens one step may carry while many rows decode (256; bounds
            the step time at 40 + 25.6 ms in the design).
        prefill_piece: alignment grid of prefill, tokens (64): a request's prompt is cut at
            multiples of it whatever else shares the step, so its arithmetic is batch-invariant.
        few_rows / prefill_token_budget_few_rows: with at most `few_rows` decode rows (4), a step may
            carry `prefill_token_budget_few_rows` prompt tokens (1,024): a longer step then delays few
            users, and the newcomer's TTFT drops (the design's "raise it when few rows decode").
        max_context: prompt + max_tokens limit in tokens (8,192, the model's context).
        max_new_tokens: upper bound for a request's max_tokens (1,000).
        kv_pool_bytes: memory budget of the paged K/V tensors in bytes (2 GiB on CPU).
        num_blocks: if set, the pool's size in blocks, overriding `kv_pool_bytes` (tests shrink it).
        free_margin: share of the pool kept free when admitting (0.05 = 5 %).
        per_key_rows: most running rows one API key may hold while another key waits (8).
        queue_budget_s: device-seconds of queued work above which submit answers 429 (2.0 s).
        output_token_weight: fair-queueing weight of an output token, prompt token = 1 (12).
        default_deadline_s: wall-clock limit of a request from arrival, in seconds.
        dtype: `DTYPES`: "bfloat16" (default, fastest on CPU), "float32", or "float16" (on the CPU
            with torch ops, not genserve's kernels).
        num_threads: torch intra-op threads; 0 means "the cores this process may use".
        batching: how batches form (the design's scheduler comparison; `BATCHING_MODES`):
            "continuous" (default): rows join and leave at every step, prefill in chunks of
                `prefill_token_budget` tokens per step;
            "continuous_unchunked": rows join and leave at every step, each prompt prefilled
                whole in one step (no prefill budget);
            "static": wait until `max_rows` requests are queued, admit them (as many as the
                pool holds), prefill them whole and run the batch until every row is done; no
                request joins a running batch;
            "dynamic": as static, but the batch also fires when the oldest queued request has
                waited `dynamic_window_s`.
        dynamic_window_s: the dynamic batcher's longest wait for a fuller batch, seconds (0.010).
        device: where the weights, the KV pool and the step run: "cuda", "cpu", or "auto"
            (default: "cuda" when torch sees a CUDA device, else "cpu").
        activation_reserve_bytes: on CUDA, device memory kept free for the forward pass's
            activations, bytes (6 GB, the design's reserve); the KV pool takes the free memory
            left after the weights and this reserve, unless `num_blocks` is given. Not used on CPU,
            where `kv_pool_bytes` sizes the pool.
        tpot_target_ms: the TPOT target, ms (70, the design's). A step carries prefill beyond the
            design's token caps while the cost model predicts it within what its decoding rows
            can spare: each row's mean time per output token stays within this target
            (`engine.core.sched.step_budget.StepBudget`).
        gap_target_ms: the longest gap between two tokens of a stream that prefill beyond the
            token caps may cause, ms (150: under the Helm chart's alert on a p99 longest gap of
            200 ms, with room for the cost model's error). The caps alone may make longer steps
            on a host slower than the cost model's targets.
        prefix_caching: reuse the K/V blocks of a prompt prefix an earlier request computed
            (on by default, as in vLLM): full prompt blocks stay cached after their request ends
            and are taken back least recently used only when the pool needs them; reuse is in
            whole `prefill_piece` pieces, so a cached answer is bit-identical to a computed one.
        prefix_cache_scope: who may reuse whose cached blocks (`PREFIX_CACHE_SCOPES`): "key"
            (default): only requests of the API key (and `cache_salt`, when a request sends one)
            that computed them, so a request's speed and its cached-token count say nothing
            about other tenants' prompts; "global": every request whose prompt and
            `cache_salt` match, across keys. "global" reuses more, and opens a side channel: a
            tenant can tell from its time to first token or its cached-token count (and from
            /metrics' hit counter) whether anyone sent a prompt before (vLLM's CVE-2025-46570).
        weights: how the block matrices are read (`WEIGHTS`): "bf16": dequantized to bf16 at
            load; "q4": the GGUF's 4-bit Q4_1 blocks as they are, 3.2x fewer bytes per product,
            with the bits of genserve's bf16 products (`engine.model.quant` says where those are the
            bf16 path's; GGUF models on AVX512-BF16 CPUs, bfloat16 only); "auto" (default): for a
            GGUF on the CPU in bf16, "q4q8" on CPUs with AVX512-VNNI and no AMX or with AVX2
            alone, "q4" on CPUs with AMX or AVX512-BF16 alone, else "bf16": the fastest of them measured on each kind
            of CPU (docs/benchmarks/int8.md; `engine.runner.builder.auto_weights`);
            "int8": every block matrix's product on int8 arithmetic with per-row scales
            (`engine.model.int8`; CPU only): faster prefill, not the bf16 products' bits;
            "q4q8": the GGUF's own blocks exact, each input rounded to 8 bits: llama.cpp's
            arithmetic for the file, product by product (`engine.model.gguf_blocks.attach_q4q8`; CPUs
            with AVX512-VNNI or AVX2): Q4_1 matrices times inputs rounded per row and block of
            32 (Q4_1 x Q8_1, `q4q8_linear`), Q4_K and Q6_K matrices (a Q4_K_M file's) times
            inputs rounded per row and block of 256 (Q4_K / Q6_K x Q8_K, `qk_linear`,
            `engine.model.kquant`), Q8_0 matrices and a Q8_0 output projection as Q8_0 x Q8_0
            (`q8q8_linear`), and Q5_0 / Q4_0 ones likewise, their blocks converted exactly to
            Q8_0 at load (`engine.model.gguf_blocks.as_q8_0`); a matrix of any
            other type, or a K-quant one whose input is not a multiple of 256, keeps its bf16
            product. One mode rather than one per type because it is one contract, "the file's
            blocks as llama.cpp multiplies them", which a mixed file (Q4_K_M is Q4_K and Q6_K)
            needs whole. Not the bf16 products' bits; rows still independent of the batch.
        kv_cache_dtype: how the KV pool stores keys and values (`KV_CACHE_DTYPES`, vLLM's
            `--kv-cache-dtype`): "auto" (default): in the model dtype; "int8": the 8-bit format
            of `engine.attention.kv_quant` (int8 with a power-of-two scale per 32 numbers, OCP MX's
            MXINT8; 0.52x the bytes of bf16 at head_dim 64): twice the tokens in the same pool and fewer bytes for decode
            attention to read, at the cost of rounding every cached key and value (the model's
            outputs change; docs/benchmarks/kv_int8.md measures by how much and how fast).
        max_loras: the most distinct LoRA adapters one step uses (vLLM's `--max-loras`; the
            scheduler holds a request whose adapter would exceed it in the queue) and keeps
            resident where the products run; the others stay in host memory and are made
            resident again, least recently used evicted first, when a step needs them
            (docs/lora.md). >= 1.
        max_lora_rank: the largest rank a LoRA adapter may have (vLLM's `--max-lora-rank`);
            1..64.
        lora_dtype: how LoRA adapters' pairs are stored and multiplied where genserve's CPU
            kernel runs them (`LORA_DTYPES`, after vLLM's `--lora-dtype`): "model": in the model
            dtype (bf16), the deltas PEFT computes up to bf16 rounding; "int8": rounded to int8
            with a scale per rank and per output column, inputs rounded to int8 per block of 32
            (llama.cpp's kind of arithmetic, `engine.model.lora.kernel_tables_q8`; half the
            bytes and the integer dot product's rate); "auto" (default): "int8" where the model's
            block products already round their inputs to 8 bits (`weights` q4q8 or the GGUF's
            K-quant / Q8_0 / int8 products), else "model". Elsewhere (CUDA, fp32, CPUs without
            the kernel) the pairs stay in the model dtype.
    """

    block_size: int = 16
    max_rows: int = 32
    prefill_token_budget: int = 256
    prefill_piece: int = 64
    few_rows: int = 4
    prefill_token_budget_few_rows: int = 1024
    max_context: int = 8192
    max_new_tokens: int = 1000
    kv_pool_bytes: int = 2 * 1024**3
    num_blocks: int | None = None
    free_margin: float = 0.05
    per_key_rows: int = 8
    queue_budget_s: float = 2.0
    output_token_weight: float = 12.0
    default_deadline_s: float = 600.0
    dtype: str = "bfloat16"
    num_threads: int = 0
    batching: str = "continuous"
    dynamic_window_s: float = 0.010
    device: str = "auto"
    activation_reserve_bytes: int = 6 * 10**9
    tpot_target_ms: float = 70.0
    gap_target_ms: float = 150.0
    prefix_caching: bool = True
    prefix_cache_scope: str = "key"
    weights: str = "auto"
    kv_cache_dtype: str = "auto"
    max_loras: int = 8
    max_lora_rank: int = 64
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two > 0, got {self.block_size}")
        if not 1 <= self.max_rows <= 1024:
            raise ValueError(f"max_rows must be in 1..1024, got {self.max_rows}")
        if self.prefill_token_budget < self.block_size:
            raise ValueError(f"prefill_token_budget must be >= block_size ({self.block_size}), got {self.prefill_token_budget}")
        if self.prefill_token_budget % self.block_size:
            raise ValueError(f"prefill_token_budget must be a multiple of block_size, got {self.prefill_token_budget}")
        if self.prefill_piece % self.block_size or self.prefill_piece > self.prefill_token_budget:
            raise ValueError(f"prefill_piece must be a multiple of block_size and <= prefill_token_budget, "
                             f"got {self.prefill_piece}")
        if self.prefill_token_budget_few_rows < self.prefill_token_budget:
            raise ValueError("prefill_token_budget_few_rows must be >= prefill_token_budget")
        if self.max_context <= 0 or self.max_new_tokens <= 0:
            raise ValueError("max_context and max_new_tokens must be positive")
        if not 0.0 <= self.free_margin < 1.0:
            raise ValueError(f"free_margin must be in [0, 1), got {self.free_margin}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.queue_budget_s <= 0 or self.default_deadline_s <= 0:
            raise ValueError("queue_budget_s and default_deadline_s must be positive")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}, got {self.batching!r}")
        if not self.dynamic_window_s >= 0:
            raise ValueError(f"dynamic_window_s must be >= 0, got {self.dynamic_window_s}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes must be >= 0, got {self.activation_reserve_bytes}")
        if not (self.tpot_target_ms > 0 and self.gap_target_ms >= self.tpot_target_ms):
            raise ValueError(f"tpot_target_ms must be > 0 and gap_target_ms >= it, got "
                             f"{self.tpot_target_ms} and {self.gap_target_ms}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, got "
                             f"{self.prefix_cache_scope!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 64:
            raise ValueError(f"max_lora_rank must be in 1..64, got {self.max_lora_rank}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")

    @property
    def prefill_step_tokens(self) -> int:
        """Prompt tokens a step carries within the token budgets (`prefill_token_budget`, or
        `prefill_token_budget_few_rows` with few rows, the larger): what a sliding-window KV group
        holds beyond its window while a prompt is prefilled (`engine.core.kv_groups`)."""
        return max(self.prefill_token_budget, self.prefill_token_budget_few_rows)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (ceil division by block_size)."""
        return -(-num_tokens // self.block_size)
