"""One component as its own process: the life every component shares, from ready to a drained
stop (lifecycle), and what an engine-backed worker adds to it (engine_worker: its engine,
readiness and health, its load on /metrics, the blocks it holds for routers: health,
load_metrics, block_feed)."""
