"""genserve.common.model_source: the spellings of --model and the served model's name."""

from __future__ import annotations

import pathlib

import pytest

from genserve.common.model_name import DEFAULT_MODEL_NAME
from genserve.common.model_source import ModelSource, parse_model_source


def test_nothing_is_the_embedded_model():
    assert parse_model_source(None) == ModelSource("embedded")
    assert parse_model_source(None).served_name == DEFAULT_MODEL_NAME


@pytest.mark.parametrize("spec,name", [
    ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),   # the embedded file's name
    ("llama-2-7b.Q4_K_M.gguf", "llama-2-7b"), ("tiny-f16.GGUF", "tiny"), ("my.model.gguf", "my.model")])
def test_gguf_name_is_the_stem_without_its_quantisation(spec, name):
    source = parse_model_source(spec)
    assert source.kind == "gguf" and source.path == pathlib.Path(spec)
    assert source.served_name == name


def test_directory_is_a_checkpoint_named_after_it(tmp_path):
    ckpt = tmp_path / "Llama-2-7b-hf"
    source = parse_model_source(str(ckpt) + "/")
    assert source.kind == "safetensors" and source.served_name == "Llama-2-7b-hf"


@pytest.mark.parametrize("spec,shape,seed,name", [
    ("random:llama-2-7b", "llama-2-7b", 0, "random-llama-2-7b"),
    ("random:tiny:seed=7", "tiny", 7, "random-tiny-seed7")])
def test_random_models(spec, shape, seed, name):
    source = parse_model_source(spec)
    assert (source.kind, source.shape, source.seed, source.served_name) == ("random", shape, seed, name)


@pytest.mark.parametrize("spec,message", [
    ("random:gpt-5", "unknown random shape 'gpt-5'; one of llama-2-7b"),
    ("random:tiny:seed=x", "random:SHAPE\\[:seed=N\\]"), ("random:tiny:temp=1", "option 'temp=1'"),
    ("  ", "empty path")])
def test_bad_spellings_say_why(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_model_source(spec)


def test_random_shapes_all_build():
    from engine.model.weights import random_shape
    from genserve.common.model_source import RANDOM_SHAPES

    assert random_shape("llama-2-7b").n_layers == 32
    for name in RANDOM_SHAPES:
        assert random_shape(name).vocab_size >= 256


def test_genserve_serve_names_the_model_for_the_bridge():
    from genserve.deploy.cli import bridge_argv, build_parser

    args = build_parser().parse_args(["serve", "--no-envoy", "--model", "random:llama-2-7b:seed=3"])
    argv = bridge_argv(args)
    assert argv[argv.index("--model-name") + 1] == "random-llama-2-7b-seed3"
    args = build_parser().parse_args(["serve", "--no-envoy"])
    argv = bridge_argv(args)
    assert argv[argv.index("--model-name") + 1] == DEFAULT_MODEL_NAME
