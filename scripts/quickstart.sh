#!/usr/bin/env bash
# Builds meshnet and runs the activation-plane demo: three peers on loopback pass a 300-token
# prefill and decode steps along a source route, in binary bfloat16 frames with zstd.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo run --release --locked -p meshnet-node --example activation_demo -- chain "$@"
