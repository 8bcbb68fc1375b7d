"""The step-time model: prediction, the attention terms, per-request estimates, fitting and refitting."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.cost_model import CostModel, StepFeatures, fit_step_model, piece_pairs

# A CPU-like model: a 32-row step at 1,500-token contexts takes ≈ 3.8× the short-context one.
CPU = {"step_base_ms": 8.5, "decode_1_ms": 0.0, "decode_32_ms": 9.3, "prefill_ms_per_token": 0.26,
       "decode_ms_per_context_token": 0.001, "prefill_ms_per_kpair": 0.066}


def test_design_defaults_and_the_per_token_form():
    m = CostModel()
    assert m.step_ms(StepFeatures(rows=32, prefill_tokens=256)) == pytest.approx(65.6)
    assert m.step_ms(StepFeatures(rows=1)) == pytest.approx(25.0)
    assert m.decode_ms_per_token == pytest.approx(1.25)
    assert m.estimate_ms(1000, 100) == pytest.approx(225.0)        # 1000 × 0.1 + 100 × 1.25
    # A measured per-token cost (what engine.runner.builder measures) sets the 32-row step.
    measured = CostModel(prefill_ms_per_token=0.3, decode_ms_per_token=0.5)
    assert measured.decode_32_ms == pytest.approx(16.0) and measured.decode_ms_per_token == pytest.approx(0.5)


def test_context_term_makes_long_context_steps_cost_more():
    m = CostModel(**CPU)
    short = m.step_ms(StepFeatures(rows=32, context=32 * 32))
    long = m.step_ms(StepFeatures(rows=32, context=32 * 1500))
    assert long / short == pytest.approx((17.8 + 48.0) / (17.8 + 1.024), rel=1e-9)
    assert 3.4 < long / short < 3.8
    # A request's estimate pays for its own attention reads: a longer prompt costs more per token.
    assert m.decode_token_ms(32, 1500) - m.decode_token_ms(32, 100) == pytest.approx(1400 * 0.001)
    # Prefill pays the causal pairs of the whole prompt wherever it is cut.
    assert m.prefill_ms(512) == pytest.approx(512 * 0.26 + piece_pairs(0, 512) / 1000 * 0.066)
    assert sum(piece_pairs(s, 64) for s in range(0, 512, 64)) == piece_pairs(0, 512)


def _samples(true: dict[str, float], noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    model = CostModel(**true)
    out = []
    for b in (0, 1, 4, 16, 32):
        for c in (0, 64, 256):
            for ctx in (32, 256, 1500):
                if not (b or c):
                    continue
                f = StepFeatures(b, c, b * ctx, piece_pairs(ctx, c))
                out.append({"rows": f.rows, "prefill": f.prefill_tokens, "context": f.context, "pairs": f.pairs,
                            "ms": model.step_ms(f) * (1 + noise * rng.standard_normal())})
    return out


def test_fit_recovers_the_terms_including_the_attention_term():
    fields, quality = fit_step_model(_samples(CPU))
    for k, v in CPU.items():
        assert fields[k] == pytest.approx(v, abs=1e-6)
    assert quality["median_abs_rel_error"] < 1e-9
    with pytest.raises(ValueError):
        fit_step_model([])


def test_observe_refits_the_model_to_the_engines_own_steps():
    m = CostModel(refit_every=64)                                  # starts at the design's numbers
    truth = CostModel(**CPU)
    v0 = m.version
    for s in _samples(CPU) * 3:
        f = StepFeatures(s["rows"], s["prefill"], s["context"], s["pairs"])
        m.observe(f, truth.step_ms(f) / 1000.0)
    assert m.version > v0
    f = StepFeatures(rows=32, context=32 * 1500)
    assert m.step_ms(f) == pytest.approx(truth.step_ms(f), rel=0.02)
    frozen = CostModel(refit_every=0)
    frozen.observe(f, 1.0)
    assert frozen.params() == CostModel().params()


def test_from_json_and_bad_terms(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text('{"sim_executor": {"prefill_ms_per_token": 0.2}}')
    m = CostModel.from_json(path)
    assert m.prefill_ms_per_token == 0.2 and m.decode_32_ms == 40.0
    with pytest.raises(ValueError, match="unknown"):
        CostModel.from_json({"decode_64_ms": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(prefill_ms_per_token=-1.0)
