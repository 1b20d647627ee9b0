#!/usr/bin/env bash
# Gemma 3 on the ten-member Docker testnet with every container's memory limited below what the
# whole model needs resident: the model is served by a mesh none of its members could hold.
#
# It measures the peak resident memory of `meshnet-peer generate` running the whole model in one
# process (the least any single member serving it would need), refuses limits that are not below
# it, starts the testnet with those limits (testnet/docker.sh up --model …), and runs its smoke
# check: the chat equals `generate --chat --boundaries` at the mesh's boundaries and no container
# was OOM-killed. The testnet is removed on exit, also when a check fails.
#
#   MESHNET_BIN                the meshnet-peer binary (default: testnet/docker.sh builds one)
#   MESHNET_TRACKER_MEM_LIMIT  the tracker's container limit (default 330m: the embedding table,
#                              which a tied LM head shares, is most of the model)
#   MESHNET_PEER_MEM_LIMIT     every peer's container limit (default 160m)
#   MESHNET_IMAGE, MESHNET_DOCKER_DIR, MESHNET_DOCKER_PORT, MESHNET_VENV: as for docker.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
tracker_limit=${MESHNET_TRACKER_MEM_LIMIT:-330m}
peer_limit=${MESHNET_PEER_MEM_LIMIT:-160m}

say() { printf 'gemma_docker.sh: %s\n' "$*" >&2; }

# mebibytes SIZE: docker's memory units (b, k, m, g; none is bytes) in MiB.
mebibytes() {
  python3 - "$1" <<'PY'
import re, sys
match = re.fullmatch(r"(\d+)([bkmg]?)", sys.argv[1].lower())
if not match:
    sys.exit(f"not a memory size in docker's units: {sys.argv[1]!r}")
scale = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match[2]]
print(int(match[1]) * scale // 2**20)
PY
}

model=$(bash "$repo/scripts/fetch-model.sh" gemma3-270m | tail -n 1)
bin=${MESHNET_BIN:-}
if [ -z "$bin" ]; then
  (cd "$repo" && cargo build --locked --release -p meshnet-peer) >&2
  bin=$repo/target/release/meshnet-peer
fi

# The whole model in one process: its peak resident set, in MiB.
whole=$(python3 - "$bin" "$model" <<'PY'
import resource, subprocess, sys
binary, model = sys.argv[1:3]
subprocess.run([binary, "generate", "--model", model, "--prompt", "The capital of France is",
                "--max-tokens", "8"], check=True, capture_output=True, timeout=600)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
PY
)
tracker_mib=$(mebibytes "$tracker_limit")
peer_mib=$(mebibytes "$peer_limit")
say "the whole model in one process peaks at $whole MiB resident; limits: tracker" \
  "$tracker_mib MiB, each peer $peer_mib MiB"
if [ "$tracker_mib" -ge "$whole" ] || [ "$peer_mib" -ge "$whole" ]; then
  say "a limit is not below the whole model's $whole MiB: this would not show a mesh that no" \
    "single member could hold"
  exit 1
fi

MESHNET_DOCKER_DIR=${MESHNET_DOCKER_DIR:-$(mktemp -d)}
export MESHNET_DOCKER_DIR MESHNET_BIN=$bin
trap '"$here/docker.sh" down >/dev/null 2>&1 || true' EXIT
"$here/docker.sh" up --model "$model" --tracker-mem-limit "$tracker_limit" \
  --peer-mem-limit "$peer_limit"
"$here/docker.sh" smoke
