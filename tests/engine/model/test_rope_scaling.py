"""RoPE scaling against transformers' own `ROPE_INIT_FUNCTIONS`: the inverse frequencies and the
cos/sin factor genserve computes from a config.json (`engine.model.hf_config.rope_for` then
`engine.model.rope.rope_inv_freq`) equal those transformers computes from the same config, for
every kind genserve serves; partial rotary tables leave the unrotated pairs exactly alone; and the
kinds genserve does not serve are refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model.hf_config import rope_for
from engine.model.rope import interleave_rope_rows, rope_inv_freq, rope_tables

HEAD_DIM = 64
PARAMETERS = {
    "linear": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192, rope_theta=500000.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768,
                 rope_theta=1e6),
    "yarn-betas": dict(rope_type="yarn", factor=32.0, beta_fast=16.0, beta_slow=2.0,
                       original_max_position_embeddings=4096, rope_theta=150000.0, truncate=False),
    "longrope": dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=4096,
                     short_factor=[1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                     long_factor=[1.5 + 0.4 * i for i in range(HEAD_DIM // 2)]),
}


def hf_config(parameters: dict, max_positions: int) -> tf.LlamaConfig:
    return tf.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                          max_position_embeddings=max_positions, rope_parameters=dict(parameters))


@pytest.mark.parametrize("kind", list(PARAMETERS))
def test_inverse_frequencies_and_factor_equal_transformers(kind):
    parameters = PARAMETERS[kind]
    for max_positions in (4096, 131072):          # longrope: short factors, then long ones
        config = hf_config(parameters, max_positions)
        # transformers picks longrope's long factors for a sequence past the original context
        seq_len = max_positions if max_positions > 4096 else None
        want, want_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu", seq_len=seq_len)
        theta, scaling = rope_for(config.to_dict(), "full_attention", "config.json")
        got, factor = rope_inv_freq(HEAD_DIM, theta, scaling, max_context=max_positions)
        assert scaling.kind == parameters["rope_type"]
        assert torch.allclose(got, want.float(), rtol=1e-6, atol=0), (kind, (got - want).abs().max())
        assert factor == pytest.approx(want_factor, rel=1e-9)


def test_partial_rotary_table_rotates_the_first_dimensions_only():
    table = rope_tables(16, 32, 10000.0, rotary_dim=12)                 # Phi-4-mini's 0.75
    assert table.shape == (32, 8)
    assert torch.equal(table[:, 6:], torch.ones(32, 2, dtype=table.dtype))       # pass-through pairs
    assert torch.equal(table[:, :6], rope_tables(12, 32, 10000.0))
    # rows of a head: rotate-half pairs (j, j + 6) of the first 12 become (2j, 2j + 1); 12..15 stay
    rows = torch.arange(16.0)[:, None]
    order = interleave_rope_rows(rows, heads=1, rotary_dim=12).flatten().tolist()
    assert order == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("kind", ["dynamic", "proportional"])
def test_unsupported_scalings_are_refused_by_name(kind):
    with pytest.raises(ValueError, match=f"RoPE scaling '{kind}' .*supported: default, linear"):
        rope_for({"rope_parameters": {"rope_type": kind, "factor": 2.0, "rope_theta": 1e4},
                  "max_position_embeddings": 4096}, "full_attention", "config.json")
