"""Tests of the network, its families and weight loaders (engine/model)."""
