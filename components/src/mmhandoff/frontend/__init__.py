"""The OpenAI-compatible HTTP frontend: request checks (request), the HTTP app and OpenAI's
shapes (app), a request's journey through the graph with its retries and migration (journey),
prefill placement (placement), Prometheus metrics (metrics)."""
