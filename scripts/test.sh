#!/usr/bin/env bash
# Runs every check and test of the workspace: formatting, lints, unit, property, HTTP and
# process-level tests, and a short run of each fuzz target when cargo-fuzz is installed.
#
#   MESHNET_FUZZ_SECONDS=N   seconds per fuzz target (default 20; 0 skips fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test --workspace"
cargo test --workspace --locked

fuzz_seconds=${MESHNET_FUZZ_SECONDS:-20}
if [ "$fuzz_seconds" -gt 0 ]; then
  if cargo fuzz --version >/dev/null 2>&1; then
    for target in $(cd fuzz && cargo fuzz list); do
      step "cargo fuzz run $target (${fuzz_seconds}s)"
      mkdir -p "fuzz/corpus/$target"
      # libFuzzer needs nightly-only compiler flags; RUSTC_BOOTSTRAP lets the stable toolchain
      # accept them.
      (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "corpus/$target" "seeds/$target" \
        -- -max_total_time="$fuzz_seconds" -rss_limit_mb=2048)
    done
  else
    step "cargo-fuzz not installed: fuzz targets skipped (scripts/setup.sh installs it)"
  fi
fi

printf '\nall checks passed\n'
