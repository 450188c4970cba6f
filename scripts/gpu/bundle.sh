#!/usr/bin/env bash
# Builds the wheel bundle an offline GPU host needs to run mmhandoff (vLLM 0.26.0 for torch
# 2.11 + CUDA 13, NIXL 1.5.1, vLLM's pure-Python dependencies; see docs/gpu.md), trimmed and
# split into parts that fit one transfer each (default 55 MiB).
#
#   scripts/gpu/bundle.sh [OUT_DIR]        # default .gpu-bundle; parts in OUT_DIR/parts/
#
# The host must already have Python 3.12, torch 2.11 (CUDA 13), transformers' own dependencies,
# numpy, pillow, aiohttp, psutil, msgpack, protobuf (the lent H200's image does). Then, there:
#   scripts/gpu/device.sh stash PART ...   # once per part (copies it to /tmp/mmhandoff-bundle)
#   scripts/gpu/device.sh install          # joins the parts, installs into /tmp/mmhandoff-site
#   scripts/gpu/device.sh run CMD ...      # runs CMD with that site on PYTHONPATH
#   scripts/gpu/device.sh stash-graph PART ... && scripts/gpu/device.sh install-graph
#                                          # the Dynamo runtime too (graph-parts/), for serve
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.gpu-bundle}
PART_MB=${PART_MB:-55}
WHEELS="$OUT/wheels"
mkdir -p "$WHEELS" "$OUT/parts"
log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

log "downloading $(grep -c . scripts/gpu/wheels.txt) wheels for CPython 3.12 (manylinux x86_64)"
platforms=()
for n in 5 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp "${platforms[@]}" \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$WHEELS" -r scripts/gpu/wheels.txt 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }

# vLLM's FlashAttention-2 kernels (Hopper runs FlashAttention 3) and its Rust front-end are
# not used: 290 -> 159 MB.
vllm_whl=$(ls "$WHEELS"/vllm-0.26.0-*.whl)
# (grep reads the whole listing: grep -q would close the pipe early and pipefail would skip this)
if unzip -Z1 "$vllm_whl" | grep -c '_vllm_fa2_C.abi3.so$' >/dev/null; then
  log "trimming $(basename "$vllm_whl")"
  zip -q -d "$vllm_whl" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/vllm-rs*' >/dev/null || true
fi

# The served graph (`mmhandoff serve`) also needs the Dynamo runtime: one 75 MB wheel, packed
# on its own (parts in OUT/graph-parts/) so that the in-process runs do not carry it.
GRAPH_WHEELS="$OUT/graph-wheels"
mkdir -p "$GRAPH_WHEELS" "$OUT/graph-parts"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  -d "$GRAPH_WHEELS" ai-dynamo-runtime==1.6.1 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
rm -f "$OUT"/graph-parts/part-*
tar -C "$GRAPH_WHEELS" -cf - . | split -b "${PART_MB}m" -d -a 2 - "$OUT/graph-parts/part-"
( cd "$OUT/graph-parts" && sha256sum part-* > SHA256SUMS )

# py-spy (3 MB), for device.sh's WATCHDOG_S stacks and vs_vllm.py --profile: carry
# .gpu-bundle/debug in the call that needs it
mkdir -p "$OUT/debug"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux1_x86_64 \
  -d "$OUT/debug" py-spy 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }

log "packing and splitting into ${PART_MB} MiB parts"
rm -f "$OUT"/parts/part-*
tar -C "$WHEELS" -cf - . | split -b "${PART_MB}m" -d -a 2 - "$OUT/parts/part-"
( cd "$OUT/parts" && sha256sum part-* > SHA256SUMS )
ls -l "$OUT/parts" >&2
log "done: $(ls "$OUT"/parts/part-* | wc -l) parts; carry one per call (see docs/gpu.md)"
