#!/usr/bin/env python3
"""Latency-aware routes across emulated links: of two holders of the same layers, the tracker
routes through the near one, and through the far one once the near one is gone.

    testnet/near_far.py [--near-ms 10] [--far-ms 150] [--timeout 60]

Starts a tracker and two peers of the release `meshnet-peer` on 127.0.0.1. The tracker has
memory for a third of the default model's layers and each peer for the rest, so both peers
hold the same span. Each peer's HTTP endpoint sits behind its own `meshnet-linkem relay`
(`--near-ms` and `--far-ms` one-way), and it announces the relay's port. Members measure
round trips to each other's activation planes and announce them; the tracker picks the route
of least total delay (ADR-0033).

It sends one-token chats until five routes in a row (the `X-Meshnet-Route` header) go through
the near peer (before the first probe rounds, routes follow load and id order), then checks
that 5 more chats do too. It kills the near peer and sends chats until one
is answered, which must go through the far peer. Prints one JSON line with the routes and how
long each step took; exit 1 when a check fails. Every process it starts is stopped when it
ends, also on failure or Ctrl-C.

Environment: MESHNET_BIN_DIR, the directory of release binaries (default: build them).
"""

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wan  # noqa: E402


def memory_for(peer, layers, tracker):
    """The --memory that holds `layers` layers (with the embedding and head on the tracker)."""
    args = [peer, "model-info", "--layers", str(layers)] + (["--tracker"] if tracker else [])
    out = wan.subprocess.run(args, capture_output=True, check=True).stdout
    return json.loads(out)["memory_for_layers"]


class NearFar(wan.Mesh):
    """A tracker and a near and a far holder of the same layers, each peer behind its link."""

    def __init__(self, args, peer, linkem):
        super().__init__(args, peer, linkem, 0, (True, True))
        self.ids = {}
        self.members = {}

    def __enter__(self):
        info = json.loads(wan.subprocess.run([self.peer, "model-info"], capture_output=True,
                                             check=True).stdout)
        tracker_layers = info["layers"] // 3
        rest = info["layers"] - tracker_layers
        http_t, http_a, relay_a, http_b, relay_b = wan.free_ports(5)
        bootstrap = None
        for name, http, advertised, layers in [
            ("tracker", http_t, http_t, tracker_layers),
            ("a", http_a, relay_a, rest),
            ("b", http_b, relay_b, rest),
        ]:
            argv = [
                self.peer,
                "--http", f"127.0.0.1:{http}",
                "--advertise-http", f"http://127.0.0.1:{advertised}",
                "--p2p", "/ip4/127.0.0.1/tcp/0",
                "--memory", str(memory_for(self.peer, layers, name == "tracker")),
                "--data-dir", os.path.join(self.dir, name),
                "--reachable",
                "--announce-interval", "0.5",
            ]
            argv += ["--tracker"] if name == "tracker" else ["--bootstrap", bootstrap]
            process = self.spawn(name, argv)
            ready = self.ready_line(process, name)
            self.ids[name] = ready["peer"]
            self.members[name] = process
            if name == "tracker":
                bootstrap = next(a for a in ready["p2p"] if "/tcp/" in a)
        # With nothing measured, equal holders are taken in id order: the near link goes to
        # the peer that order puts last, so only the measured delays can route through it.
        links = {"a": (relay_a, http_a), "b": (relay_b, http_b)}
        near, far = sorted(["a", "b"], key=lambda name: self.ids[name], reverse=True)
        for role, name, delay in [("near", near, self.args.near_ms), ("far", far, self.args.far_ms)]:
            relay, http = links[name]
            self.spawn(f"relay-{role}", [self.linkem, "relay", "--listen", f"127.0.0.1:{relay}",
                                         "--to", f"127.0.0.1:{http}", "--delay-ms", str(delay)])
            self.ids[role], self.members[role] = self.ids[name], self.members[name]
        self.tracker = f"http://127.0.0.1:{http_t}"
        self.wait_for_holders()
        return self

    def wait_for_holders(self, timeout=180):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                status = wan.http_json(f"{self.tracker}/status", timeout=5)
                spans = [p.get("span") for p in status.get("peers") or []]
                ready = [s for s in spans if s and s.get("state") == "ready"]
                if (status.get("coverage") or {}).get("complete") and len(ready) == 2:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        sys.exit(f"near_far.py: the two holders were not ready within {timeout} s")

    def kill(self, name):
        process = self.members[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def routed_chat(base, model):
    """One one-token chat: the members of its route (peer ids), or None when it failed."""
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            route = response.headers.get("X-Meshnet-Route") or ""
    except (urllib.error.HTTPError, OSError):
        return None
    return [member.split(":")[0] for member in route.split(", ") if member]


def until(check, timeout, what):
    """Calls `check` until it returns a value other than None; the value and the seconds."""
    started = time.time()
    while time.time() - started < timeout:
        value = check()
        if value is not None:
            return value, round(time.time() - started, 2)
    sys.exit(f"near_far.py: {what} within {timeout} s")


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--near-ms", type=int, default=10)
    parser.add_argument("--far-ms", type=int, default=150)
    parser.add_argument("--timeout", type=int, default=60)
    args = parser.parse_args()
    if args.near_ms >= args.far_ms:
        parser.error("--near-ms must be below --far-ms")
    peer, linkem = wan.binaries()
    with NearFar(args, peer, linkem) as mesh:
        base = mesh.tracker
        model = wan.model_id(base)
        near, far = mesh.ids["near"], mesh.ids["far"]

        def through(holder):
            route = routed_chat(base, model)
            return route if route and holder in route else None

        # Until the first probe rounds are in, routes follow load and id order (which puts
        # the near holder last): wait for five routes in a row through the near holder.
        streak = []

        def settled():
            route = routed_chat(base, model)
            streak.append(bool(route and near in route and far not in route))
            return route if len(streak) >= 5 and all(streak[-5:]) else None

        first, learned_s = until(settled, args.timeout,
                                 "no five routes in a row went through the near holder")
        later = [routed_chat(base, model) for _ in range(5)]
        if any(not route or near not in route or far in route for route in later):
            sys.exit(f"near_far.py: a later route left the near holder: {later}")
        mesh.kill("near")
        def around_near():
            route = routed_chat(base, model)
            return route if route and near not in route else None

        # A chat that started on the near holder may finish on the far one by failover, but
        # it names the route it started on: wait for one that starts without the near holder.
        after, failover_s = until(around_near, args.timeout,
                                  "no chat was routed around the dead near holder")
        if far not in after:
            sys.exit(f"near_far.py: the route after the near holder died is {after}")
    print(json.dumps({
        "near_ms": args.near_ms,
        "far_ms": args.far_ms,
        "near": near,
        "far": far,
        "route_before": first,
        "seconds_to_route_near": learned_s,
        "route_after_near_died": after,
        "seconds_to_route_far": failover_s,
    }), flush=True)
    wan.say("the route took the near holder, and the far one once the near one died")


if __name__ == "__main__":
    main()
