.PHONY: setup demo test bench
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/python examples/graph_demo.py
test: setup
	.venv/bin/python -m pytest -q
bench: setup
	.venv/bin/python benchmarks/handoff_vs_full_media.py
	.venv/bin/python benchmarks/graph_overhead.py
