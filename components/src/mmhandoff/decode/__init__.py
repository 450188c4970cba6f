"""The decode worker: Handoff -> token stream, never the media (worker)."""
