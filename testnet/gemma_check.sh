#!/usr/bin/env bash
# Gemma 3 through a 3-process mesh: a tracker and two peers on 127.0.0.1 serve the Gemma 3 270M
# Q4_K_M file (scripts/fetch-model.sh gemma3-270m); a greedy chat through the OpenAI API must
# give exactly the text `meshnet-peer generate --chat --boundaries` gives on the same file with
# the mesh's own boundaries (the same bf16 casts at the same layers), and /v1/models must name
# the family and the format. The mesh is stopped on exit, also when a check fails.
#
#   MESHNET_BIN   the meshnet-peer binary (default: testnet/local.sh builds the release one)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
model=$(bash "$repo/scripts/fetch-model.sh" gemma3-270m | tail -n 1)
MESHNET_TESTNET_DIR=$(mktemp -d)
export MESHNET_TESTNET_DIR
trap '"$repo/testnet/local.sh" down >/dev/null 2>&1 || true; rm -rf "$MESHNET_TESTNET_DIR"' EXIT
"$repo/testnet/local.sh" up 3 -- --model "$model" | tee "$MESHNET_TESTNET_DIR/up.out"
base_url=$(tail -n 1 "$MESHNET_TESTNET_DIR/up.out")
bin=${MESHNET_BIN:-$repo/target/release/meshnet-peer}
python3 - "$base_url" "$bin" "$model" <<'PY'
import json, subprocess, sys, urllib.request

base_url, binary, model = sys.argv[1:4]
question = "What is the capital of France?"

def get(path):
    with urllib.request.urlopen(base_url + path, timeout=60) as answer:
        return json.load(answer)

listed = get("/models")["data"][0]
assert listed["family"] == "gemma3", listed
assert listed["quantization"] == "q4_k_m", listed
status = json.load(urllib.request.urlopen(base_url.removesuffix("/v1") + "/status", timeout=60))
boundaries = status["route_boundaries"]
body = json.dumps({
    "model": listed["id"],
    "messages": [{"role": "user", "content": question}],
    "max_tokens": 24,
    "temperature": 0,
}).encode()
request = urllib.request.Request(base_url + "/chat/completions", body,
                                 {"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=300) as answer:
    mesh = json.load(answer)["choices"][0]["message"]["content"]
alone = subprocess.run(
    [binary, "generate", "--model", model, "--chat", "--prompt", question, "--max-tokens", "24",
     "--boundaries", ",".join(str(b) for b in boundaries)],
    check=True, capture_output=True, text=True, timeout=600,
).stdout.removesuffix("\n")
print(f"boundaries {boundaries}\nmesh:     {mesh!r}\ngenerate: {alone!r}")
if mesh != alone:
    sys.exit("the mesh's answer differs from generate's")
print("Gemma 3 through the mesh answers exactly like generate")
PY
