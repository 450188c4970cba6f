#!/usr/bin/env bash
# The GPU host's side of scripts/gpu/bundle.sh (see docs/gpu.md).
#
#   scripts/gpu/device.sh stash PART [PART ...]   # keep carried parts in /tmp/mmhandoff-bundle
#   scripts/gpu/device.sh install                 # check, join and install the stashed parts
#   scripts/gpu/device.sh run CMD [ARG ...]       # run CMD with the bundle and the checkout
#                                                 # importable (installs first if needed)
set -euo pipefail
cd "$(dirname "$0")/../.."
STASH=${MMHANDOFF_BUNDLE_STASH:-/tmp/mmhandoff-bundle}
SITE=${MMHANDOFF_SITE:-/tmp/mmhandoff-site}
log() { printf '[gpu-device] %s\n' "$*" >&2; }

install() {
  [ -f "$SITE/.installed" ] && return 0
  [ -f "$STASH/SHA256SUMS" ] || { log "no SHA256SUMS stashed: stash the parts first"; exit 2; }
  (cd "$STASH" && sha256sum -c --quiet SHA256SUMS) \
    || { log "parts missing or damaged: stash every part again"; exit 2; }
  rm -rf "$STASH/wheels" && mkdir -p "$STASH/wheels"
  cat "$STASH"/part-* | tar -C "$STASH/wheels" -xf -
  log "installing $(ls "$STASH"/wheels/*.whl | wc -l) wheels into $SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$STASH"/wheels/*.whl
  touch "$SITE/.installed"
}

case "${1:-}" in
  stash)
    shift; mkdir -p "$STASH"
    for part in "$@"; do cp "$part" "$STASH/"; done
    log "stashed: $(cd "$STASH" && ls part-* | tr '\n' ' ')" ;;
  install) install ;;
  run)
    shift; install
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # flashinfer is not in the bundle; the block-hash seed must match on every engine
    export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONHASHSEED=${PYTHONHASHSEED:-0}
    exec "$@" ;;
  *) sed -n 2,7p "$0"; exit 2 ;;
esac
