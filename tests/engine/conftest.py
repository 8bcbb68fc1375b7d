"""Real-model engines for the engine tests (session-scoped; built from the shared GGUF weights), and
a fixture that restores torch's thread count."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine import kernels as genserve_kernels
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams
from engine.runner.builder import engine_from_weights

_ids = itertools.count()


@pytest.fixture(params=["torch", "kernels"])
def kernels(request) -> bool:
    """Both compute paths: torch ops + SDPA, and genserve's CPU kernels (skipped, saying so, where
    they cannot be built)."""
    if request.param == "kernels" and not genserve_kernels.available():
        pytest.skip("genserve's CPU kernels did not build here (g++/ninja missing?); torch path only")
    return request.param == "kernels"


@pytest.fixture
def restore_threads():
    """Puts torch's thread count back after a test that changes it (torch.set_num_threads)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bf16_engine(gguf_weights) -> Engine:
    """The serving configuration: bf16, 2,048 blocks (32,768 tokens), no thread (step by hand)."""
    args, state = gguf_weights
    return engine_from_weights(EngineConfig(num_blocks=2048, dtype="bfloat16"), args, state)


@pytest.fixture(scope="session")
def fp32_engine(gguf_weights) -> Engine:
    """fp32 weights and cache, for parity with transformers."""
    args, state = gguf_weights
    return engine_from_weights(EngineConfig(num_blocks=256, dtype="float32"), args, state)


def new_request(prompt_ids: list[int], max_tokens: int, events: list | None = None,
                eos_token_id: int | None = 2, constraint=None, lora=None, **sampling) -> Request:
    """A request whose TokenEvents are appended to `events` (if given), its output following
    `constraint` (a compiled grammar) and its rows running on adapter `lora` (a `LoraRequest`)
    when given."""
    return Request(f"t{next(_ids)}", "test", list(prompt_ids), max_tokens,
                   SamplingParams(**sampling), 0.0, 0.0,
                   on_event=events.append if events is not None else None,
                   eos_token_id=eos_token_id, constraint=constraint, lora=lora)


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, **sampling) -> list[list[int]]:
    """Submit all prompts at once, step the engine until idle, return each request's tokens."""
    reqs = [new_request(p, max_tokens, **sampling) for p in prompts]
    for r in reqs:
        engine.submit(r)
    engine.run_until_idle()
    engine.pool.check_all_free()
    return [list(r.generated) for r in reqs]


def check_decode_loop_matches_python_loop(engine: Engine, prompts: list[list[int]]) -> None:
    """Greedy answers (12 tokens) of `prompts` with the runner's C++ decode loop equal those of the
    Python block loop (the loop set aside for the second run), and differ between prompts."""
    runner = engine.executor
    assert runner.decode_loop is not None
    with_loop = generate(engine, prompts, 12, temperature=0.0)
    loop, runner.decode_loop = runner.decode_loop, None        # the Python block loop
    try:
        assert generate(engine, prompts, 12, temperature=0.0) == with_loop
    finally:
        runner.decode_loop = loop
    assert len({tuple(t) for t in with_loop}) > len(prompts) // 2


def check_preemption_keeps_tokens(engine: Engine, gguf_weights, prompts: list[list[int]],
                                  settings: list[dict] | None = None, **config) -> None:
    """Run six requests (greedy and seeded top-p, 40 tokens each, or each with its own sampling
    `settings`) on `engine`, then on a fresh
    engine of the same settings (`config`: extra EngineConfig fields) whose 14-block pool must
    preempt them as they grow; assert that it did preempt and that every request produced the same
    tokens, and that both pools end with every block free.

    Six requests of 5-9 prompt tokens growing by 40 need 3 blocks each at the end (18); a pool of
    14 blocks admits all six and must preempt as they grow.
    """
    args, state = gguf_weights
    settings = settings or [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=99)] * 3

    def run(e: Engine) -> list[list[int]]:
        reqs = [new_request(p, 40, ignore_eos=True, **s) for p, s in zip(prompts, settings)]
        for r in reqs:
            e.submit(r)
        e.run_until_idle()
        e.pool.check_all_free()
        return [list(r.generated) for r in reqs]

    full = run(engine)
    small = engine_from_weights(EngineConfig(num_blocks=14, free_margin=0.0, **config), args, state)
    shrunk = run(small)
    assert small.scheduler.num_preemptions > 0
    assert shrunk == full


@pytest.fixture(scope="session")
def avx2_attention():
    """engine/kernels/csrc/decode_attention.cpp built for -march=x86-64-v3: its op
    `paged_decode` (`torch.ops.genserve_avx2_attention`), the AVX2 kernel, on a host whose own
    build is AVX512's (tests/engine/avx2_builds.py says when it skips)."""
    from benchmarks._baseline import CSRC
    from benchmarks.decode_attention import baseline_op
    from tests.engine.avx2_builds import ATTENTION_LIBRARY, MARCH, skip_unless_host_build_is_avx512

    skip_unless_host_build_is_avx512()
    return baseline_op(CSRC / "decode_attention.cpp", ATTENTION_LIBRARY, MARCH)


@pytest.fixture(scope="session")
def avx2_products():
    """engine/kernels/csrc/q4q8_linear.cpp built for -march=x86-64-v3 as
    `torch.ops.genserve_avx2_products` (`.q4q8_linear`, `.q8q8_linear`): the AVX2 kernels, on a
    host whose own build is AVX512's (tests/engine/avx2_builds.py says when it skips)."""
    from benchmarks._baseline import CSRC
    from benchmarks.products_ab import build_variant
    from tests.engine.avx2_builds import MARCH, PRODUCTS_LIBRARY, skip_unless_host_build_is_avx512

    skip_unless_host_build_is_avx512()
    return build_variant(CSRC / "q4q8_linear.cpp", PRODUCTS_LIBRARY, MARCH)
