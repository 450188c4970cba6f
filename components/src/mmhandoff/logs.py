"""One log format for every mmhandoff process: `setup()` once in a process's main, then
`logging.getLogger(__name__)` in each module. A line is its message, which names its component
in brackets ("[frontend] ready on ..."), and nothing before it: users and scripts read serve's
lines by their start ("[serve] ready: <url>"), and serve prefixes every line of a replica's
output with the replica's name. Components log to stderr; serve's own lines, which are its
output, to stdout."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

FORMAT = "%(message)s"


def setup(stream: TextIO | None = None, level: int = logging.INFO) -> None:
    """Every `mmhandoff.*` logger's records to `stream` (default stderr) in FORMAT; idempotent."""
    root = logging.getLogger("mmhandoff")
    if not any(getattr(h, "mmhandoff", False) for h in root.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.mmhandoff = True
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False  # vLLM and Dynamo configure the root logger their own way
