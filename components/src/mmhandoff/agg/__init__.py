"""The aggregated worker: the whole VLM on one engine, the parity reference (worker)."""
