#!/usr/bin/env bash
# Runs every check and test of the workspace: formatting, lints, unit, property, HTTP and
# process-level tests, and a short run of each fuzz target. A missing cargo-fuzz or a failing
# fuzz run fails the script; only MESHNET_FUZZ_SECONDS=0 skips fuzzing.
#
#   MESHNET_FUZZ_SECONDS=N   seconds per fuzz target (default 20; 0 skips fuzzing explicitly)
#   MESHNET_SKIP_MESH=1      skip the process-level mesh tests: the OpenAI client, /metrics,
#                            coverage-page and chat-panel (headless Chromium) checks against a
#                            local 3-process mesh, and the self-healing checks (testnet/chaos.py)
#                            on a 5-process mesh with redundancy 2
#   MESHNET_SKIP_NAT=1       skip the NAT testbed (testnet/nat.sh run: network namespaces, as
#                            root; without root, ip or iptables it is skipped with a loud note)
#   MESHNET_SKIP_DOCKER=1    skip the ten-peer Docker testnet (testnet/docker.sh smoke and
#                            chaos, then testnet/gemma_docker.sh: Gemma 3 under memory limits);
#                            without a Docker engine they are skipped with a loud note
#   MESHNET_VENV=DIR         virtualenv with the `openai`, `prometheus_client` and `jsonschema`
#                            packages (default .venv, made by setup.sh --dev)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s (at %d s)\n' "$*" "$SECONDS"; }

# Runs a check with a time limit, several times what it takes on a slow two-core machine, and
# kills its whole process group at the limit: a hung check fails the run with its name instead
# of stalling it.
bounded() {
  local limit=$1 rc=0
  shift
  timeout -k 30 "$limit" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    printf 'TIMED OUT: %s did not finish within %d s\n' "$*" "$limit" >&2
  fi
  return "$rc"
}

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test --workspace"
bounded 3600 cargo test --workspace --locked

# The faulty member (a test-only feature, ADR-0026): its lint, its unit tests and a mesh in
# which it lies. Only meshnet-peer is rebuilt with the feature.
step "the faulty member (feature faulty-member): clippy and tests"
cargo clippy --locked -p meshnet-peer --all-targets --features faulty-member -- -D warnings
bounded 900 cargo test --locked -p meshnet-peer --features faulty-member --lib --test faulty

# The tiny per-family GGUF files the parity tests read are written by a script from a seed; the
# committed bytes must still be what it writes (llama.cpp's logits beside them are not
# recomputed here: that needs llama.cpp built).
step "the family fixtures are what scripts/make_family_fixtures.py writes"
venv=${MESHNET_VENV:-.venv}
"$venv/bin/python" scripts/make_family_fixtures.py check crates/meshnet-model/tests/fixtures/families

# A hundred whole members in one process. The test build serves: its dependencies (libp2p,
# the codecs) are optimised; a release build would cost this run some 13 minutes more. Built
# with the workspace's features (`--workspace`), so nothing is compiled again; `-p` alone
# would resolve features apart and rebuild tokio and libp2p. The tracker's warnings (its own
# stalls, peers it dropped from its book as silent) are printed to explain a failure.
step "a hundred members in one process: converge, ten leave, re-cover"
RUST_LOG="${RUST_LOG:-meshnet_peer::tracker=warn}" \
  bounded 1800 cargo test --locked --workspace --test scale -- --ignored --nocapture

step "a 3-process mesh: the OpenAI client, structured output, /metrics, and the coverage page and chat in Chromium"
if [ "${MESHNET_SKIP_MESH:-0}" = 1 ]; then
  echo "skipped: MESHNET_SKIP_MESH=1"
else
  venv=${MESHNET_VENV:-.venv}
  if ! "$venv/bin/python" -c 'import openai, prometheus_client, jsonschema' >/dev/null 2>&1; then
    echo "no virtualenv with the openai, prometheus_client and jsonschema packages at $venv:" \
      "run scripts/setup.sh --dev first" >&2
    exit 1
  fi
  # A run directory of its own, so a testnet the user has up is left alone.
  MESHNET_TESTNET_DIR=$(mktemp -d)
  export MESHNET_TESTNET_DIR
  trap 'testnet/local.sh down || true; rm -rf "$MESHNET_TESTNET_DIR"' EXIT
  # The binary cargo test just built (a `cargo build -p meshnet-peer` would resolve features
  # apart from the workspace and rebuild much of the dependency tree).
  MESHNET_BIN=$PWD/target/debug/meshnet-peer testnet/local.sh up 3 | tee "$MESHNET_TESTNET_DIR/up.out"
  base_url=$(tail -n 1 "$MESHNET_TESTNET_DIR/up.out")
  bounded 300 "$venv/bin/python" scripts/openai_client_check.py "$base_url"
  # 22 schemas, greedy and sampled, every answer parsed and validated; json_object; the 400s.
  bounded 600 "$venv/bin/python" scripts/structured_output_check.py "$base_url"
  bounded 300 "$venv/bin/python" scripts/metrics_check.py "$base_url"
  # The page's DOM and screenshots stay under target/test-output/page for a look afterwards.
  bounded 300 python3 scripts/page_check.py "$base_url" --layers 30 --peers 3 --out target/test-output/page
  # The chat panel, driven in Chromium: streamed answers, their figures, errors.
  bounded 600 python3 scripts/chat_page_check.py "$base_url" --out target/test-output/chat-page
  testnet/local.sh down
  trap - EXIT
  rm -rf "$MESHNET_TESTNET_DIR"
  unset MESHNET_TESTNET_DIR
fi

step "emulated wide-area links: the link emulator's self-test (50 ms, 20 Mbit/s), then a 3-member mesh at 20 ms per link (HTTP and libp2p, no connection bypassing the relays) gives the text of the undelayed mesh: plain, with direct return, and with speculative decoding too; the same in network namespaces; of two holders at 10 and 150 ms the route takes the near one, and the far one once the near one died"
if [ "${MESHNET_SKIP_MESH:-0}" = 1 ]; then
  echo "skipped: MESHNET_SKIP_MESH=1"
else
  cargo build --locked -p meshnet-peer -p meshnet-linkem
  bounded 120 target/debug/meshnet-linkem selftest --delay-ms 50 --rate-kbit 20000
  MESHNET_BIN_DIR=$PWD/target/debug bounded 900 python3 testnet/wan.py --members 3 \
    --delay-ms 20 --tokens 16 --prompt copy --ladder --compare-undelayed
  if [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null 2>&1; then
    # Deletes its namespaces when it ends, also on failure.
    MESHNET_BIN_DIR=$PWD/target/debug bounded 600 python3 testnet/wan.py --netns --members 3 \
      --delay-ms 20 --tokens 16 --prompt copy --compare-undelayed
  else
    echo "SKIPPED: testnet/wan.py --netns needs root and iproute2"
  fi
  MESHNET_BIN_DIR=$PWD/target/debug bounded 600 python3 testnet/near_far.py --near-ms 10 \
    --far-ms 150
fi

step "Gemma 3 (Q4_K_M) through a 3-process mesh answers exactly like generate"
if [ "${MESHNET_SKIP_MESH:-0}" = 1 ]; then
  echo "skipped: MESHNET_SKIP_MESH=1"
else
  MESHNET_BIN=$PWD/target/debug/meshnet-peer bounded 900 testnet/gemma_check.sh
fi

step "self-healing: chaos, SIGTERM, SIGSTOP and tracker loss on a 5-process mesh, redundancy 2"
if [ "${MESHNET_SKIP_MESH:-0}" = 1 ]; then
  echo "skipped: MESHNET_SKIP_MESH=1"
else
  # A tracker and two groups of two peers, each group sized for the same span: every
  # non-tracker layer has two holders. chaos.py kills a peer mid-stream 20 times (restarting it
  # each time), SIGTERMs one and SIGSTOPs one; every stream must finish equal to an unbroken
  # one. Last,
  # it kills the tracker: a client talking to another member must get answers again within
  # 10 s, and the restarted old tracker must join as a peer.
  MESHNET_TESTNET_DIR=$(mktemp -d)
  export MESHNET_TESTNET_DIR
  trap 'testnet/local.sh down || true; rm -rf "$MESHNET_TESTNET_DIR"' EXIT
  MESHNET_BIN=$PWD/target/debug/meshnet-peer testnet/local.sh up 5 --redundancy 2
  # Every check runs, so one CI log shows them all; any failing fails the step.
  healing_failed=0
  bounded 1500 python3 testnet/chaos.py chaos --runs 20 || healing_failed=1
  bounded 300 python3 testnet/chaos.py sigterm || healing_failed=1
  bounded 300 python3 testnet/chaos.py stop || healing_failed=1
  bounded 300 python3 testnet/chaos.py tracker || healing_failed=1
  testnet/local.sh down
  trap - EXIT
  rm -rf "$MESHNET_TESTNET_DIR"
  unset MESHNET_TESTNET_DIR
  if [ "$healing_failed" -ne 0 ]; then
    echo "self-healing checks failed (see chaos.py's output above)" >&2
    exit 1
  fi
fi

step "behind NAT: a tracker and three peers behind NAT routers in network namespaces"
if [ "${MESHNET_SKIP_NAT:-0}" = 1 ]; then
  echo "skipped: MESHNET_SKIP_NAT=1"
elif [ "$(id -u)" -ne 0 ] || ! command -v ip >/dev/null 2>&1 ||
  ! command -v iptables >/dev/null 2>&1; then
  # Loud, so a CI log shows it.
  echo "##############################################################################"
  echo "SKIPPED: the NAT testbed needs root, iproute2 and iptables (scripts/setup.sh"
  echo "--dev installs them): testnet/nat.sh did not run"
  echo "##############################################################################"
else
  # Removes its namespaces and processes on exit, also when a check fails.
  MESHNET_BIN=$PWD/target/debug/meshnet-peer bounded 900 testnet/nat.sh run
fi

step "ten-peer Docker testnet: smoke and chaos"
if [ "${MESHNET_SKIP_DOCKER:-0}" = 1 ]; then
  echo "skipped: MESHNET_SKIP_DOCKER=1"
elif ! command -v docker >/dev/null 2>&1 || ! timeout -k 5 60 docker info >/dev/null 2>&1; then
  # Loud, so a CI log shows it; the tests that need no engine still ran.
  echo "##############################################################################"
  echo "SKIPPED: no Docker engine answers (docker info failed): the Docker testnet"
  echo "checks did not run"
  echo "##############################################################################"
else
  # The image packages the binary cargo test built (stripped), with the shared libraries it
  # links, FROM scratch; testnet/docker.sh down --image removes containers, network, volumes
  # and the image, also when a check fails.
  MESHNET_DOCKER_DIR=$(mktemp -d)
  export MESHNET_DOCKER_DIR
  trap 'testnet/docker.sh down --image || true; rm -rf "$MESHNET_DOCKER_DIR"' EXIT
  docker_failed=0
  # The image packages meshnet-linkem from beside the binary too (for `up --delay-ms`).
  cargo build --locked -p meshnet-linkem
  MESHNET_BIN=$PWD/target/debug/meshnet-peer bounded 900 testnet/docker.sh up || docker_failed=1
  if [ "$docker_failed" -eq 0 ]; then
    bounded 600 testnet/docker.sh smoke || docker_failed=1
    bounded 1500 testnet/docker.sh chaos || docker_failed=1
  fi
  step "the Docker testnet behind emulated links: every member behind its own 20 ms relay (HTTP and libp2p), the chat equal to generate"
  testnet/docker.sh down >/dev/null
  MESHNET_BIN=$PWD/target/debug/meshnet-peer bounded 900 testnet/docker.sh up --delay-ms 20 ||
    docker_failed=1
  [ "$docker_failed" -ne 0 ] || bounded 600 testnet/docker.sh smoke || docker_failed=1
  # Then Gemma 3 on the same ten containers, each limited below the whole model's resident size
  # (measured first, in this run): a model no single member could hold, served by the mesh.
  step "Gemma 3 on the Docker testnet, every container's memory below the whole model's"
  testnet/docker.sh down >/dev/null
  MESHNET_BIN=$PWD/target/debug/meshnet-peer bounded 900 testnet/gemma_docker.sh || docker_failed=1
  if [ "$docker_failed" -ne 0 ]; then
    # Keep the container logs docker.sh collected where the CI log can name them.
    kept=$(mktemp -d /tmp/meshnet-docker-logs.XXXXXX)
    cp -r "$MESHNET_DOCKER_DIR"/logs-* "$kept"/ 2>/dev/null || true
    echo "Docker testnet checks failed; container logs kept in $kept" >&2
  fi
  testnet/docker.sh down --image
  trap - EXIT
  rm -rf "$MESHNET_DOCKER_DIR"
  unset MESHNET_DOCKER_DIR
  [ "$docker_failed" -eq 0 ] || exit 1
fi

fuzz_seconds=${MESHNET_FUZZ_SECONDS:-20}
# The memory a fuzz run may use (libFuzzer's -rss_limit_mb, also its largest single malloc),
# from what the decoders promise per input, in MB:
#   128  zstd's decoder window: the decoder accepts windows up to 2^27 bytes
#        (ZSTD_WINDOWLOG_LIMIT_DEFAULT) whatever the shape declares;
#     8  frame_decode's frame limit (`Limits { max_frame_bytes: 1 << 20 }`, 1 MiB) for each copy
#        it holds at once: decoded values, re-encoded body, values decoded again, two bit
#        vectors, with room to spare (control messages are bounded by the input, a few kB);
#        (gguf_header holds at most about 33 bytes per input byte, candle's parsed metadata
#        and the tensors it reads, a fraction of an MB for libFuzzer's 4 KiB inputs);
#   256  AddressSanitizer's quarantine of freed memory (its default on 64-bit targets);
#   128  libFuzzer, ASan's shadow memory and runtime, and the corpus held in memory.
fuzz_rss_limit_mb=$((128 + 8 + 256 + 128))
if [ "$fuzz_seconds" -gt 0 ]; then
  if cargo fuzz --version >/dev/null 2>&1; then
    # An assignment, so a failing `cargo fuzz list` stops the script (a failing command
    # substitution in a `for` list would not).
    targets=$(cd fuzz && cargo fuzz list)
    if [ -z "$targets" ]; then
      echo "cargo fuzz list found no fuzz targets" >&2
      exit 1
    fi
    for target in $targets; do
      step "cargo fuzz run $target (${fuzz_seconds}s)"
      mkdir -p "fuzz/corpus/$target"
      # libFuzzer needs nightly-only compiler flags; RUSTC_BOOTSTRAP lets the stable toolchain
      # accept them.
      # -timeout: an input that keeps a decoder busy for a minute is a finding (libFuzzer saves
      # it and fails), not a reason to wait for libFuzzer's default of twenty minutes.
      # --dev: unoptimised, with debug assertions and overflow checks (and AddressSanitizer):
      # an optimised build of the targets' dependencies (candle, the tokenizers) was most of
      # this step's time, for twenty seconds of fuzzing per target.
      (cd fuzz && RUSTC_BOOTSTRAP=1 bounded 1500 cargo fuzz run --dev "$target" "corpus/$target" \
        "seeds/$target" -- -max_total_time="$fuzz_seconds" -timeout=60 \
        -rss_limit_mb="$fuzz_rss_limit_mb")
    done
  else
    echo "cargo-fuzz is not installed: run scripts/setup.sh --dev to install it," \
      "or set MESHNET_FUZZ_SECONDS=0 to skip fuzzing explicitly" >&2
    exit 1
  fi
else
  step "fuzzing skipped: MESHNET_FUZZ_SECONDS=0"
fi

printf '\nall checks passed in %d s\n' "$SECONDS"
