#!/usr/bin/env python3
"""Process-level self-healing checks against a testnet that `testnet/local.sh up` started.

Usage:
    testnet/chaos.py chaos [--runs 20] [--seed S] [--target any|on-route]
    testnet/chaos.py sigterm [--runs 1] [--seed S] [--at 10] [--target on-route|any]
    testnet/chaos.py stop [--runs 1] [--seed S] [--at 10] [--target on-route|any]
    testnet/chaos.py reference
    testnet/chaos.py tracker [--member NAME]

Common options: --run-dir DIR (default $MESHNET_TESTNET_DIR, else $TMPDIR/meshnet-testnet, as
local.sh), --base-url URL (default: base_url from the run dir's state file), --timeout S (how
long to wait for the mesh to heal, default 120), --stream-timeout S (longest silence of a
stream, default 120), --reference-runs N (default 2: the first unbroken stream is the
reference, the others must equal it, so a mismatch later is not plain nondeterminism).

Every run streams the same greedy chat (POST {base}/chat/completions, stream=true,
temperature 0, max_tokens 64, a fixed prompt) and compares its whole text and finish_reason
with the reference.

- chaos: each run picks a random non-tracker process and a random delta index k in [5, 40];
  when the k-th content delta arrives it sends SIGKILL to that process, reads the stream to
  the end (an SSE error event or an HTTP error fails the run), restarts the process with
  `local.sh restart NAME` and waits until the mesh is healed before the next run: coverage
  complete, every non-tracker process serving a ready span that the tracker lists (not
  leaving), the same coverage epoch for 2 s; then, for at most 15 s more, every non-tracker
  layer held by R ready holders (local.sh's --redundancy R) and none of ours in the tracker's
  `banned` list; the planner balances throughput, not holders, so when it does not get there
  a note says so and the run goes on. The failover pause is the longest gap between
  consecutive deltas after the kill. Per run it reports whether the victim was on the route
  (its active_sessions grew), whether its layers had another ready holder at the kill, and
  how much the tracker's `failovers` counter grew. `--target on-route` picks the victim among
  the processes serving this generation instead of any.
- sigterm: at delta --at (default 10) sends SIGTERM to a process serving the generation
  (--target any: any non-tracker process); the stream must finish without error and equal the
  reference, the process must exit with status 0 (from local.sh's exit file) within 35 s. Then
  it is restarted and the mesh healed as above.
- stop: at delta --at sends SIGSTOP to a process serving the generation (a laptop lid closed,
  a container paused: its connections stay open and nothing answers); the stream must finish
  equal to the reference with a pause under 20 s (the tracker notices the missed
  announcements; the hop timeout is 120 s). The process gets SIGCONT after the stream and the
  mesh must heal as above.
- reference: prints the reference stream (text, delta count, gaps) and exits.
- tracker: streams the chat through another member (--member, default peer1: every member
  answers /v1 by passing requests to the tracker) and sends SIGKILL to the tracker at delta
  --at; that request must fail. Then it asks the same member for a chat until one succeeds,
  which must happen within 10 s of the kill; the member must follow a new tracker of a
  higher term whose map covers the model. Finally it restarts the old tracker
  (`local.sh restart tracker`, same identity and flags), which must join as a peer of the new
  tracker (the higher term wins), and waits for coverage. Run it last: the tracker moves.

Exit status: 0 every run passed; 1 a run failed or differed (the first difference is shown);
2 usage; 3 the mesh was not healthy (not up, did not heal in time,
a restart failed), so runs could not go on.
Python 3 standard library only.
"""

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

PROMPT = (
    "Write a short story, at least 150 words long, about a lighthouse keeper who finds a "
    "message in a bottle."
)
MAX_TOKENS = 64
K_MIN, K_MAX = 5, 40
SIGTERM_EXIT_DEADLINE = 35.0
HERE = Path(__file__).resolve().parent


class MeshUnhealthy(Exception):
    """The testnet is not in a state runs can go on from."""


def log(message=""):
    print(message, flush=True)


def get_json(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


# --- the testnet ---------------------------------------------------------------------------


class Testnet:
    """The processes of a local.sh run directory."""

    def __init__(self, run_dir, base_url, local_sh):
        self.run_dir = Path(run_dir)
        self.local_sh = local_sh
        state_file = self.run_dir / "state"
        if not state_file.is_file():
            raise MeshUnhealthy(
                f"no testnet is up in {self.run_dir} (no state file): start one with "
                "testnet/local.sh up N"
            )
        self.state = dict(
            line.split("=", 1) for line in state_file.read_text().splitlines() if "=" in line
        )
        self.base_url = (base_url or self.state.get("base_url", "")).rstrip("/")
        self.tracker_http = self.state.get("tracker_http") or self.base_url.rsplit("/v1", 1)[0]
        self.redundancy = int(self.state.get("redundancy", "1"))
        self.peer_ids = {}

    def pids(self):
        pids = {}
        for line in (self.run_dir / "pids").read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                pids[parts[0]] = int(parts[1])
        return pids

    def names(self):
        return [name for name in self.pids() if name != "tracker"]

    def http(self, name):
        return (self.run_dir / "procs" / name / "http").read_text().strip()

    def exit_status(self, name):
        try:
            text = (self.run_dir / "exit" / name).read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.lstrip("-").isdigit() else text

    def alive(self, name):
        pid = self.pids().get(name)
        if pid is None:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    def status(self, name, timeout=2.0):
        return get_json(self.http(name) + "/status", timeout)

    def tracker_status(self, timeout=2.0):
        return get_json(self.tracker_http + "/status", timeout)

    def active_sessions(self, names):
        """active_sessions of each process's own /status (None when it does not answer)."""
        out = {}
        for name in names:
            try:
                out[name] = int(self.status(name, timeout=1.0).get("active_sessions", 0))
            except (OSError, ValueError):
                out[name] = None
        return out

    def signal(self, name, sig):
        pid = self.pids()[name]
        os.kill(pid, sig)
        return pid

    def restart(self, name):
        env = dict(os.environ, MESHNET_TESTNET_DIR=str(self.run_dir))
        started = time.monotonic()
        done = subprocess.run(
            ["bash", str(self.local_sh), "restart", name],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise MeshUnhealthy(
                f"local.sh restart {name} failed (status {done.returncode}):\n"
                f"{done.stderr.strip()}"
            )
        return time.monotonic() - started

    def health(self):
        """(epoch, "") when the mesh is healed: the tracker's coverage is complete and every
        non-tracker process runs, serves a ready span and is listed by the tracker with it.
        (None, what is missing) otherwise."""
        try:
            tracker = self.tracker_status()
        except (OSError, ValueError) as error:
            return None, f"the tracker's /status does not answer ({error})"
        coverage = tracker.get("coverage") or {}
        if not coverage.get("complete"):
            return None, "coverage incomplete"
        listed = {p.get("http"): p for p in tracker.get("peers") or []}
        for name in self.names():
            if not self.alive(name):
                return None, f"{name} is not running"
            try:
                own = self.status(name)
            except (OSError, ValueError) as error:
                return None, f"{name}'s /status does not answer ({error})"
            span = own.get("span")
            if not span or span.get("state") != "ready" or own.get("loading"):
                return None, (f"{name} serves no ready span (span {span}, loading "
                              f"{own.get('loading')})")
            if own.get("peer"):
                self.peer_ids[name] = own["peer"]
            entry = listed.get(self.http(name))
            if entry is None or entry.get("peer") != own.get("peer"):
                return None, f"{name} is not in the tracker's map"
            seen = entry.get("span") or {}
            if seen.get("state") != "ready" or seen.get("layers") != span.get("layers"):
                return None, f"the tracker lists {name} with span {seen or None}, it serves {span}"
            if entry.get("leaving"):
                return None, f"the tracker lists {name} as leaving"
        return coverage.get("epoch"), ""

    def banned(self, tracker=None):
        """Our processes the tracker keeps off routes (`banned` in its /status, if any)."""
        tracker = tracker or self.tracker_status()
        ids = {peer: name for name, peer in self.peer_ids.items()}
        return [ids.get(b.get("peer"), b.get("peer")) for b in tracker.get("banned") or []]

    def failovers(self):
        """The tracker's count of generations that got past a failed hop (None if absent)."""
        try:
            return self.tracker_status().get("failovers")
        except (OSError, ValueError):
            return None

    def short_layers(self, tracker=None):
        """Layers past the tracker's span with fewer than R ready holders, as 'layer:holders'."""
        tracker = tracker or self.tracker_status()
        coverage = tracker.get("coverage") or {}
        own_span = (tracker.get("span") or {}).get("layers") or [0, 0]
        short = []
        for layer in coverage.get("layers") or []:
            if layer["layer"] < own_span[1]:
                continue
            ready = sum(1 for h in layer["holders"] if h.get("state") == "ready")
            if ready < self.redundancy:
                short.append(f"{layer['layer']}:{ready}")
        return short

    def wait_healed(self, timeout, settle=2.0, redundancy_wait=15.0):
        """Polls until health() holds with the same coverage epoch for `settle` seconds (the
        planner may move a span right after a peer comes back); returns the seconds it took.
        Then, with redundancy R > 1, waits up to `redundancy_wait` more for every non-tracker
        layer to have R ready holders, and says so when the planner does not get there."""
        started = time.monotonic()
        deadline = started + timeout
        since, epoch_seen = None, None
        while True:
            epoch, why = self.health()
            now = time.monotonic()
            if epoch is None:
                since = None
            elif since is None or epoch != epoch_seen:
                since, epoch_seen = now, epoch
            elif now - since >= settle:
                break
            if now >= deadline:
                raise MeshUnhealthy(
                    f"the mesh did not heal within {timeout:.0f}s: "
                    f"{why or 'the coverage epoch kept changing'}"
                )
            time.sleep(0.2)
        healed = time.monotonic() - started
        # Then, bounded: R ready holders per layer, and none of ours kept off routes.
        until = time.monotonic() + redundancy_wait
        while True:
            try:
                tracker = self.tracker_status()
                short = self.short_layers(tracker) if self.redundancy > 1 else []
                banned = self.banned(tracker)
            except (OSError, ValueError):
                short, banned = ["?"], []
            if not short and not banned:
                break
            if time.monotonic() >= until:
                if short:
                    log(f"  note: after {redundancy_wait:.0f}s more the planner still leaves "
                        f"layers with fewer than {self.redundancy} ready holders (layer:holders "
                        f"{' '.join(short)}); spans now: {self.layout()}")
                if banned:
                    log(f"  note: after {redundancy_wait:.0f}s more the tracker still keeps "
                        f"{', '.join(banned)} off routes")
                break
            time.sleep(0.2)
        return healed

    def backed_up(self, name):
        """Whether every layer `name` holds has another ready holder (None when unknown)."""
        try:
            tracker = self.tracker_status(timeout=1.0)
        except (OSError, ValueError):
            return None
        peer = self.peer_ids.get(name)
        layers = tracker.get("coverage", {}).get("layers") or []
        mine = [l for l in layers if any(h.get("peer") == peer for h in l["holders"])]
        if not mine:
            return None
        return all(
            any(h.get("peer") != peer and h.get("state") == "ready" for h in l["holders"])
            for l in mine
        )

    def layout(self):
        """'name [a, b)' for every non-tracker process, from the tracker's map."""
        try:
            tracker = self.tracker_status()
        except (OSError, ValueError):
            return "?"
        by_http = {p.get("http"): p for p in tracker.get("peers") or []}
        parts = []
        for name in self.names():
            span = (by_http.get(self.http(name)) or {}).get("span") or {}
            layers = span.get("layers")
            parts.append(f"{name} [{layers[0]}, {layers[1]})" if layers else f"{name} -")
        return ", ".join(parts)


# --- streaming -----------------------------------------------------------------------------


class Stream:
    """What one streamed chat produced."""

    def __init__(self):
        self.started = time.monotonic()
        self.deltas = []  # (monotonic time, text)
        self.finish_reason = None
        self.error = None
        self.done = False

    @property
    def text(self):
        return "".join(text for _, text in self.deltas)

    def gaps_ms(self, since=None):
        """Gaps between consecutive deltas, in ms; with `since`, from that time on."""
        times = [t for t, _ in self.deltas]
        if since is not None:
            times = [since] + [t for t in times if t > since]
        return [(b - a) * 1000 for a, b in zip(times, times[1:])]


def model_id(base_url):
    data = get_json(base_url + "/models", timeout=5).get("data") or []
    if not data:
        raise MeshUnhealthy(f"{base_url}/models lists no model")
    return data[0]["id"]


def stream_chat(base_url, model, on_delta=None, timeout=120.0):
    """Streams the fixed chat; calls on_delta(count) after each content delta arrives."""
    result = Stream()
    url = urllib.parse.urlsplit(base_url)
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    try:
        conn.request(
            "POST",
            url.path.rstrip("/") + "/chat/completions",
            body=body,
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        response = conn.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read(600).decode(errors='replace')}"
            return result
        while True:
            raw = response.readline()
            if not raw:
                break
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, other fields
            data = line[5:].strip()
            if data == "[DONE]":
                result.done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                result.error = f"undecodable SSE data: {data[:200]}"
                break
            if "error" in event:
                result.error = f"SSE error event: {json.dumps(event['error'])[:400]}"
                break
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    result.deltas.append((time.monotonic(), content))
                    if on_delta is not None:
                        on_delta(len(result.deltas))
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
        if result.error is None and not result.done:
            result.error = f"the stream ended without [DONE] after {len(result.deltas)} deltas"
    except (OSError, http.client.HTTPException) as error:
        result.error = f"{type(error).__name__}: {error} (after {len(result.deltas)} deltas)"
    finally:
        conn.close()
    return result


def first_difference(reference, got):
    """A few lines showing where `got` departs from `reference`, or None when equal."""
    if reference.text == got.text and reference.finish_reason == got.finish_reason:
        return None
    a, b = reference.text, got.text
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    if a == b:
        return (
            f"same text, finish_reason {got.finish_reason!r} instead of "
            f"{reference.finish_reason!r}"
        )
    # The reference delta holding character i.
    offset, delta_index = 0, len(reference.deltas)
    for index, (_, text) in enumerate(reference.deltas):
        if offset + len(text) > i:
            delta_index = index + 1
            break
        offset += len(text)
    lo = max(0, i - 40)
    return (
        f"first difference at character {i} (reference delta {delta_index} of "
        f"{len(reference.deltas)}; {len(b)} characters in {len(got.deltas)} deltas instead of "
        f"{len(a)})\n"
        f"  reference: ...{a[lo:i]!r} | {a[i:i + 60]!r}\n"
        f"  got:       ...{b[lo:i]!r} | {b[i:i + 60]!r}"
    )


def take_reference(net, model, runs, stream_timeout):
    reference = stream_chat(net.base_url, model, timeout=stream_timeout)
    if reference.error:
        raise MeshUnhealthy(f"the reference stream failed: {reference.error}")
    gaps = reference.gaps_ms()[1:] or [0.0]
    log(
        f"reference: {len(reference.deltas)} deltas, {len(reference.text)} characters, "
        f"finish_reason {reference.finish_reason}, first delta after "
        f"{(reference.deltas[0][0] - reference.started) * 1000:.0f} ms, gap between deltas "
        f"p50 {statistics.median(gaps):.0f} ms max {max(gaps):.0f} ms"
    )
    for extra in range(1, runs):
        again = stream_chat(net.base_url, model, timeout=stream_timeout)
        if again.error:
            raise MeshUnhealthy(f"unbroken stream {extra + 1} failed: {again.error}")
        diff = first_difference(reference, again)
        if diff:
            raise MeshUnhealthy(
                f"unbroken stream {extra + 1} differs from the first (no process was "
                f"touched):\n{diff}"
            )
        log(f"unbroken stream {extra + 1}: equal to the reference")
    return reference


# --- modes ---------------------------------------------------------------------------------


class Disruption:
    """Sends `sig` to a process when the k-th delta of a stream arrives: with target "any" a
    process chosen now, with "on-route" one of those whose active_sessions grew since
    `baseline` (any, when none did)."""

    def __init__(self, net, sig, k, target, candidates, rng, baseline):
        self.net, self.sig, self.k = net, sig, k
        self.target, self.candidates, self.rng, self.baseline = target, candidates, rng, baseline
        self.name = rng.choice(candidates) if target == "any" else None
        self.sent = False
        self.pid = None
        self.on_route = None
        self.at = None
        self.error = None
        self.backup = None

    def __call__(self, count):
        if count != self.k:
            return
        if self.target == "on-route":
            now = self.net.active_sessions(self.candidates)
            serving = [
                n for n in self.candidates
                if now.get(n) is not None and now[n] > (self.baseline.get(n) or 0)
            ]
            self.name = self.rng.choice(serving or self.candidates)
            self.on_route = bool(serving)
        else:
            now = self.net.active_sessions([self.name])
            if now.get(self.name) is not None and self.baseline.get(self.name) is not None:
                self.on_route = now[self.name] > self.baseline[self.name]
        self.backup = self.net.backed_up(self.name)
        self.at = time.monotonic()
        self.sent = True
        try:
            self.pid = self.net.signal(self.name, self.sig)
        except OSError as error:
            self.error = f"could not signal {self.name}: {error}"


def wait_exit(net, name, deadline):
    """Waits (until the monotonic deadline) for the exit file of `name`; its status or None."""
    while True:
        code = net.exit_status(name)
        if code is not None:
            return code
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def percentile(values, fraction):
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def fmt_ms(value):
    return "-" if value is None else f"{value:.0f}"


def route_mark(on_route):
    return "?" if on_route is None else ("yes" if on_route else "no")


def start_runs(net, args, what):
    """Logs `what` with the model, waits for the mesh to heal and takes the reference:
    (random generator, model id, reference stream)."""
    rng = random.Random(args.seed)
    model = model_id(net.base_url)
    log(f"{what}, redundancy {net.redundancy}, {net.base_url}, model {model}")
    log(f"mesh healed after {net.wait_healed(args.timeout):.1f}s: {net.layout()}")
    reference = take_reference(net, model, args.reference_runs, args.stream_timeout)
    return rng, model, reference


def run_chaos(net, args):
    rng, model, reference = start_runs(
        net, args, f"chaos: {args.runs} runs, seed {args.seed}, target {args.target}")
    if len(reference.deltas) < K_MAX + 5:
        raise MeshUnhealthy(
            f"the reference has {len(reference.deltas)} deltas; the chaos runs need at least "
            f"{K_MAX + 5} (k goes up to {K_MAX})"
        )
    rows, failures = [], []
    aborted = None
    for run in range(1, args.runs + 1):
        k = rng.randint(K_MIN, K_MAX)
        candidates = net.names()
        baseline = net.active_sessions(candidates)
        kill = Disruption(net, signal.SIGKILL, k, args.target, candidates, rng, baseline)
        failovers_before = net.failovers()
        got = stream_chat(net.base_url, model, on_delta=kill, timeout=args.stream_timeout)
        failovers_after = net.failovers()
        row = {"run": run, "peer": kill.name if kill.sent else "-", "k": k, "route": kill.on_route,
               "backup": kill.backup,
               "failovers": (failovers_after - failovers_before
                             if isinstance(failovers_before, int)
                             and isinstance(failovers_after, int) else None),
               "deltas": len(got.deltas), "pause": None, "restart": None, "heal": None}
        why = None
        if not kill.sent:
            why = got.error or f"the stream ended after {len(got.deltas)} deltas, before delta {k}"
        elif kill.error:
            why = kill.error
        elif got.error:
            why = got.error
        else:
            row["pause"] = max(got.gaps_ms(since=kill.at) or [0.0])
            diff = first_difference(reference, got)
            if diff:
                why = "text differs: " + diff.splitlines()[0]
                failures.append((run, diff))
        if why and not (failures and failures[-1][0] == run):
            failures.append((run, why))
        if kill.sent:
            code = wait_exit(net, kill.name, time.monotonic() + 15)
            if code is None:
                aborted = f"{kill.name} (pid {kill.pid}) did not exit within 15s of SIGKILL"
            else:
                try:
                    row["restart"] = net.restart(kill.name)
                    row["heal"] = net.wait_healed(args.timeout)
                except MeshUnhealthy as error:
                    aborted = str(error)
        row["ok"] = "ok" if why is None else "FAIL"
        row["why"] = why or ""
        rows.append(row)
        log(
            f"run {run:>2}: kill {row['peer']} at delta {k} (on route: {route_mark(row['route'])},"
            f" another holder: {route_mark(row['backup'])}, tracker failovers: "
            f"{'?' if row['failovers'] is None else row['failovers']})"
            f" -> {row['ok']}{': ' + why if why else ''}; pause {fmt_ms(row['pause'])} ms; "
            f"restart {row['restart'] or 0:.1f}s, healed {row['heal'] or 0:.1f}s later"
        )
        if aborted:
            break

    log("")
    log(f"{'run':>3}  {'peer':<8} {'k':>3}  {'route':<5} {'backup':<6} {'fo':>2} {'deltas':>6}  "
        f"{'pause ms':>8}  "
        f"{'restart s':>9}  {'heal s':>6}  ok")
    for r in rows:
        log(
            f"{r['run']:>3}  {r['peer']:<8} {r['k']:>3}  {route_mark(r['route']):<5} "
            f"{route_mark(r['backup']):<6} "
            f"{'?' if r['failovers'] is None else r['failovers']:>2} "
            f"{r['deltas']:>6}  {fmt_ms(r['pause']):>8}  "
            f"{'-' if r['restart'] is None else format(r['restart'], '.1f'):>9}  "
            f"{'-' if r['heal'] is None else format(r['heal'], '.1f'):>6}  {r['ok']}"
            + (f"  {r['why'][:100]}" if r["why"] else "")
        )
    pauses = [r["pause"] for r in rows if r["pause"] is not None]
    on_route = [r for r in rows if r["route"]]
    routed = [r["pause"] for r in on_route if r["pause"] is not None]
    passed = sum(1 for r in rows if r["ok"] == "ok")
    alone = [r for r in rows if r["backup"] is False]
    normal = reference.gaps_ms()[1:] or [0.0]
    log(
        f"chaos summary: {passed}/{len(rows)} runs ok; failover pause p50 "
        f"{fmt_ms(percentile(pauses, 0.5))} ms, max {fmt_ms(max(pauses) if pauses else None)} ms"
        f" over {len(pauses)} completed runs (kills on the route: {len(on_route)}, "
        f"{len(routed)} completed, p50 "
        f"{fmt_ms(percentile(routed, 0.5))} ms, max {fmt_ms(max(routed) if routed else None)} ms);"
        f" unbroken gap p50 {statistics.median(normal):.0f} ms, max {max(normal):.0f} ms"
    )
    if alone:
        log(f"chaos: {len(alone)} run(s) killed the only ready holder of some layer (backup no:"
            f" the planner had not kept {net.redundancy} holders per span), "
            f"{sum(1 for r in alone if r['ok'] != 'ok')} of them failed")
    if aborted:
        log(f"chaos: stopped after run {rows[-1]['run']}: {aborted}")
    if failures:
        run, detail = failures[0]
        log(f"chaos: first failure, run {run}:\n{detail}")
    if aborted:
        return 3
    return 1 if failures or len(rows) < args.runs else 0


def stream_problems(disruption, got, reference, at):
    """What went wrong with a stream `disruption` was to hit at delta `at`: nothing ([]) when
    the signal went out and the stream finished equal to the reference."""
    if not disruption.sent:
        return [got.error or f"the stream ended after {len(got.deltas)} deltas, before delta {at}"]
    if disruption.error:
        return [disruption.error]
    if got.error:
        return [f"the stream failed: {got.error}"]
    diff = first_difference(reference, got)
    return ["the text differs from the reference:\n" + diff] if diff else []


def report_run(run, problems):
    """Logs a run's outcome; whether it failed."""
    if problems:
        log(f"run {run} FAILED:\n  " + "\n  ".join(problems))
        return True
    log(f"run {run} ok")
    return False


def run_sigterm(net, args):
    rng, model, reference = start_runs(
        net, args, f"sigterm: {args.runs} run(s), seed {args.seed}, target {args.target}, "
        f"SIGTERM at delta {args.at}")
    if len(reference.deltas) <= args.at:
        raise MeshUnhealthy(f"the reference has only {len(reference.deltas)} deltas")
    failed = False
    for run in range(1, args.runs + 1):
        candidates = net.names()
        baseline = net.active_sessions(candidates)
        term = Disruption(net, signal.SIGTERM, args.at, args.target, candidates, rng, baseline)
        left_map = {}
        stop_watch = threading.Event()

        def watch_map():
            # When the tracker stops listing the leaving process as a ready holder.
            while not stop_watch.is_set():
                if term.sent and "t" not in left_map:
                    try:
                        tracker = net.tracker_status(timeout=1.0)
                        entry = next((p for p in tracker.get("peers") or []
                                      if p.get("http") == net.http(term.name)), None)
                        state = ((entry or {}).get("span") or {}).get("state")
                        if entry and entry.get("leaving") and "leaving" not in left_map:
                            left_map["leaving"] = time.monotonic() - term.at
                        if state != "ready":
                            left_map["t"] = time.monotonic() - term.at
                            left_map["how"] = f"span state {state}" if entry else "left the map"
                    except (OSError, ValueError):
                        pass
                stop_watch.wait(0.1)

        watcher = threading.Thread(target=watch_map, daemon=True)
        watcher.start()
        got = stream_chat(net.base_url, model, on_delta=term, timeout=args.stream_timeout)
        problems = stream_problems(term, got, reference, args.at)
        code = exited_after = pause = None
        if term.sent:
            pause = max(got.gaps_ms(since=term.at) or [0.0]) if not got.error else None
            code = wait_exit(net, term.name, term.at + SIGTERM_EXIT_DEADLINE)
            if code is not None:
                exited_after = time.monotonic() - term.at
            stop_watch.set()
            watcher.join()
            if code is None:
                problems.append(f"{term.name} (pid {term.pid}) did not exit within "
                                f"{SIGTERM_EXIT_DEADLINE:.0f}s of SIGTERM; sending SIGKILL")
                try:
                    os.kill(term.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                code = wait_exit(net, term.name, time.monotonic() + 15)
                exited_after = None
            elif code != 0:
                problems.append(f"{term.name} exited with status {code}, not 0")
        else:
            stop_watch.set()
            watcher.join()
        exit_text = "-" if code is None else str(code)
        after_text = "-" if exited_after is None else f"{exited_after:.1f}s"
        left_text = (f"{left_map['how']} {left_map['t']:.1f}s after SIGTERM"
                     if "t" in left_map else "listed ready until it exited")
        if "leaving" in left_map:
            left_text = f"listed as leaving {left_map['leaving']:.1f}s after SIGTERM, {left_text}"
        log(
            f"run {run}: SIGTERM {term.name if term.sent else '-'} (pid {term.pid or '-'}, on route: "
            f"{route_mark(term.on_route)}, another holder: {route_mark(term.backup)}) at delta "
            f"{args.at}: stream "
            f"{'ok' if got.error is None else 'FAILED'} ({len(got.deltas)} deltas, pause "
            f"{fmt_ms(pause)} ms); tracker map: {left_text}; exit status {exit_text} after "
            f"{after_text}"
        )
        if term.sent and code is not None:
            try:
                restart = net.restart(term.name)
                heal = net.wait_healed(args.timeout)
                log(f"run {run}: restarted {term.name} in {restart:.1f}s, healed {heal:.1f}s later")
            except MeshUnhealthy as error:
                log(f"sigterm: {error}")
                return 3
        failed = report_run(run, problems) or failed
    return 1 if failed else 0


# The longest pause a stream may show when a process on its route is stopped: the tracker
# gives up on a hop once it missed three of its announcements (1.5 s at local.sh's 0.5 s
# interval) and replays onto another holder; the hop timeout it would otherwise wait is 120 s.
STOP_PAUSE_LIMIT_MS = 20_000


def run_stop(net, args):
    """SIGSTOP a process on the route mid-stream: the stream must finish equal to the
    reference, well before the hop timeout; then SIGCONT it and wait for the mesh to heal."""
    rng, model, reference = start_runs(
        net, args, f"stop: {args.runs} run(s), seed {args.seed}, target {args.target}, "
        f"SIGSTOP at delta {args.at}")
    if len(reference.deltas) <= args.at:
        raise MeshUnhealthy(f"the reference has only {len(reference.deltas)} deltas")
    failed = False
    for run in range(1, args.runs + 1):
        candidates = net.names()
        baseline = net.active_sessions(candidates)
        stop = Disruption(net, signal.SIGSTOP, args.at, args.target, candidates, rng, baseline)
        try:
            got = stream_chat(net.base_url, model, on_delta=stop, timeout=args.stream_timeout)
        finally:
            if stop.pid is not None:
                try:
                    os.kill(stop.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        problems = stream_problems(stop, got, reference, args.at)
        pause = None
        if stop.sent and not stop.error and not got.error:
            pause = max(got.gaps_ms(since=stop.at) or [0.0])
            if pause > STOP_PAUSE_LIMIT_MS:
                problems.append(f"the stream paused {pause:.0f} ms, more than "
                                f"{STOP_PAUSE_LIMIT_MS} ms")
        log(
            f"run {run}: SIGSTOP {stop.name if stop.sent else '-'} (pid {stop.pid or '-'}, on "
            f"route: {route_mark(stop.on_route)}, another holder: {route_mark(stop.backup)}) at "
            f"delta {args.at}: stream {'ok' if got.error is None else 'FAILED'} "
            f"({len(got.deltas)} deltas, pause {fmt_ms(pause)} ms); SIGCONT after the stream"
        )
        try:
            heal = net.wait_healed(args.timeout)
            log(f"run {run}: the stopped process resumed; healed {heal:.1f}s later")
        except MeshUnhealthy as error:
            log(f"stop: {error}")
            return 3
        failed = report_run(run, problems) or failed
    return 1 if failed else 0


# The longest a client pointed at another member may go without answers after the tracker dies.
TRACKER_RECOVERY_LIMIT = 10.0


def chat_once(base_url, model, timeout):
    """One short non-streaming chat: (status, text or error body)."""
    url = urllib.parse.urlsplit(base_url)
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say hello."}]})
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read().decode(errors="replace")
        if response.status != 200:
            return response.status, data[:300]
        return 200, json.loads(data)["choices"][0]["message"]["content"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        return None, f"{type(error).__name__}: {error}"
    finally:
        conn.close()


def run_tracker(net, args):
    member = args.member
    if member not in net.names():
        log(f"chaos.py tracker: no process named {member} (have {', '.join(net.names())})")
        return 2
    member_base = net.http(member) + "/v1"
    model = model_id(member_base)
    log(f"tracker: client at {member} ({member_base}), model {model}")
    log(f"mesh healed after {net.wait_healed(args.timeout):.1f}s: {net.layout()}")
    before = net.tracker_status()
    old_id, old_term = before.get("peer"), int(before.get("term") or 0)
    problems = []

    # A request in flight through the member when the tracker dies fails.
    killed_at = []

    def kill(count):
        if count == args.at and not killed_at:
            net.signal("tracker", signal.SIGKILL)
            killed_at.append(time.monotonic())

    in_flight = stream_chat(member_base, model, on_delta=kill, timeout=args.stream_timeout)
    if not killed_at:
        raise MeshUnhealthy(f"the stream ended after {len(in_flight.deltas)} deltas, before "
                            f"delta {args.at}")
    died = killed_at[0]
    log(f"SIGKILL to the tracker at delta {args.at}; the request in flight: "
        f"{in_flight.error or 'finished'}")
    if in_flight.error is None:
        problems.append("the request in flight when the tracker died did not fail")

    # The next requests through the member succeed again, soon.
    attempts = 0
    answered_after = None
    while time.monotonic() - died < args.timeout:
        attempts += 1
        status, text = chat_once(member_base, model, timeout=10.0)
        if status == 200 and text:
            answered_after = time.monotonic() - died
            break
        time.sleep(0.2)
    if answered_after is None:
        log(f"no answer through {member} within {args.timeout:.0f}s of the kill")
        return 1
    log(f"{member} answered again {answered_after:.2f}s after the kill ({attempts} requests)")
    if answered_after > TRACKER_RECOVERY_LIMIT:
        problems.append(f"answers came back after {answered_after:.2f}s, over "
                        f"{TRACKER_RECOVERY_LIMIT:.0f}s")

    # The member follows a new tracker of a later term whose map covers the model.
    seen = net.status(member)
    new_id, new_term = seen.get("tracker"), int(seen.get("term") or 0)
    new_tracker = None
    for name in net.names():
        try:
            status = net.status(name, timeout=2.0)
        except OSError:
            continue
        if status.get("peer") == new_id:
            new_tracker = (name, status)
    if new_id == old_id or new_term <= old_term or new_tracker is None:
        problems.append(f"{member} follows {new_id} (term {new_term}); the old tracker was "
                        f"{old_id} (term {old_term})")
    else:
        name, status = new_tracker
        complete = (status.get("coverage") or {}).get("complete")
        log(f"new tracker: {name} ({new_id}), term {new_term}, coverage complete: {complete}")
        if status.get("role") != "tracker" or not complete:
            problems.append(f"{name} is {status.get('role')} with coverage complete={complete}")

    # The old tracker, restarted, joins as a peer of the new one.
    restart_s = net.restart("tracker")
    deadline = time.monotonic() + args.timeout
    rejoined = None
    while time.monotonic() < deadline:
        try:
            status = get_json(net.tracker_http + "/status", timeout=2.0)
        except OSError:
            status = {}
        if status.get("role") == "peer" and status.get("tracker") == new_id:
            rejoined = status
            break
        time.sleep(0.2)
    if rejoined is None:
        problems.append("the restarted old tracker did not join as a peer of the new one")
    else:
        log(f"the old tracker restarted in {restart_s:.1f}s and follows {new_id} as a peer "
            f"(term {rejoined.get('term')})")
    if new_tracker is not None:
        name = new_tracker[0]
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            status = net.status(name, timeout=2.0)
            if status.get("role") == "tracker" and (status.get("coverage") or {}).get("complete"):
                break
            time.sleep(0.2)
        else:
            problems.append(f"{name} lost the tracker role or coverage after the old one came back")
        status, text = chat_once(net.tracker_http + "/v1", model, timeout=30.0)
        if status != 200:
            problems.append(f"the old tracker, now a peer, did not pass a chat on: {status} {text}")
    if problems:
        log("tracker FAILED:\n  " + "\n  ".join(problems))
        return 1
    log(f"tracker ok: answers again after {answered_after:.2f}s")
    return 0


def run_reference(net, args):
    model = model_id(net.base_url)
    net.wait_healed(args.timeout)
    reference = take_reference(net, model, args.reference_runs, args.stream_timeout)
    log(json.dumps(reference.text))
    log("deltas: " + json.dumps([text for _, text in reference.deltas]))
    return 0


def main():
    parser = argparse.ArgumentParser(
        description="Kill, SIGTERM and restart processes of a local.sh testnet mid-generation.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("mode", choices=["chaos", "sigterm", "stop", "reference", "tracker"])
    parser.add_argument("--run-dir", default=os.environ.get("MESHNET_TESTNET_DIR")
                        or os.path.join(os.environ.get("TMPDIR", "/tmp"), "meshnet-testnet"))
    parser.add_argument("--base-url", help="the OpenAI base URL (default: from the state file)")
    parser.add_argument("--local-sh", default=str(HERE / "local.sh"))
    parser.add_argument("--runs", type=int, help="runs (chaos: 20, sigterm: 1)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    parser.add_argument("--target", choices=["any", "on-route"],
                        help="which process to disrupt (chaos: any, sigterm and stop: on-route)")
    parser.add_argument("--at", type=int, default=10,
                        help="sigterm, stop: the delta to send the signal at")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the mesh to heal")
    parser.add_argument("--stream-timeout", type=float, default=120.0,
                        help="longest silence of a stream, seconds")
    parser.add_argument("--reference-runs", type=int, default=2)
    parser.add_argument("--member", default="peer1",
                        help="tracker: the member the client talks to")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if args.runs is None:
        args.runs = 20 if args.mode == "chaos" else 1
    if args.target is None:
        args.target = "any" if args.mode == "chaos" else "on-route"
    if args.runs < 1 or args.reference_runs < 1:
        parser.error("--runs and --reference-runs must be at least 1")
    if not K_MIN <= args.at <= K_MAX:
        parser.error(f"--at must be in [{K_MIN}, {K_MAX}]")
    try:
        net = Testnet(args.run_dir, args.base_url, args.local_sh)
        if not net.names():
            raise MeshUnhealthy(f"no non-tracker process is recorded in {args.run_dir}/pids")
        mode = {
            "chaos": run_chaos,
            "sigterm": run_sigterm,
            "stop": run_stop,
            "reference": run_reference,
            "tracker": run_tracker,
        }
        return mode[args.mode](net, args)
    except MeshUnhealthy as error:
        log(f"chaos.py {args.mode}: {error}")
        return 3


if __name__ == "__main__":
    sys.exit(main())
