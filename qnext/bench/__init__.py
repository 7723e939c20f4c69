"""Benchmark machinery as a library: model presets, FLOP counts from the parameter specs, and the transformers
driver the engine is measured against. scripts/bench*.py are thin drivers over it."""
