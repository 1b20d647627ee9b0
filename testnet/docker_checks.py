#!/usr/bin/env python3
"""Checks of the Docker testnet that `testnet/docker.sh up` started (docker.sh smoke|chaos run
them and collect the containers' logs when they fail).

Usage:
    testnet/docker_checks.py smoke --state FILE
    testnet/docker_checks.py chaos --state FILE [--seed S]

- smoke: the tracker's /status lists nine peers with ready spans (ten members) and complete
  coverage; a chat through the official OpenAI Python client (temperature 0) equals
  `meshnet-peer generate --chat --boundaries B` on this host at the route boundaries B the
  tracker reports.
- chaos: four streaming chats one after another, each disrupting, at a random delta, a peer
  serving that chat: `docker kill`, `docker kill`, `docker pause`, `docker network disconnect`.
  The first three are holders of the same layers (the first victim's), so those layers lose
  their holders one after another: either the tracker's directives move other peers there in
  between (the line "moved by the tracker's directives" names them), or the third chat finds
  nobody serving them and waits for a directive to move a peer there (the time until it is
  ready is printed). The fourth holds other layers. Every chat must finish without an error.
  Then the tracker must cover the model with the five peers left (the time is printed). Then the four come
  back (`docker start`, `docker unpause`, `docker network connect` with the same address) and
  the mesh must be whole again: complete coverage, all nine peers listed once each with a ready
  span, every holder in the map one of them holding what it announces (no duplicate or stale
  holder); it prints how long that took, and a last chat must finish.

Exit status: 0 passed, 1 a check failed, 3 the testnet was not in a state to check.
Python 3 standard library only (smoke also needs the openai package).
"""

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import chaos  # noqa: E402  (the shared stream and comparison helpers)

SMOKE_PROMPT = "What is the capital of France?"
SMOKE_MAX_TOKENS = 32
# Deltas at which a chaos chat is disrupted.
DISRUPT_MIN, DISRUPT_MAX = 6, 30
ACTIONS = ["kill", "kill", "pause", "disconnect"]


def log(message=""):
    print(message, flush=True)


class Unhealthy(Exception):
    """The testnet is not in a state the checks can go on from."""


class Testnet:
    def __init__(self, state_path):
        self.members = {}  # name -> {"id", "ip", "http"}
        values = {}
        for line in Path(state_path).read_text().splitlines():
            key, _, value = line.partition("=")
            if key == "member":
                name, container, ip, http = value.split()
                self.members[name] = {"id": container, "ip": ip, "http": http}
            else:
                values[key] = value
        self.base_url = values["base_url"]
        self.tracker_http = values["tracker_http"]
        self.network = values["network"]
        self.bin = values["bin"]
        self.model = values["model"]
        self.peers = [name for name in self.members if name != "tracker"]
        self.name_of = {m["http"]: name for name, m in self.members.items()}

    def status(self, timeout=3.0):
        return chaos.get_json(self.tracker_http + "/status", timeout)

    def member_status(self, name, timeout=1.0):
        try:
            return chaos.get_json(self.members[name]["http"] + "/status", timeout)
        except (OSError, ValueError):
            return None

    def docker(self, *args):
        done = subprocess.run(["docker", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise Unhealthy(f"docker {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip()

    def wait(self, what, condition, timeout):
        """Polls condition(status) until it returns a true value; that value and the seconds
        waited. Raises Unhealthy naming `what` and the last reason after `timeout`."""
        started = time.monotonic()
        reason = "no status yet"
        while time.monotonic() - started < timeout:
            try:
                status = self.status()
            except (OSError, ValueError) as error:
                reason = f"the tracker's /status does not answer ({error})"
            else:
                ok, reason = condition(status)
                if ok:
                    return status, time.monotonic() - started
            time.sleep(0.25)
        raise Unhealthy(f"{what} within {timeout:.0f}s: {reason}")


def ready_peers(status):
    return [p for p in status.get("peers") or []
            if (p.get("span") or {}).get("state") == "ready" and not p.get("leaving")]


def whole(net, expected):
    """A condition: coverage complete and the peers named `expected` (and no others) listed
    once each with a ready span, every holder in the map one of them holding its announced span
    (or the tracker its own)."""
    def check(status):
        coverage = status.get("coverage") or {}
        if not coverage.get("complete") or status.get("route_boundaries") is None:
            return False, "coverage is not complete"
        peers = status.get("peers") or []
        names = [net.name_of.get(p.get("http"), p.get("http")) for p in peers]
        if sorted(names) != sorted(set(names)):
            return False, f"a member is listed twice: {sorted(names)}"
        if sorted(names) != sorted(expected):
            return False, f"listed {sorted(names)}, expected {sorted(expected)}"
        not_ready = [net.name_of.get(p.get("http")) for p in peers if p not in ready_peers(status)]
        if not_ready:
            return False, f"not ready: {not_ready}"
        spans = {p["peer"]: p["span"]["layers"] for p in peers}
        spans[status["peer"]] = (status.get("span") or {}).get("layers")
        for layer in coverage.get("layers") or []:
            ids = [h["peer"] for h in layer.get("holders") or []]
            if len(ids) != len(set(ids)):
                return False, f"layer {layer['layer']} lists a holder twice: {ids}"
            for holder in ids:
                span = spans.get(holder)
                if span is None or not span[0] <= layer["layer"] < span[1]:
                    return False, (f"layer {layer['layer']} lists {holder}, which does not "
                                   f"announce it (stale holder)")
        return True, ""
    return check


def boundaries_of(status):
    return status.get("route_boundaries")


def span_text(layers):
    return f"{layers[0]}..{layers[1]}" if layers else "-"


def spans_of(net, status):
    """{name: [start, end]} from the tracker's book."""
    return {net.name_of.get(p.get("http"), "?"): (p.get("span") or {}).get("layers")
            for p in status.get("peers") or []}


def layout(net, status):
    """'peer2 3..12, ...' from the tracker's book."""
    return ", ".join(f"{name} {span_text(span)}"
                     for name, span in sorted(spans_of(net, status).items()))


# --- smoke ---------------------------------------------------------------------------------


def run_smoke(net, _args):
    from openai import OpenAI

    status, _ = net.wait("ten members and complete coverage", whole(net, net.peers), 60)
    members = 1 + len(status.get("peers") or [])
    boundaries = boundaries_of(status)
    log(f"smoke: {members} members, coverage complete, route boundaries {boundaries}")
    client = OpenAI(base_url=net.base_url, api_key="meshnet")
    model = client.models.list().data[0].id
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": SMOKE_PROMPT}],
        temperature=0,
        max_tokens=SMOKE_MAX_TOKENS,
    )
    took = time.monotonic() - started
    text = answer.choices[0].message.content
    # The route may have changed while the client asked; the boundaries it took are the ones
    # the tracker reports now, unless the mesh moved.
    after = net.status()
    if boundaries_of(after) != boundaries:
        log(f"smoke: the route boundaries moved from {boundaries} to {boundaries_of(after)} "
            "during the chat")
        return 1
    reference = subprocess.run(
        [net.bin, "generate", "--model", net.model, "--chat", "--prompt", SMOKE_PROMPT,
         "--max-tokens", str(SMOKE_MAX_TOKENS), "--boundaries",
         ",".join(str(b) for b in boundaries)],
        capture_output=True, text=True,
    )
    if reference.returncode != 0:
        log(f"smoke: meshnet-peer generate failed: {reference.stderr.strip()}")
        return 1
    expected = reference.stdout.removesuffix("\n")
    log(f"smoke: the mesh answered in {took:.2f}s: {text!r}")
    if text != expected:
        log(f"smoke FAILED: generate --boundaries {boundaries} gives {expected!r}")
        return 1
    killed = oom_killed(net)
    if killed:
        log(f"smoke FAILED: the kernel killed {', '.join(killed)} for memory")
        return 1
    log("smoke ok: the answer equals meshnet-peer generate --chat at the same boundaries; "
        f"no container was OOM-killed ({memory_limits(net)})")
    log(f"smoke: peak memory per container (cgroup, page cache included): {memory_peaks(net)}")
    return 0


def oom_killed(net):
    """The members whose container the kernel killed for memory."""
    return [name for name, member in net.members.items()
            if net.docker("inspect", "-f", "{{.State.OOMKilled}}", member["id"]) == "true"]


def memory_peaks(net):
    """Each container's peak memory use as its cgroup counts it (v2 memory.peak, or v1
    memory.max_usage_in_bytes), as text; 'unknown' where this host does not expose it."""
    def peak(container):
        candidates = [
            Path(f"/sys/fs/cgroup/system.slice/docker-{container}.scope/memory.peak"),
            Path(f"/sys/fs/cgroup/memory/docker/{container}/memory.max_usage_in_bytes"),
        ]
        for path in candidates:
            try:
                return f"{int(path.read_text()) / 2**20:.0f} MiB"
            except (OSError, ValueError):
                continue
        return "unknown"
    return ", ".join(f"{name} {peak(member['id'])}" for name, member in net.members.items())


def memory_limits(net):
    """The tracker's and the first peer's container memory limits, as text."""
    def limit(name):
        value = int(net.docker("inspect", "-f", "{{.HostConfig.Memory}}",
                               net.members[name]["id"]))
        return f"{value / 2**20:.0f} MiB" if value else "no limit"
    return f"memory limits: tracker {limit('tracker')}, peers {limit(net.peers[0])}"


# --- chaos ---------------------------------------------------------------------------------


class Disruptor:
    """At delta k of a stream, applies `action` to a peer serving it (one whose
    active_sessions grew since `baseline`; any candidate when none can be told), preferring
    one that holds the layers `span` (when given), else one that does not (`span` negated by
    `avoid_span`)."""

    def __init__(self, net, action, k, candidates, rng, baseline, span=None, avoid_span=False):
        self.net, self.action, self.k = net, action, k
        self.candidates, self.rng, self.baseline = candidates, rng, baseline
        self.span, self.avoid_span = span, avoid_span
        self.name = None
        self.victim_span = None
        self.on_route = None
        self.at = None
        self.error = None
        # Called with the victim's name once the action is applied.
        self.then = None

    def __call__(self, count):
        if count != self.k:
            return
        serving, spans = [], {}
        for name in self.candidates:
            status = self.net.member_status(name)
            if not status:
                continue
            spans[name] = ((status.get("span") or {}).get("layers"))
            if status.get("active_sessions", 0) > self.baseline.get(name, 0):
                serving.append(name)
        self.on_route = bool(serving)
        pool = serving or self.candidates
        if self.span is not None:
            preferred = [n for n in pool if (spans.get(n) == self.span) != self.avoid_span]
            pool = preferred or pool
        self.name = self.rng.choice(pool)
        self.victim_span = spans.get(self.name)
        member = self.net.members[self.name]
        self.at = time.monotonic()
        try:
            if self.action == "kill":
                self.net.docker("kill", member["id"])
            elif self.action == "pause":
                self.net.docker("pause", member["id"])
            else:
                self.net.docker("network", "disconnect", self.net.network, member["id"])
        except Unhealthy as error:
            self.error = str(error)
            return
        if self.then is not None:
            self.then(self.name)


class GapWatch:
    """From `start()`, polls the tracker until a ready peer not in `gone` holds the layers
    `span` again; `took` is then the seconds since `start()`."""

    def __init__(self, net, span):
        self.net, self.span = net, span
        self.took = None
        self.kept = None
        self.gone = set()
        self._thread = None

    def holder(self, status):
        """A ready peer outside `gone` holding the layers, if any."""
        for p in ready_peers(status):
            if (self.net.name_of.get(p.get("http")) not in self.gone
                    and p["span"]["layers"] == self.span):
                return p
        return None

    def start(self, gone):
        self.gone = set(gone)
        started = time.monotonic()
        try:
            # The tracker's book still lists a stopped peer for a moment; one that was never a
            # victim and holds the layers means no gap opened.
            survivor = self.holder(self.net.status(timeout=2.0))
        except (OSError, ValueError):
            survivor = None
        if survivor is not None:
            self.kept = self.net.name_of.get(survivor.get("http"))
            return

        def watch():
            while time.monotonic() - started < 300:
                try:
                    status = self.net.status(timeout=1.0)
                except (OSError, ValueError):
                    status = {}
                if self.holder(status) is not None:
                    self.took = time.monotonic() - started
                    return
                time.sleep(0.2)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def join(self):
        if self._thread is not None:
            self._thread.join()


def restore(net, action, name):
    member = net.members[name]
    if action == "kill":
        net.docker("start", member["id"])
    elif action == "pause":
        net.docker("unpause", member["id"])
    else:
        net.docker("network", "connect", "--ip", member["ip"], net.network, member["id"])


def run_chaos(net, args):
    rng = random.Random(args.seed)
    before, _ = net.wait("ten members and complete coverage", whole(net, net.peers), 60)
    model = chaos.model_id(net.base_url)
    log(f"chaos: seed {args.seed}, {net.base_url}, model {model}")
    log(f"spans: {layout(net, before)}")
    reference = chaos.stream_chat(net.base_url, model, timeout=args.stream_timeout)
    if reference.error:
        raise Unhealthy(f"the reference stream failed: {reference.error}")
    normal = reference.gaps_ms()[1:] or [0.0]
    log(f"reference: {len(reference.deltas)} deltas, gap between deltas max {max(normal):.0f} ms")
    if len(reference.deltas) <= DISRUPT_MAX:
        raise Unhealthy(f"the reference has only {len(reference.deltas)} deltas")

    out = []  # (action, name)
    failed = []
    last_at = None
    # The first three take out every holder of one span (the first victim's), so the third
    # chat waits for directives to give those layers to another peer; the fourth, a holder of
    # another span.
    target_span = None
    gap_at = None
    for run, action in enumerate(ACTIONS, start=1):
        candidates = [name for name in net.peers if name not in {n for _, n in out}]
        baseline = {}
        for name in candidates:
            status = net.member_status(name)
            baseline[name] = status.get("active_sessions", 0) if status else 0
        k = rng.randint(DISRUPT_MIN, DISRUPT_MAX)
        disrupt = Disruptor(net, action, k, candidates, rng, baseline, span=target_span,
                            avoid_span=run == len(ACTIONS))
        if run == len(ACTIONS) - 1 and target_span is not None:
            gone = [n for _, n in out]
            disrupt.then = lambda name, gone=gone: gap.start(gone + [name])
        got = chaos.stream_chat(net.base_url, model, on_delta=disrupt,
                                timeout=args.stream_timeout)
        if disrupt.name is not None and disrupt.error is None:
            out.append((action, disrupt.name))
            last_at = disrupt.at
            if target_span is None:
                target_span = disrupt.victim_span
                gap = GapWatch(net, target_span)
            elif run == len(ACTIONS) - 1 and disrupt.victim_span == target_span:
                gap_at = disrupt.at
        pause = max(got.gaps_ms(since=disrupt.at) or [0.0]) if disrupt.at else None
        same = chaos.first_difference(reference, got) is None
        problem = disrupt.error or got.error
        if disrupt.name is None and not problem:
            problem = f"the stream ended after {len(got.deltas)} deltas, before delta {k}"
        log(f"chat {run}: docker {action} {disrupt.name or '-'} (layers "
            f"{span_text(disrupt.victim_span)}) at delta {k} (on route: "
            f"{chaos.route_mark(disrupt.on_route)}) -> "
            f"{'FAILED: ' + problem if problem else 'completed'}; {len(got.deltas)} deltas, "
            f"pause {chaos.fmt_ms(pause)} ms, text {'equal to' if same else 'differs from'} "
            f"the unbroken one")
        if problem:
            failed.append(f"chat {run}: {problem}")

    left = [name for name in net.peers if name not in {n for _, n in out}]
    log(f"out: {', '.join(f'{n} ({a})' for a, n in out)}; left: {', '.join(left)}")
    if gap_at is None:
        log(f"note: the victims did not take out every holder of layers "
            f"{span_text(target_span)} (the route moved off them)")
    elif gap.kept is not None:
        log(f"layers {span_text(target_span)} kept a holder ({gap.kept}) at the third "
            f"disruption: as their holders fell, the tracker's directives moved others there")
    else:
        gap.join()
        if gap.took is None:
            failed.append(f"layers {span_text(target_span)} were not re-covered")
        log(f"layers {span_text(target_span)} lost their last holder in chat "
            f"{len(ACTIONS) - 1}; directives gave them to another peer, ready "
            f"{chaos.fmt_ms(gap.took * 1000 if gap.took is not None else None)} ms later")
    try:
        status, waited = net.wait("coverage by the peers left", whole(net, left), args.timeout)
        recover = (time.monotonic() - last_at) if last_at else waited
        log(f"the map shows the {len(left)} peers left covering the model "
            f"{recover:.1f}s after the last disruption; spans now {layout(net, status)}")
        was, now = spans_of(net, before), spans_of(net, status)
        moved = [f"{name} {span_text(was.get(name))} -> {span_text(now[name])}"
                 for name in sorted(now) if now[name] != was.get(name)]
        log("moved by the tracker's directives: " + (", ".join(moved) if moved else "nobody"))
    except Unhealthy as error:
        failed.append(str(error))
        log(f"chaos: {error}")

    back_at = time.monotonic()
    for action, name in out:
        restore(net, action, name)
        log(f"restored {name} (docker {'start' if action == 'kill' else 'unpause' if action == 'pause' else 'network connect'})")
    try:
        status, _ = net.wait("the whole mesh back", whole(net, net.peers), args.timeout)
        log(f"whole again {time.monotonic() - back_at:.1f}s after the four returned: "
            f"{1 + len(status.get('peers') or [])} members, coverage complete, no duplicate or "
            f"stale holder; route boundaries {boundaries_of(status)}")
    except Unhealthy as error:
        failed.append(str(error))
        log(f"chaos: {error}")
    final = chaos.stream_chat(net.base_url, model, timeout=args.stream_timeout)
    if final.error:
        failed.append(f"the chat after the return failed: {final.error}")
    log(f"chat after the return: {'FAILED: ' + final.error if final.error else 'completed'}")
    if failed:
        log("chaos FAILED:\n  " + "\n  ".join(failed))
        return 1
    log("chaos ok")
    return 0


def main():
    parser = argparse.ArgumentParser(
        description="Smoke and chaos checks of the Docker testnet.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("mode", choices=["smoke", "chaos"])
    parser.add_argument("--state", required=True, help="docker.sh's state file")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the mesh to heal")
    parser.add_argument("--stream-timeout", type=float, default=180.0,
                        help="longest silence of a stream, seconds")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    try:
        net = Testnet(args.state)
        return {"smoke": run_smoke, "chaos": run_chaos}[args.mode](net, args)
    except Unhealthy as error:
        log(f"docker_checks.py {args.mode}: {error}")
        return 3


if __name__ == "__main__":
    sys.exit(main())
