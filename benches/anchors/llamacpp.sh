#!/usr/bin/env bash
# Builds llama.cpp programs from the source distribution of the `llama-cpp-python` package on
# PyPI (it vendors llama.cpp) and prints each binary's path, one a line, in the order asked.
# By default that is `llama-bench`, the anchor the `model` bench compares against;
# `llama-quantize` makes the files benches/anchors/quantized_files.sh writes,
# `llama-batched-bench` is the concurrency anchor of the `concurrency` bench, and
# `llama-server` is what scripts/llama_server_compare.py runs. Not part of CI: the benches use
# the binaries when they exist.
#
#   bash benches/anchors/llamacpp.sh               # build llama-bench once, print the path
#   bash benches/anchors/llamacpp.sh llama-server  # any other CMake target of llama.cpp
#   bash benches/anchors/llamacpp.sh llama-bench llama-quantize llama-batched-bench
#                                                   # several targets, in one build
#   MESHNET_ANCHORS=DIR                             # where to build (default ~/.cache/meshnet/anchors)
#   MESHNET_ANCHORS_JOBS=N                          # parallel compile jobs (default: all cores)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36                 # which source distribution (default: newest)
#
# Targets already built are printed without building; the others are built together by one
# `cmake --build` call. The source is downloaded and unpacked once into DIR/llama.cpp and
# shared by every target (remove that folder to take another version). Needs python3 with pip,
# a C and C++ compiler and make; CMake comes from PyPI (once, into DIR/cmake) when the machine
# has none. Builds with -DGGML_NATIVE=ON for the CPU it runs on.
set -euo pipefail

anchors=${MESHNET_ANCHORS:-$HOME/.cache/meshnet/anchors}
if [ "$#" -eq 0 ]; then
  set -- llama-bench
fi
targets=("$@")
source_root=$anchors/llama.cpp
bin_dir=$source_root/build/bin
missing=()
for target in "${targets[@]}"; do
  [ -x "$bin_dir/$target" ] || missing+=("$target")
done
if [ "${#missing[@]}" -eq 0 ]; then
  for target in "${targets[@]}"; do
    echo "$bin_dir/$target"
  done
  exit 0
fi
mkdir -p "$anchors"
work=$(mktemp -d "$anchors/build.XXXXXX")
trap 'rm -rf "$work"' EXIT

for tool in python3 cc c++ make; do
  command -v "$tool" >/dev/null || { echo "llamacpp.sh: $tool is missing" >&2; exit 1; }
done

# CMake: the machine's, else the one an earlier run installed, else one from PyPI.
cmake=$(command -v cmake || true)
if [ -z "$cmake" ] && [ -d "$anchors/cmake" ]; then
  cmake=$(find "$anchors/cmake" -path '*/bin/cmake' -type f | head -n 1)
fi
if [ -z "$cmake" ]; then
  echo "llamacpp.sh: no cmake here, installing CMake from PyPI into $anchors/cmake" >&2
  python3 -m pip install --quiet --target "$anchors/cmake" cmake
  cmake_bin=$(find "$anchors/cmake" -path '*/bin/cmake' -type f | head -n 1)
  [ -n "$cmake_bin" ] || { echo "llamacpp.sh: the cmake package has no bin/cmake" >&2; exit 1; }
  cmake=$cmake_bin
fi

# The source distribution, located through PyPI's JSON API (a plain `pip download` of an
# sdist would build its metadata first, which for this package means building llama.cpp).
if [ ! -f "$source_root/CMakeLists.txt" ]; then
  index=${PIP_INDEX_JSON:-https://pypi.org/pypi}
  version=${LLAMA_CPP_PYTHON_VERSION:-}
  json_url=$index/llama-cpp-python${version:+/$version}/json
  url=$(curl -fsSL --max-time 60 "$json_url" | python3 -c '
import json, sys, urllib.parse
base = sys.argv[1]
data = json.load(sys.stdin)
sdists = [u["url"] for u in data["urls"] if u["packagetype"] == "sdist"]
if not sdists:
    sys.exit("no source distribution in " + base)
print(urllib.parse.urljoin(base, sdists[0]))
' "$json_url")
  echo "llamacpp.sh: downloading $url" >&2
  curl -fsSL --max-time 600 -o "$work/source.tar.gz" "$url"
  tar -xzf "$work/source.tar.gz" -C "$work"
  source_dir=$(find "$work" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -n 1)
  [ -n "$source_dir" ] || { echo "llamacpp.sh: no vendor/llama.cpp in $url" >&2; exit 1; }
  rm -rf "$source_root"
  mv "$source_dir" "$source_root"
fi

# AMX tiles are left out: where the virtual machine does not grant their register state (as on
# the Sapphire Rapids machines this was measured on), llama.cpp's AMX matmul dies with SIGSEGV.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"$cmake" -S "$source_root" -B "$source_root/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" >&2
"$cmake" --build "$source_root/build" --target "${missing[@]}" \
  -j "${MESHNET_ANCHORS_JOBS:-$(nproc)}" >&2
for target in "${targets[@]}"; do
  [ -x "$bin_dir/$target" ] || { echo "llamacpp.sh: the build made no $bin_dir/$target" >&2; exit 1; }
done
for target in "${targets[@]}"; do
  echo "$bin_dir/$target"
done
