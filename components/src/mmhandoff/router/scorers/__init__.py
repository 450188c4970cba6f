"""The router's scorers: each rates every candidate instance for one request in [0, 1] (higher is
better); the router combines them with the weights of its configuration (router.pick). One
scorer per module, each with the formula in its docstring, registered where it is defined
(`@register`): adding one is a module here, named in the import below, and its cases in
tests/test_router_pick.py."""

from mmhandoff.router.scorers import kv_usage, load, overlap  # noqa: F401  (each registers)
from mmhandoff.router.scorers.base import SCORERS, Candidates, Scorer, register

__all__ = ["SCORERS", "Candidates", "Scorer", "register"]
