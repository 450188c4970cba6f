"""The encode/prefill worker: chat request with images -> Handoff (worker)."""
