#!/usr/bin/env bash
# Sets up meshnet, starts a local mesh of three processes (a tracker and two peers, each holding a
# third of the model's layers), asks it one chat question through the OpenAI-style API, and
# leaves the mesh running. Stop it with `testnet/local.sh down`. It installs only what running
# needs (scripts/setup.sh without --dev: the model; testnet/local.sh builds the release binary).
#
#   MESHNET_SKIP_SETUP=1   skip scripts/setup.sh
#   MESHNET_PROFILE, MESHNET_HTTP_PORT, ...: see testnet/local.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${MESHNET_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi

up_out=$(mktemp)
mesh_started=0
cleanup() {
  rm -f "$up_out"
  if [ "$mesh_started" = 1 ]; then
    echo "quickstart failed: stopping the mesh" >&2
    testnet/local.sh down || true
  fi
}
trap cleanup EXIT

# local.sh stops what it started when `up` fails; from here on, a failure stops the mesh.
testnet/local.sh up 3 | tee "$up_out"
mesh_started=1
base_url=$(tail -n 1 "$up_out")

model=$(curl -sSf "$base_url/models" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
question="What is the capital of France?"
request=$(python3 -c 'import json, sys
print(json.dumps({"model": sys.argv[1], "temperature": 0, "max_tokens": 32,
                  "messages": [{"role": "user", "content": sys.argv[2]}]}))' "$model" "$question")
answer=$(curl -sSf "$base_url/chat/completions" -H 'Content-Type: application/json' -d "$request" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])')
mesh_started=0
if [ -n "${MESHNET_BIN:-}" ]; then
  bin=$MESHNET_BIN
elif [ "${MESHNET_PROFILE:-release}" = debug ]; then
  bin=target/debug/meshnet-peer
else
  bin=target/release/meshnet-peer
fi

cat <<EOF

Q: $question
A: $answer

The mesh is still running. Talk to it at the OpenAI base URL $base_url, e.g.

  curl $base_url/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$model", "messages": [{"role": "user", "content": "Hello!"}]}'

or, with the openai Python package (any API key is accepted):

  from openai import OpenAI
  client = OpenAI(base_url="$base_url", api_key="meshnet")

Watch it: open ${base_url%/v1}/ in a browser (the live coverage page), or run
  $bin status --url ${base_url%/v1}
Chat with it in the terminal:
  $bin chat --url ${base_url%/v1}

Status: testnet/local.sh status    Stop: testnet/local.sh down
EOF
