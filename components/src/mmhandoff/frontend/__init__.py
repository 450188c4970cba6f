"""The OpenAI-compatible HTTP frontend: request checks (request), the app and its retry loop
(app), Prometheus metrics (metrics)."""
