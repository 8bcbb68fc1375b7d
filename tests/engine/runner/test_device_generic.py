"""The device-generic forward (torch ops, metadata on the device, the SDPA and FlexAttention
backends), decode CUDA graphs' padding, and the batch-invariance check, run on the CPU; the
CUDA-only parts skip without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SdpaBackend
from engine.attention.base import StepLayout
from engine.config import EngineConfig
from engine.runner.cuda_graphs import (BUCKETS, decode_forward, key_blocks, pad_decode_step,
                                row_bucket)
from engine.core.engine import Engine
from engine.model.config import ModelArgs
from engine.model.transformer import Transformer
from engine.runner.invariance import check_batch_invariance, invariance_prompts
from engine.runner.kv_cache import KVCache
from engine.runner.inputs import StepInputs
from engine.runner.model_runner import ModelRunner
from tests.engine.attention_oracle import step_metadata
from tests.engine.conftest import generate, new_request
from tests.engine.model.test_model import PARAGRAPH

pytestmark = pytest.mark.slow

NO_CUDA = "needs a CUDA device (none here): {}"


def decode_inputs(tokens: list[int], spans: list, block_size: int = 16) -> StepInputs:
    """The inputs of a step of these segments (each samples its last token, greedily) with these
    tokens."""
    rows = list(range(len(tokens)))
    return StepInputs(tokens, [p for start, n, _, _ in spans for p in range(start, start + n)],
                      rows, rows, rows, [], StepLayout.from_segments(spans, block_size))


def generic_engine(model: Transformer, attention: str | None, num_blocks: int = 256,
                   device: str = "cpu", cuda_graphs: bool = False) -> Engine:
    kv = KVCache(model.args, num_blocks, 16, model.dtype)
    kv.layers = [layer.to(device) for layer in kv.layers]
    executor = ModelRunner(model, kv, attention=attention, cuda_graphs=cuda_graphs)
    return Engine(EngineConfig(num_blocks=num_blocks, dtype=str(model.dtype).removeprefix("torch."),
                               prefix_caching=False), executor)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_generic_path_logits_and_greedy_tokens_match_the_cpu_path(fp32_engine, gguf_tokenizer,
                                                                  attention):
    model = fp32_engine.executor.model
    engine = generic_engine(model, attention, num_blocks=32)     # flex's eager scores: [pool]
    assert engine.executor.attention.name == attention
    prompt = gguf_tokenizer.encode(PARAGRAPH + "The capital of France is")[:32]
    ids, pos = torch.tensor(prompt), torch.arange(32)
    with torch.inference_mode():
        cpu = fp32_engine.executor
        host = step_metadata([(0, 32, [0, 1], False)], 16, model.dtype, cpu.kernels)
        want = model.logits(model(ids, pos, cpu.kv.layers, host, cpu.layer_ops))
        meta = step_metadata([(0, 32, [0, 1], False)], 16, model.dtype,
                                       backend=engine.executor.attention, device="cpu",
                                       num_blocks=32)
        got = model.logits(model(ids, pos, engine.executor.kv.layers, meta))
    assert (got - want).abs().max().item() < 1e-3
    assert generate(engine, [prompt[:12]], 16, temperature=0.0, ignore_eos=True) == \
        generate(fp32_engine, [prompt[:12]], 16, temperature=0.0, ignore_eos=True)


def test_row_buckets_and_key_padding():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 47, 48, 49, 64)] == \
        [1, 2, 4, 8, 16, 32, 48, 48, 48, 64, 64]
    assert row_bucket(0) is None and row_bucket(65) is None
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 48, 64)
    assert [key_blocks(n) for n in (1, 4, 5, 8, 9, 97)] == [4, 4, 8, 8, 16, 128]


def test_padded_decode_step_repeats_the_last_row():
    spans = [(20, 1, [7, 3], True), (36, 1, [1, 9, 4], True), (4, 1, [5], True)]
    padded = pad_decode_step(4, decode_inputs([101, 102, 103], spans))
    assert padded.blocks_per_row == 4
    assert padded.tokens == [101, 102, 103, 103] and padded.positions == [20, 36, 4, 4]
    assert padded.slots == [3 * 16 + 4, 4 * 16 + 4, 5 * 16 + 4, 5 * 16 + 4]
    assert padded.lens == [21, 37, 5, 5]
    assert padded.tables == [7, 3, 0, 0, 1, 9, 4, 0, 5, 0, 0, 0, 5, 0, 0, 0]
    with pytest.raises(ValueError, match="1..2 decode rows"):
        pad_decode_step(2, decode_inputs([1, 2, 3], spans))
    with pytest.raises(ValueError, match="decode rows"):
        pad_decode_step(4, decode_inputs([1, 2, 3, 4, 5], [(0, 5, [1], False)]))


def test_padded_decode_forward_gives_the_unpadded_rows(fp32_engine):
    """What a graph captures, run eagerly on the CPU: the real rows of a step padded from 3 to 4
    rows and to 8 blocks a row equal the same step unpadded."""
    model = fp32_engine.executor.model
    kv = KVCache(model.args, 64, 16, model.dtype)
    backend = SdpaBackend()
    lens = [20, 37, 5]
    tables = [[3, 8], [10, 1, 12], [40]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (n + 1,), generator=g) for n in lens]
    with torch.inference_mode():
        for p, t, n in zip(prompts, tables, lens):
            meta = step_metadata([(0, n, t, False)], 16, model.dtype, backend=backend,
                                           num_blocks=64)
            model(p[:n], torch.arange(n), kv.layers, meta)
        spans = [(n, 1, t, True) for n, t in zip(lens, tables)]
        tokens = [int(p[n]) for p, n in zip(prompts, lens)]
        meta = step_metadata(spans, 16, model.dtype, backend=backend, num_blocks=64)
        want = model(torch.tensor(tokens), torch.tensor(lens), kv.layers, meta)
        padded = pad_decode_step(4, decode_inputs(tokens, spans))
        got = decode_forward(model, kv, torch.tensor(padded.ints()), 4, padded.blocks_per_row)
    assert got.shape == (4, model.args.dim)
    assert (got[:3] - want).abs().max().item() < 1e-4
    assert torch.equal(got[3], got[2])


def test_backend_is_exported_as_an_info_metric(bf16_engine):
    from prometheus_client import CollectorRegistry

    from service.metrics import EngineMetrics

    metrics = EngineMetrics(bf16_engine, CollectorRegistry())
    try:
        name = bf16_engine.executor.attention.name
        assert name in ("cpu-kernels", "cpu-sdpa")
        assert metrics.registry.get_sample_value("genserve_attention_backend_info",
                                                 {"backend": name}) == 1.0
    finally:
        bf16_engine.step_listeners.remove(metrics.on_step)


def test_batch_invariance_check_on_the_cpu(bf16_engine):
    prompts = invariance_prompts(8, 49152, seed=3)
    assert [len(p) for p in prompts] == [5, 17, 64, 100, 250, 333, 600, 31]
    result = check_batch_invariance(bf16_engine, max_tokens=8, checked=3, prompts=prompts)
    assert result.batch == 8 and result.checked == 3
    assert result.identical and result.mismatched == []
    assert result.distinct == 3


def tiny_random_model(device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    """A 2-layer Llama of random weights (GQA 4/2, head_dim 64), logits scaled up so greedy
    choices are far from ties; no model file needed (the GPU machine has none)."""
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512,
                     vocab_size=1000, max_context=2048)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.06) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    hd = args.head_dim
    state = {"tok_embeddings.weight": w(args.vocab_size, args.dim, std=1.0),
             "norm.weight": torch.ones(args.dim), "output.weight": w(args.vocab_size, args.dim, std=1.0)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        state |= {p + "attention.wq.weight": w(args.n_heads * hd, args.dim),
                  p + "attention.wk.weight": w(args.n_kv_heads * hd, args.dim),
                  p + "attention.wv.weight": w(args.n_kv_heads * hd, args.dim),
                  p + "attention.wo.weight": w(args.dim, args.n_heads * hd),
                  p + "feed_forward.w1.weight": w(args.intermediate_size, args.dim),
                  p + "feed_forward.w2.weight": w(args.dim, args.intermediate_size),
                  p + "feed_forward.w3.weight": w(args.intermediate_size, args.dim),
                  p + "attention_norm.weight": torch.ones(args.dim),
                  p + "ffn_norm.weight": torch.ones(args.dim)}
    return Transformer.from_state_dict(args, state, dtype, device=device)


def random_prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1000, (length,), generator=g).tolist()
            for length in (5, 40, 130, 17, 300, 64)[:n]]


def test_tiny_random_model_generic_path_matches_the_cpu_path():
    """The model the CUDA tests use, on the CPU: the generic path (SDPA backend, device metadata)
    gives the host path's greedy tokens."""
    model = tiny_random_model("cpu")
    prompts = random_prompts(3)
    host = generic_engine(model, "cpu")
    want = generate(host, prompts, 8, temperature=0.0, ignore_eos=True)
    assert generate(generic_engine(model, "sdpa"), prompts, 8, temperature=0.0,
                    ignore_eos=True) == want
    assert len({tuple(t) for t in want}) == 3


def test_generic_path_samples_forks_and_logprobs_like_the_cpu_path():
    """n = 3 seeded samples with logprobs: the draws' rows and the logits rows come from the
    one uploaded tensor on the generic path; tokens and logprobs equal the host path's."""
    model = tiny_random_model("cpu")

    def run(attention: str) -> list[tuple[list[int], list[float]]]:
        engine = generic_engine(model, attention)
        events: list = []
        req = new_request(random_prompts(2)[1], 6, events, temperature=0.8, seed=11,
                          logprobs=True, ignore_eos=True)
        req.fork(3, [11, 12, 13])
        engine.submit(req)
        engine.run_until_idle()
        engine.pool.check_all_free()
        return [([e.token_id for e in events if e.index == i and e.token_id is not None],
                 [e.logprob for e in events if e.index == i and e.token_id is not None])
                for i in range(3)]

    want, got = run("cpu"), run("sdpa")
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(len(t) == 6 for t, _ in want) and len({tuple(t) for t, _ in want}) > 1
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason=NO_CUDA.format("the forward pass on CUDA against the CPU's"))
def test_cuda_forward_matches_the_cpu_forward_on_every_backend():
    """fp32 on CUDA (TF32 off, torch's default) through each backend that runs there against the CPU host path:
    logits of a prefill piece and greedy tokens of mixed prompts."""
    cpu_model, cuda_model = tiny_random_model("cpu"), tiny_random_model("cuda")
    prompts = random_prompts(4)
    want = generate(generic_engine(cpu_model, "cpu"), prompts, 8, temperature=0.0, ignore_eos=True)
    chosen = generic_engine(cuda_model, None, device="cuda")          # the process's own choice
    assert chosen.executor.attention.name in ("xformers", "xformers-gathered", "flex", "sdpa")
    for attention in (None, "sdpa", "flex"):
        engine = generic_engine(cuda_model, attention, device="cuda")
        got = generate(engine, prompts, 8, temperature=0.0, ignore_eos=True)
        assert got == want, engine.executor.attention.name


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason=NO_CUDA.format("CUDA graph capture and CUDA generators"))
def test_cuda_graph_decode_gives_the_eager_tokens():
    model = tiny_random_model("cuda", torch.bfloat16)
    prompts = random_prompts(6)
    eager = generic_engine(model, "sdpa", device="cuda")
    graphs = generic_engine(model, "sdpa", device="cuda", cuda_graphs=True)
    want = generate(eager, prompts, 12, temperature=0.0, ignore_eos=True)
    assert generate(graphs, prompts, 12, temperature=0.0, ignore_eos=True) == want
    assert graphs.executor.graphs.captured
    seeded = dict(temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    assert generate(graphs, prompts[:2], 8, **seeded) == generate(eager, prompts[:2], 8, **seeded)
