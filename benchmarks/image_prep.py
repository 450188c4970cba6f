"""Where prefill's image preparation spends its time (issue 37): each step a first-seen image
goes through before the vision encoder, timed alone, for 640x480, 4K and 12 MP JPEGs and PNGs,
with the model's own image processor (LLaVA-1.5-7B's: CLIP at 336 px).

    python benchmarks/image_prep.py [--reps 5] [--sizes 640x480,4K,12MP] [--formats JPEG,PNG]

Steps, in the order a request takes them today (media.images, engine.prompt, vLLM's renderer):
- base64: the data URI's body checked and decoded (`data_uri_bytes`);
- decode: PIL's full decode to RGB (`decode_rgb`);
- hash: the image's identity, BLAKE3 (all cores) over its RGB pixels (`content_hash`; SHA-256
  until 2026-12-06);
- process: the model's image processor on the decoded image, as vLLM calls it (the torchvision
  backend transformers picks by default): resize, crop, rescale, normalise, to a tensor.
Beside them, candidates that would do the same work faster, each timed the same way:
- sha256 over the same pixels (the identity's hash function before: the same contract);
- blake3 over the compressed bytes (a different contract: the same picture sent as JPEG and as
  PNG would get two identities);
- the PIL backend of the same processor, and a JPEG decoded at a reduced scale (PIL's `draft`:
  the DCT's own downscaling to no less than twice the processor's input) then processed: both
  change the model's input, by the max abs difference printed against the default path.
Each figure is the median of `--reps` runs in this one process; the shares are of the default
path's total (base64 + decode + hash + process). CPU work only: run it where the frontend's and
prefill's processes run.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import jpeg  # noqa: E402

SIZES = {"640x480": (640, 480), "4K": (3840, 2160), "12MP": (4000, 3000)}


def timed(fn, reps: int):
    """(median ms, the last result) of `reps` calls of `fn`."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def encoded(size: tuple[int, int], fmt: str, seed: int) -> bytes:
    data = jpeg(*size, seed)
    if fmt == "JPEG":
        return data
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, format="PNG")
    return buf.getvalue()


def processor():
    from transformers import AutoImageProcessor

    from mmhandoff.models.dummy import ensure_dummy_model

    from PIL import Image

    path = ensure_dummy_model("llava-1.5-7b")
    procs = (AutoImageProcessor.from_pretrained(path),
             AutoImageProcessor.from_pretrained(path, backend="pil"))
    warm = Image.new("RGB", (640, 480))
    for proc in procs:  # a processor's first call pays one-time costs (torch's, the backend's)
        proc(images=warm, return_tensors="pt")
    return procs


def one(name: str, data: bytes, fmt: str, procs, reps: int) -> dict:
    import blake3
    from PIL import Image

    from mmhandoff.media.images import content_hash, data_uri_bytes, decode_rgb

    default, pil = procs
    uri = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    row = {"image": name, "format": fmt, "bytes": len(data)}
    row["base64"], raw = timed(lambda: data_uri_bytes(uri), reps)
    row["decode"], image = timed(lambda: decode_rgb(raw), reps)
    row["hash"], _ = timed(lambda: content_hash(image), reps)
    row["process"], ref = timed(lambda: default(images=image, return_tensors="pt"), reps)
    row["sha256 pixels"], _ = timed(lambda: hashlib.sha256(image.tobytes()).hexdigest(), reps)
    row["blake3 bytes"], _ = timed(
        lambda: blake3.blake3(raw, max_threads=blake3.blake3.AUTO).hexdigest(), reps)
    row["process (PIL)"], alt = timed(lambda: pil(images=image, return_tensors="pt"), reps)
    ref_pixels = ref["pixel_values"]
    row["PIL diff"] = float((alt["pixel_values"] - ref_pixels).abs().max())
    if fmt == "JPEG":
        side = 2 * default.crop_size["height"]

        def drafted():
            img = Image.open(io.BytesIO(raw))
            img.draft("RGB", (side, side))  # the DCT scales by 1/2, 1/4 or 1/8, never below
            return default(images=img.convert("RGB"), return_tensors="pt")
        row["draft decode + process"], small = timed(drafted, reps)
        row["draft diff"] = float((small["pixel_values"] - ref_pixels).abs().max())
    row["total"] = row["base64"] + row["decode"] + row["hash"] + row["process"]
    return row


def report(rows: list[dict]) -> None:
    print("\nms per image, median; share of the default path's total in brackets\n")
    print("| image | bytes | base64 | decode | hash (blake3) | process | total | sha256 pixels "
          "| blake3 bytes | process (PIL) / max diff | draft decode + process / max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def share(k):
            return f"{r[k]:.1f} ({r[k] / r['total']:.0%})"
        draft = (f"{r['draft decode + process']:.1f} / {r['draft diff']:.3f}"
                 if "draft diff" in r else "-")
        print(f"| {r['image']} {r['format']} | {r['bytes']:,} | {share('base64')} | "
              f"{share('decode')} | {share('hash')} | {share('process')} | {r['total']:.1f} | "
              f"{r['sha256 pixels']:.1f} | {r['blake3 bytes']:.1f} | "
              f"{r['process (PIL)']:.1f} / {r['PIL diff']:.3f} | {draft} |")
    print("\nratios (candidate / today's step):")
    for r in rows:
        line = (f"  {r['image']} {r['format']}: hash (blake3) / sha256 pixels "
                f"{r['hash'] / r['sha256 pixels']:.2f}")
        if "draft diff" in r:
            line += (f", draft decode + process / (decode + process) "
                     f"{r['draft decode + process'] / (r['decode'] + r['process']):.2f}")
        print(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--formats", default="JPEG,PNG")
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = set(sizes) - set(SIZES)
    if unknown:
        p.error(f"unknown sizes {sorted(unknown)}; known: {', '.join(SIZES)}")
    procs = processor()
    rows = []
    for i, name in enumerate(sizes):
        for fmt in args.formats.split(","):
            print(f"[image_prep] {name} {fmt} ...", file=sys.stderr, flush=True)
            rows.append(one(name, encoded(SIZES[name], fmt, 9000 + i), fmt, procs, args.reps))
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
