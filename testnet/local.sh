#!/usr/bin/env bash
# A local meshnet testnet: one tracker and N-1 peers as processes on 127.0.0.1.
#
#   testnet/local.sh up N [--redundancy R] [-- ARGS...]
#                                        start a mesh of N processes (N >= 2), wait until it
#                                        covers the model; the last line printed is the
#                                        OpenAI base URL. ARGS go to every meshnet-peer.
#                                        With R > 1 the N-1 peers form (N-1)/R groups of R
#                                        peers sized for the same span, and `up` waits until
#                                        every non-tracker span has exactly R ready holders.
#   testnet/local.sh down                stop every process of the testnet (idempotent)
#   testnet/local.sh status              one line per process (name, pid, state), then the
#                                        tracker's GET /status
#   testnet/local.sh restart NAME        start process NAME (tracker, peer1, ...) again with
#                                        the same arguments and data dir (same peer id),
#                                        stopping it first if it runs; prints the new pid
#   testnet/local.sh pid NAME            print the pid of process NAME
#
# Each process gets a --memory budget of its share of the model's layers plus half a layer
# (sized by `meshnet-peer model-info --layers`), so that no process can hold more than its share
# and all N take part in serving the model.
#
# Environment:
#   MESHNET_BIN              meshnet-peer binary to run (default: build it with cargo)
#   MESHNET_PROFILE          release | debug: the cargo profile to build and run (default release)
#   MESHNET_HTTP_PORT        the tracker's HTTP port (default 8080 if free, else one the system
#                            chooses)
#   MESHNET_TESTNET_DIR      run directory: logs, pids, data dirs ($TMPDIR/meshnet-testnet)
#   MESHNET_TESTNET_TIMEOUT  seconds to wait for the mesh to cover the model, or for a restarted
#                            process to answer /status (default 120)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run_dir=${MESHNET_TESTNET_DIR:-${TMPDIR:-/tmp}/meshnet-testnet}
[[ $run_dir == /* ]] || run_dir=$PWD/$run_dir
pids_file=$run_dir/pids
state_file=$run_dir/state
# procs/NAME/: cmd (the argv, NUL-separated), cmdline (the same, shell-quoted, for humans),
# http (its base URL), pid (written by the wrapper); exit/NAME: the exit status once it ended.
# Every port a member binds is chosen by the system at its first start (--http 127.0.0.1:0,
# --p2p /ip4/127.0.0.1/tcp/0, and the tracker's 8080 when free); `up` learns them from the JSON
# ready line the member prints on standard output, then writes them into procs/NAME/cmd, so a
# restart binds the same addresses again.
procs_dir=$run_dir/procs
exit_dir=$run_dir/exit

usage() {
  sed -n '2,31s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
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
  [[ $pid =~ ^[0-9]+$ ]] || return 1
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

# The recorded pid of process NAME (empty when none).
pid_of() {
  [ -f "$pids_file" ] || return 0
  awk -v name="$1" '$1 == name {print $2}' "$pids_file"
}

# all_gone SECONDS PID...: waits up to SECONDS for every PID to exit; whether they all did.
all_gone() {
  local tenths=$(($1 * 10)) pid left i
  shift
  for ((i = 0; i <= tenths; i++)); do
    left=0
    for pid in "$@"; do
      ours_alive "$pid" && left=1
    done
    [ "$left" -eq 0 ] && return 0
    [ "$i" -lt "$tenths" ] && sleep 0.1
  done
  return 1
}

# SIGTERM to every pid given and up to ~5 s for them to exit (a peer leaving gracefully waits
# for others to take over its layers, which never happens when all stop at once), then a second
# SIGTERM (a leaving peer stops at once on it) and ~5 s more, then SIGKILL for the rest.
stop_pids() {
  local pid
  for pid in "$@"; do
    if ours_alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  all_gone 5 "$@" && return 0
  for pid in "$@"; do
    if ours_alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  all_gone 5 "$@" && return 0
  for pid in "$@"; do
    if ours_alive "$pid"; then
      say "process $pid did not exit after two SIGTERMs; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  all_gone 5 "$@" || true
}

show_logs() {
  local log
  for log in "$run_dir"/logs/*.log; do
    [ -f "$log" ] || continue
    printf '\n----- last lines of %s -----\n' "$log" >&2
    tail -n 25 "$log" >&2
  done
}

# launch NAME: starts the command recorded in procs/NAME/cmd in its own session (detached from
# this terminal) through a small bash wrapper that records the meshnet-peer's own pid in
# procs/NAME/pid and, once it ends, its exit status in exit/NAME (128+N when killed by signal
# N). Appends to logs/NAME.log, records "NAME PID" in the pids file (replacing an older line for
# NAME) and sets launched_pid, and launched_offset to the size of the log when it started (what
# the process prints this time comes after it).
launched_pid=""
launched_offset=0
launch() {
  local name=$1 argv=() i
  local dir=$procs_dir/$name
  mapfile -d '' -t argv <"$dir/cmd"
  [ ${#argv[@]} -gt 0 ] || die "no command recorded for $name in $dir/cmd"
  mkdir -p "$exit_dir" "$run_dir/logs"
  rm -f "$dir/pid" "$dir/pid.tmp" "$exit_dir/$name" "$exit_dir/$name.tmp"
  printf '\n===== local.sh: starting %s at %s =====\n' "$name" "$(date '+%F %T')" \
    >>"$run_dir/logs/$name.log"
  launched_offset=$(wc -c <"$run_dir/logs/$name.log")
  launched_offset=$((launched_offset))
  local launcher=()
  command -v setsid >/dev/null 2>&1 && launcher=(setsid)
  # shellcheck disable=SC2016  # the wrapper's script is expanded by the wrapper
  NO_COLOR=1 "${launcher[@]+"${launcher[@]}"}" bash -c '
    pid_file=$1 exit_file=$2
    shift 2
    "$@" &
    child=$!
    echo "$child" >"$pid_file.tmp" && mv -f "$pid_file.tmp" "$pid_file"
    wait "$child"
    status=$?
    echo "$status" >"$exit_file.tmp" && mv -f "$exit_file.tmp" "$exit_file"
  ' meshnet-wrapper "$dir/pid" "$exit_dir/$name" "${argv[@]}" \
    </dev/null >>"$run_dir/logs/$name.log" 2>&1 &
  local wrapper=$!
  # The wrapper writes the pid at once; wait for it (bounded).
  for ((i = 0; i < 200; i++)); do
    [ -s "$dir/pid" ] && break
    sleep 0.025
  done
  if ! [ -s "$dir/pid" ]; then
    kill -KILL "$wrapper" 2>/dev/null || true
    die "the wrapper of $name did not record a pid within 5s"
  fi
  launched_pid=$(<"$dir/pid")
  touch "$pids_file"
  awk -v name="$name" -v pid="$launched_pid" '
    $1 == name { print name, pid; found = 1; next }
    { print }
    END { if (!found) print name, pid }' "$pids_file" >"$pids_file.tmp"
  mv -f "$pids_file.tmp" "$pids_file"
}

# record_cmd DIR ARGV...: records ARGV as the command of the process whose procs dir is DIR.
record_cmd() {
  local dir=$1
  shift
  printf '%s\0' "$@" >"$dir/cmd.tmp"
  mv -f "$dir/cmd.tmp" "$dir/cmd"
  { printf '%q ' "$@" | sed 's/ $//'; echo; } >"$dir/cmdline"
}

# set_arg NAME FLAG VALUE: in the recorded command of process NAME, the value after the first
# FLAG becomes VALUE; without FLAG, FLAG VALUE go in just before --data-dir.
set_arg() {
  local dir=$procs_dir/$1 flag=$2 value=$3 argv=() out=() i replaced=0
  mapfile -d '' -t argv <"$dir/cmd"
  for ((i = 0; i < ${#argv[@]}; i++)); do
    if [ "$replaced" -eq 0 ] && [ "${argv[i]}" = "$flag" ] && [ $((i + 1)) -lt ${#argv[@]} ]; then
      out+=("$flag" "$value")
      i=$((i + 1))
      replaced=1
    elif [ "$replaced" -eq 0 ] && [ "${argv[i]}" = --data-dir ]; then
      out+=("$flag" "$value" "${argv[i]}")
      replaced=1
    else
      out+=("${argv[i]}")
    fi
  done
  [ "$replaced" -eq 1 ] || out+=("$flag" "$value")
  record_cmd "$dir" "${out[@]}"
}

# --- helpers -----------------------------------------------------------------------------------

# ready_fields LOG OFFSET: the ready line a member printed in LOG after byte OFFSET, as
# "HTTP_URL HTTP_BOUND P2P" (the URL others reach it at, the address its HTTP server is bound to,
# its libp2p TCP listen address). Exit 3 while there is none; 1 when it names no TCP address.
ready_fields() {
  python3 - "$1" "$2" <<'PY'
import json, re, sys
with open(sys.argv[1], "rb") as log:
    log.seek(int(sys.argv[2]))
    text = log.read().decode("utf-8", "replace")
for line in text.splitlines():
    line = line.strip()
    if not line.startswith("{"):
        continue
    try:
        ready = json.loads(line)
    except ValueError:
        continue
    if not isinstance(ready, dict) or ready.get("event") != "ready":
        continue
    p2p = [str(a) for a in ready.get("p2p") or []]
    tcp = [a for a in p2p if re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/[0-9]+", a)] or \
        [a for a in p2p if re.fullmatch(r"/ip[46]/[^/]+/tcp/[0-9]+", a)]
    if not tcp or not ready.get("http") or not ready.get("http_bound"):
        sys.exit(f"its ready line names no HTTP address or libp2p TCP address: {line}")
    print(ready["http"], ready["http_bound"], tcp[0])
    sys.exit(0)
sys.exit(3)
PY
}

# wait_ready NAME PID OFFSET DEADLINE: waits until process NAME (PID), started when its log had
# OFFSET bytes, prints its ready line; sets ready_http, ready_bound and ready_p2p (see
# ready_fields). Returns 1 when the process exits without one; exits 1 with the logs when
# DEADLINE (in $SECONDS) passes or the ready line is unusable.
ready_http="" ready_bound="" ready_p2p=""
wait_ready() {
  local name=$1 pid=$2 offset=$3 deadline=$4 fields rc gone=0
  while :; do
    rc=0
    fields=$(ready_fields "$run_dir/logs/$name.log" "$offset") || rc=$?
    if [ "$rc" -eq 0 ]; then
      read -r ready_http ready_bound ready_p2p <<<"$fields"
      return 0
    elif [ "$rc" -ne 3 ]; then
      say "$name (pid $pid) did not say where it listens"
      show_logs
      exit 1
    fi
    # One more look at the log once the process has gone: it may have printed it last.
    [ "$gone" -eq 1 ] && return 1
    if ! ours_alive "$pid"; then
      gone=1
      continue
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "$name (pid $pid) printed no ready line in time"
      show_logs
      exit 1
    fi
    sleep 0.1
  done
}

# pin NAME: after NAME's ready line (wait_ready), records its HTTP base URL and writes the
# addresses it bound into its command, in place of port 0.
pin() {
  set_arg "$1" --http "$ready_bound"
  set_arg "$1" --p2p "$ready_p2p"
  printf '%s\n' "$ready_http" >"$procs_dir/$1/http"
}

# Whether TCP port PORT on 127.0.0.1 can be bound now (a check only: nothing is held).
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

# redundancy_check STATUS_JSON R "NAME=HTTP=MEMORY ..." (the non-tracker processes):
# whether every non-tracker process is in the tracker's map with a ready span and every
# non-tracker span is held by exactly R of them with equal boundaries (and distinct spans do not
# overlap). Exit 0: yes; 1: not yet (some peer missing, loading, or coverage incomplete);
# 3: every peer is ready but the spans are not R-redundant. Prints the spans it sees.
redundancy_check() {
  python3 - "$@" <<'PY'
import collections, json, sys
status = json.loads(sys.argv[1])
r = int(sys.argv[2])
procs = [p.split("=", 2) for p in sys.argv[3].split()]
by_http = {p.get("http"): p for p in status.get("peers") or []}
lines, spans, waiting = [], {}, []
lines.append(f"  coverage epoch {(status.get('coverage') or {}).get('epoch')}")
own = status.get("span")
lines.append(f"  tracker  {status.get('http')}  span "
             f"{own['layers'] if own else None} {own['state'] if own else ''}")
if not own or own.get("state") != "ready" or status.get("loading"):
    waiting.append("tracker not ready")
for name, http, memory in procs:
    p = by_http.get(http)
    span = (p or {}).get("span")
    where = f"{span['layers']} {span['state']}" if span else ("no span" if p else "not in the map")
    lines.append(f"  {name:<8} {http}  --memory {memory}  span {where}")
    if not span or span.get("state") != "ready":
        waiting.append(f"{name} {where}")
    else:
        spans[name] = tuple(span["layers"])
coverage = status.get("coverage") or {}
if not coverage.get("complete"):
    waiting.append("coverage incomplete")
print("\n".join(lines))
if waiting:
    print("waiting for: " + ", ".join(waiting))
    sys.exit(1)
count = collections.Counter(spans.values())
distinct = sorted(count)
problems = [f"span [{a}, {b}) has {count[(a, b)]} holders" for a, b in distinct if count[(a, b)] != r]
for (a1, b1), (a2, b2) in zip(distinct, distinct[1:]):
    if a2 < b1:
        problems.append(f"spans [{a1}, {b1}) and [{a2}, {b2}) overlap")
if problems:
    print(f"not {r}-redundant: " + "; ".join(problems))
    sys.exit(3)
print(f"every non-tracker span has exactly {r} holders: "
      + ", ".join(f"[{a}, {b}) x{count[(a, b)]}" for a, b in distinct))
PY
}

# wait_serving NAME URL PID DEADLINE: waits until the process at URL reports a ready span in its
# own /status (exits 1 with the logs when it exits or DEADLINE, in $SECONDS, passes).
wait_serving() {
  local name=$1 url=$2 pid=$3 deadline=$4 report
  while :; do
    report=$(curl -sf -m 2 "$url/status" || true)
    if [ -n "$report" ] && python3 -c '
import json, sys
s = json.loads(sys.argv[1])
sys.exit(0 if (s.get("span") or {}).get("state") == "ready" and not s.get("loading") else 1)' \
      "$report"; then
      return 0
    fi
    if ! ours_alive "$pid"; then
      say "$name (pid $pid) exited"
      show_logs
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "$name did not serve a ready span in time"
      show_logs
      exit 1
    fi
    sleep 0.2
  done
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
  local redundancy=1
  while [ $# -gt 0 ]; do
    case $1 in
      --redundancy)
        [ $# -ge 2 ] || {
          say "--redundancy needs a value"
          exit 2
        }
        redundancy=$2
        shift 2
        ;;
      --redundancy=*)
        redundancy=${1#--redundancy=}
        shift
        ;;
      --)
        shift
        break
        ;;
      *)
        say "unexpected argument '$1': extra meshnet-peer arguments go after --"
        exit 2
        ;;
    esac
  done
  if ! [[ $redundancy =~ ^[0-9]+$ ]] || [ "$((10#$redundancy))" -lt 1 ]; then
    say "--redundancy needs a whole number R >= 1, got '$redundancy'"
    exit 2
  fi
  redundancy=$((10#$redundancy))
  local peers=$((n - 1))
  if [ $((peers % redundancy)) -ne 0 ] || [ $((peers / redundancy)) -lt 1 ]; then
    say "up $n --redundancy $redundancy: the $peers non-tracker processes (N-1 = $peers) must" \
      "form whole groups of R = $redundancy peers, at least one group;" \
      "$peers % $redundancy = $((peers % redundancy)), $peers / $redundancy = $((peers / redundancy))" \
      "groups (choose N = 1 + a multiple of $redundancy)"
    exit 2
  fi
  local groups=$((peers / redundancy))
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
  [[ $bin == /* ]] || bin=$PWD/$bin

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

  # Memory budgets. The peers form G = (N-1)/R groups of R (R = 1: every peer is its own
  # group). The tracker gets ceil(L/(G+1)) layers (with R > 1, fewer if needed so that every
  # peer's budget also holds the tracker's layers with the embedding and head: any peer can
  # take over as tracker), the G groups split the rest as evenly as possible, and every peer
  # of a group gets the budget of its group's share; model-info sizes
  # each budget (the layers with their KV reserve, the tracker's embedding and head, half a
  # layer of slack: never enough for one more layer). Peer k (1-based) is in group (k-1) % G,
  # so the first G peers started cover the model and the next ones add redundancy.
  local layers
  layers=$(json_field "$info" layers) || die "model-info printed no layer count"
  if [ $((groups + 1)) -gt "$layers" ]; then
    if [ "$redundancy" -eq 1 ]; then
      say "the model has $layers layers: at most $layers processes can each hold one"
    else
      say "the model has $layers layers: at most $((layers - 1)) groups of peers can each hold" \
        "one besides the tracker, got $groups groups of $redundancy"
    fi
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
  local shares=() memories=() group_of=()
  local tracker_layers=$(((layers + groups) / (groups + 1)))
  local rest=$((layers - tracker_layers))
  local k g share tracker_budget low_budget high_budget
  tracker_budget=$(budget "$tracker_layers" --tracker) || exit 1
  low_budget=$(budget $((rest / groups))) || exit 1
  if [ "$redundancy" -gt 1 ]; then
    # Room for a successor: the smallest peer budget must hold the tracker's part.
    while [ "$low_budget" -lt "$tracker_budget" ] && [ "$tracker_layers" -gt 1 ]; do
      tracker_layers=$((tracker_layers - 1))
      rest=$((layers - tracker_layers))
      tracker_budget=$(budget "$tracker_layers" --tracker) || exit 1
      low_budget=$(budget $((rest / groups))) || exit 1
    done
    if [ "$low_budget" -lt "$tracker_budget" ]; then
      say "note: no layout leaves the peers room for the tracker's part; a peer cannot take over"
    fi
  fi
  high_budget=$(budget $((rest / groups + 1))) || exit 1
  shares+=("$tracker_layers")
  memories+=("$tracker_budget")
  group_of+=("")
  for ((k = 1; k <= peers; k++)); do
    g=$(((k - 1) % groups))
    if [ "$g" -lt $((rest % groups)) ]; then
      share=$((rest / groups + 1))
      memories+=("$high_budget")
    else
      share=$((rest / groups))
      memories+=("$low_budget")
    fi
    shares+=("$share")
    group_of+=("$g")
  done

  # Ports: the system chooses them (port 0), except the tracker's HTTP port: 8080 when it is free,
  # or MESHNET_HTTP_PORT. Each member's ready line says what it bound.
  local tracker_port=${MESHNET_HTTP_PORT:-}
  if [ -n "$tracker_port" ]; then
    if ! [[ $tracker_port =~ ^[0-9]{1,5}$ ]] || [ "$((10#$tracker_port))" -gt 65535 ]; then
      die "MESHNET_HTTP_PORT must be a TCP port number, got '$tracker_port'"
    fi
    tracker_port=$((10#$tracker_port))
    if [ "$tracker_port" -ne 0 ] && ! port_is_free "$tracker_port"; then
      die "MESHNET_HTTP_PORT=$tracker_port is in use"
    fi
  elif port_is_free 8080; then
    tracker_port=8080
  else
    tracker_port=0
  fi

  mkdir -p "$run_dir/logs" "$run_dir/data"
  rm -f "$run_dir"/logs/*.log
  rm -rf "$procs_dir" "$exit_dir"
  mkdir -p "$procs_dir" "$exit_dir"
  : >"$pids_file"

  started=()
  ready=0
  # shellcheck disable=SC2317  # called from the trap
  cleanup_up() {
    if [ "$ready" -eq 0 ]; then
      # Every process of the run dir, including one restarted or started by a wrapper whose
      # pid is not in `started` yet.
      local all=() p
      for p in "${started[@]+"${started[@]}"}" $(recorded_pids); do all+=("$p"); done
      if [ ${#all[@]} -gt 0 ]; then
        say "stopping the processes started so far"
        stop_pids "${all[@]}"
      fi
      rm -f "$pids_file" "$state_file"
    fi
  }
  trap cleanup_up EXIT
  trap 'exit 130' INT TERM

  # start NAME HTTP MEMORY GROUP ARGS...: records the command line of one meshnet-peer and
  # launches it.
  start() {
    local name=$1 http=$2 memory=$3 group=$4
    shift 4
    local dir=$procs_dir/$name
    mkdir -p "$dir"
    record_cmd "$dir" "$bin" "$@" --data-dir "$run_dir/data/$name" --reachable \
      --announce-interval 0.5 "${extra[@]+"${extra[@]}"}"
    printf '%s\n' "$http" >"$dir/http"
    printf '%s\n' "$memory" >"$dir/memory"
    printf '%s\n' "$group" >"$dir/group"
    launch "$name"
    started+=("$launched_pid")
  }

  local t0=$SECONDS
  local timeout=${MESHNET_TESTNET_TIMEOUT:-120}
  local deadline=$((SECONDS + timeout))

  if [ "$tracker_port" -eq 0 ]; then
    say "starting the tracker on a port the system chooses (${shares[0]} layers, memory ${memories[0]} B)"
  else
    say "starting the tracker on 127.0.0.1:$tracker_port (${shares[0]} layers, memory ${memories[0]} B)"
  fi
  start tracker "http://127.0.0.1:$tracker_port" "${memories[0]}" "" \
    --tracker --http "127.0.0.1:$tracker_port" --p2p /ip4/127.0.0.1/tcp/0 --memory "${memories[0]}"
  if ! wait_ready tracker "${started[0]}" "$launched_offset" "$deadline"; then
    # Its libp2p port is the system's choice: a port in use is its HTTP port.
    local in_use
    in_use=$(tail -c +$((launched_offset + 1)) "$run_dir/logs/tracker.log" |
      grep -i -m 1 'address already in use' || true)
    if [ -n "$in_use" ] && [ -n "${MESHNET_HTTP_PORT:-}" ]; then
      say "MESHNET_HTTP_PORT=$tracker_port is in use: the tracker could not bind" \
        "127.0.0.1:$tracker_port"
      show_logs
      exit 1
    elif [ -n "$in_use" ] && [ "$tracker_port" -ne 0 ]; then
      # Port 8080 was free when checked and taken before the tracker bound it.
      say "port $tracker_port was taken meanwhile; starting the tracker again on a port the" \
        "system chooses"
      set_arg tracker --http 127.0.0.1:0
      launch tracker
      started[0]=$launched_pid
      if ! wait_ready tracker "${started[0]}" "$launched_offset" "$deadline"; then
        say "the tracker exited"
        show_logs
        exit 1
      fi
    else
      say "the tracker exited"
      show_logs
      exit 1
    fi
  fi
  pin tracker
  local tracker_url=$ready_http
  local bootstrap=$ready_p2p
  {
    printf 'tracker_http=%s\nbase_url=%s/v1\n' "$tracker_url" "$tracker_url"
    printf 'processes=%s\nredundancy=%s\ngroups=%s\nlayers=%s\ntracker_layers=%s\n' \
      "$n" "$redundancy" "$groups" "$layers" "$tracker_layers"
  } >"$state_file"
  say "the tracker listens on $tracker_url (p2p $bootstrap)"

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

  # urls[K]: peer K's HTTP base URL, from its ready line (learn_peer K). The tracker's bootstrap
  # becomes peer1's libp2p address: not needed at the first start, but a restarted tracker finds
  # the mesh (and its successor) through it.
  local urls=("$tracker_url") offsets=("")
  learn_peer() {
    local k=$1
    if ! wait_ready "peer$k" "${started[k]}" "${offsets[k]}" "$deadline"; then
      say "peer$k (pid ${started[k]}) exited"
      show_logs
      exit 1
    fi
    pin "peer$k"
    urls[k]=$ready_http
    if [ "$k" -eq 1 ]; then
      set_arg tracker --bootstrap "$ready_p2p"
    fi
  }
  for ((k = 1; k < n; k++)); do
    if [ "$redundancy" -gt 1 ]; then
      say "starting peer$k (group $((group_of[k] + 1)) of $groups, ${shares[k]} layers, memory ${memories[k]} B)"
    else
      say "starting peer$k (${shares[k]} layers, memory ${memories[k]} B)"
    fi
    start "peer$k" "" "${memories[k]}" "${group_of[k]}" \
      --http 127.0.0.1:0 --p2p /ip4/127.0.0.1/tcp/0 --bootstrap "$bootstrap" \
      --memory "${memories[k]}"
    offsets[k]=$launched_offset
    if [ "$redundancy" -gt 1 ]; then
      learn_peer "$k"
      if [ "$k" -lt $((n - 1)) ]; then
        # One at a time: each peer measures its throughput when its span loads, and the
        # planner places the next ones by throughput; loads running side by side on a small
        # machine measure each other's contention.
        wait_serving "peer$k" "${urls[k]}" "${started[k]}" "$deadline"
      fi
    fi
  done
  local procs_spec=""
  for ((k = 1; k < n; k++)); do
    [ -n "${urls[k]:-}" ] || learn_peer "$k"
    procs_spec+="peer$k=${urls[k]}=${memories[k]} "
  done

  if [ "$redundancy" -gt 1 ]; then
    say "waiting for every peer to hold a ready span, each non-tracker span held by" \
      "$redundancy peers (up to ${timeout}s; logs in $run_dir/logs)"
  else
    say "waiting for the mesh to cover the model (up to ${timeout}s; logs in $run_dir/logs)"
  fi
  local status="" check="" check_rc=0 settled_key="" settled_since=0
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
        [ "$redundancy" -eq 1 ] && break
        check_rc=0
        check=$(redundancy_check "$status" "$redundancy" "$procs_spec") || check_rc=$?
        if [ "$check_rc" -eq 1 ]; then
          settled_key=""
        elif [ "$check" != "$settled_key" ]; then
          # The same spans (and coverage epoch) must hold for a few seconds: the planner may
          # still move a span once the peers have measured their throughput.
          settled_key=$check
          settled_since=$SECONDS
        elif [ "$check_rc" -eq 0 ] && [ $((SECONDS - settled_since)) -ge 3 ]; then
          break
        elif [ "$check_rc" -eq 3 ] && [ $((SECONDS - settled_since)) -ge 5 ]; then
          say "the planner did not give every non-tracker span exactly $redundancy holders" \
            "with equal boundaries (tracker ${shares[0]} layers, $groups groups of" \
            "$redundancy peers sized for $rest layers split $groups ways); it produced:"
          printf '%s\n' "$check" >&2
          exit 1
        fi
      elif [ "$redundancy" -gt 1 ]; then
        check="waiting for coverage"
      fi
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      if [ "$redundancy" -gt 1 ]; then
        say "the mesh did not reach $redundancy holders for every non-tracker span within ${timeout}s"
        [ -n "$check" ] && printf '%s\n' "$check" >&2
      else
        say "the mesh did not cover the model within ${timeout}s"
      fi
      coverage_summary "$(curl -s -m 2 "$tracker_url/status" || true)" >&2 || true
      show_logs
      exit 1
    fi
    sleep 0.5
  done
  ready=1
  trap - EXIT INT TERM

  if [ "$redundancy" -gt 1 ]; then
    say "$(tail -n 1 <<<"$check")"
    say "the mesh covers the model with redundancy $redundancy after $((SECONDS - t0))s"
  else
    say "the mesh covers the model after $((SECONDS - t0))s"
  fi
  local names=""
  for ((k = 1; k < n; k++)); do names+="${urls[k]}=peer$k "; done
  python3 - "$status" "$names" <<'PY'
import json, sys
status = json.loads(sys.argv[1])
names = dict(p.split("=", 1) for p in sys.argv[2].split())
print(f"meshnet testnet: {status['model']['id']}, {status['model']['layers']} layers, "
      f"route boundaries {status.get('route_boundaries')}")
rows = [("tracker", status.get("http"), status.get("span"))]
for p in status.get("peers") or []:
    if p.get("peer") == status.get("peer"):
        continue
    rows.append((names.get(p.get("http"), "peer"), p.get("http"), p.get("span")))
rows.sort(key=lambda r: ((r[2] or {}).get("layers", [1 << 30])[0], r[0]))
for name, http, span in rows:
    if span:
        lo, hi = span["layers"]
        where = f"layers {lo:>2}-{hi:<2} {span['quantization']} {span['state']}"
    else:
        where = "no span"
    print(f"  {name:<8} {http or '?':<28} {where}")
PY
  printf 'stop it with: testnet/local.sh down    logs: %s/logs\n' "$run_dir"
  printf '%s/v1\n' "$tracker_url"
}

# --- down / status / restart / pid -------------------------------------------------------------

down() {
  local pids=() pid
  for pid in $(recorded_pids); do
    ours_alive "$pid" && pids+=("$pid")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    say "stopping ${#pids[@]} process(es)"
    stop_pids "${pids[@]}"
    wait_for_exit_records
  else
    say "no testnet process is running"
  fi
  rm -f "$pids_file" "$state_file"
}

# Each wrapper writes its process's exit status just after the process ends; waits (up to ~5 s)
# until every recorded process has one, so a caller removing the run directory right after
# `down` does not race a wrapper still writing into it.
wait_for_exit_records() {
  local name i
  [ -f "$pids_file" ] || return 0
  while read -r name _; do
    [ -n "$name" ] || continue
    for ((i = 0; i < 200; i++)); do
      [ -f "$exit_dir/$name" ] && break
      sleep 0.025
    done
  done <"$pids_file"
}

status() {
  local alive=0 pid name tracker_http="" code
  if [ -f "$pids_file" ]; then
    while read -r name pid; do
      if ours_alive "$pid"; then
        alive=$((alive + 1))
        printf '%-8s pid %-8s running\n' "$name" "$pid" >&2
      else
        code=$(cat "$exit_dir/$name" 2>/dev/null || true)
        printf '%-8s pid %-8s not running%s\n' "$name" "$pid" "${code:+ (exit status $code)}" >&2
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

known_name() {
  local name=$1
  [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || die "not a process name: '$name'"
  if ! [ -f "$pids_file" ] || ! [ -f "$state_file" ]; then
    die "no testnet is up in $run_dir (start one with 'testnet/local.sh up N')"
  fi
  if ! [ -f "$procs_dir/$name/cmd" ] || [ -z "$(pid_of "$name")" ]; then
    die "no process '$name' in $run_dir (names: $(awk '{printf "%s ", $1}' "$pids_file"))"
  fi
}

restart() {
  [ $# -eq 1 ] || {
    usage
    exit 2
  }
  local name=$1 old pid http i
  known_name "$name"
  old=$(pid_of "$name")
  if ours_alive "$old"; then
    say "stopping $name (pid $old)"
    stop_pids "$old"
  fi
  launch "$name"
  pid=$launched_pid
  say "restarted $name: pid $pid (log $run_dir/logs/$name.log)"
  # Wait (bounded) until it answers /status, so a process that cannot start is reported here.
  http=$(<"$procs_dir/$name/http")
  local timeout=${MESHNET_TESTNET_TIMEOUT:-120}
  local deadline=$((SECONDS + timeout))
  until [ "$(http_code "$http/status")" = 200 ]; do
    if ! ours_alive "$pid"; then
      say "$name (pid $pid) exited with status $(cat "$exit_dir/$name" 2>/dev/null || echo '?')"
      tail -n 25 "$run_dir/logs/$name.log" >&2
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "$name (pid $pid) did not answer $http/status within ${timeout}s"
      tail -n 25 "$run_dir/logs/$name.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  printf '%s\n' "$pid"
}

pid_cmd() {
  [ $# -eq 1 ] || {
    usage
    exit 2
  }
  known_name "$1"
  pid_of "$1"
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
  restart)
    shift
    restart "$@"
    ;;
  pid)
    shift
    pid_cmd "$@"
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
