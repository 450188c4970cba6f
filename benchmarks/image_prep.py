"""Where prefill's image preparation spends its time (issue 37): each step a first-seen image
goes through before the vision encoder, timed alone, for 640x480, 4K and 12 MP JPEGs and PNGs,
with the model's own image processor (LLaVA-1.5-7B's: CLIP at 336 px).

    python benchmarks/image_prep.py [--reps 5] [--sizes 640x480,4K,12MP] [--formats JPEG,PNG]

Steps, in the order a request takes them (media.images, engine.prompt, vLLM's renderer):
- base64: the data URI's body checked and decoded (`data_uri_bytes`);
- decode: PIL's full decode to RGB (`decode_rgb`);
- hash: the image's identity, BLAKE3 (all cores) over its RGB pixels (`content_hash`);
- process: the model's image processor on the decoded image, on torch's threads as vLLM's
  renderer sets them for it (OMP_NUM_THREADS, else one): `--torch-threads`, the first count is
  the one the total uses; each other count gets a column, and "threads diff" is the max abs
  difference of the model's input between them (0: the same input).
Beside them, candidates that would do the same work faster, each timed the same way:
- the array path: the decoded image turned into one (height, width, 3) array (`np.array`), the
  identity hashed over it (the same value: the same bytes) and the processor given the array
  instead of the PIL image, which it would otherwise turn into bytes itself ("array path" is
  the three together; "diff": its model input against the default's);
- the channels-first path: the same array copied once more into a contiguous (3, height, width)
  array, which the processor takes without transposing a strided view ("CHW path", its "diff");
- the presized path: the image brought to the processor's resize size (media.presize, as the
  media processes do it), then the processor on that ("presize + process", "presized diff");
  "process presized" is the renderer's share of it, what vLLM's one thread still does;
- sha256 over the same pixels (the identity's hash function until 2026-12-06);
- blake3 over the compressed bytes (a different contract: the same picture sent as JPEG and as
  PNG would get two identities);
- a media process's whole work on the data URI (base64, decode, identity, presize), with the
  exact decode and with `--image-decode draft` (a JPEG decoded at a reduced scale, PIL's
  `draft`: the DCT's own downscaling to no less than twice the processor's short side; PNGs are
  decoded whole): the draft changes the model's input, by the max and mean abs differences
  printed.
Each figure is the median of `--reps` runs in this one process. CPU work only: run it where
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
    from PIL import Image
    from transformers import AutoImageProcessor

    from mmhandoff.models.dummy import ensure_dummy_model

    proc = AutoImageProcessor.from_pretrained(ensure_dummy_model("llava-1.5-7b"))
    proc(images=Image.new("RGB", (640, 480)), return_tensors="pt")  # one-time costs
    return proc


def on_threads(n: int, fn):
    def call():
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)
    return call


def array_hash(pixels) -> str:
    """content_hash's value, read from the array instead of PIL's bytes."""
    from blake3 import blake3

    from mmhandoff.media.images import HASH_DOMAIN

    h = blake3(HASH_DOMAIN, max_threads=blake3.AUTO)
    h.update(f"{pixels.shape[1]}x{pixels.shape[0]}\0".encode())
    h.update(memoryview(pixels))
    return h.hexdigest()


def one(name: str, data: bytes, fmt: str, proc, threads: list[int], reps: int) -> dict:
    import blake3
    import numpy as np

    from mmhandoff.media.images import content_hash, data_uri_bytes, decode_rgb

    uri = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    row = {"image": name, "format": fmt, "bytes": len(data)}
    row["base64"], raw = timed(lambda: data_uri_bytes(uri), reps)
    row["decode"], image = timed(lambda: decode_rgb(raw), reps)
    row["hash"], identity = timed(lambda: content_hash(image), reps)
    outputs = []
    for n in threads:
        row[f"process@{n}"], out = timed(
            on_threads(n, lambda: proc(images=image, return_tensors="pt")), reps)
        outputs.append(out["pixel_values"])
    row["process"] = row[f"process@{threads[0]}"]
    ref_pixels = outputs[0]
    row["threads diff"] = max(float((o - ref_pixels).abs().max()) for o in outputs)

    def array_path():
        pixels = np.array(image)
        assert array_hash(pixels) == identity
        return proc(images=pixels, return_tensors="pt")
    row["array path"], out = timed(on_threads(threads[0], array_path), reps)
    row["diff"] = float((out["pixel_values"] - ref_pixels).abs().max())
    def chw_path():
        pixels = np.array(image)
        assert array_hash(pixels) == identity
        return proc(images=np.ascontiguousarray(pixels.transpose(2, 0, 1)), return_tensors="pt")
    row["CHW path"], out = timed(on_threads(threads[0], chw_path), reps)
    row["CHW diff"] = float((out["pixel_values"] - ref_pixels).abs().max())
    import copy

    from mmhandoff.media.presize import Presizer

    presize = Presizer(copy.deepcopy(proc))
    row["presize"], small = timed(on_threads(threads[0], lambda: presize(image)), reps)
    row["process presized"], out = timed(
        on_threads(threads[0], lambda: proc(images=small, return_tensors="pt")), reps)
    row["presized diff"] = float((out["pixel_values"] - ref_pixels).abs().max())
    row["sha256 pixels"], _ = timed(lambda: hashlib.sha256(image.tobytes()).hexdigest(), reps)
    row["blake3 bytes"], _ = timed(
        lambda: blake3.blake3(raw, max_threads=blake3.blake3.AUTO).hexdigest(), reps)
    # what a media process does with the data URI (media.pool.prepare_image: decode, presize,
    # identity), the exact decode and the inexact one (--image-decode draft: a no-op for PNGs),
    # on one torch thread
    import pickle

    from mmhandoff.media.images import ImageLimits
    from mmhandoff.media.pool import prepare_image

    pickled = pickle.dumps(presize)

    def media(draft):
        return prepare_image(uri, ImageLimits(), pickled, draft).image
    row["media exact"], _ = timed(on_threads(threads[0], lambda: media(None)), reps)
    row["media draft"], small = timed(on_threads(threads[0], lambda: media(
        presize.draft_size())), reps)
    out = proc(images=small, return_tensors="pt")["pixel_values"]
    row["draft diff"] = float((out - ref_pixels).abs().max())
    row["draft mean diff"] = float((out - ref_pixels).abs().mean())
    row["total"] = row["base64"] + row["decode"] + row["hash"] + row["process"]
    return row


def report(rows: list[dict], threads: list[int]) -> None:
    more = "".join(f" process @{n} |" for n in threads[1:])
    print(f"\nms per image, median; process on {threads[0]} torch thread(s); share of the total "
          "in brackets\n")
    print("| image | bytes | base64 | decode | hash | process |" + more + " total | "
          "threads diff | array path (vs hash + process) / diff | CHW path / diff | "
          "presize + process presized / diff | sha256 pixels | "
          "blake3 bytes | media process exact / draft (ratio), max / mean diff |")
    print("|---" * (14 + len(threads) - 1) + "|")
    for r in rows:
        def share(k):
            return f"{r[k]:.1f} ({r[k] / r['total']:.0%})"
        draft = (f"{r['media exact']:.1f} / {r['media draft']:.1f} "
                 f"({r['media draft'] / r['media exact']:.2f}), {r['draft diff']:.3f} / "
                 f"{r['draft mean diff']:.4f}")
        others = "".join(f" {r[f'process@{n}']:.1f} |" for n in threads[1:])
        print(f"| {r['image']} {r['format']} | {r['bytes']:,} | {share('base64')} | "
              f"{share('decode')} | {share('hash')} | {share('process')} |{others} "
              f"{r['total']:.1f} | {r['threads diff']:.3f} | {r['array path']:.1f} "
              f"({r['hash'] + r['process']:.1f}) / {r['diff']:.3f} | "
              f"{r['CHW path']:.1f} / {r['CHW diff']:.3f} | "
              f"{r['presize']:.1f} + {r['process presized']:.1f} / {r['presized diff']:.3f} | "
              f"{r['sha256 pixels']:.1f} | {r['blake3 bytes']:.1f} | {draft} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--formats", default="JPEG,PNG")
    p.add_argument("--torch-threads", default="1,8",
                   help="torch thread counts the processor runs on, one column each (vLLM's "
                        "renderer: OMP_NUM_THREADS, else 1)")
    args = p.parse_args(argv)
    threads = [int(n) for n in args.torch_threads.split(",")]
    sizes = args.sizes.split(",")
    unknown = set(sizes) - set(SIZES)
    if unknown:
        p.error(f"unknown sizes {sorted(unknown)}; known: {', '.join(SIZES)}")
    proc = processor()
    rows = []
    for i, name in enumerate(sizes):
        for fmt in args.formats.split(","):
            print(f"[image_prep] {name} {fmt} ...", file=sys.stderr, flush=True)
            rows.append(one(name, encoded(SIZES[name], fmt, 9000 + i), fmt, proc, threads,
                            args.reps))
    report(rows, threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
