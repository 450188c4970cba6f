#!/usr/bin/env bash
# The GPU host's side of scripts/gpu/bundle.sh (see docs/gpu.md).
#
#   scripts/gpu/device.sh stash PART [PART ...]   # keep carried parts in /tmp/mmhandoff-bundle
#   scripts/gpu/device.sh install                 # check, join and install the stashed parts
#   scripts/gpu/device.sh stash-graph PART ...    # the same for graph-parts/ (Dynamo runtime),
#   scripts/gpu/device.sh install-graph           # which `mmhandoff serve` needs
#   scripts/gpu/device.sh run CMD [ARG ...]       # run CMD with the bundle and the checkout
#                                                 # importable (installs first if needed)
#   scripts/gpu/device.sh clean                   # end what an earlier command left running
#                                                 # (servers, engines) and holds the GPU
# With WATCHDOG_S=N, a CMD still running after N s gets the Python stacks of its whole process
# tree (py-spy, carried as a wheel in .gpu-bundle/debug/) written to $STACKS (default
# ${OUT:-/tmp}/stacks.txt), and runs on: the way to see where a GPU run hangs.
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

# py-spy dump of every process under PID, and the GPU's own view, into $STACKS
dump_stacks() {
  local out=${STACKS:-${OUT:-/tmp}/stacks.txt}
  if ! command -v py-spy >/dev/null; then
    # its own folder: pip --target skips a bin/ that already exists (the bundle made one)
    python3 -m pip install -q --no-index --no-deps --target "$SITE-debug" \
      .gpu-bundle/debug/py_spy-*.whl
    export PATH="$SITE-debug/bin:$PATH"
  fi
  log "still running after ${WATCHDOG_S} s: stacks of $1's process tree -> $out"
  {
    nvidia-smi || true
    for p in $1 $(descendants "$1"); do
      echo "===== pid $p: $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-200)"
      py-spy dump --native --pid "$p" 2>&1 || py-spy dump --pid "$p" 2>&1 || true
      # the kernel's view of every thread, in case ptrace is refused
      for t in /proc/$p/task/*; do
        echo "  thread ${t##*/} $(cat "$t/comm") state=$(awk '{print $3}' "$t/stat") wchan=$(cat "$t/wchan")"
      done 2>/dev/null
    done
  } > "$out"
}
ancestors() {
  local p=$1
  while p=$(ps -o ppid= -p "$p" | tr -d ' ') && [ -n "$p" ] && [ "$p" != 0 ]; do echo "$p"; done
}
descendants() {
  local c
  for c in $(ps -o pid= --ppid "$1"); do echo "$c"; descendants "$c"; done
}

# The checkout runs from PYTHONPATH, not installed: without its distribution's metadata vLLM finds
# none of mmhandoff's plugins (entry point vllm.general_plugins), which a user's `pip install`
# has. Written from pyproject.toml's entry points, once per checkout.
entry_points() {
  local info="$SITE/mmhandoff-0.0.0+checkout.dist-info"
  [ "$info/entry_points.txt" -nt pyproject.toml ] && return 0
  mkdir -p "$info"
  printf 'Metadata-Version: 2.1\nName: mmhandoff\nVersion: 0.0.0+checkout\n' > "$info/METADATA"
  python3 - pyproject.toml > "$info/entry_points.txt" <<'PY'
import re, sys
section = None
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("["):
        m = re.fullmatch(r'\[project\.(scripts|entry-points\."?([\w.-]+)"?)\]', line)
        section = m and ("console_scripts" if m[1] == "scripts" else m[2])
        if section:
            print(f"[{section}]")
    elif section and "=" in line and not line.startswith("#"):
        print(line.replace('"', ""))
PY
}

# the Dynamo runtime for the served graph: its own parts, installed into the same site
install_graph() {
  install
  [ -f "$SITE/.graph-installed" ] && return 0
  local dir="$STASH/graph"
  [ -f "$dir/SHA256SUMS" ] || { log "no graph SHA256SUMS stashed: stash-graph first"; exit 2; }
  (cd "$dir" && sha256sum -c --quiet SHA256SUMS) \
    || { log "graph parts missing or damaged: stash-graph every part again"; exit 2; }
  rm -rf "$dir/wheels" && mkdir -p "$dir/wheels"
  cat "$dir"/part-* | tar -C "$dir/wheels" -xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$dir"/wheels/*.whl
  touch "$SITE/.graph-installed"
}

case "${1:-}" in
  stash)
    shift; mkdir -p "$STASH"
    for part in "$@"; do cp "$part" "$STASH/"; done
    log "stashed: $(cd "$STASH" && ls part-* | tr '\n' ' ')" ;;
  stash-graph)
    shift; mkdir -p "$STASH/graph"
    for part in "$@"; do cp "$part" "$STASH/graph/"; done
    log "stashed graph parts: $(cd "$STASH/graph" && ls part-* | tr '\n' ' ')" ;;
  install) install ;;
  clean)
    # A command stopped by `timeout` can leave servers in sessions of their own holding the GPU
    # (a `vllm serve` kept 75 GB and the next tier failed at engine start). This shell and its
    # callers are spared: their command lines may name what is killed.
    mine=" $$ $(ancestors $$) "
    left="vllm.entrypoints|VLLM::|mmhandoff[. ](serve|frontend|agg|prefill|decode|router)"
    for pid in $(pgrep -f "$left"); do
      case "$mine" in *" $pid "*) ;; *) kill -9 "$pid" 2>/dev/null || true ;; esac
    done
    sleep 2
    log "GPU memory in use: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)" ;;
  install-graph) install_graph ;;
  run)
    shift; install; entry_points
    export PYTHONPATH="$SITE:$PWD/components/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # flashinfer is not in the bundle; the block-hash seed must match on every engine
    export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONHASHSEED=${PYTHONHASHSEED:-0}
    [ -n "${WATCHDOG_S:-}" ] || exec "$@"
    "$@" & pid=$!
    ( sleep "$WATCHDOG_S"; kill -0 "$pid" 2>/dev/null && dump_stacks "$pid" ) &
    wait "$pid" ;;
  *) sed -n 2,11p "$0"; exit 2 ;;
esac
