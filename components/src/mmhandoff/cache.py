"""mmhandoff's cache folder, for what is built or compiled once and kept between runs (the
tiny models, torch's compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """mmhandoff's cache folder: $MMHANDOFF_CACHE, else ~/.cache/mmhandoff."""
    return Path(os.environ.get("MMHANDOFF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mmhandoff"))
