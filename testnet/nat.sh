#!/usr/bin/env bash
# A NAT testbed in Linux network namespaces: a public tracker and three peers behind home
# routers, two of them port-preserving (hole punching works between them) and one that
# randomises its source ports (reachable only through a relay). Needs root, iproute2, iptables
# and python3; curl for `run`.
#
#   testnet/nat.sh up        build the topology (namespaces, links, NAT) and print it; it stays
#                            up until `down`
#   testnet/nat.sh down      stop every process in the testbed's namespaces and delete them
#                            (idempotent; also cleans what a crashed earlier run left)
#   testnet/nat.sh selftest  build the topology, check its network layer with python3 probes
#                            (each check prints ok or FAILED), tear it down
#   testnet/nat.sh run       (the default) build the topology, start a tracker and three peers
#                            behind the NATs, check what the mesh does across them, tear down
#   testnet/nat.sh speed     decode tokens/s on three meshes over the same links: the routers
#                            forwarding ports (every hop direct HTTP), the NATs of `run` (one hop
#                            punched, one relayed), every NAT randomising ports (relayed hops)
#   testnet/nat.sh run --private, speed --private
#                            the same as a private mesh: one swarm key (`meshnet-peer swarm-key
#                            new`), every member started with --swarm-key and on TCP only (QUIC
#                            cannot carry the key); `run` also checks that a connection without
#                            the key is refused and counted in the tracker's /metrics
#
# Topology (every name starts with mnat-; nothing outside these namespaces is touched):
#
#                      "internet" 198.51.100.0/24: bridge mnat-br in netns mnat-inet
#        +------------------+------------------+------------------+
#        |                  |                  |                  |
#    mnat-trk           mnat-ra            mnat-rb            mnat-rc
#    tracker            router A           router B           router C
#    .10                WAN .11            WAN .12            WAN .13
#                       LAN 10.0.1.1/24    LAN 10.0.2.1/24    LAN 10.0.3.1/24
#                       MASQUERADE         MASQUERADE         MASQUERADE
#                       (keeps ports)      --random-fully     (keeps ports)
#                           |                  |                  |
#                       mnat-a             mnat-b             mnat-c
#                       host 10.0.1.2      host 10.0.2.2      host 10.0.3.2
#
# Every router forwards LAN->WAN and, WAN->LAN, only packets of connections its LAN opened
# (conntrack ESTABLISHED,RELATED); it drops everything else arriving on its WAN, including
# packets for itself, so unsolicited inbound traffic gets no answer. When the kernel has netem,
# every WAN link gets MESHNET_NAT_DELAY_MS of delay each way.
#
# `run` starts `meshnet-peer --tracker --reachable` in mnat-trk and peers A, C, B (in that
# order, each once the previous one serves its span) in mnat-a, mnat-c, mnat-b without
# --reachable, with --memory budgets that make the route tracker -> A -> C -> B (the two
# port-preserving sites next to each other), then asserts:
#   1. a greedy chat through the tracker's OpenAI API equals `meshnet-peer generate --chat
#      --boundaries` at the tracker's route boundaries;
#   2. the tracker's /status has a `network` section; every hop's path is printed from the
#      /status of the hop before it (`network.paths`: how activations from a member reach each
#      other one): C's hop (A's path to C) becomes `direct-p2p` within 60 s (a hole punch
#      between the port-preserving NATs), B's hop (C's path to B) is `relayed`;
#   3. grants: an anonymous /forward to the tracker (from the internet) and to A (from its own
#      LAN) is refused 401; one signed by a member that is not the tracker is refused 403; the
#      tracker's grant for A's hop is accepted (200) with the route it names and refused 403
#      with the route redirected to a listener on the internet, which nobody ever connects to;
#   4. chats for MESHNET_NAT_SOAK_SECONDS all answer 200, and B's relayed hop carries more than
#      MESHNET_NAT_SOAK_MIB MiB of activations (frames and answers) meanwhile (the load runs
#      again, up to MESHNET_NAT_SOAK_ROUNDS rounds in all, while it has carried less);
#   5. prints decode tokens/s, one chat at a time and during the soak, and each hop's path.
#
# Environment:
#   MESHNET_BIN              meshnet-peer binary for `run` (default target/debug/meshnet-peer)
#   MESHNET_NAT_TIMEOUT      seconds to wait for a process to serve, or the mesh to cover the
#                            model (default 180)
#   MESHNET_NAT_SOAK_SECONDS how long `run` chats through the relayed hop (default 130)
#   MESHNET_NAT_SOAK_MIB     MiB B's relayed hop must carry during it (default 10)
#   MESHNET_NAT_SOAK_CLIENTS chats running at once during it (default 1: one after another)
#   MESHNET_NAT_SOAK_ROUNDS  most rounds of the soak a slow machine gets to carry it (default 4)
#   MESHNET_NAT_SPEED_CHATS  chats (64 tokens each) per mesh in `speed` (default 5)
#   MESHNET_NAT_DELAY_MS     netem delay on each WAN link (default 15; 0: none)
#   MESHNET_NAT_KEEP         1: keep the run directory (logs, data dirs) even on success
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# --- names and addresses -----------------------------------------------------------------------

prefix=mnat-
ns_inet=mnat-inet
ns_trk=mnat-trk
bridge=mnat-br
inet_net=198.51.100
tracker_ip=$inet_net.10
# Per site (a, b, c): its router's namespace, WAN address, LAN /24 and how it masquerades.
sites=(a b c)
declare -A router_ns=([a]=mnat-ra [b]=mnat-rb [c]=mnat-rc)
declare -A host_ns=([a]=mnat-a [b]=mnat-b [c]=mnat-c)
declare -A wan_ip=([a]=$inet_net.11 [b]=$inet_net.12 [c]=$inet_net.13)
declare -A lan_net=([a]=10.0.1 [b]=10.0.2 [c]=10.0.3)
declare -A nat_kind=([a]=port-preserving [b]=random-fully [c]=port-preserving)
# Interface names inside the namespaces (the same in each) and the bridge ports in mnat-inet.
if_wan=mnat-wan
if_lan=mnat-lan
if_host=mnat-eth
declare -A bridge_port=([trk]=mnat-p-trk [a]=mnat-p-ra [b]=mnat-p-rb [c]=mnat-p-rc)

delay_ms=${MESHNET_NAT_DELAY_MS:-15}
# 1: the routers forward TCP 8080 and TCP/UDP 4001 on their WAN address to their host (`speed`).
forward_ports=0
timeout=${MESHNET_NAT_TIMEOUT:-180}

usage() {
  sed -n '2,71s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
}

say() { printf 'nat.sh: %s\n' "$*" >&2; }
die() {
  say "$*"
  exit 1
}

# --- namespaces --------------------------------------------------------------------------------

# in_ns NS CMD...: runs CMD in network namespace NS.
in_ns() {
  local ns=$1
  shift
  ip netns exec "$ns" "$@"
}

# The testbed's namespaces that exist now (ours and leftovers of an earlier run).
our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix" || true
}

# Links in the root namespace named with the prefix. The testbed creates none there (veths are
# created straight in their namespaces), but `down` removes any it finds.
our_root_links() {
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^$prefix" || true
}

make_ns() {
  local ns=$1
  ip netns add "$ns"
  in_ns "$ns" ip link set lo up
  # IPv4 only: no IPv6 addresses or router solicitations on the links.
  in_ns "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
  in_ns "$ns" sysctl -qw net.ipv6.conf.default.disable_ipv6=1 2>/dev/null || true
}

# veth NS1 IF1 NS2 IF2: a veth pair with one end in each namespace, both up.
veth() {
  ip link add "$2" netns "$1" type veth peer name "$4" netns "$3"
  in_ns "$1" ip link set "$2" up
  in_ns "$3" ip link set "$4" up
}

# wan_link NS NAME: links NS to the internet bridge with interface mnat-wan in NS.
wan_link() {
  local ns=$1 name=$2
  veth "$ns" "$if_wan" "$ns_inet" "${bridge_port[$name]}"
  in_ns "$ns_inet" ip link set "${bridge_port[$name]}" master "$bridge"
}

netem_note=""
netem_probed=0
# add_delay NS: netem delay on NS's WAN interface (egress), when the kernel has netem.
add_delay() {
  local ns=$1
  [ "$delay_ms" != 0 ] || return 0
  [ -z "$netem_note" ] || return 0
  if [ "$netem_probed" -eq 0 ]; then
    netem_probed=1
    if command -v modprobe >/dev/null 2>&1; then modprobe -q sch_netem 2>/dev/null || true; fi
  fi
  if ! command -v tc >/dev/null 2>&1; then
    netem_note="tc (iproute2) is not installed: WAN links get no added delay"
  elif ! in_ns "$ns" tc qdisc add dev "$if_wan" root netem delay "${delay_ms}ms" 2>/dev/null; then
    netem_note="the kernel has no netem (sch_netem): WAN links get no added delay"
  fi
}

# router SITE: the router namespace of SITE, its WAN and LAN, NAT and firewall; and the host.
router() {
  local site=$1
  local r=${router_ns[$site]} h=${host_ns[$site]} net=${lan_net[$site]}
  make_ns "$r"
  make_ns "$h"
  wan_link "$r" "$site"
  in_ns "$r" ip addr add "${wan_ip[$site]}/24" dev "$if_wan"
  veth "$r" "$if_lan" "$h" "$if_host"
  in_ns "$r" ip addr add "$net.1/24" dev "$if_lan"
  in_ns "$h" ip addr add "$net.2/24" dev "$if_host"
  in_ns "$h" ip route add default via "$net.1"
  in_ns "$r" sysctl -qw net.ipv4.ip_forward=1
  # NAT: Linux keeps the source port when it is free on the WAN address (what port-preserving
  # home routers do); --random-fully picks a random port for every connection.
  local masq=(-j MASQUERADE)
  [ "${nat_kind[$site]}" = random-fully ] && masq+=(--random-fully)
  in_ns "$r" iptables -t nat -A POSTROUTING -o "$if_wan" "${masq[@]}"
  # Forwarding: the LAN opens connections; only their answers come back in.
  in_ns "$r" iptables -P FORWARD DROP
  in_ns "$r" iptables -A FORWARD -i "$if_lan" -o "$if_wan" -j ACCEPT
  in_ns "$r" iptables -A FORWARD -i "$if_wan" -o "$if_lan" \
    -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  if [ "$forward_ports" -eq 1 ]; then
    # Port forwarding, as a volunteer may set up on a home router.
    local forward
    for forward in tcp/8080 tcp/4001 udp/4001; do
      in_ns "$r" iptables -t nat -A PREROUTING -i "$if_wan" -p "${forward%/*}" \
        --dport "${forward#*/}" -j DNAT --to-destination "$net.2"
    done
    in_ns "$r" iptables -A FORWARD -i "$if_wan" -o "$if_lan" -m conntrack --ctstate DNAT \
      -j ACCEPT
  fi
  # The router itself answers nothing unsolicited on its WAN (no TCP RST, no ICMP port
  # unreachable). Dropping here also keeps conntrack from confirming an entry for a packet
  # that arrives before the LAN host's own packet to the same peer: such an entry would take
  # the host's port, and the host's packet would leave with another one (no hole punch).
  in_ns "$r" iptables -A INPUT -i "$if_wan" -m conntrack ! --ctstate ESTABLISHED,RELATED -j DROP
  add_delay "$r"
}

topology_up() {
  local leftovers
  leftovers=$(our_namespaces)
  if [ -n "$leftovers" ] || [ -n "$(our_root_links)" ]; then
    say "removing what an earlier run left: $(echo "$leftovers" | tr '\n' ' ')"
    teardown
  fi
  say "building the topology"
  make_ns "$ns_inet"
  in_ns "$ns_inet" ip link add "$bridge" type bridge
  in_ns "$ns_inet" ip link set "$bridge" up
  make_ns "$ns_trk"
  wan_link "$ns_trk" trk
  in_ns "$ns_trk" ip addr add "$tracker_ip/24" dev "$if_wan"
  add_delay "$ns_trk"
  local site
  for site in "${sites[@]}"; do
    router "$site"
  done
  [ -z "$netem_note" ] || say "note: $netem_note"
}

print_topology() {
  local delay="no added delay"
  if [ "$delay_ms" != 0 ] && [ -z "$netem_note" ]; then delay="netem ${delay_ms}ms per WAN link"; fi
  printf 'internet %s.0/24: bridge %s in netns %s (%s)\n' "$inet_net" "$bridge" "$ns_inet" "$delay"
  printf '  %-9s netns %-9s %s\n' tracker "$ns_trk" "$tracker_ip"
  local site
  for site in "${sites[@]}"; do
    printf '  %-9s netns %-9s WAN %s  LAN %s.1/24  MASQUERADE %s%s\n' "router $site" \
      "${router_ns[$site]}" "${wan_ip[$site]}" "${lan_net[$site]}" "${nat_kind[$site]}" \
      "$([ "$forward_ports" -eq 0 ] || echo ', forwards tcp/8080 tcp/4001 udp/4001')"
    printf '  %-9s netns %-9s %s.2 via %s.1\n' "host $site" "${host_ns[$site]}" \
      "${lan_net[$site]}" "${lan_net[$site]}"
  done
  printf 'a shell in one: ip netns exec mnat-a bash    remove it all: testnet/nat.sh down\n'
}

# kill_ns_processes NS...: SIGTERM to every process in the namespaces, again after ~5 s (a
# leaving meshnet-peer stops at once on the second), SIGKILL after ~10 s.
kill_ns_processes() {
  local ns pids round i
  for round in TERM TERM KILL; do
    pids=()
    for ns in "$@"; do
      mapfile -t -O "${#pids[@]}" pids < <(ip netns pids "$ns" 2>/dev/null || true)
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    [ "$round" = KILL ] && say "sending SIGKILL to ${#pids[@]} process(es) that did not stop"
    kill "-$round" "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      any_alive "${pids[@]}" || return 0
      sleep 0.1
    done
  done
}

# Whether any of the pids is a live (not zombie) process.
any_alive() {
  local pid stat
  for pid in "$@"; do
    stat=$(ps -o stat= -p "$pid" 2>/dev/null) || continue
    case $stat in Z*) ;; *) return 0 ;; esac
  done
  return 1
}

# Stops every process in the testbed's namespaces and deletes the namespaces (their veths and
# the bridge go with them) and any prefixed link left in the root namespace. Idempotent.
teardown() {
  local nss=() ns link
  mapfile -t nss < <(our_namespaces)
  if [ ${#nss[@]} -gt 0 ]; then
    kill_ns_processes "${nss[@]}"
    for ns in "${nss[@]}"; do
      ip netns del "$ns" 2>/dev/null || say "could not delete netns $ns"
    done
  fi
  for link in $(our_root_links); do
    ip link del "$link" 2>/dev/null || true
  done
}

down() {
  local nss
  nss=$(our_namespaces)
  if [ -z "$nss" ] && [ -z "$(our_root_links)" ]; then
    say "nothing of the testbed is up"
    return 0
  fi
  say "removing $(echo "$nss" | tr '\n' ' ')"
  teardown
  nss=$(our_namespaces)
  [ -z "$nss" ] || die "namespaces left: $nss"
  [ -z "$(our_root_links)" ] || die "links left: $(our_root_links | tr '\n' ' ')"
  say "down: no namespace or link of the testbed is left"
}

need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 ||
      die "$tool is needed (apt-get install iproute2 iptables curl python3; or scripts/setup.sh --dev)"
  done
}

preflight() {
  [ "$(id -u)" -eq 0 ] || die "network namespaces need root"
  need ip iptables python3
  # Namespaced processes get the same python without a version manager's shim in between.
  py=$(python3 -c 'import sys; print(sys.executable)')
}

# --- the run directory and the processes it starts ---------------------------------------------

run_dir=""
started=()   # pids of the processes started by this run
cleaned=0
keep_up=0    # `up`: leave the topology up on success
succeeded=0

new_run_dir() {
  run_dir=$(mktemp -d "${TMPDIR:-/tmp}/meshnet-nat.XXXXXX")
  mkdir -p "$run_dir/logs"
}

# spawn NAME NS CMD...: starts CMD in NS in the background, output to logs/NAME.log; sets
# spawned_pid. `ip netns exec` and `env` exec, so the pid is the command's own.
spawned_pid=""
spawn() {
  local name=$1 ns=$2
  shift 2
  printf '===== %s in %s: %s =====\n' "$name" "$ns" "$*" >>"$run_dir/logs/$name.log"
  ip netns exec "$ns" env NO_COLOR=1 "$@" </dev/null >>"$run_dir/logs/$name.log" 2>&1 &
  spawned_pid=$!
  started+=("$spawned_pid")
  printf '%s %s\n' "$name" "$spawned_pid" >>"$run_dir/pids"
}

alive() { any_alive "$1"; }

show_logs() {
  local log
  [ -n "$run_dir" ] || return 0
  for log in "$run_dir"/logs/*.log; do
    [ -f "$log" ] || continue
    printf '\n----- last lines of %s -----\n' "$log" >&2
    tail -n 30 "$log" >&2
  done
}

# shellcheck disable=SC2317  # called from the trap
cleanup() {
  local status=$?
  [ "$cleaned" -eq 0 ] || return 0
  cleaned=1
  trap - INT TERM
  if [ "$keep_up" -eq 1 ] && [ "$succeeded" -eq 1 ]; then
    return 0
  fi
  # Every process this run started runs in one of the namespaces: teardown stops them all.
  teardown
  local pid
  for pid in "${started[@]+"${started[@]}"}"; do
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  if [ -n "$run_dir" ]; then
    if [ "$succeeded" -eq 1 ] && [ "${MESHNET_NAT_KEEP:-0}" != 1 ]; then
      rm -rf "$run_dir"
    else
      say "logs and data: $run_dir"
    fi
  fi
  return "$status"
}

arm_cleanup() {
  trap cleanup EXIT
  trap 'say "interrupted"; exit 130' INT
  trap 'say "terminated"; exit 143' TERM
}

# wait_for DESC SECONDS CMD...: polls CMD (every 0.2 s) until it succeeds; whether it did
# within SECONDS.
wait_for() {
  local desc=$1 seconds=$2 deadline
  shift 2
  deadline=$((SECONDS + seconds))
  until "$@"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "gave up after ${seconds}s waiting for $desc"
      return 1
    fi
    sleep 0.2
  done
}

# --- selftest ----------------------------------------------------------------------------------

# The probes the selftest runs in the namespaces.
write_probe() {
  cat >"$run_dir/probe.py" <<'PY'
"""Small network probes for testnet/nat.sh selftest."""
import socket
import sys
import threading
import time


def serve(port):
    """TCP and UDP on PORT: answers every connection and datagram with the address it came from."""
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(64)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))

    def udp_loop():
        while True:
            _, addr = udp.recvfrom(2048)
            udp.sendto(f"{addr[0]} {addr[1]}\n".encode(), addr)

    threading.Thread(target=udp_loop, daemon=True).start()
    print(f"listening on {port}", flush=True)
    while True:
        conn, addr = tcp.accept()
        with conn:
            conn.sendall(f"{addr[0]} {addr[1]}\n".encode())


def ask(proto, host, port, count):
    """COUNT exchanges with a `serve`, each from a new ephemeral port: prints
    'LOCAL_PORT SEEN_IP SEEN_PORT' per exchange ('LOCAL_PORT - -' when nothing answered)."""
    for _ in range(count):
        data = b""
        if proto == "tcp":
            with socket.create_connection((host, port), timeout=3) as s:
                local = s.getsockname()[1]
                while not data.endswith(b"\n"):
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("0.0.0.0", 0))
                s.settimeout(0.5)
                local = s.getsockname()[1]
                for _ in range(6):
                    s.sendto(b"hello", (host, port))
                    try:
                        data, _ = s.recvfrom(256)
                        break
                    except socket.timeout:
                        pass
        seen = data.decode().split() or ["-", "-"]
        print(local, *seen, flush=True)


def dial(proto, host, port, wait):
    """One unsolicited attempt: prints answered, refused or timeout."""
    if proto == "tcp":
        try:
            socket.create_connection((host, port), timeout=wait).close()
            print("answered")
        except socket.timeout:
            print("timeout")
        except ConnectionRefusedError:
            print("refused")
        except OSError as error:
            print(f"error {error}")
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(wait)
        try:
            s.sendto(b"hello", (host, port))
            s.recvfrom(256)
            print("answered")
        except socket.timeout:
            print("timeout")
        except ConnectionRefusedError:
            print("refused")


def punch_udp(local_port, peer_ip, peer_port, seconds, name):
    """Sends a datagram to the peer's public address every 100 ms from a fixed port; once one
    of the peer's arrives, keeps sending for a second (so the peer gets one too). Prints
    'got NAME from IP:PORT' or 'nothing'."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", local_port))
    s.settimeout(0.02)
    end = time.monotonic() + seconds
    got, linger = None, None
    while time.monotonic() < end:
        s.sendto(f"punch {name}".encode(), (peer_ip, peer_port))
        next_send = time.monotonic() + 0.1
        while time.monotonic() < next_send:
            try:
                data, addr = s.recvfrom(256)
            except (socket.timeout, ConnectionRefusedError):
                continue
            if got is None and data.startswith(b"punch "):
                got = (data.decode().split()[1], addr)
                linger = time.monotonic() + 1.0
        if linger is not None and time.monotonic() > linger:
            break
    print(f"got {got[0]} from {got[1][0]}:{got[1][1]}" if got else "nothing", flush=True)


def punch_tcp(local_port, peer_ip, peer_port, seconds, name):
    """TCP simultaneous open: connects from a fixed port to the peer's public address while
    the peer does the same; on a connection each side sends its name. Prints
    'got NAME from IP:PORT' or 'nothing'."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", local_port))
        s.settimeout(max(0.1, end - time.monotonic()))
        try:
            s.connect((peer_ip, peer_port))
            s.sendall(f"punch {name}\n".encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
            addr = s.getpeername()
            s.close()
            if data.startswith(b"punch "):
                print(f"got {data.decode().split()[1]} from {addr[0]}:{addr[1]}", flush=True)
                return
        except socket.timeout:
            s.close()
            break
        except OSError:
            s.close()
            time.sleep(0.2)
    print("nothing", flush=True)


def main():
    cmd, *args = sys.argv[1:]
    if cmd == "serve":
        serve(int(args[0]))
    elif cmd == "ask":
        ask(args[0], args[1], int(args[2]), int(args[3]))
    elif cmd == "dial":
        dial(args[0], args[1], int(args[2]), float(args[3]))
    elif cmd == "punch":
        fn = punch_udp if args[0] == "udp" else punch_tcp
        fn(int(args[1]), args[2], int(args[3]), float(args[4]), args[5])
    else:
        sys.exit(f"unknown probe {cmd}")


main()
PY
}

probe() {
  local ns=$1
  shift
  in_ns "$ns" "$py" "$run_dir/probe.py" "$@"
}

failures=0
checks=0
ok() {
  checks=$((checks + 1))
  printf 'ok      %s\n' "$*"
}
failed() {
  checks=$((checks + 1))
  failures=$((failures + 1))
  printf 'FAILED  %s\n' "$*"
}

echo_port=7000

# check_reach SITE PROTO COUNT: SITE's host talks to the tracker's echo server COUNT times;
# leaves the "LOCAL SEEN_IP SEEN_PORT" lines in reach_lines.
reach_lines=""
check_reach() {
  local site=$1 proto=$2 count=$3 host=${host_ns[$1]}
  reach_lines=$(probe "$host" ask "$proto" "$tracker_ip" "$echo_port" "$count" 2>&1) || true
  if [ "$(awk 'NF == 3 && $2 != "-"' <<<"$reach_lines" | wc -l)" -eq "$count" ]; then
    ok "(1) host $site reaches the tracker over $proto"
    return 0
  fi
  failed "(1) host $site reaches the tracker over $proto: $(tail -n 3 <<<"$reach_lines" | tr '\n' ';')"
  return 1
}

# check_mapping SITE PROTO: whether the tracker saw SITE's exchanges (reach_lines) from its
# router's WAN address, with the host's own ports (port-preserving) or with none of them
# (random-fully).
check_mapping() {
  local site=$1 proto=$2 kind=${nat_kind[$1]} line local_port seen_ip seen_port
  local kept=0 changed=0 wrong_ip="" seen=""
  while read -r local_port seen_ip seen_port; do
    [ -n "$local_port" ] || continue
    seen+="$local_port->$seen_ip:$seen_port "
    [ "$seen_ip" = "${wan_ip[$site]}" ] || wrong_ip+="$seen_ip "
    if [ "$local_port" = "$seen_port" ]; then kept=$((kept + 1)); else changed=$((changed + 1)); fi
  done <<<"$reach_lines"
  line="(2) $proto from host $site is seen from ${wan_ip[$site]}"
  if [ -n "$wrong_ip" ] || [ $((kept + changed)) -eq 0 ]; then
    failed "$line: seen ${seen:-nothing}"
  elif [ "$kind" = port-preserving ] && [ "$changed" -eq 0 ]; then
    ok "$line with the same source port (${seen% })"
  elif [ "$kind" = random-fully ] && [ "$kept" -eq 0 ] && [ "$changed" -ge 2 ]; then
    ok "$line with a new source port every time (${seen% })"
  else
    failed "$line, $kind: ports $seen"
  fi
}

# punch PROTO PORT SITE1 SITE2: both hosts punch towards the other's WAN address at once from
# local port PORT; sets punch_result to "SITE1-RESULT|SITE2-RESULT".
punch_result=""
punch() {
  local proto=$1 port=$2 s1=$3 s2=$4 f1=$run_dir/punch.$1.$3 f2=$run_dir/punch.$1.$4 p1 p2
  probe "${host_ns[$s1]}" punch "$proto" "$port" "${wan_ip[$s2]}" "$port" 5 "$s1" >"$f1" 2>&1 &
  p1=$!
  probe "${host_ns[$s2]}" punch "$proto" "$port" "${wan_ip[$s1]}" "$port" 5 "$s2" >"$f2" 2>&1 &
  p2=$!
  wait "$p1" || true
  wait "$p2" || true
  punch_result="$(tr '\n' ' ' <"$f1" | sed 's/ $//')|$(tr '\n' ' ' <"$f2" | sed 's/ $//')"
}

# check_punch PROTO PORT SITE1 SITE2 EXPECT (works | fails)
check_punch() {
  local proto=$1 port=$2 s1=$3 s2=$4 expect=$5 r1 r2 n
  punch "$proto" "$port" "$s1" "$s2"
  r1=${punch_result%%|*}
  r2=${punch_result#*|}
  n=$([ "$expect" = works ] && echo 4 || echo 5)
  local line="($n) $proto hole punch between host $s1 and host $s2 $expect"
  local want1="got $s2 from ${wan_ip[$s2]}:$port" want2="got $s1 from ${wan_ip[$s1]}:$port"
  if [ "$expect" = works ]; then
    if [ "$r1" = "$want1" ] && [ "$r2" = "$want2" ]; then
      ok "$line ($s1: $r1; $s2: $r2)"
    else
      failed "$line: $s1: $r1; $s2: $r2"
    fi
  else
    if [ "$r1" = nothing ] && [ "$r2" = nothing ]; then
      ok "$line (neither side got a packet)"
    else
      failed "$line: $s1: $r1; $s2: $r2"
    fi
  fi
}

selftest() {
  preflight
  arm_cleanup
  new_run_dir
  topology_up
  print_topology
  write_probe

  # The tracker's echo server, and a listener on host a for the unsolicited-inbound check.
  spawn echo "$ns_trk" "$py" "$run_dir/probe.py" serve "$echo_port"
  spawn listener-a "${host_ns[a]}" "$py" "$run_dir/probe.py" serve 4001
  wait_for "the tracker's echo server" 10 grep -q listening "$run_dir/logs/echo.log" ||
    die "the echo server did not start: $(cat "$run_dir/logs/echo.log")"
  wait_for "host a's listener" 10 grep -q listening "$run_dir/logs/listener-a.log" ||
    die "host a's listener did not start: $(cat "$run_dir/logs/listener-a.log")"

  # (1) and (2): two exchanges per protocol from a and c, three from b.
  local site proto count
  for site in "${sites[@]}"; do
    count=2
    if [ "${nat_kind[$site]}" = random-fully ]; then count=3; fi
    for proto in tcp udp; do
      if check_reach "$site" "$proto" "$count"; then
        check_mapping "$site" "$proto"
      else
        failed "(2) $proto mapping of host $site: it did not reach the tracker"
      fi
    done
  done

  # (3) host a's listener answers on its LAN but not from the internet.
  local answer
  answer=$(probe "${router_ns[a]}" dial tcp "${lan_net[a]}.2" 4001 2 2>&1 || true)
  if [ "$answer" != answered ]; then
    failed "(3) host a's listener does not answer on its own LAN ($answer): the check below proves nothing"
  fi
  answer=$(probe "$ns_trk" dial tcp "${wan_ip[a]}" 4001 3 2>&1 || true)
  if [ "$answer" = timeout ]; then
    ok "(3) unsolicited TCP from the tracker to ${wan_ip[a]}:4001 is dropped (no answer in 3 s)"
  else
    failed "(3) unsolicited TCP from the tracker to ${wan_ip[a]}:4001: $answer (expected no answer)"
  fi
  answer=$(probe "$ns_trk" dial udp "${wan_ip[a]}" 4001 2 2>&1 || true)
  if [ "$answer" = timeout ]; then
    ok "(3) unsolicited UDP from the tracker to ${wan_ip[a]}:4001 is dropped (no answer in 2 s)"
  else
    failed "(3) unsolicited UDP from the tracker to ${wan_ip[a]}:4001: $answer (expected no answer)"
  fi

  # (4) hole punching between the port-preserving NATs; (5) not through the randomising one.
  # Each pair uses its own ports, so no conntrack entry of an earlier check helps.
  check_punch udp 40001 a c works
  check_punch tcp 40002 a c works
  check_punch udp 40003 a b fails
  check_punch tcp 40004 a b fails

  if [ "$failures" -gt 0 ]; then
    show_logs
    die "selftest: $failures of $checks checks FAILED"
  fi
  say "selftest: all $checks checks ok; tearing down"
  succeeded=1
}

# --- run: the mesh across the NATs -------------------------------------------------------------

# json_get JSON EXPR: EXPR (Python, over the parsed JSON `s`) printed: strings bare, other
# values as JSON; exits 1 when JSON does not parse or EXPR fails (a missing key).
json_get() {
  python3 -c '
import json, sys
try:
    s = json.loads(sys.argv[1])
    v = eval(sys.argv[2], {"s": s})
except (ValueError, KeyError, IndexError, TypeError):
    sys.exit(1)
print(v if isinstance(v, str) else json.dumps(v))' "$1" "$2"
}

# ns_get NS PATH: GET http://127.0.0.1:8080/PATH from inside NS (empty on no answer).
ns_get() {
  in_ns "$1" curl -sf -m 5 "http://127.0.0.1:8080/$2" 2>/dev/null || true
}

# fail ASSERTION DETAIL...: the run's failure, naming the assertion.
fail() {
  local what=$1
  shift
  say "FAILED: $what${*:+: $*}"
  show_logs
  # Once more after the logs, where it is seen.
  say "FAILED: $what${*:+: $*}"
  exit 1
}

declare -A proc_pid=() peer_id=()
data_suffix=""  # `speed`: each mesh's data directories apart
declare -A proc_ns=([tracker]=$ns_trk [a]=mnat-a [b]=mnat-b [c]=mnat-c)

# start_member NAME ARGS...: meshnet-peer in NAME's namespace.
start_member() {
  local name=$1
  shift
  local p2p=(--p2p /ip4/0.0.0.0/tcp/4001 --p2p /ip4/0.0.0.0/udp/4001/quic-v1)
  if [ "$private" -eq 1 ]; then
    p2p=(--p2p /ip4/0.0.0.0/tcp/4001 --swarm-key "$run_dir/swarm.key")
  fi
  spawn "$name" "${proc_ns[$name]}" "$bin" --model "$model" --data-dir "$run_dir/data$data_suffix/$name" \
    --announce-interval 0.5 --http 0.0.0.0:8080 "${p2p[@]}" "$@"
  proc_pid[$name]=$spawned_pid
}

check_alive() {
  local name
  for name in "${!proc_pid[@]}"; do
    alive "${proc_pid[$name]}" || fail "startup" "$name (pid ${proc_pid[$name]}) exited"
  done
}

# serving NAME: whether NAME's own /status shows a ready span and nothing loading.
serving() {
  check_alive
  local report
  report=$(ns_get "${proc_ns[$1]}" status)
  [ -n "$report" ] && python3 -c '
import json, sys
s = json.loads(sys.argv[1])
sys.exit(0 if (s.get("span") or {}).get("state") == "ready" and not s.get("loading") else 1)' \
    "$report"
}

# covered: whether the tracker's /status shows complete coverage with A, B and C in its map,
# each with a ready span.
covered() {
  check_alive
  local report
  report=$(ns_get "$ns_trk" status)
  [ -n "$report" ] && python3 -c '
import json, sys
s = json.loads(sys.argv[1])
ids = sys.argv[2:]
spans = {p.get("peer"): p.get("span") or {} for p in s.get("peers") or []}
ok = (s.get("coverage") or {}).get("complete") and s.get("route_boundaries") is not None \
    and all(spans.get(i, {}).get("state") == "ready" for i in ids)
sys.exit(0 if ok else 1)' "$report" "${peer_id[a]}" "${peer_id[b]}" "${peer_id[c]}"
}

# reserved: whether A, B and C each report a relayed address (a relay reservation on the
# tracker) in their own /status: members behind NAT are reached through them until a direct
# connection exists. Names the ones without in `unreserved`.
unreserved=""
reserved() {
  check_alive
  local name addresses
  unreserved=""
  for name in a b c; do
    addresses=$(json_get "$(ns_get "${proc_ns[$name]}" status)" \
      'len(s["network"]["relayed_addresses"])' 2>/dev/null || echo 0)
    [ "$addresses" -gt 0 ] || unreserved+="$name "
  done
  [ -z "$unreserved" ]
}

tracker_answers() {
  check_alive
  [ -n "$(ns_get "$ns_trk" status)" ]
}

# The --memory that holds exactly LAYERS layers (model-info --layers, as local.sh does).
budget() {
  local out
  out=$("$bin" model-info --model "$model" --layers "$@") ||
    fail "startup" "meshnet-peer model-info --layers $* failed"
  json_get "$out" 's["memory_for_layers"]'
}

# Who holds which layers, in route order, from the tracker's /status; fails unless the route
# is tracker -> a -> c -> b.
check_route_order() {
  local report=$1 order
  order=$(python3 -c '
import json, sys
s = json.loads(sys.argv[1])
names = dict(zip(sys.argv[3::2], sys.argv[2::2]))
rows = [(tuple((s.get("span") or {}).get("layers") or [0, 0]), "tracker")]
for p in s.get("peers") or []:
    if p.get("peer") in names and p.get("peer") != s.get("peer"):
        rows.append((tuple((p.get("span") or {}).get("layers") or [0, 0]), names[p["peer"]]))
rows.sort()
for layers, name in rows:
    print(f"  {name:<8} layers {layers[0]:>2}-{layers[1]:<2}", file=sys.stderr)
print(" ".join(name for _, name in rows))' "$report" \
    a "${peer_id[a]}" b "${peer_id[b]}" c "${peer_id[c]}")
  [ "$order" = "tracker a c b" ] ||
    fail "route order" "the spans put the route through '$order', expected 'tracker a c b'"
}

openai_url=http://$tracker_ip:8080/v1
chat_prompt="What is the capital of France?"
chat_max_tokens=24

# (1) a greedy chat through the tracker equals generate --chat at the route boundaries.
check_chat() {
  local models model_id before after body answer code text expected boundaries
  models=$(in_ns "$ns_trk" curl -sf -m 10 "$openai_url/models") ||
    fail "1 chat" "GET $openai_url/models failed"
  model_id=$(json_get "$models" 's["data"][0]["id"]') || fail "1 chat" "no model in /v1/models"
  before=$(json_get "$(ns_get "$ns_trk" status)" 's["route_boundaries"]') ||
    fail "1 chat" "the tracker's /status has no route_boundaries"
  body=$(python3 -c '
import json, sys
print(json.dumps({"model": sys.argv[1], "messages": [{"role": "user", "content": sys.argv[2]}],
                  "max_tokens": int(sys.argv[3]), "temperature": 0}))' \
    "$model_id" "$chat_prompt" "$chat_max_tokens")
  answer=$(in_ns "$ns_trk" curl -s -m 300 -o - -w '\n%{http_code}' \
    -H 'Content-Type: application/json' -d "$body" "$openai_url/chat/completions") || true
  code=$(tail -n 1 <<<"$answer")
  answer=$(sed '$d' <<<"$answer")
  [ "$code" = 200 ] || fail "1 chat" "POST $openai_url/chat/completions answered $code: $answer"
  text=$(json_get "$answer" 's["choices"][0]["message"]["content"]') ||
    fail "1 chat" "no message content in: $answer"
  after=$(json_get "$(ns_get "$ns_trk" status)" 's["route_boundaries"]') || after=none
  [ "$before" = "$after" ] ||
    fail "1 chat" "the route boundaries moved from $before to $after during the chat"
  boundaries=$(json_get "$before" '",".join(str(b) for b in s)')
  expected=$("$bin" generate --model "$model" --chat --prompt "$chat_prompt" \
    --max-tokens "$chat_max_tokens" --boundaries "$boundaries" 2>"$run_dir/logs/generate.log") ||
    fail "1 chat" "meshnet-peer generate failed (logs/generate.log)"
  if [ "$text" != "$expected" ]; then
    fail "1 chat" "the mesh answered $(printf '%q' "$text"), generate --chat --boundaries" \
      "$boundaries gives $(printf '%q' "$expected")"
  fi
  say "1 chat ok: the mesh's answer equals generate --chat --boundaries $boundaries:" \
    "$(printf '%q' "$text")"
}

# path_of NS PEER_ID: network.paths[PEER_ID] in NS's member's /status (empty when absent).
path_of() {
  json_get "$(ns_get "$1" status)" "s[\"network\"][\"paths\"][\"$2\"]" 2>/dev/null || true
}

# print_paths: every member's network.reachability and its path to each other member (its own
# /status), as a matrix: row FROM, column TO.
print_paths() {
  python3 - "$(ns_get "$ns_trk" status)" "$(ns_get mnat-a status)" "$(ns_get mnat-b status)" \
    "$(ns_get mnat-c status)" "${peer_id[tracker]}" "${peer_id[a]}" "${peer_id[b]}" \
    "${peer_id[c]}" <<'PY' >&2
import json, sys
names = ["tracker", "a", "b", "c"]
reports = [json.loads(r) if r else {} for r in sys.argv[1:5]]
ids = sys.argv[5:9]
print(f"  {'from/to':<10} {'reachability':<13} " + " ".join(f"{n:<13}" for n in names))
for name, report in zip(names, reports):
    network = report.get("network") or {}
    paths = network.get("paths") or {}
    cells = ["-" if n == name else paths.get(i, "<none>") for n, i in zip(names, ids)]
    print(f"  {name:<10} {network.get('reachability', '<none>'):<13} "
          + " ".join(f"{c:<13}" for c in cells))
PY
}

# hop_path FROM TO: FROM's path to TO (names), from FROM's own /status.
hop_path() {
  path_of "${proc_ns[$1]}" "${peer_id[$2]}"
}

# (2) paths: the tracker reports its network; every hop's path from the hop before it (each
# member reports how activations from it reach the others); B's hop is relayed (A cannot dial
# B, and B's randomising NAT defeats a hole punch); A reaches C directly after a hole punch.
check_paths() {
  local report
  report=$(ns_get "$ns_trk" status)
  json_get "$report" 's["network"]["reachability"]' >/dev/null ||
    fail "2 paths" "the tracker's /status has no network.reachability (network:" \
      "$(json_get "$report" 's.get("network")'))"
  json_get "$report" 's["network"]["paths"]' >/dev/null ||
    fail "2 paths" "the tracker's /status has no network.paths"
  # The chat above made A forward to C over the tracker's relay, which starts a hole punch
  # (DCUtR) between them; once it succeeds the relayed connection is closed.
  if ! wait_for "A's path to C to become direct-p2p" 60 a_reaches_c_direct; then
    print_paths
    fail "2 paths" "A's /status network.paths[C] is '$(hop_path a c)' after 60 s, expected" \
      "direct-p2p (a hole punch between the two port-preserving NATs)"
  fi
  # C forwarded to B in the chat, so C knows its path to B by now; a deadline anyway.
  wait_for "C's path to B to be known" 30 c_knows_b || true
  local path
  path=$(hop_path c b)
  [ "$path" = relayed ] ||
    fail "2 paths" "B's hop (C's path to B) is '${path:-<none>}', expected relayed"
  say "paths (each member's /status network section: row from, column to):"
  print_paths
  say "route hops: tracker -> a $(hop_path tracker a), a -> c $(hop_path a c)," \
    "c -> b $(hop_path c b)"
  say "2 paths ok: A reaches C direct-p2p after a hole punch; B's hop is relayed"
}

c_knows_b() {
  check_alive
  case $(hop_path c b) in "" | not-connected) return 1 ;; esac
}

a_reaches_c_direct() {
  check_alive
  [ "$(hop_path a c)" = direct-p2p ]
}

# span_of NAME: NAME's span as X-Meshnet-Layers text (start-end), from its own /status.
span_of() {
  json_get "$(ns_get "${proc_ns[$1]}" status)" '"-".join(str(x) for x in s["span"]["layers"])'
}

# forward_status NS URL SESSION LAYERS ROUTE GRANT: POSTs a one-token frame of zeros for
# SESSION and LAYERS (route ROUTE after it, grant GRANT; either may be empty) to URL from NS;
# prints the status code and the answer's error code (`-` when it has none).
forward_status() {
  local ns=$1 url=$2 session=$3 layers=$4 route=$5 grant=$6 code
  local headers=(-H 'Content-Type: application/octet-stream' -H 'X-Meshnet-Wire-Version: 1'
    -H 'X-Meshnet-Dtype: bfloat16' -H "X-Meshnet-Shape: 1,1,$hidden"
    -H "X-Meshnet-Session: $session"
    -H 'X-Meshnet-Chunk-Index: 0' -H 'X-Meshnet-Chunk-Total: 1' -H 'X-Meshnet-Position: 0'
    -H "X-Meshnet-Layers: $layers")
  [ -z "$route" ] || headers+=(-H "X-Meshnet-Route: $route")
  [ -z "$grant" ] || headers+=(-H "X-Meshnet-Grant: $grant")
  head -c $((hidden * 2)) /dev/zero >"$run_dir/frame.bin"
  code=$(in_ns "$ns" curl -s -m 60 -o "$run_dir/forward.out" -w '%{http_code}' "${headers[@]}" \
    --data-binary @"$run_dir/frame.bin" "$url") || code=000
  printf '%s %s\n' "$code" \
    "$(json_get "$(tr -d '\000' <"$run_dir/forward.out")" 's["error"]["code"]' 2>/dev/null || echo -)"
}

# expect_forward WHAT EXPECTED REASON ARGS...: forward_status ARGS must print EXPECTED, and the
# answer's error message must contain REASON.
expect_forward() {
  local what=$1 expected=$2 reason=$3 got message
  shift 3
  got=$(forward_status "$@")
  message=$(json_get "$(tr -d '\000' <"$run_dir/forward.out")" 's["error"]["message"]' 2>/dev/null || true)
  if [ "$got" != "$expected" ] || [[ $message != *"$reason"* ]]; then
    fail "3 grants" "$what: answered '$got' ($(head -c 300 "$run_dir/forward.out")), expected" \
      "'$expected'${reason:+ saying '$reason'}"
  fi
  say "  $what: $got${message:+ ($message)}"
}

# grant SIGNER SESSION ROUTE: a grant signed with SIGNER's identity (its data directory).
grant() {
  "$bin" grant --data-dir "$run_dir/data/$1" --session "$2" --route "$3" ||
    fail "3 grants" "meshnet-peer grant --data-dir data/$1 failed"
}

# (3) grants: /forward over HTTP is for frames the tracker allowed.
check_grants() {
  local a_span c_span route session genuine forged bait_port=9999
  a_span=$(span_of a) && c_span=$(span_of c) || fail "3 grants" "no span in A's or C's /status"
  route="$a_span@/p2p/${peer_id[a]},$c_span@/p2p/${peer_id[c]}"
  # A listener on the internet that a redirected frame would be sent to: it logs a line for
  # every connection it accepts.
  spawn bait "$ns_trk" python3 -c '
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    connection, peer = server.accept()
    print("accepted a connection from", peer, flush=True)
    connection.close()' "$tracker_ip" "$bait_port"
  local bait_pid=$spawned_pid
  wait_for "the bait listener" 10 grep -q '^listening' "$run_dir/logs/bait.log" ||
    fail "3 grants" "the bait listener did not start"
  say "3 grants: /forward with and without the tracker's grant"
  session=$(python3 -c 'import uuid; print(uuid.uuid4())')
  local to_a=("${proc_ns[a]}" http://127.0.0.1:8080/forward "$session" "$a_span")
  expect_forward "no grant, to the tracker from the internet (router A's WAN side)" \
    "401 grant_missing" "" "${router_ns[a]}" "http://$tracker_ip:8080/forward" "$session" \
    "$a_span" "" ""
  expect_forward "no grant, to A from its own LAN" "401 grant_missing" "" "${to_a[@]}" "" ""
  forged=$(grant c "$session" "$route")
  expect_forward "a grant signed by C (a member, not the tracker), to A" "403 grant_refused" \
    "signed by ${peer_id[c]}" "${to_a[@]}" "$c_span@/p2p/${peer_id[c]}" "$forged"
  genuine=$(grant tracker "$session" "$route")
  expect_forward "the tracker's grant, to A with C's hop redirected to the internet" \
    "403 grant_refused" "does not cover" "${to_a[@]}" "$c_span@http://$tracker_ip:$bait_port" "$genuine"
  expect_forward "the tracker's grant, for another session" "403 grant_refused" \
    "does not cover" "${proc_ns[a]}" http://127.0.0.1:8080/forward "$(python3 -c 'import uuid; print(uuid.uuid4())')" \
    "$a_span" "$c_span@/p2p/${peer_id[c]}" "$genuine"
  expect_forward "the tracker's grant, to A with the route it names (A computes, C next)" \
    "200 -" "" "${to_a[@]}" "$c_span@/p2p/${peer_id[c]}" "$genuine"
  # (The log's first lines are the command itself; what the listener prints starts a line.)
  if grep -q '^accepted' "$run_dir/logs/bait.log"; then
    fail "3 grants" "a member connected to the bait listener: $(grep '^accepted' "$run_dir/logs/bait.log")"
  fi
  kill "$bait_pid" 2>/dev/null || true
  say "3 grants ok: no grant 401, a member's forged grant 403, a redirected route 403 (the" \
    "redirect target never contacted), another session 403, the tracker's grant with its" \
    "route 200"
}

# B's activation bytes received and sent (encoded: what crossed the wire; and raw), from its
# /metrics. B is the last hop: all of them travel its one relayed hop, frames from C one way,
# answers the other.
b_wire_bytes() {
  ns_get mnat-b metrics | python3 -c '
import re, sys
totals = {"encoded": 0.0, "raw": 0.0}
for line in sys.stdin:
    m = re.match(r"meshnet_wire_bytes_total\{([^}]*)\}\s+(\S+)", line)
    if not m:
        continue
    labels = dict(re.findall(r"(\w+)=\"([^\"]*)\"", m.group(1)))
    if labels.get("form") in totals:
        totals[labels["form"]] += float(m.group(2))
print(int(totals["encoded"]), int(totals["raw"]))'
}

# The chat load: CLIENTS threads chatting until SECONDS pass; a JSON summary on stdout.
write_load() {
  cat >"$run_dir/load.py" <<'PY'
"""Chats through the tracker's OpenAI API from several threads until a deadline."""
import json
import sys
import threading
import time
import urllib.error
import urllib.request

url, model, seconds, clients, max_tokens, most = sys.argv[1:7]
seconds, clients, max_tokens, most = float(seconds), int(clients), int(max_tokens), int(most)
PROMPTS = [
    "Explain how a bicycle stays upright while it moves.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What are the main differences between a lake and a sea?",
    "Describe the water cycle to a ten year old.",
    "Give three tips for learning to play the piano.",
]
lock = threading.Lock()
results = []  # (status, completion_tokens, seconds, error)
start = time.monotonic()
deadline = start + seconds


def client(k):
    n = 0
    while time.monotonic() < deadline and (most == 0 or n < most):
        prompt = f"{PROMPTS[(k + n) % len(PROMPTS)]} (request {k}.{n})"
        n += 1
        body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        request = urllib.request.Request(url, data=body,
                                         headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.load(response)
                row = (response.status, answer["usage"]["completion_tokens"],
                       time.monotonic() - t0, None)
        except urllib.error.HTTPError as error:
            try:
                detail = error.read()[:300].decode(errors="replace")
            except OSError as read_error:
                detail = repr(read_error)
            row = (error.code, 0, time.monotonic() - t0, detail)
        except Exception as error:  # noqa: BLE001 - every failure is reported
            row = (0, 0, time.monotonic() - t0, repr(error)[:300])
        with lock:
            results.append(row)
        if row[0] != 200:
            # A failing mesh answers at once: do not hammer it.
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))


threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
for t in threads:
    t.start()
last = start
while any(t.is_alive() for t in threads):
    time.sleep(1)
    if time.monotonic() - last >= 10:
        last = time.monotonic()
        with lock:
            done = len(results)
            bad = sum(1 for r in results if r[0] != 200)
        print(f"load: {time.monotonic() - start:.0f}s, {done} chats, {bad} not 200",
              file=sys.stderr, flush=True)
for t in threads:
    t.join()
wall = time.monotonic() - start
errors = [f"{r[0]}: {r[3]}" for r in results if r[0] != 200]
print(json.dumps({
    "requests": len(results), "not_200": len(errors), "errors": errors[:5],
    "completion_tokens": sum(r[1] for r in results), "wall_seconds": wall,
    "request_seconds": sum(r[2] for r in results),
}))
PY
}

# load NAME SECONDS CLIENTS MAX_TOKENS [MOST]: runs the chat load from the tracker's namespace
# (each client makes at most MOST chats; 0, the default: no limit); the summary JSON goes to
# $run_dir/NAME.json.
load() {
  local name=$1
  in_ns "$ns_trk" "$py" "$run_dir/load.py" "$openai_url/chat/completions" "$model_id" \
    "$2" "$3" "$4" "${5:-0}" >"$run_dir/$name.json" 2> >(tee -a "$run_dir/logs/$name.log" >&2) ||
    fail "$name" "the chat load failed (logs/$name.log)"
}

model_id=""
hidden=""
# (4) a relayed hop carries traffic for minutes and megabytes. The load runs for `seconds`, and
# again (up to `rounds` times in all) while B's hop has carried no more than `mib` MiB: what is
# checked is that the relay never cuts a circuit after some bytes or minutes, not how fast a
# machine decodes, so a slow machine gets more time instead of a failure.
check_soak() {
  local seconds=${MESHNET_NAT_SOAK_SECONDS:-130} mib=${MESHNET_NAT_SOAK_MIB:-10}
  local clients=${MESHNET_NAT_SOAK_CLIENTS:-1} rounds=${MESHNET_NAT_SOAK_ROUNDS:-4}
  local before after summary round=0 requests=0 not200=0 wall=0 carried=0 raw=0
  before=$(b_wire_bytes)
  say "4 soak: chats through the tracker for ${seconds}s, $clients at a time (max_tokens 64)," \
    "repeated (at most $rounds rounds) until B's relayed hop has carried more than $mib MiB"
  while [ "$round" -lt "$rounds" ] && [ "$carried" -le $((mib * 1024 * 1024)) ]; do
    round=$((round + 1))
    load soak "$seconds" "$clients" 64
    after=$(b_wire_bytes)
    summary=$(<"$run_dir/soak.json")
    requests=$((requests + $(json_get "$summary" 's["requests"]')))
    not200=$((not200 + $(json_get "$summary" 's["not_200"]')))
    wall=$((wall + $(json_get "$summary" 'round(s["wall_seconds"])')))
    carried=$((${after% *} - ${before% *}))
    raw=$((${after#* } - ${before#* }))
    say "soak round $round: $requests chats in ${wall}s; B's relayed hop carried $carried B on" \
      "the wire ($raw B raw bf16), both ways"
  done
  [ "$requests" -gt 0 ] || fail "4 soak" "no chat was made"
  [ "$not200" -eq 0 ] ||
    fail "4 soak" "$not200 of $requests chats were not answered 200: $(json_get "$summary" 's["errors"]')"
  [ "$wall" -ge "$seconds" ] || fail "4 soak" "the load ran ${wall}s, less than ${seconds}s"
  [ "$carried" -gt $((mib * 1024 * 1024)) ] ||
    fail "4 soak" "B's hop carried $carried bytes in $round rounds (${wall}s), not more than $mib MiB"
  local path
  path=$(hop_path c b)
  [ "$path" = relayed ] || fail "4 soak" "after the soak B's hop (C's path to B) is '$path', not relayed"
  say "4 soak ok: every chat answered 200; B's relayed hop carried" \
    "$((carried / 1024 / 1024)) MiB in ${wall}s"
}

# (5) decode speed: one chat at a time, then the soak's aggregate; and each hop's latency.
report_speed() {
  say "5 speed: three chats one at a time"
  load single 300 1 64 3
  python3 - "$(<"$run_dir/single.json")" "$(<"$run_dir/soak.json")" \
    "${MESHNET_NAT_SOAK_CLIENTS:-1}" <<'PY'
import json, sys
single, soak, clients = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"{'decode speed':<28} {'chats':>6} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'tok/s/chat':>11}")
for name, r in [("one chat at a time", single), (f"soak, {clients} at a time", soak)]:
    per_chat = r["completion_tokens"] / r["request_seconds"] if r["request_seconds"] else 0
    total = r["completion_tokens"] / r["wall_seconds"] if r["wall_seconds"] else 0
    print(f"{name:<28} {r['requests']:>6} {r['completion_tokens']:>7} {r['wall_seconds']:>8.1f} "
          f"{total:>7.1f} {per_chat:>11.1f}")
PY
  python3 - "$(ns_get "$ns_trk" status)" a "${peer_id[a]}" "$(hop_path tracker a)" \
    c "${peer_id[c]}" "$(hop_path a c)" b "${peer_id[b]}" "$(hop_path c b)" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
args = sys.argv[2:]
names = {args[i + 1]: (args[i], args[i + 2]) for i in range(0, len(args), 3)}
print(f"{'hop':<8} {'layers':<8} {'path in':<14} {'forward_latency_ms':>18}")
rows = [("tracker", s.get("span"), "-", s.get("forward_latency_ms"))]
for p in s.get("peers") or []:
    if p.get("peer") in names:
        name, path = names[p["peer"]]
        rows.append((name, p.get("span"), path or "?", p.get("forward_latency_ms")))
rows.sort(key=lambda r: ((r[1] or {}).get("layers") or [1 << 30])[0])
for name, span, path, latency in rows:
    layers = "-".join(str(x) for x in (span or {}).get("layers", [])) or "-"
    latency = f"{latency:.2f}" if isinstance(latency, (int, float)) else "?"
    print(f"{name:<8} {layers:<8} {path:<14} {latency:>18}")
PY
}

# prepare: the binary, the model, a run directory; the members' --memory budgets (as local.sh
# sizes them for one tracker and three peers: the tracker ceil(L/4) layers with its embedding
# and head, the peers the rest as evenly as possible, each with half a layer of slack, never room
# for one more layer, so all four take part).
declare -A share=() memory=()
tracker_layers=0
prepare() {
  preflight
  need curl
  bin=${MESHNET_BIN:-${CARGO_TARGET_DIR:-$repo/target}/debug/meshnet-peer}
  [[ $bin == /* ]] || bin=$PWD/$bin
  [ -x "$bin" ] || die "meshnet-peer binary not found or not executable: $bin (build it with" \
    "cargo build -p meshnet-peer, or set MESHNET_BIN)"
  model=$(bash "$repo/scripts/fetch-model.sh" | tail -n 1)
  [ -f "$model" ] || die "scripts/fetch-model.sh printed no model file ($model)"
  arm_cleanup
  new_run_dir
  write_load
  if [ "$private" -eq 1 ]; then
    "$bin" swarm-key new --out "$run_dir/swarm.key" >&2 || die "meshnet-peer swarm-key new failed"
    say "private mesh: every member gets --swarm-key $run_dir/swarm.key, TCP only"
  fi
  local info layers rest name
  info=$("$bin" model-info --model "$model") || die "meshnet-peer model-info failed"
  layers=$(json_get "$info" 's["layers"]') || die "model-info printed no layer count"
  hidden=$(json_get "$info" 's["hidden"]') || die "model-info printed no hidden size"
  [ "$layers" -ge 4 ] || die "the model has $layers layers: four members need at least 4"
  tracker_layers=$(((layers + 3) / 4))
  rest=$((layers - tracker_layers))
  share=([a]=$((rest / 3 + (rest % 3 > 0))) [c]=$((rest / 3 + (rest % 3 > 1))) [b]=$((rest / 3)))
  memory[tracker]=$(budget "$tracker_layers" --tracker)
  for name in a b c; do memory[$name]=$(budget "${share[$name]}"); done
}

# start_mesh: the topology, then the tracker and peers A, C, B, each once the one before serves;
# returns once the tracker's map covers the model with all three (and, behind the NATs, each
# holds a relay reservation). With forward_ports=1 the routers forward the members' ports and
# the peers run --reachable with their router's WAN address: every hop is direct HTTP.
start_mesh() {
  topology_up
  print_topology
  say "starting the tracker in $ns_trk ($tracker_layers layers, memory ${memory[tracker]} B)"
  start_member tracker --tracker --reachable --memory "${memory[tracker]}"
  wait_for "the tracker's /status" "$timeout" tracker_answers ||
    fail "startup" "the tracker did not answer /status within ${timeout}s"
  local report url
  report=$(ns_get "$ns_trk" status)
  peer_id[tracker]=$(json_get "$report" 's["peer"]') || fail "startup" "no peer id in the tracker's /status"
  url=$(json_get "$report" 's.get("http")')
  # Bound to all interfaces, it must name its internet address (never the loopback one).
  [ "$url" = "http://$tracker_ip:8080" ] ||
    fail "startup" "the tracker announces HTTP $url, expected http://$tracker_ip:8080"
  local bootstrap=/ip4/$tracker_ip/tcp/4001/p2p/${peer_id[tracker]}
  say "tracker ${peer_id[tracker]}, HTTP $url, bootstrap $bootstrap"
  local name extra
  for name in a c b; do
    extra=()
    if [ "$forward_ports" -eq 1 ]; then
      extra=(--reachable --advertise-http "http://${wan_ip[$name]}:8080")
    fi
    say "starting peer $name in ${proc_ns[$name]} (${share[$name]} layers, memory ${memory[$name]} B)"
    start_member "$name" --bootstrap "$bootstrap" --memory "${memory[$name]}" "${extra[@]}"
    wait_for "peer $name to serve a ready span" "$timeout" serving "$name" ||
      fail "startup" "peer $name did not serve a ready span within ${timeout}s"
    peer_id[$name]=$(json_get "$(ns_get "${proc_ns[$name]}" status)" 's["peer"]') ||
      fail "startup" "no peer id in peer $name's /status"
    say "peer $name ${peer_id[$name]} serves $(json_get "$(ns_get "${proc_ns[$name]}" status)" \
      's["span"]["layers"]')"
  done
  wait_for "the tracker to see the model covered by A, B and C" "$timeout" covered ||
    fail "startup" "the tracker's map is not complete with A, B and C within ${timeout}s"
  if [ "$forward_ports" -eq 0 ]; then
    wait_for "A, B and C to hold relay reservations" 60 reserved ||
      fail "startup" "no relayed address (relay reservation) in the /status of: $unreserved"
  fi
  report=$(ns_get "$ns_trk" status)
  say "the mesh covers the model; route boundaries $(json_get "$report" 's["route_boundaries"]')"
  check_route_order "$report"
  model_id=$(json_get "$(in_ns "$ns_trk" curl -sf -m 10 "$openai_url/models")" \
    's["data"][0]["id"]') || fail "startup" "no model in /v1/models"
}

# check_private: in a private mesh, a connection from peer A's LAN to the tracker's libp2p port
# that speaks libp2p without the key (multistream's header and Noise's proposal in the clear) is
# dropped, and the tracker counts it in /metrics.
check_private() {
  [ "$private" -eq 1 ] || return 0
  local before after series='meshnet_p2p_connections_refused_total{reason="swarm_key"}'
  before=$(refusals)
  in_ns mnat-a python3 -c '
import socket, sys
s = socket.create_connection((sys.argv[1], 4001), timeout=10)
s.sendall(b"\x13/multistream/1.0.0\n\x07/noise\n" + bytes(64))
try:
    while s.recv(4096):
        pass
except (ConnectionResetError, socket.timeout):
    pass' "$tracker_ip" || fail "private" "the keyless connection to the tracker failed to open"
  wait_for "the tracker to count the refusal" 10 refusals_above "$before" ||
    fail "private" "the tracker's $series stayed at $before"
  after=$(refusals)
  say "private: a keyless connection was refused; the tracker's $series went $before -> $after"
}

# refusals: the tracker's count of connections refused for the swarm key.
refusals() {
  ns_get "$ns_trk" metrics | awk '$1 == "meshnet_p2p_connections_refused_total{reason=\"swarm_key\"}" { v = $2 } END { print v + 0 }'
}

refusals_above() { [ "$(refusals)" -gt "$1" ]; }

run_mesh() {
  prepare
  start_mesh
  check_private
  check_chat
  check_paths
  check_grants
  check_soak
  report_speed
  say "run: every check passed"
  succeeded=1
}

# speed: decode tokens/s of one chat at a time on three meshes over the same links: the
# routers forwarding the members' ports (every hop direct HTTP), the NATs as in `run` (A to C
# punched, C to B relayed), and all three NATs randomising ports (no punch: A to C relayed too).
speed() {
  prepare
  local setups=(forwarded punched relayed) setup rows=()
  for setup in "${setups[@]}"; do
    forward_ports=0
    nat_kind=([a]=port-preserving [b]=random-fully [c]=port-preserving)
    case $setup in
      forwarded) forward_ports=1 ;;
      relayed) nat_kind=([a]=random-fully [b]=random-fully [c]=random-fully) ;;
    esac
    say "speed: $setup"
    data_suffix=-$setup
    start_mesh
    # A warm-up chat, which also starts the hole punch where there can be one.
    load "warmup-$setup" 300 1 8 1
    if [ "$setup" = punched ]; then
      wait_for "A's path to C to become direct-p2p" 60 a_reaches_c_direct ||
        fail "speed" "A's path to C is '$(hop_path a c)', expected direct-p2p"
    fi
    load "speed-$setup" 300 1 64 "${MESHNET_NAT_SPEED_CHATS:-5}"
    rows+=("$(python3 -c '
import json, sys
r = json.loads(sys.argv[1])
rate = r["completion_tokens"] / r["request_seconds"] if r["request_seconds"] else 0
print(" ".join(sys.argv[2:]), r["requests"], r["completion_tokens"], f"{rate:.1f}")' \
      "$(<"$run_dir/speed-$setup.json")" "$setup" "$(hop_path tracker a)" "$(hop_path a c)" \
      "$(hop_path c b)")")
    teardown
    proc_pid=()
  done
  printf '%-10s %-13s %-13s %-13s %6s %7s %11s\n' setup "tracker->A" "A->C" "C->B" chats tokens \
    "tok/s/chat"
  local row
  for row in "${rows[@]}"; do
    # shellcheck disable=SC2086  # the row's words are the columns
    printf '%-10s %-13s %-13s %-13s %6s %7s %11s\n' $row
  done
  succeeded=1
}

# --- main --------------------------------------------------------------------------------------

command=${1:-run}
[ "$#" -eq 0 ] || shift
private=0
for option in "$@"; do
  case $option in
    --private) private=1 ;;
    *)
      usage
      exit 2
      ;;
  esac
done

case $command in
  up)
    preflight
    keep_up=1
    arm_cleanup
    topology_up
    print_topology
    succeeded=1
    ;;
  down)
    [ "$(id -u)" -eq 0 ] || die "network namespaces need root"
    need ip
    down
    ;;
  selftest)
    selftest
    ;;
  run)
    run_mesh
    ;;
  speed)
    speed
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
