"""Tests of the model runner, sampling and the builder (engine/runner)."""
