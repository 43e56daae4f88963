#!/usr/bin/env bash
# Fill gpu_wheels/ (git-ignored) with the wheels of the packages the GPU machine lacks (tests/gpu/lane.py,
# MODULES): CPython 3.12, manylinux x86-64 or pure Python, no dependencies (each one is named there).
# The device tool carries the folder (`carry: ["gpu_wheels", ...]`); tests/gpu/run.sh installs from it offline.
#
#   bash tests/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
read -r -a specs <<<"$("$PYTHON" tests/gpu/lane.py wheel-specs)"
mkdir -p gpu_wheels
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_28_x86_64 -d gpu_wheels "${specs[@]}"
# What is in the folder and nothing else (an older version left behind would stop the install).
wanted=$("$PYTHON" - "${specs[@]}" <<'PY'
import re, sys
print(" ".join(re.sub(r"[-_.]+", "_", spec.split("==")[0]).lower() + "-" + spec.split("==")[1] for spec in sys.argv[1:]))
PY
)
for path in gpu_wheels/*; do
  stem=$(basename "$path" | cut -d- -f1-2 | awk -F- '{n=$1; gsub(/[-_.]+/, "_", n); print tolower(n) "-" $2}')
  case " $wanted " in *" $stem "*) ;; *) echo "removing $path (not wanted)"; rm -f "$path" ;; esac
done
ls -l gpu_wheels
du -sh gpu_wheels
