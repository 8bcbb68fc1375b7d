"""Tests of constrained decoding (engine/structured)."""
