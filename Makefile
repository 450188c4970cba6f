.PHONY: setup demo test test-unit bench
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/python examples/graph_demo.py
# unit first: a logic mistake fails in seconds, before any engine starts; short tracebacks
# for the engine tiers, so that a failure's own message comes first in a CI report
test: setup
	.venv/bin/python -m pytest -q -m unit
	.venv/bin/python -m pytest -q --tb=short -m "engine or graph"
test-unit: setup
	.venv/bin/python -m pytest -q -m unit
bench: setup
	.venv/bin/python benchmarks/handoff_vs_full_media.py
	.venv/bin/python benchmarks/graph_overhead.py
