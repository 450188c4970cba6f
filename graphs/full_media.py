"""The benchmark arm: frontend -> prefill -> decode, where prefill hands decode the
prompt text and the image bytes and decode re-processes them (what P/D stacks do today). The
same components as the disagg graph, run with --full-media (configs/full_media.yaml)."""

from .disagg import Decode, Frontend, Prefill  # noqa: F401  (the same graph)
