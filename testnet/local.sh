#!/usr/bin/env bash
# A local meshnet testnet: one tracker and N-1 peers as processes on 127.0.0.1.
#
#   testnet/local.sh up N [-- ARGS...]   start a mesh of N processes (N >= 2), wait until it
#                                        covers the model; the last line printed is the
#                                        OpenAI base URL. ARGS go to every meshnet-peer.
#   testnet/local.sh down                stop every process of the testnet (idempotent)
#   testnet/local.sh status              print the tracker's GET /status
#
# Each process gets a --memory budget of its share of the model's layers plus half a layer
# (sized by `meshnet-peer model-info --layers`), so that no process can hold more than its
# share and all N take part in serving the model.
#
# Environment:
#   MESHNET_BIN              meshnet-peer binary to run (default: build it with cargo)
#   MESHNET_PROFILE          release | debug: the cargo profile to build and run (default release)
#   MESHNET_HTTP_PORT        the tracker's HTTP port (default 8080 if free, else any free port)
#   MESHNET_TESTNET_DIR      run directory: logs, pids, data dirs ($TMPDIR/meshnet-testnet)
#   MESHNET_TESTNET_TIMEOUT  seconds to wait for the mesh to cover the model (default 120)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run_dir=${MESHNET_TESTNET_DIR:-${TMPDIR:-/tmp}/meshnet-testnet}
[[ $run_dir == /* ]] || run_dir=$PWD/$run_dir
pids_file=$run_dir/pids
state_file=$run_dir/state

usage() {
  sed -n '2,19s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
}

say() { printf 'local.sh: %s\n' "$*" >&2; }
die() {
  say "$*"
  exit 1
}

# --- processes ---------------------------------------------------------------------------------

# Whether PID is a live (not zombie) process of this run directory.
ours_alive() {
  local pid=$1 stat args
  kill -0 "$pid" 2>/dev/null || return 1
  stat=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
  case $stat in Z*) return 1 ;; esac
  args=$(ps -o args= -p "$pid" 2>/dev/null) || return 1
  [[ $args == *"$run_dir/data/"* ]]
}

# The pids in the pids file ("NAME PID" lines).
recorded_pids() {
  [ -f "$pids_file" ] || return 0
  awk '{print $2}' "$pids_file"
}

# SIGTERM to every pid given, up to ~10 s for them to exit, then SIGKILL for the rest.
stop_pids() {
  local pid left i
  for pid in "$@"; do
    if ours_alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for ((i = 0; i < 100; i++)); do
    left=0
    for pid in "$@"; do
      ours_alive "$pid" && left=1
    done
    [ "$left" -eq 0 ] && break
    sleep 0.1
  done
  for pid in "$@"; do
    if ours_alive "$pid"; then
      say "process $pid did not exit after SIGTERM; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  # Reap the ones that are our own children (when `up` cleans up after a failure).
  for pid in "$@"; do
    wait "$pid" 2>/dev/null || true
  done
}

show_logs() {
  local log
  for log in "$run_dir"/logs/*.log; do
    [ -f "$log" ] || continue
    printf '\n----- last lines of %s -----\n' "$log" >&2
    tail -n 25 "$log" >&2
  done
}

# --- helpers -----------------------------------------------------------------------------------

# N distinct free TCP ports on 127.0.0.1, one per line.
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
for s in socks:
    print(s.getsockname()[1])
PY
}

port_is_free() {
  python3 - "$1" <<'PY' 2>/dev/null
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
PY
}

# The HTTP status code of a GET, or 000 when nothing answers.
http_code() {
  curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" 2>/dev/null || true
}

# json_field JSON KEY: the top-level KEY of a JSON object.
json_field() {
  python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"
}

# What a tracker's /status says about coverage, in a few lines.
coverage_summary() {
  python3 - "$1" <<'PY'
import json, sys
try:
    status = json.loads(sys.argv[1])
except ValueError:
    sys.exit("the tracker's /status did not answer")
missing = [l["layer"] for l in (status.get("coverage") or {}).get("layers", [])
           if not any(h["state"] == "ready" for h in l["holders"])]
print(f"tracker /status: coverage complete={(status.get('coverage') or {}).get('complete')}, "
      f"layers without a ready holder: {missing or 'none'}")
for p in status.get("peers") or []:
    print(f"  peer {p.get('peer')} {p.get('http')} span={p.get('span')} "
          f"memory={p.get('memory_bytes')} last_seen_ms={p.get('last_seen_ms')}")
PY
}

# --- up ----------------------------------------------------------------------------------------

up() {
  [ $# -ge 1 ] || {
    usage
    exit 2
  }
  local n=$1
  shift
  if ! [[ $n =~ ^[0-9]+$ ]] || [ "$n" -lt 2 ]; then
    say "up needs a number of processes N >= 2 (one tracker and N-1 peers), got '$n'"
    exit 2
  fi
  n=$((10#$n))
  if [ $# -gt 0 ]; then
    if [ "$1" != "--" ]; then
      say "unexpected argument '$1': extra meshnet-peer arguments go after --"
      exit 2
    fi
    shift
  fi
  local extra=("$@")
  command -v python3 >/dev/null 2>&1 || die "python3 is needed (free ports, JSON)"
  command -v curl >/dev/null 2>&1 || die "curl is needed"

  local pid
  for pid in $(recorded_pids); do
    if ours_alive "$pid"; then
      die "a testnet is already up in $run_dir (pid $pid); run 'testnet/local.sh down' first"
    fi
  done
  rm -f "$pids_file" "$state_file"

  # The binary.
  local bin profile
  if [ -n "${MESHNET_BIN:-}" ]; then
    bin=$MESHNET_BIN
  else
    profile=${MESHNET_PROFILE:-release}
    local cargo_args=(build --locked -p meshnet-peer)
    case $profile in
      release) cargo_args+=(--release) ;;
      debug) ;;
      *)
        say "MESHNET_PROFILE must be release or debug, got '$profile'"
        exit 2
        ;;
    esac
    say "building meshnet-peer ($profile)"
    (cd "$repo" && cargo "${cargo_args[@]}") >&2
    bin=${CARGO_TARGET_DIR:-$repo/target}/$profile/meshnet-peer
  fi
  [ -x "$bin" ] || die "meshnet-peer binary not found or not executable: $bin"

  # model-info sees the same --model and --kv-tokens as the peers will.
  local info_args=() format="" i a
  for ((i = 0; i < ${#extra[@]}; i++)); do
    a=${extra[i]}
    case $a in
      --model | --kv-tokens) info_args+=("$a" "${extra[i + 1]:-}") ;;
      --model=* | --kv-tokens=*) info_args+=("$a") ;;
      --quantization) [ -n "$format" ] || format=${extra[i + 1]:-} ;;
      --quantization=*) [ -n "$format" ] || format=${a#--quantization=} ;;
    esac
  done
  local has_model=0
  for a in "${info_args[@]+"${info_args[@]}"}"; do
    case $a in --model | --model=*) has_model=1 ;; esac
  done
  if [ "$has_model" -eq 0 ]; then
    bash "$repo/scripts/fetch-model.sh" >/dev/null
  fi
  local info
  info=$("$bin" model-info "${info_args[@]+"${info_args[@]}"}") ||
    die "meshnet-peer model-info failed"

  # Memory budgets: the tracker gets ceil(L/N) layers, the peers split the rest as evenly as
  # possible; model-info sizes each budget (the layers with their KV reserve, the tracker's
  # embedding and head, half a layer of slack: never enough for one more layer).
  local layers
  layers=$(json_field "$info" layers) || die "model-info printed no layer count"
  if [ "$n" -gt "$layers" ]; then
    say "the model has $layers layers: at most $layers processes can each hold one"
    exit 2
  fi
  local format_args=()
  [ -n "$format" ] && format_args=(--quantization "$format")
  # budget LAYERS [--tracker]: the --memory that holds exactly LAYERS layers.
  budget() {
    local out
    out=$("$bin" model-info "${info_args[@]+"${info_args[@]}"}" --layers "$@" \
      "${format_args[@]+"${format_args[@]}"}") || die "meshnet-peer model-info --layers $* failed"
    json_field "$out" memory_for_layers
  }
  local shares=() memories=()
  local tracker_layers=$(((layers + n - 1) / n))
  local rest=$((layers - tracker_layers)) peers=$((n - 1))
  local k share tracker_budget low_budget high_budget
  tracker_budget=$(budget "$tracker_layers" --tracker) || exit 1
  low_budget=$(budget $((rest / peers))) || exit 1
  high_budget=$(budget $((rest / peers + 1))) || exit 1
  shares+=("$tracker_layers")
  memories+=("$tracker_budget")
  for ((k = 0; k < peers; k++)); do
    if [ "$k" -lt $((rest % peers)) ]; then
      share=$((rest / peers + 1))
      memories+=("$high_budget")
    else
      share=$((rest / peers))
      memories+=("$low_budget")
    fi
    shares+=("$share")
  done

  # Ports.
  local tracker_http=${MESHNET_HTTP_PORT:-}
  if [ -z "$tracker_http" ]; then
    if port_is_free 8080; then tracker_http=8080; else tracker_http=$(free_ports 1); fi
  elif ! port_is_free "$tracker_http"; then
    die "MESHNET_HTTP_PORT=$tracker_http is in use"
  fi
  local ports=()
  mapfile -t ports < <(free_ports $((2 * n)))
  # ports[0] is the tracker's p2p port; peer k (1..n-1) gets ports[2k-1] (HTTP), ports[2k] (p2p).
  local tracker_p2p=${ports[0]}
  local tracker_url=http://127.0.0.1:$tracker_http
  local bootstrap=/ip4/127.0.0.1/tcp/$tracker_p2p

  mkdir -p "$run_dir/logs" "$run_dir/data"
  rm -f "$run_dir"/logs/*.log
  : >"$pids_file"
  printf 'tracker_http=%s\nbase_url=%s/v1\n' "$tracker_url" "$tracker_url" >"$state_file"

  started=()
  ready=0
  # shellcheck disable=SC2317  # called from the trap
  cleanup_up() {
    if [ "$ready" -eq 0 ] && [ ${#started[@]} -gt 0 ]; then
      say "stopping the processes started so far"
      stop_pids "${started[@]}"
      rm -f "$pids_file" "$state_file"
    fi
  }
  trap cleanup_up EXIT
  trap 'exit 130' INT TERM

  # start NAME ARGS...: one meshnet-peer in its own session (detached from this terminal).
  start() {
    local name=$1
    shift
    local launcher=()
    command -v setsid >/dev/null 2>&1 && launcher=(setsid)
    NO_COLOR=1 "${launcher[@]+"${launcher[@]}"}" "$bin" "$@" --data-dir "$run_dir/data/$name" --reachable \
      --announce-interval 0.5 "${extra[@]+"${extra[@]}"}" \
      </dev/null >"$run_dir/logs/$name.log" 2>&1 &
    started+=("$!")
    printf '%s %s\n' "$name" "$!" >>"$pids_file"
  }

  local t0=$SECONDS
  local timeout=${MESHNET_TESTNET_TIMEOUT:-120}
  local deadline=$((SECONDS + timeout))

  say "starting the tracker on $tracker_url (p2p $bootstrap, ${shares[0]} layers, memory ${memories[0]} B)"
  start tracker --tracker --http "127.0.0.1:$tracker_http" --p2p "$bootstrap" \
    --memory "${memories[0]}"

  # Wait for the tracker's /status before starting the peers.
  until [ "$(http_code "$tracker_url/status")" = 200 ]; do
    if ! ours_alive "${started[0]}"; then
      say "the tracker exited"
      show_logs
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "the tracker did not answer $tracker_url/status within ${timeout}s"
      show_logs
      exit 1
    fi
    sleep 0.2
  done

  local k
  for ((k = 1; k < n; k++)); do
    say "starting peer$k (${shares[k]} layers, memory ${memories[k]} B)"
    start "peer$k" --http "127.0.0.1:${ports[2 * k - 1]}" \
      --p2p "/ip4/127.0.0.1/tcp/${ports[2 * k]}" --bootstrap "$bootstrap" \
      --memory "${memories[k]}"
  done

  say "waiting for the mesh to cover the model (up to ${timeout}s; logs in $run_dir/logs)"
  local status=""
  while :; do
    for ((k = 0; k < n; k++)); do
      if ! ours_alive "${started[k]}"; then
        say "$(sed -n "$((k + 1))s/ .*//p" "$pids_file") (pid ${started[k]}) exited"
        show_logs
        exit 1
      fi
    done
    if [ "$(http_code "$tracker_url/health")" = 200 ]; then
      status=$(curl -sf -m 2 "$tracker_url/status" || true)
      if [ -n "$status" ] && python3 -c '
import json, sys
s = json.loads(sys.argv[1])
sys.exit(0 if (s.get("coverage") or {}).get("complete") else 1)' "$status"; then
        break
      fi
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "the mesh did not cover the model within ${timeout}s"
      coverage_summary "$(curl -s -m 2 "$tracker_url/status" || true)" >&2 || true
      show_logs
      exit 1
    fi
    sleep 0.5
  done
  ready=1
  trap - EXIT INT TERM

  say "the mesh covers the model after $((SECONDS - t0))s"
  python3 - "$status" <<'PY'
import json, sys
status = json.loads(sys.argv[1])
print(f"meshnet testnet: {status['model']['id']}, {status['model']['layers']} layers, "
      f"route boundaries {status.get('route_boundaries')}")
rows = [("tracker", status.get("http"), status.get("span"))]
for p in status.get("peers") or []:
    if p.get("peer") == status.get("peer"):
        continue
    rows.append(("peer", p.get("http"), p.get("span")))
rows.sort(key=lambda r: (r[2] or {}).get("layers", [1 << 30])[0])
for role, http, span in rows:
    if span:
        lo, hi = span["layers"]
        where = f"layers {lo:>2}-{hi:<2} {span['quantization']} {span['state']}"
    else:
        where = "no span"
    print(f"  {role:<8} {http or '?':<28} {where}")
PY
  printf 'stop it with: testnet/local.sh down    logs: %s/logs\n' "$run_dir"
  printf '%s/v1\n' "$tracker_url"
}

# --- down / status -----------------------------------------------------------------------------

down() {
  local pids=() pid
  for pid in $(recorded_pids); do
    ours_alive "$pid" && pids+=("$pid")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    say "stopping ${#pids[@]} process(es)"
    stop_pids "${pids[@]}"
  else
    say "no testnet process is running"
  fi
  rm -f "$pids_file" "$state_file"
}

status() {
  local alive=0 pid name tracker_http=""
  if [ -f "$pids_file" ]; then
    while read -r name pid; do
      if ours_alive "$pid"; then
        alive=$((alive + 1))
        printf '%-8s pid %-8s running\n' "$name" "$pid" >&2
      else
        printf '%-8s pid %-8s not running\n' "$name" "$pid" >&2
      fi
    done <"$pids_file"
  fi
  [ "$alive" -gt 0 ] || die "no testnet is up (start one with 'testnet/local.sh up N')"
  tracker_http=$(sed -n 's/^tracker_http=//p' "$state_file" 2>/dev/null || true)
  [ -n "$tracker_http" ] || die "no tracker address recorded in $state_file"
  local report
  report=$(curl -sf -m 5 "$tracker_http/status") ||
    die "the tracker at $tracker_http does not answer /status"
  python3 -m json.tool <<<"$report"
}

case ${1:-} in
  up)
    shift
    up "$@"
    ;;
  down)
    down
    ;;
  status)
    status
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
