"""EngineConfig's command-line flags (engine/config_cli.py): one per field, documented, with the
dataclass's defaults, and a lossless round trip config -> argv -> config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.config import BATCHING_MODES, DTYPES, EngineConfig
from engine.config_cli import (
    GIB,
    add_engine_config_args,
    attribute_docs,
    engine_config_argv,
    engine_config_from_args,
    engine_flags,
)

# Every field away from its default (and still a valid config): the round trip must carry each.
NON_DEFAULT = EngineConfig(
    block_size=32, max_rows=16, prefill_token_budget=512, prefill_piece=128, few_rows=2,
    prefill_token_budget_few_rows=2048, max_context=4096, max_new_tokens=500,
    kv_pool_bytes=3 * GIB + 12_345, num_blocks=100, free_margin=0.1, per_key_rows=4,
    queue_budget_s=3.5, output_token_weight=6.25, default_deadline_s=60.0, dtype="float32",
    num_threads=3, batching="dynamic", dynamic_window_s=0.02, device="cpu",
    activation_reserve_bytes=2_500_000_000, tpot_target_ms=50.0, gap_target_ms=80.0,
    prefix_caching=False, prefix_cache_scope="global", weights="q4",
    kv_cache_dtype="int8", max_loras=3, max_lora_rank=32, lora_dtype="int8")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test")
    add_engine_config_args(p)
    return p


def parse(argv: list[str]) -> EngineConfig:
    return engine_config_from_args(parser().parse_args(argv))


def test_every_field_has_one_documented_flag():
    flags = engine_flags()
    assert [f.field for f in flags] == [f.name for f in dataclasses.fields(EngineConfig)]
    assert len({f.flag for f in flags}) == len(flags)
    for flag in flags:
        assert flag.help.strip(), flag.field
    help_text = parser().format_help()          # argparse expands every help's %-format here
    for flag in flags:
        assert flag.flag in help_text


def test_documented_attributes_are_fields():
    """No docstring entry outlives its field (nor names one that does not exist)."""
    assert set(attribute_docs(EngineConfig)) == {f.name for f in dataclasses.fields(EngineConfig)}


def test_defaults_are_the_dataclass_defaults():
    assert parse([]) == EngineConfig()
    actions = {a.dest: a for a in parser()._actions}
    for flag in engine_flags():
        field_default = getattr(EngineConfig(), flag.field)
        assert flag.to_field(actions[flag.dest].default) == field_default, flag.flag


def test_round_trip_of_every_field():
    for field in dataclasses.fields(EngineConfig):
        assert getattr(NON_DEFAULT, field.name) != field.default, f"{field.name} is at its default"
    argv = engine_config_argv(NON_DEFAULT)
    assert len(argv) == len(dataclasses.fields(EngineConfig))
    assert parse(argv) == NON_DEFAULT


def test_a_bool_field_is_a_pair_of_flags():
    assert engine_config_argv(EngineConfig(prefix_caching=False)) == ["--no-prefix-caching"]
    assert parse(["--no-prefix-caching"]).prefix_caching is False
    assert parse(["--no-prefix-caching", "--prefix-caching"]).prefix_caching is True


def test_default_config_needs_no_flags():
    assert engine_config_argv(EngineConfig()) == []


def test_existing_spellings_keep_their_meaning():
    config = parse(["--threads", "3", "--kv-pool-gib", "0.5", "--num-blocks", "64", "--dtype", "float32",
                    "--queue-budget-s", "3600"])
    assert config.num_threads == 3
    assert config.kv_pool_bytes == GIB // 2
    assert config.num_blocks == 64 and config.dtype == "float32" and config.queue_budget_s == 3600.0
    assert parse(["--kv-pool-gib", "0.3"]).kv_pool_bytes == int(0.3 * GIB)   # truncated, as before


def test_renamed_flags_keep_their_old_spelling_as_an_alias():
    old = parse(["--prefill-chunk", "512", "--prefill-chunk-few-rows", "2048"])
    new = parse(["--prefill-token-budget", "512", "--prefill-token-budget-few-rows", "2048"])
    assert old == new
    assert (new.prefill_token_budget, new.prefill_token_budget_few_rows) == (512, 2048)
    assert engine_config_argv(new) == ["--prefill-token-budget=512", "--prefill-token-budget-few-rows=2048"]


def test_fractional_gib_round_trips_to_the_byte():
    config = parse(["--kv-pool-gib", "0.3"])
    assert parse(engine_config_argv(config)) == config


def test_choices_are_enforced(capsys):
    flags = {f.field: f for f in engine_flags()}
    assert flags["dtype"].choices == DTYPES
    assert flags["batching"].choices == BATCHING_MODES
    assert flags["device"].choices == ("auto", "cpu", "cuda")
    assert flags["weights"].choices == ("auto", "bf16", "q4", "int8", "q4q8")
    for flag, value in (("--dtype", "float8"), ("--device", "tpu"), ("--weights", "fp4")):
        with pytest.raises(SystemExit):
            parse([flag, value])
        assert "invalid choice" in capsys.readouterr().err


def test_invalid_values_raise_the_configs_error():
    with pytest.raises(ValueError, match="num_blocks"):
        parse(["--num-blocks", "1"])


def test_attribute_docs_reads_shared_and_continued_entries():
    class Documented:
        """Something.

        Attributes:
            a / b: shared text
                continued here.
            c: alone.

        Raises:
            nothing: a later section is not read.
        """

    shared = "shared text continued here."
    assert attribute_docs(Documented) == {"a": shared, "b": shared, "c": "alone."}


def test_attribute_docs_needs_the_section():
    class Undocumented:
        """No attributes here."""

    with pytest.raises(ValueError, match="Attributes"):
        attribute_docs(Undocumented)
