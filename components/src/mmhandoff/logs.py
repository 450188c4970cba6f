"""One log format for every mmhandoff process: `setup()` once in a process's main, then
`logging.getLogger(__name__)` in each module. Each line names its component in brackets, as it
always did ("[frontend] ready on ..."); serve then prefixes every line of a component's output
with the replica's name. Components log to stderr; serve's own lines, which are its output, to
stdout."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(message)s"
DATE_FORMAT = "%H:%M:%S"


def setup(stream: TextIO | None = None, level: int = logging.INFO) -> None:
    """Every `mmhandoff.*` logger's records to `stream` (default stderr) in FORMAT; idempotent."""
    root = logging.getLogger("mmhandoff")
    if not any(getattr(h, "mmhandoff", False) for h in root.handlers):
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        handler.mmhandoff = True
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False  # vLLM and Dynamo configure the root logger their own way
