#!/usr/bin/env python3
"""Checks the `GET /metrics` scrape of every member of a running mesh.

Usage:
    python3 scripts/metrics_check.py http://127.0.0.1:8080/v1

Needs the `prometheus_client` package (its text-format parser reads every scrape). Given the
tracker's OpenAI base URL (the last line of `testnet/local.sh up`), it finds the other members
through the tracker's `/status`, then checks that

- every member's scrape parses and carries each meshnet family (and libp2p's own);
- a scrape changes no state: two scrapes in a row with no traffic agree on every meshnet
  counter that only traffic moves;
- the families move as a chat runs: while a streamed answer is under way the tracker counts an
  active session and KV-cache bytes in use; afterwards tokens, time-to-first-token and
  inter-token histograms, /forward latencies to every peer as a hop, wire bytes, and on the
  peers forward compute time and received bytes have grown, and the session is gone;
- the mesh's formation left its marks: directives issued by the tracker and applied by the
  peers, accepted gossip, served layers and a finished load on every member.

Prints the scrape time of each member; exits non-zero on the first failed check.
"""

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    sys.exit("error: the `prometheus_client` package is missing; run scripts/setup.sh --dev")

# Every family a member exports (without the `_total` / `_bucket` sample suffixes), and its type.
FAMILIES = {
    "meshnet_tokens_generated": "counter",
    "meshnet_time_to_first_token_seconds": "histogram",
    "meshnet_inter_token_latency_seconds": "histogram",
    "meshnet_forward_request_seconds": "histogram",
    "meshnet_forward_compute_seconds": "histogram",
    "meshnet_wire_bytes": "counter",
    "meshnet_directives_issued": "counter",
    "meshnet_directives_applied": "counter",
    "meshnet_gossip_accepted": "counter",
    "meshnet_gossip_rejected": "counter",
    "meshnet_p2p_connections_refused": "counter",
    "meshnet_failovers": "counter",
    "meshnet_api_key_requests": "counter",
    "meshnet_api_key_tokens": "counter",
    "meshnet_api_key_rate_limited": "counter",
    "meshnet_api_unauthorized": "counter",
    "meshnet_active_sessions": "gauge",
    "meshnet_queued_sessions": "gauge",
    "meshnet_kv_cache_used_bytes": "gauge",
    "meshnet_kv_cache_free_bytes": "gauge",
    "meshnet_load_progress_ratio": "gauge",
    "meshnet_served_layers": "gauge",
}
# Prefixes of libp2p's own families (swarm, gossipsub, Kademlia) that must be present.
LIBP2P_PREFIXES = ("libp2p_swarm_", "libp2p_gossipsub_", "libp2p_kad_")
CONTENT_TYPE = "text/plain"


class CheckFailed(Exception):
    """A check did not hold."""


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read()


class Scrape:
    """One parsed scrape: samples by (name, labels)."""

    def __init__(self, text):
        self.families = {}
        self.samples = {}
        for family in text_string_to_metric_families(text):
            self.families[family.name] = family.type
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                self.samples[key] = sample.value

    def value(self, name, **labels):
        """The sum of every sample named `name` whose labels include `labels`."""
        wanted = set(labels.items())
        return sum(
            value
            for (sample, sample_labels), value in self.samples.items()
            if sample == name and wanted <= set(sample_labels)
        )

    def series(self, name):
        return [dict(labels) for (sample, labels) in self.samples if sample == name]


def scrape(base):
    status, content_type, body = http_get(f"{base}/metrics")
    check(status == 200, f"{base}/metrics answered {status}")
    check(content_type.startswith(CONTENT_TYPE), f"{base}/metrics has Content-Type {content_type!r}")
    try:
        return Scrape(body.decode("utf-8"))
    except Exception as error:  # the parser raises ValueError and friends on bad input
        raise CheckFailed(f"{base}/metrics does not parse as Prometheus text: {error}")


def scrape_millis(base, times=20):
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        http_get(f"{base}/metrics")
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), max(samples)


def check_families(name, metrics):
    for family, kind in FAMILIES.items():
        check(family in metrics.families, f"{name}: family {family} is missing")
        check(
            metrics.families[family] == kind,
            f"{name}: {family} is a {metrics.families[family]}, expected a {kind}",
        )
    for prefix in LIBP2P_PREFIXES:
        check(
            any(f.startswith(prefix) for f in metrics.families),
            f"{name}: no libp2p family starting with {prefix}",
        )


# Counters that only traffic moves: equal across two scrapes with no chat between them.
TRAFFIC_SAMPLES = (
    "meshnet_tokens_generated_total",
    "meshnet_time_to_first_token_seconds_count",
    "meshnet_inter_token_latency_seconds_count",
    "meshnet_forward_request_seconds_count",
    "meshnet_forward_compute_seconds_count",
    "meshnet_wire_bytes_total",
)


def members(tracker):
    status = json.loads(http_get(f"{tracker}/status")[2])
    check(status.get("role") == "tracker", f"{tracker} is not the tracker: {status.get('role')}")
    peers = [p["http"] for p in status.get("peers") or [] if p.get("http")]
    check(peers, "the tracker's /status lists no peer with an HTTP endpoint")
    return status["model"]["id"], peers


def stream_chat(tracker, model, during):
    """Streams one answer; calls `during()` once the first token arrived. Returns the text."""
    request = json.dumps({
        "model": model, "temperature": 0, "max_tokens": 24, "stream": True,
        "messages": [{"role": "user", "content": "Name three colours."}],
    }).encode()
    req = urllib.request.Request(
        f"{tracker}/v1/chat/completions", data=request,
        headers={"Content-Type": "application/json"},
    )
    text, called = "", False
    with urllib.request.urlopen(req, timeout=120) as response:
        check(response.status == 200, f"the chat answered {response.status}")
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            check("error" not in chunk, f"the stream failed: {chunk}")
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    text += piece
                    if not called:
                        called = True
                        during()
    check(called, "the streamed answer carried no text")
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", help="the tracker's OpenAI base URL, e.g. http://127.0.0.1:8080/v1")
    args = parser.parse_args()
    tracker = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        model, peers = members(tracker)
        everyone = [("tracker", tracker)] + [(f"peer {url}", url) for url in peers]

        before = {}
        for name, base in everyone:
            first = scrape(base)
            check_families(name, first)
            second = scrape(base)
            for sample in TRAFFIC_SAMPLES:
                check(
                    first.value(sample) == second.value(sample),
                    f"{name}: {sample} moved between two scrapes with no traffic "
                    f"({first.value(sample)} -> {second.value(sample)})",
                )
            before[base] = second
            check(second.value("meshnet_served_layers") > 0, f"{name}: serves no layer")
            check(second.value("meshnet_load_progress_ratio") == 1, f"{name}: its load is unfinished")
            check(second.value("meshnet_gossip_accepted_total") > 0, f"{name}: accepted no gossip")
            check(second.value("meshnet_kv_cache_free_bytes") > 0, f"{name}: no free KV-cache bytes")
        check(before[tracker].value("meshnet_directives_issued_total") > 0,
              "the tracker counts no directive issued")
        for url in peers:
            check(before[url].value("meshnet_directives_applied_total") > 0,
                  f"peer {url} counts no directive applied")

        during = {}

        def while_streaming():
            during["tracker"] = scrape(tracker)

        text = stream_chat(tracker, model, while_streaming)
        check(during["tracker"].value("meshnet_active_sessions") >= 1,
              "mid-answer the tracker counts no active session")
        check(during["tracker"].value("meshnet_kv_cache_used_bytes") > 0,
              "mid-answer the tracker's KV cache holds no bytes")

        after = {base: scrape(base) for _, base in everyone}
        t0, t1 = before[tracker], after[tracker]

        def grew(scrape_before, scrape_after, name, sample, **labels):
            old, new = scrape_before.value(sample, **labels), scrape_after.value(sample, **labels)
            check(new > old, f"{name}: {sample}{labels or ''} did not grow across a chat ({old} -> {new})")
            return new - old

        tokens = grew(t0, t1, "tracker", "meshnet_tokens_generated_total")
        grew(t0, t1, "tracker", "meshnet_time_to_first_token_seconds_count")
        grew(t0, t1, "tracker", "meshnet_inter_token_latency_seconds_count")
        check(
            t1.value("meshnet_inter_token_latency_seconds_count")
            - t0.value("meshnet_inter_token_latency_seconds_count") == tokens - 1,
            "the tracker's inter-token count is not one less than the tokens generated",
        )
        # A route is a chain (ADR-0011): each member posts to the next hop, so every peer is
        # some member's hop.
        for url in peers:
            posted = sum(
                after[base].value("meshnet_forward_request_seconds_count", hop=url, path="direct-http")
                - before[base].value("meshnet_forward_request_seconds_count", hop=url, path="direct-http")
                for _, base in everyone
            )
            check(posted > 0, f"no member timed a /forward to hop {url} across a chat")
        for form in ("raw", "encoded"):
            grew(t0, t1, "tracker", "meshnet_wire_bytes_total", direction="sent", form=form)
            grew(t0, t1, "tracker", "meshnet_wire_bytes_total", direction="received", form=form)
        for url in peers:
            p0, p1 = before[url], after[url]
            grew(p0, p1, f"peer {url}", "meshnet_forward_compute_seconds_count")
            grew(p0, p1, f"peer {url}", "meshnet_wire_bytes_total", direction="received", form="raw")
        # The session closes just after the last event: wait for it, with a deadline.
        deadline = time.monotonic() + 10
        while scrape(tracker).value("meshnet_active_sessions") != 0:
            check(time.monotonic() < deadline,
                  "the tracker still counts an active session 10 s after the answer ended")
            time.sleep(0.1)

        for name, base in everyone:
            median, worst = scrape_millis(base)
            print(f"scrape of {name}: median {median:.2f} ms, worst {worst:.2f} ms of 20")
        print(f"metrics check passed: {len(FAMILIES)} meshnet families on {len(everyone)} members; "
              f"a chat of {tokens:.0f} tokens moved them ({text!r})")
    except CheckFailed as failure:
        sys.exit(f"metrics check FAILED: {failure}")
    except (urllib.error.URLError, OSError) as error:
        sys.exit(f"metrics check FAILED: cannot reach the mesh: {error}")


if __name__ == "__main__":
    main()
