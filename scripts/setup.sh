#!/usr/bin/env bash
# Installs what building and testing meshnet needs on a fresh Debian machine with a Rust
# toolchain: rustfmt and clippy, cargo-fuzz for the fuzz targets, and the default model file
# (scripts/fetch-model.sh) for the model tests. Idempotent.
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install a Rust toolchain (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install --locked cargo-fuzz
fi
bash "$(dirname "$0")/fetch-model.sh" >/dev/null
echo "setup done"
