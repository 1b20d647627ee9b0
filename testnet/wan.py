#!/usr/bin/env python3
"""A mesh across emulated wide-area links: every member's HTTP endpoint behind a delay relay.

    testnet/wan.py [--members N] [--delay-ms D] [--rate-kbit R] [--jitter-ms J]
                   [--prompt short|long|copy|code] [--tokens T]
                   [--direct-return on|off|both] [--speculation on|off|both] [--ladder]
                   [--compare-undelayed] [--alternate ROUNDS] [--netns]

Starts one tracker and N-1 peers of the release `meshnet-peer` on 127.0.0.1, each serving an
equal share of the default model's layers, and one `meshnet-linkem relay` with two links per
member, one for its HTTP endpoint and one for its libp2p port: a member listens on its own
ports and announces the relay's (`--advertise-http`, `--advertise-p2p`), so every activation
frame sent to it, every libp2p connection dialed to it (gossip, Kademlia) and every answer it
gives crosses one emulated link of D ms each way at R kbit/s. The members are the unmodified
binary. After each chat the script checks with `ss` that every TCP connection a member
accepted came from the relay (none bypassed the emulated links).

With `--netns` (root, iproute2) the members run in the network-namespace testbed instead:
each in a namespace of its own on one bridge (198.18.0.0/24), listening only on the
namespace's loopback, with its relay beside it on the bridge address, so every byte between
two members crosses the relay by construction.

It then sends one greedy streamed chat and prints a JSON line per run: the time to the first
token (TTFT, from the request), decode tok/s after the first token (the mean over the rest of
the tokens) and the text. `--direct-return both` runs the mesh twice, with the route's output
coming back along the route (`--no-direct-return`) and straight from the last hop, and checks
the texts are equal; `--speculation both` does the same with speculative decoding off
(`--no-speculation`) and on, and `--ladder` runs the three steps plain, direct return, direct
return with speculation. `--prompt` picks the task: `short` a story (free text), `long` a
summary of a ~1,000-token prompt, `copy` a paragraph rewritten with one word changed and
`code` a function edited (repetitive tasks, where drafts from the context are accepted). Each
row also gives the tokens the tracker drafted and had accepted. `--compare-undelayed` also runs the same chat on a mesh without delay and
checks the text is equal. `--alternate ROUNDS` measures speculation on one mesh instead (it
must be on): ROUNDS rounds of two chats, one as the tracker drafts and one with the request's
`max_draft` at 0, in the order on, off in even rounds and off, on in odd ones; it prints a line
per chat and one with the mean decode tok/s of each and their ratio (so the spread between
freshly started meshes does not enter the comparison). Exit 1 when a check fails.

Every process it starts is stopped when it ends, also on failure or Ctrl-C.

Environment: MESHNET_BIN_DIR, the directory of release binaries (default: build them with
cargo into target/release).
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
COPY_PARAGRAPH = (
    "The old bridge over the river was built in 1872 from grey stone carried down from the "
    "northern quarries. For more than a century it carried carts, then cars, then buses full "
    "of children on their way to school. In the spring floods the water rose almost to its "
    "arches, and the whole town came out to watch."
)
CODE_SNIPPET = (
    "def average(values):\n"
    "    total = 0\n"
    "    count = 0\n"
    "    for value in values:\n"
    "        total = total + value\n"
    "        count = count + 1\n"
    "    return total / count\n"
)
LONG_PARAGRAPH = (
    "The river town woke slowly: bakers lit their ovens, ferrymen checked their ropes, and the "
    "schoolteacher walked the long way round to look at the water before the children came. "
)


def say(message):
    print(f"wan.py: {message}", file=sys.stderr, flush=True)


def binaries():
    """The release meshnet-peer and meshnet-linkem, built when not given."""
    bin_dir = os.environ.get("MESHNET_BIN_DIR")
    if not bin_dir:
        say("building meshnet-peer and meshnet-linkem (release)")
        subprocess.run(
            ["cargo", "build", "--locked", "--release", "-p", "meshnet-peer", "-p", "meshnet-linkem"],
            cwd=REPO,
            check=True,
            stdout=sys.stderr,
        )
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
        bin_dir = os.path.join(target, "release")
    peer, linkem = (os.path.join(bin_dir, name) for name in ("meshnet-peer", "meshnet-linkem"))
    for path in (peer, linkem):
        if not os.access(path, os.X_OK):
            sys.exit(f"wan.py: {path} is not an executable")
    return peer, linkem


def free_ports(count):
    """`count` TCP ports the system reports free on 127.0.0.1 (held until all are chosen)."""
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def budgets(peer, members):
    """The --memory of each member: the tracker's share with the embedding and head first."""
    info = json.loads(subprocess.run([peer, "model-info"], capture_output=True, check=True).stdout)
    layers = info["layers"]
    shares = [layers // members + (1 if k < layers % members else 0) for k in range(members)]

    def memory(count, tracker):
        args = [peer, "model-info", "--layers", str(count)] + (["--tracker"] if tracker else [])
        out = subprocess.run(args, capture_output=True, check=True).stdout
        return json.loads(out)["memory_for_layers"]

    return [memory(share, k == 0) for k, share in enumerate(shares)]


def http_json(url, body=None, timeout=30):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LoopbackSites:
    """Every member on 127.0.0.1 with ports of its own, and one relay process holding two
    links per member: its HTTP port and its libp2p port."""

    def __init__(self, members):
        ports = free_ports(4 * members)
        self.http, self.relay, self.p2p, self.p2p_relay = (
            ports[k * members:(k + 1) * members] for k in range(4)
        )
        self.direct_ports = set(self.http) | set(self.p2p)

    def relays(self):
        """(log name, command prefix, LISTEN=TARGET links) of each relay process."""
        own, relayed = self.http + self.p2p, self.relay + self.p2p_relay
        return [("linkem", [], [f"127.0.0.1:{r}=127.0.0.1:{o}" for o, r in zip(own, relayed)])]

    def member(self, k):
        """Member k's command prefix and its listen and advertised addresses (HOST:PORT)."""
        return [], {
            "http": f"127.0.0.1:{self.http[k]}",
            "advertise_http": f"127.0.0.1:{self.relay[k]}",
            "p2p": f"127.0.0.1:{self.p2p[k]}",
            "advertise_p2p": f"127.0.0.1:{self.p2p_relay[k]}",
        }

    def enter_client(self):
        pass

    def leave_client(self):
        pass

    def close(self):
        pass

    def bypassing_connections(self):
        """The TCP connections a member accepted from another process than the relay, as `ss`
        lines (None when `ss` is not installed). A connection whose other end no process
        holds any more (closed by it and being torn down) cannot be told apart and is left
        out: a bypassing one stays open and is held by the member that dialed it."""
        if shutil.which("ss") is None:
            return None
        lines = subprocess.run(["ss", "-Htanp"], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        owner, accepted = {}, []
        for line in lines:
            fields = line.split()
            if len(fields) < 5 or fields[0] == "LISTEN":
                continue
            local, remote = fields[3].rpartition(":")[2], fields[4].rpartition(":")[2]
            if len(fields) > 5:
                owner[local] = fields[5]
            if fields[0] == "ESTAB" and int(local) in self.direct_ports:
                accepted.append((remote, line))
        return [line for remote, line in accepted
                if remote in owner and "meshnet-linkem" not in owner[remote]]


class NamespaceSites:
    """Each member in a network namespace of its own (mwan-m<k>, 198.18.0.<10+k> on the bridge
    mwan-br in mwan-inet) with its relay beside it. The member listens on the namespace's
    127.0.0.1 only, so the relay on the bridge address is the only way in: no connection can
    bypass the emulated link. The script's own requests go to the tracker from inside its
    namespace (setns). Needs root and iproute2."""

    INET = "mwan-inet"
    HTTP_PORT, P2P_PORT = 8080, 4001

    def __init__(self, members):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            sys.exit("wan.py: --netns needs root and iproute2 (ip)")
        self.names = [f"mwan-m{k}" for k in range(members)]
        self.host_netns = None
        self.close()
        self.ip("netns", "add", self.INET)
        self.ip("-n", self.INET, "link", "add", "mwan-br", "type", "bridge")
        self.ip("-n", self.INET, "link", "set", "mwan-br", "up")
        for k, name in enumerate(self.names):
            self.ip("netns", "add", name)
            self.ip("-n", name, "link", "set", "lo", "up")
            self.ip("link", "add", f"mwan-p{k}", "netns", self.INET, "type", "veth",
                    "peer", "name", "eth0", "netns", name)
            self.ip("-n", self.INET, "link", "set", f"mwan-p{k}", "master", "mwan-br", "up")
            self.ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            self.ip("-n", name, "link", "set", "eth0", "up")

    @staticmethod
    def ip(*argv):
        subprocess.run(["ip", *argv], check=True, stdout=subprocess.DEVNULL)

    @staticmethod
    def address(k):
        return f"198.18.0.{10 + k}"

    def relays(self):
        return [
            (f"linkem{k}", ["ip", "netns", "exec", name], [
                f"{self.address(k)}:{port}=127.0.0.1:{port}"
                for port in (self.HTTP_PORT, self.P2P_PORT)
            ])
            for k, name in enumerate(self.names)
        ]

    def member(self, k):
        return ["ip", "netns", "exec", self.names[k]], {
            "http": f"127.0.0.1:{self.HTTP_PORT}",
            "advertise_http": f"{self.address(k)}:{self.HTTP_PORT}",
            "p2p": f"127.0.0.1:{self.P2P_PORT}",
            "advertise_p2p": f"{self.address(k)}:{self.P2P_PORT}",
        }

    def enter_client(self):
        """Moves this process into the tracker's namespace (until `leave_client`)."""
        self.host_netns = os.open("/proc/self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.names[0]}", os.O_RDONLY)
        try:
            set_netns(target)
        finally:
            os.close(target)

    def leave_client(self):
        if self.host_netns is not None:
            set_netns(self.host_netns)
            os.close(self.host_netns)
            self.host_netns = None

    def close(self):
        """Stops what runs in the namespaces and deletes them (also what a crashed run left)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for name in [line.split()[0] for line in listed.splitlines() if line.startswith("mwan-")]:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], check=False)

    def bypassing_connections(self):
        return []


def set_netns(fd):
    """Moves this (single-threaded) process into the network namespace open at `fd`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "setns")


class Mesh:
    """N members behind one relay process, started in __enter__ and stopped in __exit__."""

    def __init__(self, args, peer, linkem, delay_ms, mode):
        self.args, self.peer, self.linkem = args, peer, linkem
        self.delay_ms = delay_ms
        self.direct_return, self.speculation = mode
        self.processes = []
        self.dir = tempfile.mkdtemp(prefix="meshnet-wan-")

    def spawn(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        self.processes.append(process)
        return process

    def __enter__(self):
        members = self.args.members
        memories = budgets(self.peer, members)
        self.sites = (NamespaceSites if self.args.netns else LoopbackSites)(members)
        shape = ["--delay-ms", str(self.delay_ms), "--rate-kbit", str(self.args.rate_kbit)]
        if self.args.jitter_ms:
            shape += ["--jitter-ms", str(self.args.jitter_ms)]
        for name, prefix, links in self.sites.relays():
            self.spawn(name, [*prefix, self.linkem, "relay",
                              *(f"--link={link}" for link in links), *shape])
        bootstrap = None
        for k in range(members):
            prefix, place = self.sites.member(k)
            argv = [
                *prefix, self.peer,
                "--http", place["http"],
                "--advertise-http", f"http://{place['advertise_http']}",
                "--p2p", f"/ip4/{place['p2p'].replace(':', '/tcp/')}",
                "--advertise-p2p", f"/ip4/{place['advertise_p2p'].replace(':', '/tcp/')}",
                "--memory", str(memories[k]),
                "--data-dir", os.path.join(self.dir, f"member{k}"),
                "--reachable",
                "--announce-interval", "0.5",
            ]
            argv += ["--tracker"] if k == 0 else ["--bootstrap", bootstrap]
            if not self.direct_return:
                argv.append("--no-direct-return")
            if not self.speculation:
                argv.append("--no-speculation")
            process = self.spawn(f"member{k}", argv)
            if k == 0:
                tracker_id = self.ready_line(process, "member0")["peer"]
                bootstrap = f"/ip4/{place['advertise_p2p'].replace(':', '/tcp/')}/p2p/{tracker_id}"
                self.tracker = f"http://{place['http']}"
        self.sites.enter_client()
        self.wait_for_coverage(members)
        return self

    def ready_line(self, process, name):
        """The ready line `process` (logging to `name`.log) prints, as a dict."""
        for line in process.stdout:
            try:
                ready = json.loads(line)
            except ValueError:
                continue
            if isinstance(ready, dict) and ready.get("event") == "ready":
                return ready
        sys.exit(f"{os.path.basename(sys.argv[0])}: {name} printed no ready line; "
                 f"see {self.dir}/{name}.log")

    def wait_for_coverage(self, members, timeout=180):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                status = http_json(f"{self.tracker}/status", timeout=5)
                spans = [p.get("span") for p in status.get("peers") or []]
                ready = [s for s in spans if s and s.get("state") == "ready"]
                if (status.get("coverage") or {}).get("complete") and len(ready) == members - 1:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        sys.exit(f"wan.py: the mesh did not cover the model in {timeout} s; logs in {self.dir}")

    def __exit__(self, *_):
        sites = getattr(self, "sites", None)
        if sites:
            sites.leave_client()
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if sites:
            sites.close()


def prompt_text(kind):
    if kind == "short":
        return SHORT_PROMPT
    if kind == "copy":
        return (
            "Rewrite the paragraph below exactly as it is, but with the word 'grey' changed to "
            f"'white'.\n\n{COPY_PARAGRAPH}"
        )
    if kind == "code":
        return (
            "Rename the variable 'total' to 'running_sum' in this Python function and give the "
            f"whole function back.\n\n{CODE_SNIPPET}"
        )
    return LONG_PARAGRAPH * 24 + "Summarise the paragraph above in one sentence."


def streamed_chat(base, model, prompt, tokens, max_draft=None):
    """One greedy streamed chat: (TTFT s, decode tok/s after the first token, tokens, text).
    `max_draft` sets the request's draft length (None leaves it to the tracker)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if max_draft is not None:
        body["max_draft"] = max_draft
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    first = last = None
    text, usage = [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(content)
    generated = usage.get("completion_tokens", 0)
    decode = (generated - 1) / (last - first) if generated > 1 and last > first else 0.0
    return first - started, decode, generated, "".join(text)


def model_id(base):
    return http_json(f"{base}/v1/models")["data"][0]["id"]


def counters(base):
    """The tracker's drafted and accepted token counts from its /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    found = {}
    for line in lines:
        name, _, value = line.partition(" ")
        if name in ("meshnet_drafted_tokens_total", "meshnet_accepted_drafts_total"):
            found[name] = int(float(value))
    return found.get("meshnet_drafted_tokens_total", 0), found.get(
        "meshnet_accepted_drafts_total", 0
    )


def run(args, peer, linkem, delay_ms, mode):
    with Mesh(args, peer, linkem, delay_ms, mode) as mesh:
        base = mesh.tracker
        model = model_id(base)
        # One short chat first: connections are opened and the pools warm.
        streamed_chat(base, model, "Hello.", 4)
        before = counters(base)
        ttft, decode, generated, text = streamed_chat(
            base, model, prompt_text(args.prompt), args.tokens
        )
        after = counters(base)
        bypassing = mesh.sites.bypassing_connections()
    if bypassing:
        sys.exit("wan.py: connections reached members without crossing the emulated links:\n"
                 + "\n".join(bypassing))
    if bypassing is None and not args.netns:
        say("ss is not installed: not checked that every connection crossed the relay")
    row = {
        "members": args.members,
        "delay_ms": delay_ms,
        "rate_kbit": args.rate_kbit,
        "direct_return": mode[0],
        "speculation": mode[1],
        "drafted": after[0] - before[0],
        "accepted": after[1] - before[1],
        "prompt": args.prompt,
        "ttft_s": round(ttft, 3),
        "decode_tok_s": round(decode, 2),
        "tokens": generated,
        "text": text,
    }
    print(json.dumps(row), flush=True)
    return row


def alternate(args, peer, linkem, rounds):
    """Chats with speculation on and off (the request's `max_draft` at 0) in turn on one mesh."""
    chats = {True: [], False: []}
    texts = set()
    with Mesh(args, peer, linkem, args.delay_ms, (args.direct_return != "off", True)) as mesh:
        base = mesh.tracker
        model = model_id(base)
        streamed_chat(base, model, "Hello.", 4)
        for round_index in range(rounds):
            order = [True, False] if round_index % 2 == 0 else [False, True]
            for speculation in order:
                before = counters(base)
                _, decode, generated, text = streamed_chat(
                    base, model, prompt_text(args.prompt), args.tokens,
                    None if speculation else 0,
                )
                after = counters(base)
                texts.add(text)
                chats[speculation].append(decode)
                print(json.dumps({
                    "round": round_index,
                    "speculation": speculation,
                    "drafted": after[0] - before[0],
                    "accepted": after[1] - before[1],
                    "decode_tok_s": round(decode, 2),
                    "tokens": generated,
                }), flush=True)
    if len(texts) != 1:
        sys.exit(f"wan.py: the chats' texts differ: {sorted(texts)}")
    on = sum(chats[True]) / rounds
    off = sum(chats[False]) / rounds
    print(json.dumps({
        "members": args.members,
        "delay_ms": args.delay_ms,
        "prompt": args.prompt,
        "rounds": rounds,
        "on_tok_s": round(on, 2),
        "off_tok_s": round(off, 2),
        "on_over_off": round(on / off, 3) if off else None,
    }), flush=True)


def main():
    # A SIGTERM ends the run like Ctrl-C does: the meshes' processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--delay-ms", type=int, default=50)
    parser.add_argument("--rate-kbit", type=int, default=1_000_000)
    parser.add_argument("--jitter-ms", type=int, default=0)
    parser.add_argument("--prompt", choices=["short", "long", "copy", "code"], default="short")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--direct-return", choices=["on", "off", "both"], default="on")
    parser.add_argument("--speculation", choices=["on", "off", "both"], default="on")
    parser.add_argument("--ladder", action="store_true")
    parser.add_argument("--compare-undelayed", action="store_true")
    parser.add_argument("--alternate", type=int, metavar="ROUNDS")
    parser.add_argument("--netns", action="store_true")
    args = parser.parse_args()
    if args.members < 2:
        parser.error("--members needs at least 2 (a tracker and a peer)")
    if args.tokens < 2:
        parser.error("--tokens needs at least 2 (decode speed is measured after the first)")
    if args.alternate is not None:
        if args.alternate < 1 or args.ladder or args.speculation != "on":
            parser.error("--alternate needs ROUNDS >= 1, speculation on and no --ladder")
    peer, linkem = binaries()
    if args.alternate is not None:
        alternate(args, peer, linkem, args.alternate)
        return
    switch = {"on": [True], "off": [False], "both": [False, True]}
    modes = [
        (direct, speculation)
        for direct in switch[args.direct_return]
        for speculation in switch[args.speculation]
    ]
    if args.ladder:
        modes = [(False, False), (True, False), (True, True)]
    rows = [run(args, peer, linkem, args.delay_ms, mode) for mode in modes]
    if args.compare_undelayed:
        rows.append(run(args, peer, linkem, 0, modes[-1]))
    texts = {row["text"] for row in rows}
    if len(texts) != 1:
        sys.exit(f"wan.py: the runs' texts differ: {[row['text'] for row in rows]}")
    if len(rows) > 1:
        say(f"all {len(rows)} runs gave the same text")


if __name__ == "__main__":
    main()
