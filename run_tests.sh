#!/usr/bin/env bash
# Install megarl's pinned stack (first run only) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash run_tests.sh -k conversion -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ! -f artifacts/tiny-qwen2/megarl_tiny.json ]; then
  echo "[tests] building the built-in tiny model (about a minute)"
  .venv/bin/python tools/make_tiny_model.py --out artifacts/tiny-qwen2
fi
exec .venv/bin/python -m pytest "$@"
