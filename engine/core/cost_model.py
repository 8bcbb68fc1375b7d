"""The step-time model: what one step costs the device, from its rows, their contexts and its prompt.

One formula serves the scheduler (a step's prefill beyond the design's caps is sized with it; admission control
estimates queued device-seconds with it) and the simulator (`SimExecutor` advances its virtual
clock by it). Step time in milliseconds of a step with B decode rows and C prefill tokens:

    step_base_ms                                            every step (loop overhead)
  + decode_1_ms + (decode_32_ms - decode_1_ms)(B - 1)/31    if B > 0 (weights read once per step)
  + C × prefill_ms_per_token
  + K × decode_ms_per_context_token                         K = Σ context read by the decode rows
  + P / 1000 × prefill_ms_per_kpair                         P = (query, key) pairs of the prefill

K sums, over the decode rows, the tokens each row attends to (its position + 1): the attention
term that grows with context (on a GPU, K/V bytes read per step; on the CPU, the gather and dot
products of decode attention). P sums, over the prefill pieces [s, s + L), the pairs
L·s + L(L + 1)/2 of causal attention. The defaults are the reference deployment's assumptions
(docs/design.md, "The numbers"): 25 ms for 1 row and 40 ms for 32 (each step reads the 14 GB of
weights once), 0.1 ms per prefill token (10,000 tokens/s), no base or context terms.
`fit_step_model` fits the six terms to measured steps (least squares on relative error,
non-negative), which is how `loadgen.calibrate` measures a machine and how a running engine
refits its model from its own steps (`CostModel.observe`).

numpy only: the scheduler and the simulator load it without torch.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

COST_FIELDS = ("decode_1_ms", "decode_32_ms", "prefill_ms_per_token", "step_base_ms",
               "decode_ms_per_context_token", "prefill_ms_per_kpair")
DESIGN_COSTS = {"decode_1_ms": 25.0, "decode_32_ms": 40.0, "prefill_ms_per_token": 0.1,
                "step_base_ms": 0.0, "decode_ms_per_context_token": 0.0, "prefill_ms_per_kpair": 0.0}
# The fit's unknowns, in the column order of `design_matrix`.
FIT_TERMS = ("step_base_ms", "decode_1_ms", "decode_slope_ms", "prefill_ms_per_token",
             "decode_ms_per_context_token", "prefill_ms_per_kpair")


def piece_pairs(start: int, length: int) -> int:
    """Causal (query, key) pairs of a prefill piece [start, start + length): L·s + L(L + 1)/2."""
    return length * start + length * (length + 1) // 2


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What the step-time model reads from a step.

    Attributes:
        rows: B, decode rows (one token each).
        prefill_tokens: C, prompt tokens in prefill pieces.
        context: K, tokens the decode rows attend to, summed (each row: its position + 1).
        pairs: P, causal (query, key) pairs of the prefill pieces, summed (`piece_pairs`).
    """

    rows: int = 0
    prefill_tokens: int = 0
    context: int = 0
    pairs: int = 0

    def with_piece(self, start: int, length: int) -> "StepFeatures":
        """These features plus the prefill piece [start, start + length)."""
        return StepFeatures(self.rows, self.prefill_tokens + length, self.context,
                            self.pairs + piece_pairs(start, length))

    def as_tuple(self) -> tuple[int, int, int, int]:
        """(B, C, K, P)."""
        return self.rows, self.prefill_tokens, self.context, self.pairs


class CostModel:
    """Predicted device time of a step (ms), and of a request, from the six cost terms.

    Args:
        prefill_ms_per_token: C's cost, ms per prompt token.
        decode_ms_per_token: a measured cost per output token of a full (32-row), short-context
            decode step, ms; when given, it sets `decode_32_ms` (32 × it − `step_base_ms`) and
            `decode_1_ms` in the design's 25 : 40 proportion. Kept for engines that measure
            only that (`engine.runner.builder.measure_costs`).
        step_base_ms, decode_1_ms, decode_32_ms, decode_ms_per_context_token,
            prefill_ms_per_kpair: the other terms (module docstring), ms.
        refit_every: with `observe`, refit the terms every this many observed steps (0: never).

    Raises:
        ValueError: a term is negative or not finite.
    """

    __slots__ = (*COST_FIELDS, "refit_every", "version", "_window", "_num_observed")

    def __init__(self, prefill_ms_per_token: float = 0.1, decode_ms_per_token: float | None = None, *,
                 step_base_ms: float = 0.0, decode_1_ms: float = 25.0, decode_32_ms: float = 40.0,
                 decode_ms_per_context_token: float = 0.0, prefill_ms_per_kpair: float = 0.0,
                 refit_every: int = 256) -> None:
        if decode_ms_per_token is not None:
            decode_32_ms = max(0.0, 32.0 * decode_ms_per_token - step_base_ms)
            decode_1_ms = decode_32_ms * 25.0 / 40.0
        self.set_params({"decode_1_ms": decode_1_ms, "decode_32_ms": decode_32_ms,
                         "prefill_ms_per_token": prefill_ms_per_token, "step_base_ms": step_base_ms,
                         "decode_ms_per_context_token": decode_ms_per_context_token,
                         "prefill_ms_per_kpair": prefill_ms_per_kpair})
        self.refit_every = refit_every
        self.version = 0                         # +1 at every change of the terms
        self._window: deque[tuple[StepFeatures, float]] = deque(maxlen=2048)
        self._num_observed = 0

    # -- the terms ----------------------------------------------------------------------------
    def params(self) -> dict[str, float]:
        """The six cost terms (what `from_json` reads), ms."""
        return {k: getattr(self, k) for k in COST_FIELDS}

    def set_params(self, params: dict[str, float]) -> None:
        """Replace the given terms (the others stay).

        Raises:
            ValueError: an unknown term, or a value that is negative or not a finite number.
        """
        unknown = set(params) - set(COST_FIELDS)
        if unknown:
            raise ValueError(f"unknown cost model fields {sorted(unknown)}; known: {COST_FIELDS}")
        for k, v in params.items():
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"cost model field {k} must be a finite number >= 0, got {v!r}")
            setattr(self, k, float(v))
        if hasattr(self, "version"):
            self.version += 1

    @classmethod
    def from_json(cls, source: str | os.PathLike | dict[str, Any], **kwargs: Any) -> "CostModel":
        """A model from a JSON file path or its parsed dict: the terms themselves, or an object
        holding them under "sim_executor" (what `loadgen.calibrate` writes). Terms not given keep
        the design's defaults. `kwargs` go to the constructor (`refit_every`).

        Raises:
            ValueError: an unknown term or a value that is not a finite number >= 0.
        """
        data = source if isinstance(source, dict) else json.loads(pathlib.Path(source).read_text())
        data = data.get("sim_executor", data)
        model = cls(**kwargs)
        model.set_params(dict(data))
        return model

    @property
    def decode_ms_per_token(self) -> float:
        """Cost per output token of a full 32-row decode step at short context, ms (40 / 32 =
        1.25 in the design's numbers)."""
        return (self.step_base_ms + self.decode_32_ms) / 32.0

    # -- predictions --------------------------------------------------------------------------
    def step_ms(self, f: StepFeatures) -> float:
        """Predicted time of a step with features `f`, ms (the module docstring's formula)."""
        decode = 0.0
        if f.rows:
            decode = self.decode_1_ms + (self.decode_32_ms - self.decode_1_ms) * (f.rows - 1) / 31.0
        return (self.step_base_ms + decode + f.prefill_tokens * self.prefill_ms_per_token
                + f.context * self.decode_ms_per_context_token + f.pairs / 1000.0 * self.prefill_ms_per_kpair)

    def prefill_ms(self, num_prompt: int) -> float:
        """Device time of prefilling a `num_prompt`-token prompt in pieces, ms (the pieces' pairs
        add up to the whole prompt's causal pairs, wherever it is cut)."""
        return num_prompt * self.prefill_ms_per_token + piece_pairs(0, num_prompt) / 1000.0 * self.prefill_ms_per_kpair

    def decode_token_ms(self, rows: int, context: float) -> float:
        """One output token's share of a step of `rows` decode rows, ms: the step's base and weight
        reads divided by the rows, plus the row's own attention over `context` tokens."""
        rows = max(1, rows)
        shared = self.step_ms(StepFeatures(rows=rows)) / rows
        return shared + context * self.decode_ms_per_context_token

    def estimate_ms(self, num_prompt: int, expected_output: float, rows: int = 32) -> float:
        """Estimated device time of a whole request, ms: its prefill, plus `expected_output` tokens
        decoded among `rows` rows at its mean context (prompt + half the answer). In the design's
        numbers at 32 rows: prompt × 0.1 ms + output × 1.25 ms."""
        context = num_prompt + expected_output / 2.0
        return self.prefill_ms(num_prompt) + expected_output * self.decode_token_ms(rows, context)

    # -- learning from the engine's own steps ---------------------------------------------------
    def observe(self, f: StepFeatures, step_s: float) -> None:
        """Record one measured step; every `refit_every` steps, refit the six terms.

        The refit (`fit_step_model`) runs over the last 2,048 steps plus the current model's own
        predictions on a grid of rows × prefill × context (the prior, weighing 5 % of the measured
        steps together), so shapes the traffic has not shown keep roughly their old cost; it is
        kept only when its median relative error over the measured steps is below the current
        model's.
        """
        if step_s <= 0 or not math.isfinite(step_s):
            return
        self._window.append((f, step_s * 1000.0))
        self._num_observed += 1
        if self.refit_every and self._num_observed % self.refit_every == 0 and len(self._window) >= 64:
            self._refit()

    def _refit(self) -> None:
        measured = list(self._window)
        prior = [(StepFeatures(b, c, b * ctx, piece_pairs(0, c)), 0.0)
                 for b in (0, 1, 8, 32, 64) for c in (0, 64, 256) for ctx in (64, 1024) if b or c]
        prior = [(f, self.step_ms(f)) for f, _ in prior]
        prior_weight = 0.05 * len(measured) / len(prior)     # the prior: 5 % of the evidence
        samples = [{"rows": f.rows, "prefill": f.prefill_tokens, "context": f.context, "pairs": f.pairs,
                    "ms": ms, "weight": w} for (f, ms), w in
                   zip(measured + prior, [1.0] * len(measured) + [prior_weight] * len(prior))]
        try:
            fields, _ = fit_step_model(samples)
        except (np.linalg.LinAlgError, ValueError):
            return
        X = design_matrix(samples[:len(measured)])
        y = np.array([ms for _, ms in measured])

        def median_error(p: dict[str, float]) -> float:
            coef = np.array([p["step_base_ms"], p["decode_1_ms"], (p["decode_32_ms"] - p["decode_1_ms"]) / 31.0,
                             p["prefill_ms_per_token"], p["decode_ms_per_context_token"], p["prefill_ms_per_kpair"]])
            return float(np.median(np.abs(X @ coef / y - 1.0)))

        if median_error(fields) < median_error(self.params()):
            self.set_params(fields)


# -- fitting ------------------------------------------------------------------------------------
def design_matrix(samples: Sequence[dict[str, float]]) -> np.ndarray:
    """Rows of (1, B > 0, B − 1 if B > 0, C, K, P / 1000) for samples {rows, prefill, context, pairs}:
    the unknowns of `FIT_TERMS` (decode_slope_ms is (decode_32_ms − decode_1_ms) / 31)."""
    b = np.array([s["rows"] for s in samples], dtype=np.float64)
    has = (b > 0).astype(np.float64)
    return np.column_stack([np.ones_like(b), has, b - has,
                            [s["prefill"] for s in samples], [s["context"] for s in samples],
                            [s["pairs"] / 1000.0 for s in samples]])


def fit_step_model(samples: Sequence[dict[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
    """The six cost terms fitted to measured steps, and the fit's quality.

    Args:
        samples: [{rows, prefill, context, pairs, ms}], one per measured step (ms > 0); an optional
            "weight" (default 1) scales a sample's relative error.
    Returns:
        (terms as `CostModel.params()` names them, {num_samples, median_abs_rel_error,
        p95_abs_rel_error, r2, num_outliers, dropped_terms}).
    Raises:
        ValueError: no samples, or a step time that is not > 0.

    Least squares on relative error (each row divided by its measured time), so short decode steps
    weigh as much as long prefill steps. A term that comes out negative is fixed at 0 and the others
    refitted, until none is. Steps slowed by other work on a shared CPU (relative error above 3 × the
    median) are left out of a second fit and counted.
    """
    if not samples:
        raise ValueError("no samples to fit")
    X = design_matrix(samples)
    y = np.array([s["ms"] for s in samples], dtype=np.float64)
    weight = np.array([s.get("weight", 1.0) for s in samples], dtype=np.float64)
    if not (y > 0).all():
        raise ValueError("every step time must be > 0")
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        coef, active = _nnls_rel(X[keep], y[keep], weight[keep])
        rel = (X @ coef) / y - 1.0
        keep = np.abs(rel) <= max(3.0 * np.median(np.abs(rel)), 0.05)
    base, d1, slope, p, kd, kp = coef
    fields = {"step_base_ms": base, "decode_1_ms": d1, "decode_32_ms": d1 + 31.0 * slope,
              "prefill_ms_per_token": p, "decode_ms_per_context_token": kd, "prefill_ms_per_kpair": kp}
    pred = X @ coef
    rel = pred / y - 1.0
    quality = {"num_samples": len(samples), "median_abs_rel_error": float(np.median(np.abs(rel))),
               "p95_abs_rel_error": float(np.percentile(np.abs(rel), 95)),
               "r2": float(1.0 - ((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-300)),
               "num_outliers": int((~keep).sum()),
               "dropped_terms": [FIT_TERMS[i] for i in range(len(FIT_TERMS)) if i not in active]}
    return {k: float(v) for k, v in fields.items()}, quality


def _nnls_rel(X: np.ndarray, y: np.ndarray, weight: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """Least squares of X·c ≈ y on relative error with c ≥ 0, by dropping the most negative term."""
    w = (1.0 if weight is None else weight) / y
    active = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        if not active:
            return coef, active
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        coef[active] = sol
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef, active
        active.remove(min(neg, key=lambda i: coef[i]))

