"""Local models for tests and benchmarks: the tiny random LLaVA (tiny), real-size shapes without
weights (dummy)."""
