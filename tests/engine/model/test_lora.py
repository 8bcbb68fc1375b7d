"""Multi-LoRA serving in the engine, on tiny transformers checkpoints
(tests/engine/hf_families.py) and tiny adapters PEFT builds inside the test with lora_A and
lora_B redrawn (tests/engine/lora_adapters.py; PEFT's lora_B starts at zero).

Checked:
* fp32 logits of every adapter within 1e-4 of PEFT's model over prefill pieces and decode steps,
  on Llama 3, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 2, Phi-3 (checkpoint-fused
  qkv_proj / gate_up_proj) and Qwen3-MoE (attention and the dense layer's MLP);
* a batch of three adapters and the base gives each row the tokens (fp32) and the bits (bf16,
  genserve's `lora_delta_`) it gets alone;
* `lora_delta_` against the fp32 product of each part (adapters of different ranks, parts left
  out, odd ranks), each row's bits alone equal to its bits in the batch; pure-decode steps with
  adapter rows in the C++ decode loop give the Python loop's bits;
* no prefix-cache hit across adapters, nor from the base, nor after an adapter is reloaded;
* an adapter unloaded while its requests run: they finish on it, new requests are refused, its
  resident copy leaves;
* resident slots: at most `max_loras`, least recently used evicted;
* bad adapter directories: clear ValueErrors naming the file, module or rank.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.model.layer_ops import TorchLayerOps
from engine.model.lora import MAX_LORA_RANK, LoraBatch, kernel_path, load_adapter, make_resident
from engine.model.transformer import Transformer
from engine.model.weights import load_safetensors
from engine.runner.builder import engine_from_weights
from engine.runner.kv_cache import KVCache
from engine.runner.lora import LoraSlots
from tests.engine.attention_oracle import step_metadata
from tests.engine.conftest import new_request
from tests.engine.hf_families import build_checkpoint
from tests.engine.lora_adapters import ALL_TARGETS, PHI3_TARGETS, build_adapter, peft_logits
from tests.engine.model.test_model_families import run as families_run

PARITY_FAMILIES = ("llama3", "qwen2", "qwen3", "gemma2", "phi3", "qwen3_moe")
CPU = torch.device("cpu")


def tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    """`n` random token ids in [3, vocab)."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """A tiny Llama 3 checkpoint and three adapters: rank 8 on every projection, rank 4 on
    q/v (rsLoRA), rank 16 on the MLP."""
    root = tmp_path_factory.mktemp("lora_llama")
    ckpt = build_checkpoint("llama3", root / "base")
    adapters = {
        "all8": build_adapter(ckpt, root / "all8", seed=11, r=8),
        "qv4": build_adapter(ckpt, root / "qv4", seed=12, r=4, targets=("q_proj", "v_proj"), rslora=True),
        "mlp16": build_adapter(ckpt, root / "mlp16", seed=13, r=16, alpha=8.0,
                               targets=("gate_proj", "up_proj", "down_proj")),
    }
    return ckpt, adapters


def stepped_logits(model: Transformer, ids: list[int], resident) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] computed as the engine computes them: two 16-token prefill
    pieces, then one-token decode steps, every row on `resident` (None: the base)."""
    args = model.args
    kv = KVCache(args, 8, 16, model.dtype, "cpu")
    rows = []
    with torch.inference_mode():
        for start, length in [(0, 16), (16, 16)] + [(p, 1) for p in range(32, len(ids))]:
            meta = step_metadata([(start, length, [3, 1, 5], length == 1)], 16, num_blocks=8)
            lora = None if resident is None else LoraBatch.from_rows([resident] * length, CPU)
            hidden = model(torch.tensor(ids[start:start + length]), torch.arange(start, start + length),
                           kv.layers, meta, TorchLayerOps, lora)
            rows.append(model.logits(hidden))
    return torch.cat(rows)


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_logits_match_peft_for_each_adapter(family, tmp_path):
    ckpt = build_checkpoint(family, tmp_path / "base")
    # PEFT puts an MoE model's MLP targets on its stacked experts (target_parameters), which
    # genserve refuses (test_bad_adapter_directories...): attention only there
    targets = {"phi3": PHI3_TARGETS, "qwen3_moe": ALL_TARGETS[:4]}.get(family, ALL_TARGETS)
    adapters = [build_adapter(ckpt, tmp_path / "a", seed=21, r=8, targets=targets),
                build_adapter(ckpt, tmp_path / "b", seed=22, r=16, alpha=32.0, rslora=True,
                              targets=targets[:2])]
    args, state = load_safetensors(ckpt, torch.float32)
    model = Transformer.from_state_dict(args, state, torch.float32)
    ids = tokens(40, seed=1)
    base = peft_logits(ckpt, None, ids)
    for i, directory in enumerate(adapters):
        adapter = load_adapter(directory, args, torch.float32, f"a{i}", i + 1)
        ours = stepped_logits(model, ids, make_resident(adapter, CPU, torch.float32))
        ref = peft_logits(ckpt, directory, ids)
        diff = (ours - ref).abs().max().item()
        print(f"{family} adapter {i}: max |logit - PEFT's| = {diff:.2e}, "
              f"adapter moves logits by {(ref - base).abs().max().item():.2f}")
        assert (ref - base).abs().max().item() > 0.1          # the adapter does change the model
        assert diff < 1e-4, diff
    assert (stepped_logits(model, ids, None) - base).abs().max().item() < 1e-4


def engine(ckpt: pathlib.Path, dtype: str = "float32", **config) -> Engine:
    """A stopped engine over the checkpoint, stepped by hand."""
    args, state = load_safetensors(ckpt, getattr(torch, dtype))
    settings = dict(device="cpu", dtype=dtype, num_blocks=64, queue_budget_s=1e6) | config
    return engine_from_weights(EngineConfig(**settings), args, state)


def run(e: Engine, jobs: list[tuple[list[int], str | None]], max_tokens: int = 12
        ) -> list[tuple[list[int], list[float], int]]:
    """Submit every (prompt, adapter name or None) at once, greedy with logprobs; step until idle.
    Each request's (tokens, logprobs, prompt tokens taken from the prefix cache)."""
    loras = [None if name is None else e.executor.adapters.request(name) for _, name in jobs]
    answers = families_run(e, [prompt for prompt, _ in jobs], max_tokens, loras)
    return [(a.tokens, a.logprobs, a.num_cached) for a in answers]


def run_both_loops(e: Engine, adapters: dict[str, pathlib.Path], jobs: list[tuple[list[int], str | None]]):
    """Load `adapters` into `e`, then `run` the jobs with its C++ decode loop and again through
    the Python block loop. Returns (with the loop, without it) and the adapters' dtypes where the
    products run (their `lora_delta_` buffers')."""
    loop = e.executor.decode_loop
    assert loop is not None
    for name, path in adapters.items():
        e.executor.adapters.load(name, path)
    with_loop = run(e, jobs)
    e.executor.decode_loop = None
    try:
        python_loop = run(e, jobs)
    finally:
        e.executor.decode_loop = loop
    used = e.executor.loras.acquire([e.executor.adapters.request(name) for name in adapters])
    return with_loop, python_loop, {r.kernel[0].dtype for r in used.values()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_gives_each_row_what_it_gets_alone(llama, dtype):
    ckpt, adapters = llama
    e = engine(ckpt, dtype, prefix_caching=False)
    for name, path in adapters.items():
        e.executor.adapters.load(name, path)
    jobs = [(tokens(n, seed=30 + n), name) for n, name in
            [(9, "all8"), (40, "qv4"), (70, "mlp16"), (23, None), (17, "all8"), (5, None)]]
    alone = [run(e, [job])[0] for job in jobs]
    together = run(e, jobs)
    for (prompt, name), a, t in zip(jobs, alone, together):
        assert t[0] == a[0], name
        if dtype == "bfloat16" and kernel_path(torch.bfloat16, CPU):
            assert t[1] == a[1], name                    # the same bits, not just the same tokens
        else:        # fp32 products are F.linear's, whose low bits may follow the row count
            assert max(abs(x - y) for x, y in zip(t[1], a[1])) < 1e-4
    # each adapter (and the base) answers differently: the rows did run on their own adapters
    same_prompt = tokens(20, seed=99)
    answers = run(e, [(same_prompt, name) for name in (None, "all8", "qv4", "mlp16")], 8)
    assert len({tuple(a[0]) for a in answers}) == 4
    base_alone = run(e, [(same_prompt, None)], 8)[0]
    assert answers[0][0] == base_alone[0]


def test_steps_use_at_most_max_loras_adapters(llama, tmp_path):
    """max_loras=2, ten requests over four adapters and the base submitted at once: every step
    runs at most two adapters and keeps at most two resident; every request ends with the
    tokens it gets alone and every block comes back."""
    ckpt, adapters = llama
    e = engine(ckpt, max_loras=2, prefix_caching=False)
    reg = e.executor.adapters
    for name, path in adapters.items():
        reg.load(name, path)
    reg.load("down8", build_adapter(ckpt, tmp_path / "down8", seed=14, r=8, targets=("down_proj",)))
    jobs = [(tokens(n, seed=50 + n), name) for n, name in
            [(9, "all8"), (40, "qv4"), (70, "mlp16"), (23, "down8"), (17, None), (5, "all8"),
             (33, "down8"), (12, "qv4"), (28, None), (19, "mlp16")]]
    alone = [run(e, [job])[0] for job in jobs]
    per_step: list[tuple[int, int]] = []           # (adapters in the plan, resident after it)
    e.step_listeners.append(lambda plan, events, s: per_step.append((
        len({g.request.lora.name for g in plan.segments if g.request.lora is not None}),
        len(e.executor.loras.resident_ids))))
    together = run(e, jobs)                         # run() checks that every block is free
    assert max(n for n, _ in per_step) == 2 and max(r for _, r in per_step) <= 2
    for (prompt, name), a, t in zip(jobs, alone, together):
        assert t[0] == a[0] and len(t[0]) == 12, name
        assert max(abs(x - y) for x, y in zip(t[1], a[1])) < 1e-4


def test_no_prefix_cache_hit_across_adapters(llama):
    ckpt, adapters = llama
    e = engine(ckpt)
    reg = e.executor.adapters
    for name in ("all8", "qv4"):
        reg.load(name, adapters[name])
    prompt = tokens(70, seed=5)                      # one whole 64-token cacheable piece
    first = run(e, [(prompt, "all8")])[0]
    assert first[2] == 0
    again = run(e, [(prompt, "all8")])[0]
    assert again[2] == 64 and again[0] == first[0]
    assert run(e, [(prompt, "qv4")])[0][2] == 0       # another adapter: no hit
    assert run(e, [(prompt, None)])[0][2] == 0        # the base: no hit
    assert run(e, [(prompt, None)])[0][2] == 64       # ... its own blocks, from now on
    # the same name loaded again (other weights): a new load id, a new scope
    reg.unload("all8")
    reg.load("all8", adapters["mlp16"])
    reloaded = run(e, [(prompt, "all8")])[0]
    assert reloaded[2] == 0
    assert reloaded[0] != first[0]


def test_unload_while_running_finishes_on_the_adapter(llama):
    ckpt, adapters = llama
    e = engine(ckpt)
    reg = e.executor.adapters
    reg.load("all8", adapters["all8"])
    prompt = tokens(30, seed=6)
    want = run(e, [(prompt, "all8")], 16)[0][0]
    events: list = []
    req = new_request(prompt, 16, events, lora=reg.request("all8"), temperature=0.0, ignore_eos=True)
    e.submit(req)
    for _ in range(4):
        e.step()
    assert 0 < len(req.generated) < 16
    reg.unload("all8")
    with pytest.raises(KeyError):
        reg.request("all8")
    assert "all8" not in reg and reg.adapters() == []
    e.run_until_idle()
    assert [x.token_id for x in events if x.token_id is not None] == want
    assert req.lora.lora_id in e.executor.loras.resident_ids     # until a step no longer uses it
    run(e, [(prompt, None)], 2)
    assert e.executor.loras.resident_ids == []


def test_resident_slots_evict_least_recently_used(llama):
    ckpt, adapters = llama
    args, _ = load_safetensors(ckpt, torch.float32)
    from engine.runner.lora import LoraRegistry
    reg = LoraRegistry(args, torch.float32)
    reqs = {name: (reg.load(name, path), reg.request(name))[1] for name, path in adapters.items()}
    slots = LoraSlots(CPU, torch.float32, max_loras=2)
    slots.acquire([reqs["all8"]])
    slots.acquire([reqs["qv4"]])
    slots.acquire([reqs["all8"]])                    # all8 most recent now
    slots.acquire([reqs["mlp16"]])                   # evicts qv4
    assert slots.resident_ids == [reqs["all8"].lora_id, reqs["mlp16"].lora_id]
    assert (slots.loads, slots.evictions) == (3, 1)
    used = slots.acquire(list(reqs.values()))        # a step of three: all three kept for it
    assert set(used) == {r.lora_id for r in reqs.values()}
    assert len(slots.resident_ids) == 3
    slots.trim()                                     # the next step's trim: back to max_loras
    assert slots.resident_ids == [reqs["qv4"].lora_id, reqs["mlp16"].lora_id]
    with pytest.raises(ValueError, match="max_loras"):
        LoraSlots(CPU, torch.float32, max_loras=0)


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapter_directories_are_clear_errors(llama, tmp_path):
    ckpt, adapters = llama
    args, _ = load_safetensors(ckpt, torch.float32)
    good = adapters["all8"]

    def fails(directory, *words):
        with pytest.raises(ValueError) as info:
            load_adapter(directory, args, torch.float32)
        for w in words:
            assert w in str(info.value), (w, str(info.value))

    fails(tmp_path / "nowhere", "no such directory")
    no_config = _copy(good, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    fails(no_config, "missing adapter_config.json")
    no_weights = _copy(good, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    fails(no_weights, "missing adapter_model.safetensors")

    def with_config(name, **changes):
        d = _copy(good, tmp_path / name)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(changes)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return d

    fails(with_config("wrong_rank", r=4), "adapter_model.safetensors", "model.layers.0.", "r = 4")
    fails(with_config("too_big", r=MAX_LORA_RANK + 1), "adapter_config.json", f"r = {MAX_LORA_RANK + 1}")
    fails(with_config("no_module", target_modules=["q_proj", "c_attn"]), "adapter_config.json",
          "'c_attn'", "q_proj")
    fails(with_config("dora", use_dora=True), "use_dora")
    fails(with_config("experts", target_parameters=["gate_up_proj"]), "target_parameters")
    # a tensor of a module the model lacks (layer 7 of a 2-layer model)
    from safetensors.torch import load_file, save_file
    extra = _copy(good, tmp_path / "extra_layer")
    tensors = load_file(extra / "adapter_model.safetensors")
    key = next(k for k in tensors if ".layers.0.self_attn.q_proj.lora_A" in k)
    tensors[key.replace(".layers.0.", ".layers.7.")] = tensors[key].clone()
    save_file(tensors, extra / "adapter_model.safetensors")
    fails(extra, "layers.7", "layer 7")
    # built for another base (hidden 64, head_dim 32 / 2 KV heads: k_proj out 64, not 32)
    other = build_checkpoint("mistral", tmp_path / "mistral_base")
    mismatch = build_adapter(other, tmp_path / "mismatch", seed=3, r=8)
    fails(mismatch, "adapter_model.safetensors", "do not fit", "out 32")
    # a lora_A without its lora_B
    half = _copy(good, tmp_path / "half")
    tensors = load_file(half / "adapter_model.safetensors")
    del tensors[key.replace("lora_A", "lora_B")]
    save_file(tensors, half / "adapter_model.safetensors")
    fails(half, "no lora_B.weight", "q_proj")
    # after all of that, the registry still serves the good adapter
    from engine.runner.lora import LoraRegistry
    reg = LoraRegistry(args, torch.float32)
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        reg.load("bad", no_config)
    reg.load("good", good)
    assert [a.name for a in reg.adapters()] == ["good"]
    with pytest.raises(ValueError, match="already loaded"):
        reg.load("good", good)


@pytest.mark.skipif(not kernel_path(torch.bfloat16, CPU), reason="lora_delta_ is not built here")
@pytest.mark.parametrize("int8", [False, True], ids=["bf16-pairs", "int8-pairs"])
def test_kernel_delta_matches_each_part_and_keeps_row_bits(llama, int8):
    ckpt, adapters = llama
    args, _ = load_safetensors(ckpt, torch.float32)
    res = [make_resident(load_adapter(p, args, torch.bfloat16, n, i + 1), CPU, torch.bfloat16, int8)
           for i, (n, p) in enumerate(adapters.items())]
    assert all(r.kernel is not None and r.kernel[0].dtype == (torch.uint8 if int8 else torch.bfloat16)
               for r in res)
    x = torch.randn(9, args.dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y0 = torch.randn(9, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    owners = [res[0], None, res[1], res[2], res[0], None, res[1], res[0], res[2]]
    key = (0, "attention.wqkv")
    y = LoraBatch.from_rows(owners, CPU).add(y0.clone(), x, *key)
    for row, r in enumerate(owners):
        if r is None or key not in r.matrices:
            assert torch.equal(y[row], y0[row])        # base rows, and rows of an adapter without it
            continue
        m = r.adapter.matrices[key]
        if int8:
            # int8 pairs and inputs: within 2 % of the delta's largest value (plus y's rounding)
            delta = (x[row].float() @ m.a.float().t()) @ m.b.float().t()
            err = (y[row].float() - (y0[row].float() + delta)).abs()
            assert (err <= 0.02 * delta.abs().max() + 2 ** -7 * y[row].float().abs()).all(), row
            assert delta.abs().max() > 0.1                     # a delta that a dropped one would fail
        else:
            shrunk = (x[row].float() @ m.a.float().t()).to(torch.bfloat16).float()     # bf16, as the kernel
            want = y0[row].float() + shrunk @ m.b.float().t()
            assert torch.allclose(y[row].float(), want, rtol=1e-2, atol=1e-2), row
        untouched = torch.ones(128, dtype=torch.bool)
        for lo, hi, _, _ in m.parts:
            untouched[lo:hi] = False
        assert torch.equal(y[row][untouched], y0[row][untouched])      # parts it leaves alone (k of qv4)
        alone = LoraBatch.from_rows([r], CPU).add(y0[row:row + 1].clone(), x[row:row + 1], *key)
        assert torch.equal(alone[0], y[row])           # its bits alone, whatever its neighbours
    assert res[1].adapter.matrices[key].parts == ((0, 64, 0, 4), (96, 128, 4, 8))   # q and v, rank 4


@pytest.mark.skipif(not kernel_path(torch.bfloat16, CPU), reason="lora_delta_ is not built here")
@pytest.mark.parametrize("lora_dtype", ["model", "int8"])
def test_decode_steps_with_adapters_keep_the_cpp_loop_and_the_python_loop_bits(tmp_path, lora_dtype):
    # head_dim 64: the C++ decode loop's attention kernel
    ckpt = build_checkpoint("llama3", tmp_path / "base", head_dim=64)
    adapters = {"all8": build_adapter(ckpt, tmp_path / "all8", seed=21, r=8),
                "qv4": build_adapter(ckpt, tmp_path / "qv4", seed=22, r=4, targets=("q_proj", "v_proj")),
                "mlp16": build_adapter(ckpt, tmp_path / "mlp16", seed=23, r=16,
                                       targets=("gate_proj", "up_proj", "down_proj"))}
    e = engine(ckpt, "bfloat16", prefix_caching=False, lora_dtype=lora_dtype)
    assert e.executor.loras.int8 == (lora_dtype == "int8")
    jobs = [(tokens(n, seed=50 + n), name) for n, name in [(9, "all8"), (12, "qv4"), (7, "mlp16"), (5, None)]]
    with_loop, python_loop, dtypes = run_both_loops(e, adapters, jobs)
    assert with_loop == python_loop                    # tokens and logprobs, bit for bit
    assert dtypes == {torch.uint8 if lora_dtype == "int8" else torch.bfloat16}
    assert len({tuple(a[0]) for a in with_loop}) == len(jobs)


def q4q8_llama(directory: pathlib.Path) -> Transformer:
    """A tiny Llama 3 (head_dim 64) written as a Q4_1 GGUF under `directory` (its checkpoint in
    `directory / "ckpt"`, for adapters), loaded with every block product on Q4_1 x Q8 blocks."""
    import gguf

    from engine.model.gguf_blocks import attach_gguf_blocks
    from engine.model.weights import load_gguf
    from engine.runner.builder import model_from_weights
    from tests.engine.gguf_families import write_gguf

    path = write_gguf("llama3", directory / "ckpt", directory / "q4_1.gguf", gguf.GGMLQuantizationType.Q4_1,
                      head_dim=64)
    model = model_from_weights(*load_gguf(path), torch.bfloat16)
    assert attach_gguf_blocks(model, gguf.GGUFReader(path))["q4q8"] > 0
    return model


def test_lora_dtype_auto_follows_the_base_products(llama, tmp_path):
    from engine.kernels import q4q8_linear_available
    from engine.runner.builder import engine_from_model

    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        EngineConfig(lora_dtype="fp8")
    ckpt, _ = llama
    assert not engine(ckpt, "bfloat16").executor.loras.int8      # bf16 block products: bf16 pairs
    if not (kernel_path(torch.bfloat16, CPU) and q4q8_linear_available()):
        pytest.skip("the 8-bit products or lora_delta_ are not built here")
    model = q4q8_llama(tmp_path)                                 # Q4_1 x Q8 products
    settings = dict(device="cpu", dtype="bfloat16", num_blocks=8)
    assert engine_from_model(EngineConfig(**settings), model).executor.loras.int8
    assert not engine_from_model(EngineConfig(**settings, lora_dtype="model"), model).executor.loras.int8


@pytest.mark.skipif(not kernel_path(torch.bfloat16, CPU), reason="lora_delta_ is not built here")
def test_int8_pairs_over_q4q8_products_keep_the_cpp_loop_and_the_python_loop_bits(tmp_path):
    # the C++ loop rounds each input once for the Q4_1 x Q8 product and the adapters' deltas
    from engine.kernels import q4q8_linear_available
    from engine.runner.builder import engine_from_model

    if not q4q8_linear_available():
        pytest.skip("the 8-bit products are not built here")
    model = q4q8_llama(tmp_path)
    e = engine_from_model(EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64, queue_budget_s=1e6,
                                       prefix_caching=False), model)
    assert e.executor.loras.int8
    assert all(blocks.numel() > 0 for blocks in e.executor.decode_loop.q4q8)   # every product Q4_1 x Q8
    adapters = {"all8": build_adapter(tmp_path / "ckpt", tmp_path / "all8", seed=31, r=8),
                "mlp16": build_adapter(tmp_path / "ckpt", tmp_path / "mlp16", seed=32, r=16,
                                       targets=("gate_proj", "up_proj", "down_proj"))}
    jobs = [(tokens(n, seed=60 + n), name) for n, name in [(9, "all8"), (7, "mlp16"), (5, None), (6, "all8")]]
    with_loop, python_loop, dtypes = run_both_loops(e, adapters, jobs)
    assert with_loop == python_loop                    # tokens and logprobs, bit for bit
    assert dtypes == {torch.uint8}
    assert len({tuple(a[0]) for a in with_loop[:3]}) == 3
