"""Tests of the scheduling core (engine/core)."""
