#!/usr/bin/env bash
# Fill gpu_carry/ (git-ignored; GPU_LANE_CARRY: another folder) with what the GPU lane needs and the GPU machine
# lacks, which the device tool carries beside the working tree (`carry: ["gpu_carry"]`):
#   wheels/      the packages of tests/gpu/lane.py's MODULES that have a distribution: CPython 3.12, manylinux
#                x86-64 or pure Python, no dependencies (each one is named there); setup installs them offline;
#   tiny-qwen2/  the tiny model (artifacts/ is git-ignored, so it does not travel; built here first if absent,
#                about a minute, rather than in the lane's 8 minutes); setup copies it back into artifacts/.
#
#   bash tests/gpu/fetch.sh      # then: bash tests/gpu/run.sh /tmp/lane-dry --dry-run (checks it, prints the size)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
carry=${GPU_LANE_CARRY:-$root/gpu_carry}
read -r -a specs <<<"$("$PYTHON" tests/gpu/lane.py wheel-specs)"
mkdir -p "$carry/wheels"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$carry/wheels" "${specs[@]}"
# What is in the folder and nothing else (an older version left behind would stop the install).
wanted=$("$PYTHON" - "${specs[@]}" <<'PY'
import re, sys
print(" ".join(re.sub(r"[-_.]+", "_", spec.split("==")[0]).lower() + "-" + spec.split("==")[1] for spec in sys.argv[1:]))
PY
)
for path in "$carry"/wheels/*; do
  stem=$(basename "$path" | cut -d- -f1-2 | awk -F- '{n=$1; gsub(/[-_.]+/, "_", n); print tolower(n) "-" $2}')
  case " $wanted " in *" $stem "*) ;; *) echo "removing $path (not wanted)"; rm -f "$path" ;; esac
done
# megarl_tiny.json is written last: its presence marks a complete model
if [ ! -f artifacts/tiny-qwen2/megarl_tiny.json ]; then
  "$PYTHON" tools/make_tiny_model.py --out artifacts/tiny-qwen2 --quiet
fi
rm -rf "$carry/tiny-qwen2"
cp -r artifacts/tiny-qwen2 "$carry/tiny-qwen2"
ls -l "$carry/wheels" "$carry/tiny-qwen2"
du -sh "$carry"
