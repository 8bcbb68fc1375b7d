"""Tests of genserve's C++ kernels and the products over them (engine/kernels, engine/model/linear.py and the quantized formats)."""
