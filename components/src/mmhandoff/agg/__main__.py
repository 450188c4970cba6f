"""`python -m mmhandoff.agg`: the aggregated worker."""

from mmhandoff.agg.worker import main

# Guarded: vLLM's engine processes are spawned, and a spawned child imports this module again.
if __name__ == "__main__":
    raise SystemExit(main())
