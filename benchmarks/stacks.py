"""Summarise py-spy's collapsed stacks (`py-spy record --format raw`, as `vs_vllm.py --profile`
writes them): per file, its samples, and the functions that hold most of them, by their own
samples (the frame at a stack's top) and with what they call (every frame of a stack, once).

    python benchmarks/stacks.py DIR_OR_FILES... [--top 15]

A line of the raw format is `frame;frame;...;frame COUNT`, outermost frame first; a frame is
`function (file:line)`. Lines are folded away so that one function is one row.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

EVERYWHERE = 0.95  # an inclusive row in this share of the samples or more is not shown
LINE = re.compile(r" \(([^()]*):\d+\)$")


def frame_name(frame: str) -> str:
    """`function (path/to/module.py:123)` -> `function (module.py)`: one row per function."""
    match = LINE.search(frame)
    if match is None:
        return frame
    return f"{frame[:match.start()]} ({match.group(1).rsplit('/', 1)[-1]})"


def summarise(text: str) -> tuple[int, Counter, Counter]:
    """(samples, own samples per function, inclusive samples per function)."""
    total, own, inclusive = 0, Counter(), Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for name in set(frames):
            inclusive[name] += n
    return total, own, inclusive


def report(path: Path, top: int) -> str:
    total, own, inclusive = summarise(path.read_text(errors="replace"))
    lines = [f"== {path.name}: {total} samples"]
    if not total:
        return lines[0]
    # a frame in (nearly) every stack says nothing: the thread's or the loop's entry
    inclusive = Counter({k: n for k, n in inclusive.items() if n < EVERYWHERE * total})
    for title, counts in (("own", own), ("inclusive", inclusive)):
        lines.append(f"  by {title}:")
        lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in counts.most_common(top)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    files = []
    for p in map(Path, args.paths):
        files += sorted(p.glob("*.txt")) if p.is_dir() else [p]
    print("\n\n".join(report(f, args.top) for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
