"""The fixed run that chooses the int8 path's outlier channels (`engine.model.int8_weights.attach_int8`).

The channels are chosen once at load, from the model's activations on a fixed English text, so
every server of the same model and version chooses the same ones and serves the same bits. The
text is the end of Python's own documentation topics (`pydoc_data.topics`, shipped with every
CPython): the last `CALIBRATION_TOKENS` tokens of the topics joined in key order.
benchmarks/int8.py measures perplexity on the beginning of the same joined text, which these
tokens do not overlap.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.core.request import Request, SamplingParams

CALIBRATION_TOKENS = 512


def topics_text() -> str:
    """Python's documentation topics (`pydoc_data.topics.topics`) joined in key order, with a
    blank line between topics."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def calibration_tokens(encode) -> list[int]:
    """The last `CALIBRATION_TOKENS` token ids of `topics_text()`, by `encode` (str → list of
    ids, the model's tokenizer)."""
    return encode(topics_text())[-CALIBRATION_TOKENS:]


def calibration_config(num_tokens: int) -> EngineConfig:
    """The throwaway engine's settings for a `num_tokens`-token calibration prompt: a KV pool
    just large enough, no prefix cache, the whole prompt in one step."""
    budget = -(-num_tokens // 64) * 64
    return EngineConfig(num_blocks=-(-num_tokens // 16) + 4, prefix_caching=False,
                        prefill_token_budget=max(256, budget),
                        prefill_token_budget_few_rows=max(1024, budget))


def run_calibration(engine: Engine, token_ids: list[int]) -> None:
    """Run `engine` (over the model being calibrated, `calibration_config`) once over
    `token_ids` as one prompt, one greedy token, until idle."""
    engine.submit(Request("int8-calibration", "calibration", list(token_ids), 1,
                          SamplingParams(temperature=0.0, ignore_eos=True), 0.0, 0.0))
    engine.run_until_idle()
