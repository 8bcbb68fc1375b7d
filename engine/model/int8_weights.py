"""Attaching int8 copies to a model's block matrices (`EngineConfig.weights` "int8"): the products
on int8 arithmetic of `engine.model.int8`, with each matrix's outlier input channels chosen by one
calibration run over a fixed text (`engine.runner.int8_calibration`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from engine.model.int8 import int8_exact, quantize_weight
from engine.model.linear import PackedWeight
from engine.model.transformer import Transformer, block_matrices

log = logging.getLogger(__name__)

OUTLIERS = 16       # input channels per matrix quantized apart (`attach_int8`)


def attach_int8(model: Transformer, calibrate: Callable[[], None] | None = None,
                outliers: int = OUTLIERS, block: int = 0, exact: bool = False) -> None:
    """Run every block matrix's products on int8 arithmetic (`engine.model.int8.int8_linear`).

    Sets `PackedWeight.i8` on each block matrix's packed copy (a model runner made after this
    passes them to its C++ decode loop, `engine.runner.decode_loop`, unless `block` is set).
    The output projection keeps its bf16 product. With `calibrate`, the outlier channels are
    chosen first: every matrix is quantized without outliers and observes its inputs while
    `calibrate()` runs the model over a fixed text (`engine.runner.int8_calibration`); then each
    matrix keeps apart the `outliers` input channels with the largest |x| seen. Without it, no
    channel is kept apart.

    Args:
        model: an `engine.model.llama.Transformer` in bf16 on the CPU, packed or not.
        calibrate: runs the model once (through an engine) on the calibration text, or None.
        outliers: input channels per matrix to keep apart (≤ the matrix's input size).
        block: 0, or k per scale block (`Int8Weight.block`; then no calibration, no outliers).
        exact: with `block`, keep the weights unrounded and round only the inputs
            (`Int8Weight.exact`: llama.cpp's Q4_1 × Q8_1 arithmetic, for comparing quality).
    Raises:
        ValueError: the model is not bf16 on the CPU, or `torch._int_mm` does not give exact sums
            here for one of the shapes (`int8_exact`).
    """
    if model.dtype != torch.bfloat16 or model.output.device.type != "cpu":
        raise ValueError(f"weights 'int8' needs a bfloat16 model on the CPU, got {model.dtype} "
                         f"on {model.output.device.type}")
    for shape in sorted({tuple(getattr(module, name).shape) for module, name in block_matrices(model)}):
        if not int8_exact(*shape):
            raise ValueError(f"weights 'int8': torch._int_mm gives inexact sums for {shape} here")

    def attach(choose: Callable[[PackedWeight], torch.Tensor | None], observe: bool = False
               ) -> None:
        for module, name in block_matrices(model):
            weight = getattr(module, name)
            packed = getattr(module, name + "_packed") or PackedWeight(weight, 0)
            setattr(module, name + "_packed", dataclasses.replace(
                packed, i8=quantize_weight(weight, choose(packed), observe, block, exact)))

    if block:
        attach(lambda packed: None)
        log.info("weights int8: scale blocks of %d along k (%s)", block,
                 "activations only, Q4_1 x Q8_1" if exact else "Q8_0 x Q8_0")
        return
    if calibrate is None or outliers == 0:
        attach(lambda packed: None)
    else:
        attach(lambda packed: None, observe=True)
        calibrate()
        attach(lambda packed: packed.i8.observed.topk(outliers).indices)
    log.info("weights int8: every block matrix on int8 arithmetic (per-row weight and "
             "activation scales, %d outlier channels apart); output projection in bf16",
             outliers if calibrate is not None else 0)
