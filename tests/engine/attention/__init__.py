"""Tests of the attention backends and KV formats (engine/attention)."""
