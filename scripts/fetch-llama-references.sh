#!/usr/bin/env bash
# Puts llama.cpp's own reference files in a cache: the tokenizer test vectors
# (models/ggml-vocab-*.gguf with their .gguf.inp / .gguf.out) and the real chat templates
# (models/templates/*.jinja). They come from the source distribution of the PyPI package
# `llama-cpp-python`, pinned to one release and checked by sha256, which vendors llama.cpp.
# Nothing is built. The last line printed is the directory holding `models/`.
#
#   MESHNET_REFERENCES=DIR   where reference files live (default ~/.cache/meshnet/references)
set -euo pipefail

version=0.3.36
sdist_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
cache=${MESHNET_REFERENCES:-$HOME/.cache/meshnet/references}
target=$cache/llama.cpp-$version
stamp=$target/.complete

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sdist_sha256" ]; then
  echo "$target"
  exit 0
fi

python=${PYTHON:-python3}
if ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "pip not found for $python: install it (apt-get install python3-pip)" >&2
  exit 1
fi

work_dir=$(mktemp -d)
trap 'rm -rf "$work_dir"' EXIT
sdist=$work_dir/llama_cpp_python-$version.tar.gz
echo "downloading the llama-cpp-python $version source distribution with pip" >&2
# Only this package is taken as source; its build backend comes as wheels (pip prepares an
# sdist's metadata before saving it).
"$python" -m pip download --quiet --no-deps --no-binary llama-cpp-python --disable-pip-version-check \
  "llama-cpp-python==$version" -d "$work_dir" >&2
if [ ! -f "$sdist" ]; then
  echo "pip did not produce $sdist" >&2
  exit 1
fi
found=$(sha256sum "$sdist" | cut -d ' ' -f 1)
if [ "$found" != "$sdist_sha256" ]; then
  echo "$sdist has sha256 $found, expected $sdist_sha256: refusing it" >&2
  exit 1
fi

# Only the vocabularies, their vectors and the templates: a few tens of MB.
extract=$work_dir/extract
mkdir -p "$extract"
tar -xzf "$sdist" -C "$extract" --wildcards \
  "llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-*" \
  "llama_cpp_python-$version/vendor/llama.cpp/models/templates/*"
rm -rf "$target"
mkdir -p "$cache"
mv "$extract/llama_cpp_python-$version/vendor/llama.cpp" "$target"
echo "$sdist_sha256" >"$stamp"
echo "$target"
