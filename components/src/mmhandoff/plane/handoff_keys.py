"""The handoff keys a process signs with (prefill) or checks with (decode, the router): from
`--handoff-key-file` or the environment, one key per line. Every component that reads them
loads them here."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

KEY_ENV, KEY_FILE_ENV = "MMHANDOFF_HANDOFF_KEY", "MMHANDOFF_HANDOFF_KEY_FILE"
MIN_KEY_BYTES = 16


def handoff_keys(args: argparse.Namespace) -> tuple[bytes, ...]:
    """The handoff keys from --handoff-key-file or $MMHANDOFF_HANDOFF_KEY, one per line (empty:
    no signing). The first signs; decode accepts any of them, so a rotation adds the new key
    second, then moves it first, then drops the old one. A key too short to be a secret is
    refused, not used."""
    if args.handoff_key_file:
        try:
            text = Path(args.handoff_key_file).read_bytes()
        except OSError as e:
            raise SystemExit(f"--handoff-key-file: {e}") from None
        source = args.handoff_key_file
    elif os.environ.get(KEY_ENV):
        text, source = os.environ[KEY_ENV].encode(), f"${KEY_ENV}"
    else:
        return ()
    keys = tuple(line.strip() for line in text.splitlines() if line.strip())
    short = [len(k) for k in keys if len(k) < MIN_KEY_BYTES]
    if not keys or short:
        raise SystemExit(f"the handoff keys in {source} must each be at least {MIN_KEY_BYTES} "
                         f"bytes (got lengths {[len(k) for k in keys]})")
    return keys
