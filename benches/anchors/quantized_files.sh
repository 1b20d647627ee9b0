#!/usr/bin/env bash
# Makes the default model (SmolLM2-135M-Instruct, shipped as Q4_1) in other GGUF formats with
# llama.cpp's `llama-quantize --allow-requantize`, for the `model` bench's table of formats, and
# prints each file's path, one a line. Not part of CI.
#
#   bash benches/anchors/quantized_files.sh               # Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0
#   bash benches/anchors/quantized_files.sh Q5_0 Q3_K_M   # any types llama-quantize knows
#   MESHNET_MODELS=DIR      where the default model lives (default ~/.cache/meshnet)
#   MESHNET_QUANTIZED=DIR   where the files go (default DIR/quantized of the models folder)
#
# A file already there is printed without being made again (remove it to make it anew); a new
# one is written beside its final name and renamed when complete. The default model is fetched
# (and its hash checked) by scripts/fetch-model.sh; llama-quantize is built by llamacpp.sh.
#
# The files are requantised from Q4_1, so their weights carry Q4_1's rounding as well as their
# own: they serve to measure speed and memory, not quality. The model's hidden size (576) is
# not a multiple of 256, so in the k-quant files the matrices whose rows are 576 long fall back
# to the 32-value formats llama-quantize picks for that case (Q5_0, Q5_1, Q8_0).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
models_dir=${MESHNET_MODELS:-$HOME/.cache/meshnet}
out_dir=${MESHNET_QUANTIZED:-$models_dir/quantized}

if [ "$#" -eq 0 ]; then
  set -- Q4_0 Q4_K_M Q5_K_M Q6_K Q8_0
fi

source_file=$(bash "$root/scripts/fetch-model.sh" smollm2-135m | tail -n 1)
base=$(basename "$source_file")
base=${base%.gguf}
base=${base%.*}

# Only built when a file is missing.
quantize=
mkdir -p "$out_dir"
for type in "$@"; do
  target=$out_dir/$base.$type.gguf
  if [ ! -f "$target" ]; then
    if [ -z "$quantize" ]; then
      quantize=$(bash "$here/llamacpp.sh" llama-quantize | tail -n 1)
    fi
    partial=$target.partial
    log=$out_dir/$base.$type.log
    echo "quantized_files.sh: making $type from $(basename "$source_file")" >&2
    if ! "$quantize" --allow-requantize "$source_file" "$partial" "$type" "$(nproc)" >"$log" 2>&1; then
      tail -n 20 "$log" >&2
      rm -f "$partial"
      echo "quantized_files.sh: llama-quantize failed for $type (log: $log)" >&2
      exit 1
    fi
    mv -f "$partial" "$target"
    rm -f "$log"
  fi
  echo "$target"
done
