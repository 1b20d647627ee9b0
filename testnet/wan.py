#!/usr/bin/env python3
"""A mesh across emulated wide-area links: every member's HTTP endpoint behind a delay relay.

    testnet/wan.py [--members N] [--delay-ms D] [--rate-kbit R] [--jitter-ms J]
                   [--prompt short|long|copy|code] [--tokens T]
                   [--direct-return on|off|both] [--speculation on|off|both] [--ladder]
                   [--compare-undelayed]

Starts one tracker and N-1 peers of the release `meshnet-peer` on 127.0.0.1, each serving an
equal share of the default model's layers, and one `meshnet-linkem relay` with a link per
member: a member listens on its own port and announces the relay's port, so every activation
frame sent to it (and every answer it gives) crosses one emulated link of D ms each way at R
kbit/s. The members are the unmodified binary. libp2p traffic (announcements, gossip) is not
delayed: the activation plane is what is measured.

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
checks the text is equal. Exit 1 when a check fails.

Every process it starts is stopped when it ends, also on failure or Ctrl-C.

Environment: MESHNET_BIN_DIR, the directory of release binaries (default: build them with
cargo into target/release).
"""

import argparse
import json
import os
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
        ports = free_ports(2 * members)
        http, relay = ports[:members], ports[members:]
        links = [f"--link=127.0.0.1:{r}=127.0.0.1:{h}" for h, r in zip(http, relay)]
        shape = ["--delay-ms", str(self.delay_ms), "--rate-kbit", str(self.args.rate_kbit)]
        if self.args.jitter_ms:
            shape += ["--jitter-ms", str(self.args.jitter_ms)]
        self.spawn("linkem", [self.linkem, "relay", *links, *shape])
        bootstrap = None
        for k in range(members):
            argv = [
                self.peer,
                "--http", f"127.0.0.1:{http[k]}",
                "--advertise-http", f"http://127.0.0.1:{relay[k]}",
                "--p2p", "/ip4/127.0.0.1/tcp/0",
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
                bootstrap = self.ready_p2p(process)
        self.tracker = f"http://127.0.0.1:{http[0]}"
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

    def ready_p2p(self, process):
        """The libp2p TCP address in the ready line the tracker prints."""
        ready = self.ready_line(process, "member0")
        return next(a for a in ready["p2p"] if "/tcp/" in a)

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


def streamed_chat(base, model, prompt, tokens):
    """One greedy streamed chat: (TTFT s, decode tok/s after the first token, tokens, text)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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
    args = parser.parse_args()
    if args.members < 2:
        parser.error("--members needs at least 2 (a tracker and a peer)")
    if args.tokens < 2:
        parser.error("--tokens needs at least 2 (decode speed is measured after the first)")
    peer, linkem = binaries()
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
