"""Models from --model: Hugging Face safetensors checkpoints (sharded, with tokenizer.json) and
random-initialised shapes, loaded by engine.runner.builder.build_engine and served under their own name."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from engine.config import EngineConfig
from engine.model.config import ModelArgs
from engine.model.weights import load_safetensors, random_shape, random_weights
from engine.runner.builder import build_engine, engine_from_weights
from engine.tokenizer import ByteTokenizer, Tokenizer
from tests.engine.checkpoint import sentencepiece_tokenizer, write_checkpoint
from tests.engine.conftest import generate

CPU = dict(device="cpu", num_blocks=64, dtype="float32", queue_budget_s=1e6)


def tiny_args(vocab_size: int, tie: bool = False) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                     vocab_size=vocab_size, max_context=1024, rope_theta=10000.0, tie_embeddings=tie)


def test_random_weights_are_seeded_shaped_and_tied():
    args = tiny_args(300, tie=True)
    a, b = random_weights(args, torch.float32, seed=3), random_weights(args, torch.float32, seed=3)
    c = random_weights(args, torch.float32, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    assert a["output.weight"] is a["tok_embeddings.weight"]
    assert torch.equal(a["norm.weight"], torch.ones(64))
    w = a["layers.1.feed_forward.w2.weight"]
    assert w.shape == (64, 128) and 0.018 < w.std().item() < 0.022


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sharded_checkpoint_round_trip(tmp_path, dtype):
    """Llama-2-7B's layout in small: 3 shards and an index, FP16 or BF16 on disk."""
    args = tiny_args(300)
    state = random_weights(args, torch.float32, seed=1)
    write_checkpoint(tmp_path / "ckpt", args, state, sentencepiece_tokenizer(), shards=3, dtype=dtype)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) == 3
    loaded_args, loaded = load_safetensors(tmp_path / "ckpt", torch.float32)
    assert loaded_args == args
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k].to(dtype).float()) for k in state)


def test_sentencepiece_tokenizer_json(tmp_path):
    args = tiny_args(300)
    write_checkpoint(tmp_path, args, random_weights(args, seed=0), sentencepiece_tokenizer(),
                     bos_token_id=1, eos_token_id=2)
    tok = Tokenizer.from_hf_dir(tmp_path, args.vocab_size)
    assert tok.vocab_size == 300 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    ids = tok.encode("hello hello\n")
    assert ids == [1, 268, 268, 13]                    # <s> ▁hello ▁hello <0x0A>
    assert [tok.token_bytes(i) for i in ids[1:]] == [b" hello", b" hello", b"\n"]
    assert tok.is_special(1) and tok.is_special(2) and not tok.is_special(268)
    assert tok.token_bytes(299) == b""                   # a padded id beyond the tokenizer's 269
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        Tokenizer.from_hf_dir(tmp_path, 100)


def test_byte_tokenizer():
    tok = ByteTokenizer(32000)
    assert tok.encode("é!") == [0xC3, 0xA9, 0x21]
    assert tok.decode([0xC3, 0xA9, 256 + 0x21]) == "é!"
    assert tok.token_bytes(31999) == bytes([31999 % 256]) and not tok.is_special(2)
    with pytest.raises(IndexError):
        tok.token_bytes(32000)
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer(100)


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory, gguf_tokenizer):
    """A 2-layer fp16 checkpoint in 2 shards with the embedded model's byte-level tokenizer.json."""
    args = tiny_args(gguf_tokenizer.vocab_size)
    state = random_weights(args, torch.float32, seed=5, std=0.5)   # wide: no near-ties in greedy
    path = tmp_path_factory.mktemp("ckpt") / "Tiny-Llama-test"
    write_checkpoint(path, args, state, gguf_tokenizer._tk, eos_token_id=gguf_tokenizer.eos_token_id)
    return path, args, {k: v.half().float() for k, v in state.items()}


def test_checkpoint_generates_as_its_weights(gpt2_checkpoint, gguf_tokenizer):
    path, args, state = gpt2_checkpoint
    loaded = build_engine(EngineConfig(**CPU), str(path), calibrate=False)
    assert loaded.model_name == "Tiny-Llama-test" and loaded.args == args
    assert loaded.source.kind == "safetensors" and loaded.source.path == path
    text = "The capital of France is 12345"
    assert loaded.tokenizer.encode(text) == gguf_tokenizer.encode(text)
    ids = [loaded.tokenizer.token_bytes(i) for i in range(gguf_tokenizer.vocab_size)]
    assert ids == [gguf_tokenizer.token_bytes(i) for i in range(gguf_tokenizer.vocab_size)]
    prompt = loaded.tokenizer.encode(text)
    got = generate(loaded.engine, [prompt], 8, temperature=0.0, ignore_eos=True)
    want = generate(engine_from_weights(EngineConfig(**CPU), args, state), [prompt], 8,
                    temperature=0.0, ignore_eos=True)
    assert got == want and len(got[0]) == 8


async def test_service_serves_the_checkpoint_under_its_name(gpt2_checkpoint):
    import grpc

    from genserve.v1 import generate_pb2 as pb, generate_pb2_grpc as pb_grpc
    from service.server import EngineServer
    from tests.service.harness import collect, request

    path, _, _ = gpt2_checkpoint
    build = functools.partial(build_engine, calibrate=False)
    server = EngineServer(EngineConfig(**CPU), "127.0.0.1", 0, model_path=str(path), build=build)
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    try:
        while server.loaded is None:
            assert not task.done(), task
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            info = await stub.Info(pb.InfoRequest(), timeout=10)
            assert info.model_name == "Tiny-Llama-test" and info.vocab_size == 49152
            msgs, err = await collect(stub.Generate(request("Hello", max_tokens=4), timeout=30))
            assert err is None
            tokens = [m.token for m in msgs if m.HasField("token")]
            assert len(tokens) == 4
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def test_random_model_builds_with_a_byte_tokenizer():
    config = EngineConfig(**{**CPU, "num_blocks": 256})      # a pool of 4,096 tokens
    loaded = build_engine(config, "random:tiny:seed=2", calibrate=False)
    assert loaded.model_name == "random-tiny-seed2" and loaded.args == random_shape("tiny")
    assert config.max_context == loaded.engine.config.max_context == 4096   # the model's positions, not 8,192
    assert isinstance(loaded.tokenizer, ByteTokenizer) and loaded.tokenizer.vocab_size == 512
    first = generate(loaded.engine, [loaded.tokenizer.encode("hello")], 6, temperature=0.0, ignore_eos=True)
    again = build_engine(EngineConfig(**CPU), "random:tiny:seed=2", calibrate=False)
    assert generate(again.engine, [again.tokenizer.encode("hello")], 6, temperature=0.0,
                    ignore_eos=True) == first


def test_cuda_asked_for_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --device cuda is valid here")
    with pytest.raises(ValueError, match="--device cuda"):
        build_engine(EngineConfig(**{**CPU, "device": "cuda"}), "random:tiny", calibrate=False)
