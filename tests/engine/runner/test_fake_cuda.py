"""The engine's CUDA path on a fake CUDA device (`tests.engine.fake_cuda`): Llama-2-7B's shape in
fp16, built by the real builder, stepped by the real scheduler and model runner, every op on fake
tensors (shapes, dtypes and devices checked as on the GPU; no numbers).

Each step is checked for its transfers: one pinned int64 host-to-device copy of the step's
integers (`engine.attention.base.build_metadata`, every integer of the step in it), and one
device-to-host copy back, of the sampled ids only. The ids the engine reads back are chosen here
(`Script`): a fake tensor holds no values, so the harness answers the one `tolist` with the ids
`token_for` gives each draw, and the test checks each request ends with exactly those ids, forks
and preempted requests included.

Memory (`test_activation_peak_fits_the_reserve`, docs/gpu.md "Memory on the device") counts
the bytes of every live fake CUDA tensor by category.

LoRA (`test_mixed_adapter_steps_on_the_device`): rows of three adapters and of the base model in
one step; the adapters' matrices and their rows' indices are the LoRA path's own uploads, checked
apart from the step's one upload.

Other families run the same steps in bf16: Qwen3-8B, Gemma-3-12B, and Qwen3-30B-A3B's
mixture-of-experts layers, whose experts run as grouped products (`aten._grouped_mm`, counted by
the ledger) over stacked expert matrices, with no read back to the host.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from engine.attention.base import StepLayout
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.plan import Segment, StepPlan
from engine.core.request import Request, SamplingParams
from engine.runner.builder import build_engine
from engine.runner.cuda_graphs import DecodeGraphs, _Graph, decode_forward, pad_decode_step
from engine.runner.inputs import StepInputs
from engine.runner.model_runner import ModelRunner
from engine.model.weights import random_shape
from tests.engine.fake_cuda import DEVICE, FakeCuda, Transfer, default_reply, install_cuda_guard
from tests.engine.lora_adapters import write_adapter

pytestmark = pytest.mark.slow

MODEL = "random:llama-2-7b"
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def cuda_guard(tmp_path_factory):
    why = install_cuda_guard(tmp_path_factory.mktemp("fake-cuda"))
    if why is not None:
        pytest.skip(why)


def token_for(req: Request, i: int) -> int:
    """The id the fake device hands back as `req`'s i-th generated token (3..30,002: no special
    token, inside Llama-2's 32,000)."""
    return 3 + (zlib.crc32(req.request_id.encode()) + 7919 * i) % 30_000


@dataclasses.dataclass
class StepRecord:
    """What one checked step ran and moved.

    Attributes:
        plan: the step; draws: its draws' requests, taken before the step ran (a fork's
            `plan.draws` changes once it has a token); integers: how many int64 its upload must
            hold, and the module that uploads them (`step_integers`).
        transfers: its copies; shared_blocks: blocks referenced by two or more requests after it.
    """

    plan: StepPlan | None
    draws: list[Request]
    integers: tuple[int, str]
    transfers: list[Transfer]
    shared_blocks: int


class Script:
    """Steps an engine on the fake device, checks every step's transfers and answers its one
    read of sampled ids with `token_for` of each draw.

    The sampler returns the greedy draws' ids first, then the drawn (temperature > 0) ones, in
    one copy (`engine.runner.sampler.sample`); the answer is laid out the same way.
    """

    def __init__(self, engine: Engine, fake: FakeCuda) -> None:
        self.engine, self.fake = engine, fake
        self.records: list[StepRecord] = []
        self._plan: StepPlan | None = None
        self._draws: list[Request] = []
        self._integers = (0, "")
        runner = engine.executor
        execute = runner.execute

        def recording(plan: StepPlan):
            self._plan, self._draws = plan, [r for _, r in plan.draws]
            self._integers = step_integers(engine, plan)
            return execute(plan)

        runner.execute = recording
        fake.reply = self.reply

    def reply(self, t: torch.Tensor):
        if self._plan is None or t.dtype != torch.int64 or t.dim() != 1:
            return default_reply(t)              # e.g. the backend probe's difference (.item())
        draws = self._draws
        ordered = ([r for r in draws if r.sampling.greedy] + [r for r in draws if not r.sampling.greedy])
        assert t.numel() == len(ordered), f"read {t.numel()} ids for {len(ordered)} draws"
        return [token_for(r, len(r.generated)) for r in ordered]

    def step(self) -> StepRecord:
        mark = len(self.fake.ledger.transfers)
        self._plan = None
        self.engine.step()
        pool = self.engine.pool
        shared = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) > 1)
        record = StepRecord(self._plan, self._draws, self._integers,
                            self.fake.transfers_since(mark), shared)
        if record.plan is not None:
            check_transfers(record)
        self.records.append(record)
        return record

    def run(self, max_steps: int = 200) -> list[StepRecord]:
        for _ in range(max_steps):
            if not self.engine.scheduler.has_work:
                return self.records
            self.step()
        raise AssertionError(f"still busy after {max_steps} steps")


def step_integers(engine: Engine, plan: StepPlan) -> tuple[int, str]:
    """How many int64 values the step's one upload must carry, and the module that makes it:
    the attention metadata (slots, decode tables and lengths, pieces' blocks, the backend's own
    lists; those of every KV group), the token ids, positions, rows to sample, rows each draw reads and the sampler's
    greedy / drawn split (`build_metadata`); or, for a step a CUDA graph replays, the padded
    graph inputs and the same sampling lists (`DecodeGraphs.run`)."""
    inputs = StepInputs.from_plan(plan, BLOCK)
    sampling = sum(len(x) for x in inputs.sampling_ints)
    graphs = engine.executor.graphs
    bucket = graphs.bucket(plan) if graphs is not None else None
    if bucket is not None:
        return len(pad_decode_step(bucket, inputs).ints()) + sampling, "engine/runner/cuda_graphs.py"
    backend = engine.executor.attention
    layouts: list[StepLayout] = [inputs.layout, *inputs.group_layouts]     # one per KV group
    attention = sum(len(x.slots) + len(x.decode_tables) + len(x.decode_lens) + len(x.piece_blocks)
                    + sum(len(o) for o in backend.host_ints(x)) for x in layouts)
    return (attention + len(inputs.token_ids) + len(inputs.positions) + sampling,
            "engine/attention/base.py")


LORA_MODULE = "engine/model/lora.py"


def check_transfers(record: StepRecord) -> None:
    """One pinned int64 upload holding every integer of the step; the sampler's temperatures
    (fp32, one per drawn row) at most besides; one read of exactly the sampled ids. The LoRA
    path's own uploads (`LORA_MODULE`: adapters made resident, rows of each adapter) come only
    with adapter rows, and `check_lora_transfers` checks them."""
    has_lora = any(s.request.lora is not None for s in record.plan.segments)
    transfers = [t for t in record.transfers if not t.where.startswith(LORA_MODULE)]
    assert has_lora or len(transfers) == len(record.transfers), record.transfers
    h2d = [t for t in transfers if t.direction == "h2d"]
    ints = [t for t in h2d if t.dtype == torch.int64]
    numel, where = record.integers
    assert [(t.pinned, t.where.split(":")[0], t.numel) for t in ints] == [(True, where, numel)], h2d
    drawn = sum(1 for r in record.draws if not r.sampling.greedy)
    others = [t for t in h2d if t.dtype != torch.int64]
    assert all(t.dtype == torch.float32 and t.numel == drawn and "sampler.py" in t.where
               for t in others) and len(others) <= 1, others
    d2h = [t for t in transfers if t.direction == "d2h"]
    if record.draws:
        assert [(t.how, t.dtype, t.numel) for t in d2h] == [("tolist", torch.int64, len(record.draws))], d2h
    else:
        assert d2h == []


def fake_engine(fake: FakeCuda, attention: str, monkeypatch, **config) -> Engine:
    """`build_engine` on the fake device: random Llama-2-7B in fp16, the given backend."""
    monkeypatch.setenv("GENSERVE_ATTENTION", attention)
    cfg = EngineConfig(device="cuda", dtype="float16", num_threads=1, **config)
    loaded = build_engine(cfg, MODEL, calibrate=False)
    engine = loaded.engine
    assert engine.executor.device == torch.device("cuda", 0)
    assert loaded.args.dim == 4096 and loaded.args.vocab_size == 32_000
    return engine


def request(rid: str, key: str, prompt: list[int], max_tokens: int, lora=None, **sampling) -> Request:
    return Request(rid, key, prompt, max_tokens, SamplingParams(ignore_eos=True, **sampling), 0.0, 0.0,
                   lora=lora)


def prompt_of(n: int, salt: int) -> list[int]:
    return [3 + (salt * 131 + 17 * i) % 30_000 for i in range(n)]


def expected_tokens(req: Request) -> list[int]:
    return [token_for(req, i) for i in range(req.max_tokens)]


BACKENDS = ("sdpa", "flex", "xformers")


@pytest.fixture
def xformers_cutlass(request, monkeypatch):
    """For "xformers": its gathered bias through `cutlass.FwOp`, which is PyTorch's own
    `aten._efficient_attention_forward` (a meta kernel exists). The paged bias's kernels (fa2, fa3:
    xformers' own CUDA builds; triton split-K: a Triton launch) have none, and split-K refuses
    genserve's steps anyway (queries > 16 with a causal bias, 16-token pages)."""
    if request.node.callspec.params.get("attention") != "xformers":
        yield
        return
    fmha = pytest.importorskip("xformers.ops.fmha")
    import functools

    import xformers.ops.fmha.common as common

    monkeypatch.setattr(common, "_built_with_cuda", True)      # a CPU wheel says it was not
    monkeypatch.setattr(fmha, "memory_efficient_attention_forward",
                        functools.partial(fmha.memory_efficient_attention_forward, op=fmha.cutlass.FwOp))
    yield


@pytest.mark.parametrize("attention, kv_cache_dtype",
                         [(name, "auto") for name in BACKENDS] + [("sdpa", "int8")])
def test_mixed_decode_and_shared_steps_on_the_device(attention, kv_cache_dtype, monkeypatch,
                                                     xformers_cutlass):
    """Mixed steps (decode rows beside prefill pieces at offsets), n = 2 forks sharing their
    prompt blocks (copy-on-write of the shared partial block), a prefix-cache hit, a 32-row
    decode-only step, greedy and seeded rows, on each backend, and on the 8-bit KV cache (read
    by SDPA only)."""
    with FakeCuda() as fake:
        engine = fake_engine(fake, attention, monkeypatch, num_blocks=512,
                             kv_cache_dtype=kv_cache_dtype)
        want = {"sdpa": "sdpa", "flex": "flex", "xformers": "xformers-gathered"}[attention]
        assert engine.executor.attention.name == want
        assert len(engine.executor.model.layers) == len(engine.executor.kv.layers) == 32
        layer = engine.executor.kv.layers[0]
        assert (layer.dtype, layer.shape[-1]) == \
            ((torch.int8, 132) if kv_cache_dtype == "int8" else (torch.float16, 128))
        script = Script(engine, fake)
        long = request("long", "a", prompt_of(200, 1), 5, temperature=0.0)
        forked = request("forked", "a", prompt_of(40, 2), 5, temperature=0.8, seed=7)
        forked.fork(2, [7, 8])
        for r in (long, forked):
            engine.submit(r)
        script.step()                       # both prompts: four pieces of `long`, one of `forked`
        assert script.records[-1].shared_blocks == 3          # the forks share the prompt's blocks
        cached = request("cached", "a", list(long.prompt_ids[:192]) + prompt_of(30, 3), 5, temperature=0.0)
        engine.submit(cached)
        script.step()                       # 3 decode rows, `cached` from position 192
        others = [request(f"u{i}", f"key{i}", prompt_of(8, 10 + i), 2,
                          **({"temperature": 0.0} if i % 2 else {"temperature": 0.7, "seed": i}))
                  for i in range(28)]
        for r in others:
            engine.submit(r)
        script.run()

    plans = [r.plan for r in script.records if r.plan is not None]
    mixed = [p for p in plans if p.num_decode_rows and any(not s.decode and s.start > 0 for s in p.segments)]
    assert mixed, "no step held decode rows beside a prefill piece at an offset"
    assert any(p.num_decode_rows == 32 and not p.num_prefill_tokens for p in plans)
    assert len(plans) <= 8
    assert any(p.block_copies for p in plans)               # a fork's copy-on-write, on the device
    assert cached.stats.num_cached == 192 and engine.scheduler.stats().prefix_hit_tokens >= 192
    children = forked.children
    for r in [long, forked, cached, *children, *others]:
        assert r.generated == expected_tokens(r), r.request_id
    # one generator per request (the runner's state, kept across steps), each seeded as asked
    everyone = [long, forked, cached, *children, *others]
    assert [r.sampling.seed for r in [forked, *children]] == [7, 8]
    assert sorted(map(repr, (seed for seed, _ in fake.generators))) == \
        sorted(repr(r.sampling.seed) for r in everyone)
    assert all(g.device == torch.device("cuda", 0) for _, g in fake.generators)
    engine.pool.check_all_free()


def test_int8_cache_refuses_backends_that_cannot_read_it(monkeypatch):
    with FakeCuda() as fake:
        with pytest.raises(ValueError, match="8-bit KV cache runs with the cpu or sdpa attention "
                                             "backend, not 'flex'"):
            fake_engine(fake, "flex", monkeypatch, num_blocks=64, kv_cache_dtype="int8")


def test_preemption_and_readmission_on_the_device(monkeypatch):
    """Seven blocks for two 45-token prompts that each grow past three blocks: the newer one is
    preempted when the older needs its fourth block, is re-admitted once the older finishes,
    recomputes its prompt and its tokens, and ends with every token it was given."""
    with FakeCuda() as fake:
        engine = fake_engine(fake, "sdpa", monkeypatch, num_blocks=7, free_margin=0.0,
                             prefix_caching=False)
        script = Script(engine, fake)
        first = request("first", "a", prompt_of(45, 1), 6, temperature=0.0)
        second = request("second", "b", prompt_of(45, 2), 6, temperature=0.9, seed=5)
        for r in (first, second):
            engine.submit(r)
        script.run()
    plans = [r.plan for r in script.records if r.plan is not None]
    assert engine.scheduler.stats().num_preemptions == 1
    assert any(p.num_preempted for p in plans)
    # re-admitted: its prompt prefilled again from position 0, without a draw (its next token is
    # known), then its tokens fed back as decode rows
    pieces = [(s.start, s.length, s.samples) for p in plans for s in p.segments
              if s.request is second and not s.decode]
    assert pieces == [(0, 45, True), (0, 45, False)]
    for r in (first, second):
        assert r.generated == expected_tokens(r), r.request_id
    engine.pool.check_all_free()


class EagerGraph:
    """Stands in for a captured `torch.cuda.CUDAGraph` (capture needs a real device): `replay`
    runs the captured function again, writing into the same output tensor."""

    def __init__(self, run) -> None:
        self.replay = run


def eager_capture(self: DecodeGraphs, rows: int, nb: int, first: torch.Tensor) -> _Graph:
    """`DecodeGraphs._capture` without CUDA graphs: the warm-up run, then a replay that reruns
    `decode_forward` on the same static inputs into the same output."""
    static = first.clone()
    out = decode_forward(self.model, self.kv, static, rows, nb)
    return _Graph(EagerGraph(lambda: out.copy_(decode_forward(self.model, self.kv, static, rows, nb))),
                  static, out)


def test_decode_graph_buckets_on_the_device(monkeypatch):
    """Decode-only steps through `DecodeGraphs` (capture replaced by eager runs): 3 rows replay in
    the 4-row bucket, 5 in the 8-row one, 2 in the 2-row one, keys padded to 4 blocks; one upload
    per step, of the padded graph inputs and the sampling lists; mixed steps run eagerly."""
    monkeypatch.setattr(DecodeGraphs, "_capture", eager_capture)
    with FakeCuda() as fake:
        built = fake_engine(fake, "sdpa", monkeypatch, num_blocks=64)
        old = built.executor
        runner = ModelRunner(old.model, old.kv, kernels=False, attention="sdpa", cuda_graphs=True)
        engine = Engine(built.config, runner, 64)
        script = Script(engine, fake)
        first = [request(f"g{i}", f"k{i}", prompt_of(20, i), 4, temperature=0.0) for i in range(3)]
        for r in first:
            engine.submit(r)
        script.step()                       # prefill: eager
        script.step()                       # 3 decode rows: bucket 4
        later = [request(f"h{i}", f"l{i}", prompt_of(12, 20 + i), 3,
                         **({"temperature": 0.5, "seed": i} if i else {"temperature": 0.0}))
                 for i in range(2)]
        for r in later:
            engine.submit(r)
        script.run()
    assert runner.graphs.captured == [(2, 4), (4, 4), (8, 4)]
    for rows, nb in runner.graphs.captured:          # tokens, positions, slots, lengths, tables
        assert runner.graphs._graphs[rows, nb].static.shape == (4 * rows + rows * nb,)
        assert runner.graphs._graphs[rows, nb].out.shape == (rows, 4096)
    graph_steps = [r for r in script.records if r.integers[1].endswith("cuda_graphs.py")]
    assert [len(r.plan.segments) for r in graph_steps] == [3, 5, 2]
    for r in first + later:
        assert r.generated == expected_tokens(r), r.request_id


def synthetic_plan(rows: int, context: int, prompt_tokens: int, prompt_start: int,
                   piece: int = 64) -> StepPlan:
    """A step built by hand (the memory tests need contexts the scheduler would take thousands
    of fake steps to reach): `rows` greedy decode rows at position `context` − 1, then one
    request's prompt positions [prompt_start, prompt_start + prompt_tokens) in `piece`-token
    pieces, the last one sampling; every request on its own consecutive blocks."""
    segments: list[Segment] = []
    next_block = 0

    def table(tokens: int) -> tuple[int, ...]:
        nonlocal next_block
        blocks = tuple(range(next_block, next_block + -(-tokens // BLOCK)))
        next_block += len(blocks)
        return blocks

    for i in range(rows):
        req = request(f"d{i}", "m", prompt_of(context, i), 1, temperature=0.0)
        segments.append(Segment(req, context - 1, 1, True, table(context), decode=True))
    end = prompt_start + prompt_tokens
    if prompt_tokens:
        req = request("p", "m", prompt_of(end, 99), 1, temperature=0.0)
        blocks = table(end)
        for start in range(prompt_start, end, piece):
            segments.append(Segment(req, start, min(piece, end - start), start + piece >= end, blocks))
    return StepPlan(segments)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes of live fake CUDA tensors by category (decimal GB in `describe`).

    Attributes:
        weights: the network's parameters and buffers (the RoPE table among them).
        kv_pool: every layer's K/V pool; kv_blocks: its blocks.
        activations: at the step's peak, everything else live (the step's temporaries, the
            gather buffer, logits).
    """

    weights: int
    kv_pool: int
    kv_blocks: int
    activations: int


def storages_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a tied matrix counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def step_memory(fake: FakeCuda, runner: ModelRunner, plan: StepPlan) -> DeviceMemory:
    """Run `plan` on `runner` and split the peak of live device bytes by category."""
    weights = storages_bytes([*runner.model.parameters(), *runner.model.buffers()])
    kv = storages_bytes(runner.kv.layers)
    fake.reset_peak()
    runner.execute(plan)
    return DeviceMemory(weights, kv, runner.kv.num_blocks, fake.peak_bytes - weights - kv)


def seven_b_runner(fake: FakeCuda, monkeypatch, layers: int | None = None, max_context: int = 4096,
                   **config) -> ModelRunner:
    """The executor of `fake_engine` on the design's device (pool sized from the free memory
    left after the weights and the reserve), or, with `layers`, of Llama-2-7B's shape cut to that
    many blocks and given `max_context` positions (weights and pool shrink; a block's
    temporaries are the same, and are freed before the next block runs)."""
    if layers is None:
        return fake_engine(fake, "sdpa", monkeypatch, **config).executor
    import engine.runner.builder as builder
    from engine.model.weights import random_shape

    shape = dataclasses.replace(random_shape("llama-2-7b"), n_layers=layers, max_context=max_context)
    monkeypatch.setattr(builder, "random_shape", lambda name: shape)
    return fake_engine(fake, "sdpa", monkeypatch, max_context=max_context, **config).executor


GB = 10**9
RESERVE = EngineConfig().activation_reserve_bytes
DECODE_32_PLUS_256 = dict(rows=32, context=1550, prompt_tokens=256, prompt_start=1024)
FULL_POOL_32_PLUS_256 = dict(rows=32, context=3520, prompt_tokens=256, prompt_start=1024)
WHOLE_8192 = dict(rows=0, context=0, prompt_tokens=8192, prompt_start=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_activation_peak_fits_the_reserve(kv_cache_dtype, monkeypatch):
    """On the design's 80 GB device: weights, the KV pool the builder sizes, and the activation
    peak of (a) 32 decode rows of the design's average request (1,550 tokens) beside a 256-token
    prompt run (four 64-token pieces), (b) then 32 rows of 3,520 tokens beside the same (the pool
    nearly full: SDPA's gathered keys grow with the context, and the gather buffer grows while
    its old one is still held), (c) a whole 8,192-token prompt in one step (7B's shape with 8,192
    positions). Each peak stays under the reserve the builder keeps
    (`EngineConfig.activation_reserve_bytes`). A block's temporaries are freed before the next
    block runs, so (b) and (c) run on 7B's shape cut to 2 blocks, after (a) shows that 2 and 32
    blocks peak alike."""
    rows = {}
    with FakeCuda(device_bytes=80 * GB) as fake:
        runner = seven_b_runner(fake, monkeypatch, kv_cache_dtype=kv_cache_dtype)
        weights = storages_bytes([*runner.model.parameters(), *runner.model.buffers()])
        per_block = runner.kv.layers[0][:, 0].nbytes * 32              # K and V of 32 layers
        assert runner.kv.num_blocks == (80 * GB - weights - RESERVE) // per_block
        full = step_memory(fake, runner, synthetic_plan(**DECODE_32_PLUS_256))
        del runner
    with FakeCuda(device_bytes=80 * GB) as fake:
        short = seven_b_runner(fake, monkeypatch, layers=2, kv_cache_dtype=kv_cache_dtype,
                               num_blocks=7200)
        for name, shape in (("decode_32_plus_256", DECODE_32_PLUS_256),
                            ("full_pool_32_plus_256", FULL_POOL_32_PLUS_256)):
            rows[name] = step_memory(fake, short, synthetic_plan(**shape))
        del short
    assert rows["decode_32_plus_256"].activations == full.activations
    with FakeCuda(device_bytes=80 * GB) as fake:
        long = seven_b_runner(fake, monkeypatch, layers=2, max_context=8192,
                              kv_cache_dtype=kv_cache_dtype, num_blocks=520,
                              batching="continuous_unchunked")
        rows["whole_8192"] = step_memory(fake, long, synthetic_plan(**WHOLE_8192))
    print(f"{kv_cache_dtype}: weights {full.weights / GB:.2f} GB, KV pool {full.kv_pool / GB:.2f} GB "
          f"({full.kv_blocks} blocks)")
    for name, m in rows.items():                 # the table of docs/gpu.md (pytest -s shows it)
        print(f"{kv_cache_dtype} {name}: activation peak {m.activations / GB:.3f} GB")
    # fp16 matrices of 6,738,415,616 parameters, the 65 norm vectors in fp32, the RoPE table
    assert full.weights == 6_738_415_616 * 2 + 65 * 4096 * 2 + 4096 * 64 * 8
    for name, m in rows.items():
        assert 0 < m.activations < RESERVE, name


def run_mixed_steps(engine: Engine, fake: FakeCuda) -> tuple[Script, Request, Request, list[Request]]:
    """The design-scale script: a 200-token prompt alone, then a request sharing its first 192
    tokens (a prefix-cache hit) beside 31 short ones of other keys (greedy and seeded), run to
    the end: mixed steps, then a 32-row decode step. Returns (script, long, cached, others)."""
    script = Script(engine, fake)
    long = request("long", "a", prompt_of(200, 1), 5, temperature=0.0)
    engine.submit(long)
    script.step()
    cached = request("cached", "a", list(long.prompt_ids[:192]) + prompt_of(30, 3), 5, temperature=0.0)
    others = [request(f"u{i}", f"key{i}", prompt_of(8, 10 + i), 2,
                      **({"temperature": 0.0} if i % 2 else {"temperature": 0.7, "seed": i}))
              for i in range(31)]
    for r in [cached, *others]:
        engine.submit(r)
    script.run()
    return script, long, cached, others


@pytest.mark.parametrize("shape", ["qwen3-8b", "gemma-3-12b"])
def test_qwen3_and_gemma3_at_the_design_scale_on_the_device(shape, monkeypatch):
    """Qwen3-8B (per-head q/k norms, head_dim 128) and Gemma-3-12B (head_dim 256, five sliding
    layers to one global, two RoPE tables, sandwich norms, GeGLU, embedding scale), random bf16 on
    the fake device, through the real builder, scheduler and runner with SDPA, the backend that
    honours sliding windows: mixed steps, a prefix-cache hit and a 32-row decode step, each
    request ending with the ids the device handed back. FlexAttention, which has no sliding
    windows, is refused for Gemma 3 when forced, and passed over when not. Gemma 3's KV pool is in
    groups of sliding and global layers, a block table each."""
    with FakeCuda() as fake:
        monkeypatch.setenv("GENSERVE_ATTENTION", "sdpa")
        cfg = EngineConfig(device="cuda", dtype="bfloat16", num_threads=1, num_blocks=512)
        loaded = build_engine(cfg, f"random:{shape}", calibrate=False)
        engine, model = loaded.engine, loaded.engine.executor.model
        assert engine.executor.attention.name == "sdpa" and not engine.executor.kernels
        args = loaded.args
        if shape == "gemma-3-12b":
            windows = args.sliding_windows
            assert (args.head_dim, windows.count(1024), windows.count(None)) == (256, 40, 8)
            assert len(model.rope_freqs) == 2 and args.sandwich_norm and args.qk_norm
            # linear x8 on the global layers only; the local ones at base 10,000 unscaled
            assert [(args.layer(i).rope_theta, args.layer(i).rope_scaling.kind) for i in (0, 5)] == \
                [(1e4, "default"), (1e6, "linear")]
            assert all(t.device.type == "cuda" for t in model.rope_freqs)
            # KV groups of 8 layers: the global one, five sliding; a block table each
            kv = engine.executor.kv
            assert (kv.groups.group_size, engine.pool.windows) == (8, (None,) + (1024,) * 5)
            assert len(kv.slots) == 8 and kv.slots[0].device.type == "cuda"
        else:
            assert (args.head_dim, args.qk_norm, args.plain_llama) == (128, True, False)
        script, long, cached, others = run_mixed_steps(engine, fake)
        if shape == "gemma-3-12b":
            monkeypatch.setenv("GENSERVE_ATTENTION", "flex")
            with pytest.raises(RuntimeError, match="'flex' has no sliding windows"):
                engine.executor.kernels = False             # chooses the backend again
    plans = [r.plan for r in script.records if r.plan is not None]
    assert any(p.num_decode_rows and p.num_prefill_tokens for p in plans)
    assert any(p.num_decode_rows == 32 and not p.num_prefill_tokens for p in plans)
    assert cached.stats.num_cached == 192
    for r in [long, cached, *others]:
        assert r.generated == expected_tokens(r), r.request_id
    engine.pool.check_all_free()


def qwen3_moe_parameters(args) -> tuple[int, int]:
    """(bf16 matrix entries, fp32 vector entries) of a Qwen3-MoE shape whose every layer is
    sparse: embeddings and output untied; per layer Q | K | V and O, the router (fp32) and E
    experts of gate | up [2F, dim] and down [dim, F]; the norms (two per layer, q/k per head,
    the final one) in fp32."""
    moe, hd = args.moe, args.head_dim
    matrices = 2 * args.vocab_size * args.dim + args.n_layers * (
        (args.n_heads + 2 * args.n_kv_heads) * hd * args.dim + args.dim * args.n_heads * hd
        + moe.n_experts * 3 * moe.expert_size * args.dim)
    vectors = args.n_layers * (2 * args.dim + 2 * hd + moe.n_experts * args.dim) + args.dim
    return matrices, vectors


def test_qwen3_30b_a3b_experts_run_as_one_grouped_product_per_matrix(monkeypatch):
    """Qwen3-30B-A3B's layer shape (dim 2,048, 32 query and 4 KV heads of 128, 128 experts of 768,
    top 8), cut to 2 layers, random bf16 on the fake device through the real builder, scheduler
    and runner with SDPA: mixed steps, a prefix-cache hit and a 32-row decode step, each request
    ending with the ids the device handed back. Every MoE layer runs its experts as two
    `aten._grouped_mm` calls over the stacked experts (the gate | up product, then the down one),
    8 rows per token of the step, with no read back to the host (each step's only device-to-host
    copy is the sampled ids, `check_transfers`); the weights take exactly the bytes of the shape's
    parameters, each expert's matrices a view of its layer's stacked tensor."""
    import engine.runner.builder as builder
    from engine.model.weights import random_shape

    full = random_shape("qwen3-30b-a3b")
    assert (full.n_layers, full.dim, full.moe.n_experts, full.moe.top_k, full.moe.expert_size,
            full.moe.norm_topk_prob, all(full.moe.sparse_layers)) == (48, 2048, 128, 8, 768, True, True)
    matrices, vectors = qwen3_moe_parameters(full)
    assert matrices + vectors == 30_532_122_624                  # "30.5B" as published
    shape = dataclasses.replace(full, n_layers=2,
                                moe=dataclasses.replace(full.moe, sparse_layers=full.moe.sparse_layers[:2]))
    monkeypatch.setattr(builder, "random_shape", lambda name: shape)
    rows: list[int] = []
    grouped_mm = torch._grouped_mm

    def recording(mat_a, mat_b, *args, **kwargs):
        offs = kwargs["offs"]
        assert (offs.dtype, offs.device, offs.shape) == (torch.int32, DEVICE, (128,))
        rows.append(mat_a.shape[0])
        return grouped_mm(mat_a, mat_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    grouped = torch.ops.aten._grouped_mm.default
    with FakeCuda() as fake:
        monkeypatch.setenv("GENSERVE_ATTENTION", "sdpa")
        cfg = EngineConfig(device="cuda", dtype="bfloat16", num_threads=1, num_blocks=512)
        loaded = build_engine(cfg, "random:qwen3-30b-a3b", calibrate=False)
        engine, model = loaded.engine, loaded.engine.executor.model
        assert engine.executor.attention.name == "sdpa" and not engine.executor.kernels
        # the builder serves EngineConfig.max_context (8,192) of the 40,960 positions
        assert loaded.args == dataclasses.replace(shape, max_context=8192) and len(model.moe_layers) == 2
        for moe in model.moe_layers:
            assert moe.w13_stacked.shape == (128, 2 * 768, 2048) and moe.w2_stacked.shape == (128, 2048, 768)
            assert moe.w13_stacked.dtype == torch.bfloat16 and moe.w13_stacked.device == DEVICE
            for name in ("w13", "w2"):
                storage = getattr(moe, f"{name}_stacked").untyped_storage()._cdata
                assert all(getattr(e, name).untyped_storage()._cdata == storage for e in moe.experts)
        matrices, vectors = qwen3_moe_parameters(shape)
        rope = 8192 * shape.head_dim // 2 * 8                          # complex64 table
        weights = storages_bytes([*model.parameters(), *model.buffers()])
        assert weights == matrices * 2 + vectors * 4 + rope + 2 * 128 * 8   # + expert_rows, int64
        assert fake.live_bytes() == weights + storages_bytes(engine.executor.kv.layers)
        before = fake.ledger.op_calls[grouped]
        script, long, cached, others = run_mixed_steps(engine, fake)
        calls = fake.ledger.op_calls[grouped] - before
        assert fake.ledger.op_calls[torch.ops.aten.bincount.default] == 0
    plans = [r.plan for r in script.records if r.plan is not None]
    assert any(p.num_decode_rows and p.num_prefill_tokens for p in plans)
    assert any(p.num_decode_rows == 32 and not p.num_prefill_tokens for p in plans)
    assert calls == len(rows) == 4 * len(plans)                     # 2 layers x 2 products a step
    assert rows == [8 * p.num_tokens for p in plans for _ in range(4)]
    assert 8 * 32 in rows
    assert cached.stats.num_cached == 192
    for r in [long, cached, *others]:
        assert r.generated == expected_tokens(r), r.request_id
    engine.pool.check_all_free()


def lora_index_uploads(plan: StepPlan) -> list[int]:
    """The row indices the LoRA path uploads for `plan` (`LoraBatch._select`), by length: one per
    distinct set of the step's adapters that change a fused matrix, holding those adapters' rows."""
    rows: dict[int, int] = {}                     # adapter load id -> its rows, in first-row order
    adapters = {}
    for seg in plan.segments:
        if seg.request.lora is not None:
            rows[seg.request.lora.lora_id] = rows.get(seg.request.lora.lora_id, 0) + seg.length
            adapters[seg.request.lora.lora_id] = seg.request.lora.adapter
    keys = set().union(*(a.matrices for a in adapters.values()))
    present = {tuple(key in adapters[lid].matrices for lid in rows) for key in keys}
    return sorted(sum(n for n, on in zip(rows.values(), p) if on) for p in present)


def test_mixed_adapter_steps_on_the_device(monkeypatch, tmp_path):
    """Rows of three LoRA adapters and of the base model in the same steps, on Llama-2-7B in fp16:
    every step's integers still in its one pinned upload and one read of its sampled ids; each
    adapter's matrices uploaded once, in the model's dtype, when a step first needs it, and
    resident on the device from then on (no host copy in a product: the fake device raises on a
    mix of devices); each step's LoRA row indices uploaded once per set of adapters that change a
    matrix; one delta (`index_add_`) per adapted matrix a step; every request ends with the ids
    the device handed back."""
    import engine.runner.model_runner as model_runner

    args = random_shape("llama-2-7b")
    dirs = {                                  # written before the fake device exists
        "qv": write_adapter(tmp_path / "qv", args, {0: ("self_attn.q_proj", "self_attn.v_proj"),
                                                    5: ("self_attn.q_proj", "self_attn.v_proj")}),
        "mlp": write_adapter(tmp_path / "mlp", args, {2: ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}),
        "o": write_adapter(tmp_path / "o", args, {0: ("self_attn.o_proj",), 31: ("self_attn.o_proj",)}, r=16),
    }
    batches = []
    real_lora_batch = model_runner.lora_batch
    monkeypatch.setattr(model_runner, "lora_batch",
                        lambda *a: batches.append(real_lora_batch(*a)) or batches[-1])
    with FakeCuda() as fake:
        engine = fake_engine(fake, "sdpa", monkeypatch, num_blocks=512)
        reg = engine.executor.adapters
        for name, path in dirs.items():
            reg.load(name, str(path))
        index_adds = fake.ledger.op_calls[torch.ops.aten.index_add_.default]
        script = Script(engine, fake)
        reqs = [request(f"m{i}", f"key{i % 3}", prompt_of(20 + 9 * i, 40 + i), 4,
                        lora=None if i % 4 == 3 else reg.request(("qv", "mlp", "o")[i % 4]),
                        **({"temperature": 0.0} if i % 2 else {"temperature": 0.7, "seed": i}))
                for i in range(12)]
        for r in reqs:
            engine.submit(r)
        script.run()
        index_adds = fake.ledger.op_calls[torch.ops.aten.index_add_.default] - index_adds

    records = [r for r in script.records if r.plan is not None]
    mixed = [r for r in records if len({s.request.lora for s in r.plan.segments}) == 4]
    assert mixed, "no step held rows of the three adapters and of the base model"
    matrix_numel = {name: sum(a.numel() + b.numel() for a, b in
                              ((m.a, m.b) for m in reg.request(name).adapter.matrices.values()))
                    for name in dirs}
    assert matrix_numel == {"qv": 2 * (16 * 4096 + 12288 * 16), "o": 2 * 2 * 16 * 4096,
                            "mlp": 16 * 4096 + 22016 * 16 + 8 * 11008 + 4096 * 8}
    uploaded: set[str] = set()
    deltas = 0
    for record in records:
        lora = [t for t in record.transfers if t.where.startswith(LORA_MODULE)]
        matrices = [t for t in lora if t.dtype == torch.float16]
        indices = [t for t in lora if t.dtype == torch.int64]
        assert len(matrices) + len(indices) == len(lora), lora
        assert sorted(t.numel for t in indices) == lora_index_uploads(record.plan)
        names = {s.request.lora.name for s in record.plan.segments if s.request.lora is not None}
        new = sorted(n for n in names if n not in uploaded)
        assert sum(t.numel for t in matrices) == sum(matrix_numel[n] for n in new), (new, matrices)
        uploaded.update(new)
        deltas += len(set().union(*(reg.request(n).adapter.matrices for n in names)) if names else ())
    assert set(uploaded) == set(dirs)
    assert index_adds == deltas
    resident = [res for batch in batches if batch is not None for res, _ in batch.groups]
    assert {res.adapter.name for res in resident} == set(dirs)
    for res in resident:
        assert res.kernel is None                       # the CPU kernel's tables off the CPU
        for (layer, matrix), (a, b) in res.matrices.items():
            host = res.adapter.matrices[(layer, matrix)]
            assert (a.device, b.device, a.dtype, b.dtype) == (DEVICE, DEVICE, torch.float16, torch.float16)
            assert (a.shape, b.shape) == (host.a.shape, host.b.shape)
    assert engine.executor.loras.loads == 3 and engine.executor.loras.evictions == 0
    for r in reqs:
        assert r.generated == expected_tokens(r), r.request_id
    engine.pool.check_all_free()
