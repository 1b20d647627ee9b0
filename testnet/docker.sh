#!/usr/bin/env bash
# A ten-member meshnet testnet in Docker: a tracker and nine peers, each its own container with
# its own address on one compose network (testnet/docker-compose.yml).
#
#   testnet/docker.sh build    build the image FROM scratch (no registry, no base image)
#   testnet/docker.sh up [--model FILE] [--tracker-mem-limit SIZE] [--peer-mem-limit SIZE]
#                        [--private] [--delay-ms D [--rate-kbit R] [--jitter-ms J]]
#                              build if needed, start the ten, wait for coverage; the last line
#                              printed is the OpenAI base URL on this host (the flags override
#                              MESHNET_MODEL and the two MEM_LIMIT variables below); --private
#                              makes one swarm key (run directory's swarm.key) and starts every
#                              member with --swarm-key: a private mesh; --delay-ms puts an
#                              emulated link (meshnet-linkem relay, D ms one-way, R kbit/s) in
#                              front of every member: a relay container in the member's network
#                              namespace takes its other ports (9080 for HTTP, 5001 for libp2p)
#                              and every member advertises those and bootstraps from them, so
#                              traffic between members crosses their relays (the host's API port
#                              still reaches the tracker directly); not for `chaos`
#   testnet/docker.sh smoke    ten members, complete coverage, and the OpenAI client's chat equal
#                              to `meshnet-peer generate --chat --boundaries` at the tracker's
#                              boundaries
#   testnet/docker.sh chaos    streaming chats while two peers are killed, one paused and one cut
#                              off the network; then they return and the mesh must be whole again
#   testnet/docker.sh status   the containers, then the tracker's members and spans
#   testnet/docker.sh logs     every container's log into one folder (printed)
#   testnet/docker.sh down     remove the containers, the network and volumes (--image: the
#                              image too); idempotent
#
# Environment:
#   MESHNET_BIN            the meshnet-peer binary to package (default: cargo build --release);
#                          meshnet-linkem beside it is packaged too when it is there
#   MESHNET_PROFILE        release (default) or debug, when MESHNET_BIN is not set
#   MESHNET_MODEL          the GGUF model file (default: scripts/fetch-model.sh's)
#   MESHNET_DOCKER_DIR     run directory: env file, image context, logs (default
#                          $TMPDIR/meshnet-docker)
#   MESHNET_DOCKER_PORT    host port of the tracker's API (default 8090)
#   MESHNET_TRACKER_MEM_LIMIT, MESHNET_PEER_MEM_LIMIT
#                          container memory limits of the tracker and of each peer (docker's
#                          units, e.g. 400m; default none); smoke fails if any container was
#                          OOM-killed
#   MESHNET_DOCKER_NET     first three octets of the compose network's /24 (default 10.213.0)
#   MESHNET_DOCKER_TIMEOUT seconds `up` waits for the mesh (default 240)
#   MESHNET_IMAGE          image name (default meshnet-peer:testnet)
#   MESHNET_VENV           virtualenv with the openai package, for smoke (default .venv)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
compose_file=$here/docker-compose.yml
run_dir=${MESHNET_DOCKER_DIR:-${TMPDIR:-/tmp}/meshnet-docker}
env_file=$run_dir/compose.env
# With `up --private`: the swarm key, and the compose file that hands it to every member.
key_file=$run_dir/swarm.key
private_file=$run_dir/private.yml
# With `up --delay-ms`: the compose file of the emulated links.
links_file=$run_dir/links.yml
state_file=$run_dir/state
project=meshnet-testnet
image=${MESHNET_IMAGE:-meshnet-peer:testnet}
host_port=${MESHNET_DOCKER_PORT:-8090}
net=${MESHNET_DOCKER_NET:-10.213.0}
timeout=${MESHNET_DOCKER_TIMEOUT:-240}
peers=9
services=(tracker peer1 peer2 peer3 peer4 peer5 peer6 peer7 peer8 peer9)
private=0
link_shape=()

say() { printf 'docker.sh: %s\n' "$*" >&2; }
die() {
  say "$*"
  exit 1
}

usage() {
  sed -n '2,44p' "$0" | sed 's/^# \{0,1\}//'
}

# The compose tool: the standalone docker-compose, else the docker compose plugin.
compose_cmd=()
find_compose() {
  if command -v docker-compose >/dev/null 2>&1; then
    compose_cmd=(docker-compose)
  elif docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
  else
    die "neither docker-compose nor the docker compose plugin is installed"
  fi
}

compose() {
  local files=(-f "$compose_file")
  [ ! -f "$private_file" ] || files+=(-f "$private_file")
  [ ! -f "$links_file" ] || files+=(-f "$links_file")
  "${compose_cmd[@]}" -p "$project" "${files[@]}" --env-file "$env_file" "$@"
}

# write_private: a new swarm key, and a compose file that mounts it in every member and puts
# --swarm-key before the member's own arguments (the image has no shell to add it otherwise).
write_private() {
  rm -f "$key_file" "$private_file"
  "$bin" swarm-key new --out "$key_file" >&2 || die "meshnet-peer swarm-key new failed"
  {
    echo "# Written by testnet/docker.sh up --private: every member holds the swarm key."
    echo 'version: "2.4"'
    echo "services:"
    local service
    for service in "${services[@]}"; do
      echo "  $service:"
      echo '    entrypoint: ["/usr/local/bin/meshnet-peer", "--swarm-key", "/keys/swarm.key"]'
      echo "    volumes:"
      echo "      - $key_file:/keys/swarm.key:ro"
    done
  } >"$private_file"
}

# member_command K: the JSON command of member K (0 the tracker) behind its link: its own
# ports as in docker-compose.yml, the relay's advertised and bootstrapped from.
member_command() {
  local k=$1 ip="\${MESHNET_DOCKER_NET:-10.213.0}.1$1" role memory others
  if [ "$k" = 0 ]; then
    role='"--tracker", '
    memory='${MESHNET_TRACKER_MEMORY}'
    others=(1)
  else
    role=''
    memory='${MESHNET_PEER_MEMORY}'
    others=(0 $((k == 1 ? 2 : 1)))
  fi
  local bootstrap="" other
  for other in "${others[@]}"; do
    bootstrap+=", \"--bootstrap\", \"/ip4/\${MESHNET_DOCKER_NET:-10.213.0}.1$other/tcp/5001\""
  done
  printf '[%s"--model", "/models/${MESHNET_MODEL_FILE}", "--memory", "%s", ' "$role" "$memory"
  printf '"--http", "0.0.0.0:8080", "--advertise-http", "http://%s:9080", ' "$ip"
  printf '"--p2p", "/ip4/0.0.0.0/tcp/4001", "--advertise-p2p", "/ip4/%s/tcp/5001"%s, ' \
    "$ip" "$bootstrap"
  printf '"--reachable", "--announce-interval", "0.5"]'
}

# write_links: a compose file that starts every member behind its relay (see `up --delay-ms`).
write_links() {
  rm -f "$links_file"
  local shape k
  shape=$(printf ', "%s"' "${link_shape[@]}")
  {
    echo "# Written by testnet/docker.sh up --delay-ms: every member behind an emulated link."
    echo 'version: "2.4"'
    echo "services:"
    for ((k = 0; k < ${#services[@]}; k++)); do
      echo "  ${services[$k]}:"
      echo "    command: $(member_command "$k")"
      echo "  ${services[$k]}-link:"
      echo '    image: ${MESHNET_IMAGE:-meshnet-peer:testnet}'
      echo '    restart: "no"'
      echo "    network_mode: \"service:${services[$k]}\""
      echo '    entrypoint: ["/usr/local/bin/meshnet-linkem"]'
      printf '    command: ["relay", "--link", "0.0.0.0:9080=127.0.0.1:8080", '
      printf '"--link", "0.0.0.0:5001=127.0.0.1:4001"%s]\n' "$shape"
    done
  } >"$links_file"
}

# start_member SERVICE: starts it, and its relay when the members are behind links.
start_member() {
  compose up -d --no-deps "$1" >/dev/null 2>&1 || return 1
  [ ! -f "$links_file" ] || compose up -d --no-deps "$1-link" >/dev/null 2>&1
}

# Fails loudly when no Docker engine answers (status 3, so callers can tell it apart).
require_engine() {
  command -v docker >/dev/null 2>&1 || {
    say "docker is not installed: no Docker engine to run the testnet on"
    exit 3
  }
  if ! timeout -k 5 60 docker info >/dev/null 2>&1; then
    say "no Docker engine answers (docker info failed or took over 60s): start dockerd, or" \
      "check access to its socket"
    exit 3
  fi
  find_compose
}

# The binary to package and to run model-info and generate with on the host.
resolve_bin() {
  if [ -n "${MESHNET_BIN:-}" ]; then
    [ -x "$MESHNET_BIN" ] || die "MESHNET_BIN=$MESHNET_BIN is not an executable file"
    bin=$(cd "$(dirname "$MESHNET_BIN")" && pwd)/$(basename "$MESHNET_BIN")
    return
  fi
  local profile=${MESHNET_PROFILE:-release} flags=()
  case "$profile" in
    release) flags=(--release) ;;
    debug) ;;
    *) die "MESHNET_PROFILE must be release or debug, got '$profile'" ;;
  esac
  say "building meshnet-peer ($profile)"
  (cd "$repo" && cargo build --locked -p meshnet-peer -p meshnet-linkem \
    "${flags[@]+"${flags[@]}"}") >&2 ||
    die "cargo build failed"
  bin=$repo/target/$profile/meshnet-peer
}

resolve_model() {
  if [ -n "${MESHNET_MODEL:-}" ]; then
    model=$MESHNET_MODEL
  else
    model=$(bash "$repo/scripts/fetch-model.sh" | tail -n 1) || die "scripts/fetch-model.sh failed"
  fi
  [ -f "$model" ] || die "the model file $model does not exist"
  model=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
}

# The digest of what an image of the binary `$1` packages (meshnet-linkem beside it too).
binary_digest() {
  local linkem
  linkem=$(dirname "$1")/meshnet-linkem
  if [ -x "$linkem" ]; then
    cat "$1" "$linkem" | sha256sum | cut -c1-64
  else
    sha256sum "$1" | cut -c1-64
  fi
}

# build: stages rootfs/ with the binary (debug info stripped) and the shared libraries `ldd`
# names at their own paths, then `docker build`s FROM scratch.
build() {
  require_engine
  resolve_bin
  local context=$run_dir/image
  rm -rf "$context"
  mkdir -p "$context/rootfs/usr/local/bin" "$context/rootfs/data" "$context/rootfs/models"
  cp "$here/docker/Dockerfile" "$context/Dockerfile"
  local target=$context/rootfs/usr/local/bin/meshnet-peer
  if command -v strip >/dev/null 2>&1; then
    strip --strip-debug -o "$target" "$bin"
  else
    cp "$bin" "$target"
  fi
  local libs lib packaged=("$bin")
  if [ -x "$(dirname "$bin")/meshnet-linkem" ]; then
    packaged+=("$(dirname "$bin")/meshnet-linkem")
    cp "${packaged[1]}" "$context/rootfs/usr/local/bin/meshnet-linkem"
  fi
  # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and "/lib64/ld-linux-x86-64.so.2
  # (0x...)"; a static binary has none.
  libs=$(for lib in "${packaged[@]}"; do ldd "$lib" 2>/dev/null || true; done |
    awk '/=> \//{print $3} /^\t\//{print $1}' | sort -u)
  for lib in $libs; do
    mkdir -p "$context/rootfs$(dirname "$lib")"
    cp -L "$lib" "$context/rootfs$lib"
  done
  local digest
  digest=$(binary_digest "$bin")
  say "building image $image from $bin ($(echo "$libs" | grep -c . || true) shared libraries)"
  docker build -q --label "meshnet.binary-sha256=$digest" -t "$image" "$context" >/dev/null ||
    die "docker build failed"
  rm -rf "$context"
  local size
  size=$(docker image inspect -f '{{.Size}}' "$image")
  say "image $image: $((size / 1024 / 1024)) MiB"
}

# Builds the image unless one built from the same binary exists.
build_if_needed() {
  resolve_bin
  local have=""
  have=$(docker image inspect -f '{{index .Config.Labels "meshnet.binary-sha256"}}' "$image" \
    2>/dev/null || true)
  if [ "$have" = "$(binary_digest "$bin")" ]; then
    say "image $image is up to date with $bin"
  else
    MESHNET_BIN=$bin build
  fi
}

json_field() {
  python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"
}

# budget LAYERS [--tracker]: the --memory that holds exactly LAYERS layers.
budget() {
  local out
  out=$("$bin" model-info --model "$model" --layers "$@") ||
    die "meshnet-peer model-info --layers $* failed"
  json_field "$out" memory_for_layers
}

# The layout: the nine peers form three groups of three, each group sized for a third of the
# layers after the tracker's; the tracker takes as many layers as leave every peer's budget room
# for the tracker's part (any peer can take over), so every layer outside the tracker's has three
# holders with the same boundaries.
plan_budgets() {
  local info layers groups=3 t best=""
  info=$("$bin" model-info --model "$model") || die "meshnet-peer model-info failed"
  layers=$(json_field "$info" layers)
  [ "$layers" -ge 4 ] || die "the model has $layers layers; the testnet needs at least 4"
  for ((t = layers - groups; t >= 1; t--)); do
    [ $(((layers - t) % groups)) -eq 0 ] || continue
    tracker_memory=$(budget "$t" --tracker)
    peer_memory=$(budget $(((layers - t) / groups)))
    if [ "$peer_memory" -ge "$tracker_memory" ]; then
      best=$t
      break
    fi
  done
  if [ -z "$best" ]; then
    # No layout lets a peer take over; give the tracker a third of the layers anyway.
    t=$(((layers / (groups + 1)) - ((layers - layers / (groups + 1)) % groups)))
    [ "$t" -ge 1 ] || t=$((layers % groups == 0 ? groups : layers % groups))
    best=$t
    tracker_memory=$(budget "$t" --tracker)
    peer_memory=$(budget $(((layers - t) / groups)))
    say "note: no layout leaves the peers room for the tracker's part; a peer cannot take over"
  fi
  tracker_layers=$best
  group_layers=$(((layers - best) / groups))
  model_layers=$layers
}

tracker_url() { printf 'http://127.0.0.1:%s' "$host_port"; }

port_is_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

http_code() {
  curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" 2>/dev/null || true
}

container_of() {
  compose ps -q "$1" 2>/dev/null | head -n 1
}

# collect_logs [DIR]: every container's log into DIR (default a new folder in the run dir).
collect_logs() {
  local dir=${1:-$run_dir/logs-$(date +%Y%m%d-%H%M%S)} name id
  mkdir -p "$dir"
  for name in "${services[@]}"; do
    id=$(container_of "$name")
    [ -n "$id" ] || continue
    docker logs --timestamps "$id" >"$dir/$name.log" 2>&1 || true
    docker inspect "$id" >"$dir/$name.inspect.json" 2>/dev/null || true
  done
  compose ps >"$dir/ps.txt" 2>&1 || true
  curl -s -m 5 "$(tracker_url)/status" >"$dir/tracker-status.json" 2>/dev/null || true
  say "container logs in $dir"
  printf '%s\n' "$dir"
}

write_state() {
  local name id ip k network port=8080
  # Behind links, members advertise their relay's port.
  [ ! -f "$links_file" ] || port=9080
  network=$(docker inspect -f '{{range $name, $_ := .NetworkSettings.Networks}}{{$name}} {{end}}' \
    "$(container_of tracker)" | awk '{print $1}')
  {
    printf 'base_url=%s/v1\ntracker_http=%s\nnetwork=%s\nnet=%s\nbin=%s\nmodel=%s\n' \
      "$(tracker_url)" "$(tracker_url)" "$network" "$net" "$bin" "$model"
    printf 'layers=%s\ntracker_layers=%s\ngroup_layers=%s\n' \
      "$model_layers" "$tracker_layers" "$group_layers"
    for ((k = 0; k < ${#services[@]}; k++)); do
      name=${services[k]}
      id=$(container_of "$name")
      ip=$net.$((10 + k))
      printf 'member=%s %s %s http://%s:%s\n' "$name" "$id" "$ip" "$ip" "$port"
    done
  } >"$state_file"
}

# The tracker's /status satisfies the Python condition CONDITION (a function of `s`, the status,
# `want`, the number of peers, and `layers`).
status_check() {
  local status
  status=$(curl -sf -m 2 "$(tracker_url)/status" 2>/dev/null) || return 1
  python3 - "$status" "$1" "$2" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
want = int(sys.argv[3])
cov = s.get("coverage") or {}
peers = s.get("peers") or []
own = (s.get("span") or {}).get("layers") or [0, 0]
ready = [p for p in peers if (p.get("span") or {}).get("state") == "ready" and not p.get("leaving")]
def holders(layer):
    return [h for h in layer.get("holders") or [] if h.get("state") == "ready"]
layers = [l for l in cov.get("layers") or [] if l["layer"] >= own[1]]
ok = {
    "listed": len(ready) >= want,
    "covered": bool(cov.get("complete")) and s.get("route_boundaries") is not None,
    "redundant": bool(layers) and all(len(holders(l)) >= 2 for l in layers),
}[sys.argv[2]]
sys.exit(0 if ok else 1)
PY
}

print_layout() {
  local status
  status=$(curl -sf -m 5 "$(tracker_url)/status") || die "the tracker does not answer /status"
  python3 - "$status" "$state_file" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
names = {}
for line in open(sys.argv[2]):
    if line.startswith("member="):
        name, _, _, http = line[len("member="):].split()
        names[http] = name
print(f"meshnet docker testnet: {s['model']['id']}, {s['model']['layers']} layers, "
      f"route boundaries {s.get('route_boundaries')}")
span = (s.get("span") or {})
rows = [(names.get(s["http"], "tracker"), s["http"], span.get("layers"), span.get("state"))]
for p in sorted(s.get("peers") or [], key=lambda p: names.get(p.get("http"), p.get("http") or "")):
    sp = p.get("span") or {}
    rows.append((names.get(p.get("http"), "?"), p.get("http"), sp.get("layers"), sp.get("state")))
for name, http, layers, state in rows:
    span_text = f"{layers[0]:>2}-{layers[1]:<2}" if layers else "  -  "
    print(f"  {name:<8} {http:<26} layers {span_text} {state or '-'}")
PY
}

# parse_up_flags ARGS...: `up`'s flags, into the variables they override.
parse_up_flags() {
  while [ "$#" -gt 0 ]; do
    case "$1" in
      --model | --tracker-mem-limit | --peer-mem-limit)
        [ "$#" -ge 2 ] && [ -n "$2" ] || die "up: $1 needs a value"
        case "$1" in
          --model) MESHNET_MODEL=$2 ;;
          --tracker-mem-limit) MESHNET_TRACKER_MEM_LIMIT=$2 ;;
          --peer-mem-limit) MESHNET_PEER_MEM_LIMIT=$2 ;;
        esac
        shift 2
        ;;
      --private)
        private=1
        shift
        ;;
      --delay-ms | --rate-kbit | --jitter-ms)
        [ "$#" -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] || die "up: $1 needs a whole number"
        link_shape+=("$1" "$2")
        shift 2
        ;;
      *) die "up: unknown argument '$1' (flags: --model FILE, --tracker-mem-limit SIZE, --peer-mem-limit SIZE, --private, --delay-ms D, --rate-kbit R, --jitter-ms J)" ;;
    esac
  done
}

up() {
  parse_up_flags "$@"
  require_engine
  mkdir -p "$run_dir"
  if [ -f "$env_file" ] && [ -n "$(compose ps -q 2>/dev/null)" ]; then
    die "a testnet is already up (project $project): run 'testnet/docker.sh down' first"
  fi
  port_is_free "$host_port" ||
    die "port $host_port on this host is in use: set MESHNET_DOCKER_PORT to a free one"
  resolve_model
  build_if_needed
  plan_budgets
  rm -f "$private_file" "$links_file"
  if [ "${#link_shape[@]}" -gt 0 ]; then
    [ -x "$(dirname "$bin")/meshnet-linkem" ] ||
      die "up --delay-ms: no meshnet-linkem beside $bin (cargo build -p meshnet-linkem)"
    write_links
    say "every member behind an emulated link: ${link_shape[*]}"
  fi
  if [ "$private" -eq 1 ]; then
    write_private
    say "private mesh: every member gets --swarm-key ($key_file)"
  fi
  {
    printf 'MESHNET_IMAGE=%s\nMESHNET_MODEL_DIR=%s\nMESHNET_MODEL_FILE=%s\n' \
      "$image" "$(dirname "$model")" "$(basename "$model")"
    printf 'MESHNET_TRACKER_MEMORY=%s\nMESHNET_PEER_MEMORY=%s\n' "$tracker_memory" "$peer_memory"
    printf 'MESHNET_DOCKER_NET=%s\nMESHNET_DOCKER_PORT=%s\n' "$net" "$host_port"
    printf 'MESHNET_TRACKER_MEM_LIMIT=%s\nMESHNET_PEER_MEM_LIMIT=%s\n' \
      "${MESHNET_TRACKER_MEM_LIMIT:-0}" "${MESHNET_PEER_MEM_LIMIT:-0}"
  } >"$env_file"
  say "layout: the tracker holds $tracker_layers layers (memory $tracker_memory B), three groups" \
    "of three peers hold $group_layers layers each (memory $peer_memory B)"
  local started=$SECONDS deadline=$((SECONDS + timeout))
  fail_up() {
    say "$*"
    collect_logs >/dev/null || true
    compose down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true
    exit 1
  }
  start_member tracker || fail_up "starting the tracker failed"
  until [ "$(http_code "$(tracker_url)/status")" = 200 ]; do
    [ "$SECONDS" -lt "$deadline" ] || fail_up "the tracker did not answer $(tracker_url)/status in ${timeout}s"
    sleep 0.5
  done
  write_state
  local k
  # One at a time, each once the tracker lists it with a ready span: a peer measures its
  # throughput as its span loads, and the planner places the next one by it; loads side by
  # side measure each other's contention.
  for ((k = 1; k <= peers; k++)); do
    say "starting peer$k"
    start_member "peer$k" || fail_up "starting peer$k failed"
    until status_check listed "$k"; do
      [ "$SECONDS" -lt "$deadline" ] ||
        fail_up "the tracker did not list peer$k with a ready span within ${timeout}s"
      sleep 0.5
    done
  done
  write_state
  say "waiting for complete coverage with at least two holders of every layer past the tracker's"
  until status_check covered "$peers" && status_check redundant "$peers"; do
    [ "$SECONDS" -lt "$deadline" ] ||
      fail_up "the mesh did not reach complete coverage with two holders per layer within ${timeout}s"
    sleep 0.5
  done
  say "the mesh covers the model after $((SECONDS - started))s"
  print_layout
  printf 'stop it with: testnet/docker.sh down    logs: testnet/docker.sh logs\n'
  printf '%s/v1\n' "$(tracker_url)"
}

require_up() {
  require_engine
  [ -f "$env_file" ] && [ -f "$state_file" ] && [ -n "$(compose ps -q 2>/dev/null)" ] ||
    die "no testnet is up: start one with 'testnet/docker.sh up'"
}

status() {
  require_up
  compose ps
  print_layout
}

# run_check MODE: testnet/docker_checks.py MODE against the testnet; on failure, collects the
# container logs.
run_check() {
  require_up
  local python=python3 venv=${MESHNET_VENV:-$repo/.venv}
  if [ "$1" = smoke ]; then
    "$venv/bin/python" -c 'import openai' >/dev/null 2>&1 ||
      die "no virtualenv with the openai package at $venv: run scripts/setup.sh --dev first"
    python=$venv/bin/python
  fi
  local rc=0
  "$python" "$here/docker_checks.py" "$1" --state "$state_file" || rc=$?
  if [ "$rc" -ne 0 ]; then
    say "$1 failed (status $rc)"
    collect_logs >/dev/null || true
  fi
  return "$rc"
}

# Runs a Docker command with a time limit, so a wedged engine fails `down` with a message
# instead of stalling whoever called it.
docker_bounded() {
  local limit=$1 rc=0
  shift
  timeout -k 5 "$limit" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "down: '$*' did not finish within ${limit}s"
  fi
  return "$rc"
}

down() {
  require_engine
  mkdir -p "$run_dir"
  [ -f "$env_file" ] || : >"$env_file"
  say "down: stopping and removing the containers of $project"
  local failed=0
  MESHNET_MODEL_DIR=${MESHNET_MODEL_DIR:-/nonexistent} docker_bounded 180 \
    "${compose_cmd[@]}" -p "$project" -f "$compose_file" --env-file "$env_file" \
    down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
  # Whatever the project left behind, even if the env file is gone.
  local leftovers
  leftovers=$(docker_bounded 60 docker ps -aq --filter "label=com.docker.compose.project=$project") ||
    failed=1
  [ -z "$leftovers" ] || docker_bounded 120 docker rm -f $leftovers >/dev/null || failed=1
  leftovers=$(docker_bounded 60 docker network ls -q \
    --filter "label=com.docker.compose.project=$project") || failed=1
  [ -z "$leftovers" ] || docker_bounded 60 docker network rm $leftovers >/dev/null || failed=1
  leftovers=$(docker_bounded 60 docker volume ls -q \
    --filter "label=com.docker.compose.project=$project") || failed=1
  [ -z "$leftovers" ] || docker_bounded 60 docker volume rm $leftovers >/dev/null || failed=1
  if [ "${1:-}" = --image ]; then
    docker_bounded 60 docker image rm -f "$image" >/dev/null 2>&1 || true
  fi
  [ "$failed" -eq 0 ] || die "down: some of $project may be left: see 'docker ps -a' and 'docker network ls'"
  rm -f "$state_file" "$private_file" "$key_file" "$links_file"
  say "down: no container, network or volume of $project is left"
}

case "${1:-}" in
  build) build ;;
  up)
    shift
    up "$@"
    ;;
  smoke) run_check smoke ;;
  chaos) run_check chaos ;;
  status) status ;;
  logs)
    require_up
    collect_logs "${2:-}"
    ;;
  down)
    shift
    down "$@"
    ;;
  -h | --help | help) usage ;;
  *)
    usage
    exit 2
    ;;
esac
