#!/usr/bin/env python3
"""Opens a member's live coverage page (`GET /`) in headless Chromium and checks what it shows.

Usage:
    python3 scripts/page_check.py http://127.0.0.1:8080/v1 --layers 30 --peers 3 [--out DIR]

Given the tracker's OpenAI base URL (the last line of `testnet/local.sh up`), it lets Chromium
run the page until its scripts have read `/status` and `/metrics`, then checks from the
rendered DOM that

- the page refreshed (`<html data-updated>` counts its refreshes) and shows no error;
- the grid has the expected number of layers and one row per peer, every row a cell per layer;
- each cell's state is the one the tracker's coverage map gives for that peer and layer
  (`empty` where the peer holds nothing), and every layer has a ready holder;
- the page names no outside URL (all its assets are embedded in the binary).

It saves the rendered DOM and screenshots at desktop and phone sizes under --out
(default target/test-output/page). Needs `chromium` (Debian's package; scripts/setup.sh --dev).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from html.parser import HTMLParser

# Virtual time the page may run for: several 2-second refreshes.
VIRTUAL_TIME_MS = 12000
# Real time one Chromium run may take.
CHROMIUM_TIMEOUT_S = 120


class CheckFailed(Exception):
    """A check did not hold."""


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    raise CheckFailed("no Chromium found: install Debian's `chromium` (scripts/setup.sh --dev)")


def run_chromium(binary, profile, *args):
    command = [
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}", *args,
    ]
    try:
        done = subprocess.run(command, capture_output=True, timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"Chromium did not finish within {CHROMIUM_TIMEOUT_S} s: {command}")
    if done.returncode != 0:
        raise CheckFailed(
            f"Chromium exited with {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}"
        )
    return done.stdout.decode("utf-8", errors="replace")


class PageDom(HTMLParser):
    """What the checks read off the rendered DOM."""

    def __init__(self):
        super().__init__()
        self.updated = None
        self.grid = None
        self.rows = []  # [(peer id, {layer: state})]
        self.error_banner_hidden = None
        self.tokens_per_second = False
        self.outside_urls = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "html":
            self.updated = a.get("data-updated")
        for key in ("src", "href"):
            value = a.get(key) or ""
            if re.match(r"^(https?:)?//", value):
                self.outside_urls.append(value)
        if a.get("id") == "coverage-grid":
            self.grid = a
        elif a.get("id") == "error-banner":
            self.error_banner_hidden = "hidden" in a
        elif a.get("id") == "tokens-per-second":
            self.tokens_per_second = True
        classes = (a.get("class") or "").split()
        if tag == "tr" and "peer-row" in classes:
            self.rows.append((a.get("data-peer"), {}))
        elif "cell" in classes and self.rows:
            self.rows[-1][1][int(a["data-layer"])] = a.get("data-state")


def expected_states(status):
    """{peer: {layer: state}} from the tracker's coverage map."""
    states = {}
    for layer in status["coverage"]["layers"]:
        for holder in layer["holders"]:
            states.setdefault(holder["peer"], {})[layer["layer"]] = holder["state"]
    return states


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", help="the tracker's OpenAI base URL, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--layers", type=int, required=True, help="layers the grid must show")
    parser.add_argument("--peers", type=int, required=True, help="peer rows the grid must show")
    parser.add_argument("--out", default="target/test-output/page", help="where screenshots go")
    args = parser.parse_args()
    member = args.base_url.rstrip("/").removesuffix("/v1")
    os.makedirs(args.out, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="meshnet-chromium-")
    try:
        binary = chromium_binary()
        with urllib.request.urlopen(f"{member}/", timeout=10) as response:
            check(response.status == 200, f"GET / answered {response.status}")
            content_type = response.headers.get("Content-Type", "")
            check(content_type.startswith("text/html"), f"GET / has Content-Type {content_type!r}")

        dom_text = run_chromium(binary, profile, "--dump-dom", f"{member}/")
        with open(os.path.join(args.out, "page-dom.html"), "w", encoding="utf-8") as f:
            f.write(dom_text)
        dom = PageDom()
        dom.feed(dom_text)
        with urllib.request.urlopen(f"{member}/status", timeout=10) as response:
            status = json.load(response)

        check(dom.updated is not None and dom.updated.isdigit() and int(dom.updated) >= 1,
              f"the page never refreshed from /status (data-updated={dom.updated!r})")
        check(dom.error_banner_hidden is True, "the page shows its error banner")
        check(dom.tokens_per_second, "the page has no tokens/s figure")
        check(not dom.outside_urls, f"the page loads outside URLs: {dom.outside_urls}")
        check(dom.grid is not None, "the page has no #coverage-grid")
        check(dom.grid.get("data-layers") == str(args.layers),
              f"the grid shows {dom.grid.get('data-layers')} layers, expected {args.layers}")
        check(dom.grid.get("data-peers") == str(args.peers),
              f"the grid shows {dom.grid.get('data-peers')} peers, expected {args.peers}")
        check(len(dom.rows) == args.peers, f"{len(dom.rows)} peer rows, expected {args.peers}")

        expected = expected_states(status)
        check(set(expected) == {peer for peer, _ in dom.rows},
              f"the grid's peers {[p for p, _ in dom.rows]} are not the map's {sorted(expected)}")
        ready_layers = set()
        for peer, cells in dom.rows:
            check(sorted(cells) == list(range(args.layers)),
                  f"row {peer} has cells for layers {sorted(cells)}")
            for layer, state in cells.items():
                want = expected[peer].get(layer, "empty")
                check(state == want, f"row {peer}, layer {layer}: the page shows {state!r}, "
                                     f"the tracker's map says {want!r}")
                if state == "ready":
                    ready_layers.add(layer)
        check(ready_layers == set(range(args.layers)),
              f"layers without a ready cell: {sorted(set(range(args.layers)) - ready_layers)}")

        shots = []
        for name, size in (("page-desktop.png", "1280,1000"), ("page-phone.png", "390,844")):
            path = os.path.abspath(os.path.join(args.out, name))
            run_chromium(binary, profile, f"--window-size={size}", f"--screenshot={path}",
                         f"{member}/")
            check(os.path.getsize(path) > 0, f"the screenshot {path} is empty")
            shots.append(path)
        print(f"page check passed: {args.layers} layers x {args.peers} peers, all ready, "
              f"refreshed {dom.updated} times; screenshots {', '.join(shots)}")
    except CheckFailed as failure:
        sys.exit(f"page check FAILED: {failure}")
    except OSError as error:
        sys.exit(f"page check FAILED: {error}")
    finally:
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
