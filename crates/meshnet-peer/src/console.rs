//! What the terminal commands `meshnet-peer status` and `meshnet-peer chat` need besides
//! HTTP: the coverage map and peers of a `/status` answer as a text table, and a decoder of
//! the OpenAI-style API's server-sent events. Both are pure: the binary does the I/O.

use std::collections::BTreeMap;
use std::fmt::Write;

use meshnet_p2p::SpanStatus;
use meshnet_types::{PeerId, SpanState};
use serde_json::Value;

use crate::status::{CoverageReport, HolderReport, StatusReport};

/// The base URL of a member from what a user typed: `host:port`, `http://host:port`,
/// `http://host:port/` or the API's `http://host:port/v1` all name the same member.
pub fn member_base_url(url: &str) -> Result<String, String> {
    let typed = url.trim();
    let with_scheme = if typed.contains("://") {
        typed.to_owned()
    } else {
        format!("http://{typed}")
    };
    let example = "such as http://127.0.0.1:8080";
    let parsed = reqwest::Url::parse(&with_scheme)
        .map_err(|error| format!("{url:?} is not a URL {example} ({error})"))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(format!(
            "{url:?} is not an http:// URL of a member, {example}"
        ));
    }
    let path = parsed.path().trim_end_matches('/');
    let path = path.strip_suffix("/v1").unwrap_or(path);
    Ok(format!("{}{path}", parsed.origin().ascii_serialization()))
}

/// A peer id short enough for a table column: `…` and its last eight characters, or the whole
/// id when it has at most twelve.
fn short_id(id: &str) -> String {
    let tail: String = id
        .chars()
        .rev()
        .take(8)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    if id.chars().count() > 12 {
        format!("…{tail}")
    } else {
        id.to_owned()
    }
}

/// One peer's row in the table.
#[derive(Default)]
struct PeerRow {
    span: String,
    state: String,
    quantization: String,
    path: String,
    sessions: String,
    latency: String,
    note: String,
}

impl PeerRow {
    /// Takes what a member's own status and a tracker's peer entry share: the announced span
    /// (when there is one), the sessions and the milliseconds per decode step.
    fn fill_from(&mut self, span: Option<&SpanStatus>, sessions: u64, step_ms: f64) {
        if let Some(span) = span {
            self.span = span.layers.to_string();
            self.state = span.state.to_string();
            self.quantization = span.quantization.to_string();
        }
        self.sessions = sessions.to_string();
        self.latency = format!("{step_ms:.1}");
    }
}

/// A `/status` answer as text: the member, the model and tracker, a line per layer range with
/// its holders, and a row per peer. Works on any member (a non-tracker knows the coverage map
/// but not the tracker's book of peers, so its rows come from the map).
pub fn status_table(status: &StatusReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "member  {} ({}) at {}",
        status.peer,
        status.role.as_str(),
        status.http.as_deref().unwrap_or("")
    );
    let _ = writeln!(
        out,
        "model   {} ({} layers)",
        status.model.id, status.model.layers
    );
    let _ = writeln!(
        out,
        "tracker {} (term {}) {}",
        status.tracker.as_ref().map_or("none yet", PeerId::as_str),
        status.term,
        status.tracker_http.as_deref().unwrap_or("")
    );
    let coverage = status.coverage.as_ref();
    match coverage {
        Some(coverage) => {
            let _ = writeln!(
                out,
                "coverage {} (epoch {})",
                if coverage.complete {
                    "complete"
                } else {
                    "INCOMPLETE"
                },
                coverage.epoch
            );
        }
        None => {
            let _ = writeln!(out, "coverage none heard yet");
        }
    }

    let rows = peer_rows(status, coverage);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<14} {:<8} {:<9} {:<6} {:<12} {:>8} {:>10}  NOTE",
        "PEER", "LAYERS", "STATE", "QUANT", "PATH", "SESSIONS", "STEP(ms)"
    );
    // In route order: by first layer, then id.
    let mut rows: Vec<(&PeerId, PeerRow)> = rows.into_iter().collect();
    rows.sort_by_key(|(peer, row)| (first_layer(&row.span), *peer));
    for (peer, row) in &rows {
        let _ = writeln!(
            out,
            "{:<14} {:<8} {:<9} {:<6} {:<12} {:>8} {:>10}  {}",
            short_id(peer.as_str()),
            row.span,
            row.state,
            row.quantization,
            row.path,
            row.sessions,
            row.latency,
            row.note
        );
    }
    if let Some(coverage) = coverage {
        let _ = writeln!(out);
        let _ = writeln!(out, "{}", redundancy_line(coverage, status.model.layers));
    }
    out
}

/// The first layer of a span written `a..b` (spans not held sort last).
fn first_layer(span: &str) -> u64 {
    span.split_once("..")
        .and_then(|(first, _)| first.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The peers of a status answer, by id: the member itself, the tracker's book, and every
/// holder in the coverage map.
fn peer_rows<'a>(
    status: &'a StatusReport,
    coverage: Option<&'a CoverageReport>,
) -> BTreeMap<&'a PeerId, PeerRow> {
    let mut rows: BTreeMap<&PeerId, PeerRow> = BTreeMap::new();
    // Spans from the map: the first and last layer each peer holds, and its state and format
    // on the first of them.
    let mut held: BTreeMap<&PeerId, (u32, u32, &HolderReport)> = BTreeMap::new();
    for layer in coverage.into_iter().flat_map(|c| &c.layers) {
        for holder in &layer.holders {
            let entry = held
                .entry(&holder.peer)
                .or_insert((layer.layer, layer.layer, holder));
            entry.0 = entry.0.min(layer.layer);
            entry.1 = entry.1.max(layer.layer);
        }
    }
    for (peer, (first, last, holder)) in held {
        rows.insert(
            peer,
            PeerRow {
                span: format!("{first}..{}", u64::from(last) + 1),
                state: holder.state.to_string(),
                quantization: holder.quantization.to_string(),
                ..PeerRow::default()
            },
        );
    }
    let own = rows.entry(&status.peer).or_default();
    own.fill_from(
        status.span.as_ref(),
        status.active_sessions as u64,
        status.forward_latency_ms,
    );
    own.path = "local".to_owned();
    own.note = format!("this member ({})", status.role.as_str());
    for known in status.peers.iter().flatten() {
        let row = rows.entry(&known.peer).or_default();
        row.fill_from(
            known.span.as_ref(),
            u64::from(known.active_sessions),
            known.forward_latency_ms,
        );
        row.path = known.path.as_str().to_owned();
        if known.leaving {
            row.note = "leaving".to_owned();
        }
    }
    for row in rows.values_mut() {
        for field in [
            &mut row.span,
            &mut row.state,
            &mut row.quantization,
            &mut row.path,
        ] {
            if field.is_empty() {
                *field = "-".to_owned();
            }
        }
    }
    rows
}

/// Ready holders per layer, as runs: `layers 0..10: 1 holder, 10..30: 2 holders`.
fn redundancy_line(coverage: &CoverageReport, layers: u32) -> String {
    let mut counts = vec![0usize; layers as usize];
    for layer in &coverage.layers {
        if let Some(count) = counts.get_mut(layer.layer as usize) {
            *count = layer
                .holders
                .iter()
                .filter(|holder| holder.state == SpanState::Ready)
                .count();
        }
    }
    let mut runs = Vec::new();
    let mut start = 0;
    for index in 1..=counts.len() {
        if index == counts.len() || counts[index] != counts[start] {
            let count = counts[start];
            runs.push(format!(
                "{start}..{index}: {count} holder{}",
                if count == 1 { "" } else { "s" }
            ));
            start = index;
        }
    }
    format!("ready holders per layer: {}", runs.join(", "))
}

/// One event of an OpenAI-style completion stream.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// Text added to the answer.
    Delta(String),
    /// The usage chunk: tokens in the prompt and the answer.
    Usage {
        /// Prompt tokens.
        prompt_tokens: u64,
        /// Generated tokens.
        completion_tokens: u64,
    },
    /// The server reported an error in the stream.
    Error(String),
    /// `data: [DONE]`: the stream is over.
    Done,
}

/// Splits a stream of server-sent-event bytes into [`StreamEvent`]s, whatever the chunking.
#[derive(Debug, Default)]
pub struct SseDecoder {
    pending: Vec<u8>,
}

/// The most bytes one event line may take before the stream is refused.
const MAX_EVENT_LINE: usize = 1 << 20;

impl SseDecoder {
    /// Takes the next bytes of the stream and returns the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<StreamEvent>, String> {
        self.pending.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(event) = parse_data_line(line.trim_end_matches(['\r', '\n']))? {
                events.push(event);
            }
        }
        if self.pending.len() > MAX_EVENT_LINE {
            return Err(format!(
                "the stream sent a line longer than {MAX_EVENT_LINE} bytes"
            ));
        }
        Ok(events)
    }
}

/// The event of one `data: ...` line (`None` for blank lines, comments and other fields).
fn parse_data_line(line: &str) -> Result<Option<StreamEvent>, String> {
    let Some(data) = line.strip_prefix("data:") else {
        return Ok(None);
    };
    let data = data.trim_start();
    if data == "[DONE]" {
        return Ok(Some(StreamEvent::Done));
    }
    let chunk: Value = serde_json::from_str(data)
        .map_err(|error| format!("the stream sent an event that is not JSON ({error}): {data}"))?;
    if let Some(error) = chunk.get("error") {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .map_or_else(|| error.to_string(), str::to_owned);
        return Ok(Some(StreamEvent::Error(message)));
    }
    if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
        let count = |key| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
        return Ok(Some(StreamEvent::Usage {
            prompt_tokens: count("prompt_tokens"),
            completion_tokens: count("completion_tokens"),
        }));
    }
    let delta = chunk
        .pointer("/choices/0/delta/content")
        .and_then(Value::as_str)
        .unwrap_or_default();
    Ok((!delta.is_empty()).then(|| StreamEvent::Delta(delta.to_owned())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_member_is_named_however_the_user_writes_it() {
        for typed in [
            "127.0.0.1:8080",
            "http://127.0.0.1:8080",
            "http://127.0.0.1:8080/",
            "http://127.0.0.1:8080/v1",
            "http://127.0.0.1:8080/v1/",
        ] {
            assert_eq!(member_base_url(typed).unwrap(), "http://127.0.0.1:8080");
        }
        assert!(
            member_base_url("ftp://host")
                .unwrap_err()
                .contains("http://")
        );
        assert!(member_base_url("http://").is_err());
    }

    fn holder(peer: &str, state: &str) -> Value {
        json!({"peer": peer, "state": state, "quantization": "q4_1"})
    }

    const TRACKER: &str = "12D3KooWTrackerTrackerTracker0001";
    const A: &str = "12D3KooWPeerAAAAAAAAAAAAAAAAAAAA";
    const B: &str = "12D3KooWPeerBBBBBBBBBBBBBBBBBBBB";
    const C: &str = "12D3KooWPeerCCCCCCCCCCCCCCCCCCCC";

    /// A tracker's `/status` with every field docs/status.md lists: six layers, held by the
    /// tracker (0..2), A (2..4), B (2..4 while loading, 4..6 ready) and C (loading 5..6, not
    /// in the tracker's book).
    fn tracker_document() -> Value {
        let layers: Vec<Value> = (0..6)
            .map(|layer| {
                let holders = match layer {
                    0 | 1 => vec![holder(TRACKER, "ready")],
                    2 | 3 => vec![holder(A, "ready"), holder(B, "loading")],
                    4 => vec![holder(B, "ready")],
                    _ => vec![holder(B, "ready"), holder(C, "loading")],
                };
                json!({"layer": layer, "holders": holders})
            })
            .collect();
        let testimony = |peer: &str, digest: &str| json!({"peer": peer, "output_sha256": digest});
        let peers = json!([
            {"peer": A, "http": "http://127.0.0.1:8081", "path": "direct-http",
             "span": {"layers": [2, 4], "quantization": "q4_1", "state": "ready"},
             "memory_bytes": 67_108_864, "quantizations": ["q4_1", "bf16"],
             "throughput": 1830.5, "active_sessions": 0, "free_kv_tokens": 20480,
             "last_seen_ms": 212, "forward_latency_ms": 2.25, "leaving": false,
             "verified_sessions": 12},
            {"peer": B, "http": null, "path": "relayed",
             "span": {"layers": [4, 6], "quantization": "q4_1", "state": "ready"},
             "memory_bytes": 33_554_432, "quantizations": ["q4_1"],
             "throughput": 950.0, "active_sessions": 2, "free_kv_tokens": 1024,
             "last_seen_ms": 1500, "forward_latency_ms": 1.0, "leaving": true,
             "verified_sessions": 0}
        ]);
        let banned = json!([
            {"peer": "12D3KooWCheater", "cause": "returned wrong activations for layers 2-4",
             "since_ms": 5000, "remaining_ms": 86_395_000,
             "evidence": {"session": "5f0c", "position": 37, "tokens": 1, "layers": [2, 4],
                          "convicted": testimony("12D3KooWCheater", "9b1e"),
                          "witness": testimony(A, "41c7"),
                          "arbiter": testimony(B, "41c7")}}
        ]);
        let network = json!({
            "reachability": "public", "relayed_addresses": [],
            "paths": {A: "direct-http", B: "relayed", C: "not-connected"}
        });
        json!({
            "peer": TRACKER, "role": "tracker", "version": "0.1.0",
            "model": {"id": "tiny", "layers": 6},
            "http": "http://127.0.0.1:8080", "p2p": ["/ip4/127.0.0.1/tcp/4001"],
            "span": {"layers": [0, 2], "quantization": "q4_1", "state": "ready"},
            "loading": null,
            "active_sessions": 1, "free_kv_tokens": 2048,
            "tracker": TRACKER, "tracker_http": "http://127.0.0.1:8080", "term": 2,
            "succession": [A, B], "announce_interval_ms": 2000,
            "failovers": 1, "checked_sessions": 12, "convictions": 1, "leaving": false,
            "forward_latency_ms": 3.4,
            "gossip": {"published_messages": 120, "published_bytes": 31200,
                       "received_messages": 480, "received_bytes": 98400},
            "network": network,
            "rejected_messages": 1,
            "recent_rejections": [{"from": "12D3KooWOutsider", "topic": "identify",
                                   "reason": "serves another model"}],
            "coverage": {"epoch": 7, "complete": true, "layers": layers},
            "peers": peers,
            "admission": {"max_sessions": 8, "running": 1, "queued": 0, "max_queued": 32,
                          "queue_timeout_ms": 60000},
            "banned": banned,
            "batching": {"passes": 5120, "requests": 31870, "largest_pass": 8,
                         "max_batch_tokens": 256},
            "openai_base_url": "http://127.0.0.1:8080/v1",
            "route_boundaries": [2, 4]
        })
    }

    fn parse(document: &Value) -> StatusReport {
        serde_json::from_value(document.clone()).unwrap()
    }

    #[test]
    fn a_report_with_every_field_renders_exactly() {
        let document = tracker_document();
        let status = parse(&document);
        // The document holds every field of the report and nothing else.
        assert_eq!(serde_json::to_value(&status).unwrap(), document);
        let expected = [
            "member  12D3KooWTrackerTrackerTracker0001 (tracker) at http://127.0.0.1:8080",
            "model   tiny (6 layers)",
            "tracker 12D3KooWTrackerTrackerTracker0001 (term 2) http://127.0.0.1:8080",
            "coverage complete (epoch 7)",
            "",
            "PEER           LAYERS   STATE     QUANT  PATH         SESSIONS   STEP(ms)  NOTE",
            "…cker0001      0..2     ready     q4_1   local               1        3.4  this member (tracker)",
            "…AAAAAAAA      2..4     ready     q4_1   direct-http         0        2.2  ",
            "…BBBBBBBB      4..6     ready     q4_1   relayed             2        1.0  leaving",
            "…CCCCCCCC      5..6     loading   q4_1   -                                 ",
            "",
            "ready holders per layer: 0..6: 1 holder",
        ];
        let table = status_table(&status);
        assert_eq!(table.lines().collect::<Vec<_>>(), expected, "{table}");
        assert!(table.ends_with('\n'));
    }

    #[test]
    fn rows_follow_the_route_whatever_order_the_book_lists_peers_in() {
        let mut document = tracker_document();
        let peers = document["peers"].as_array_mut().unwrap();
        peers.reverse();
        let table = status_table(&parse(&document));
        let order: Vec<usize> = [TRACKER, A, B, C]
            .iter()
            .map(|id| table.find(&short_id(id)).unwrap())
            .collect();
        assert!(order.is_sorted(), "{table}");
    }

    #[test]
    fn redundancy_runs_follow_the_ready_holders_and_show_gaps() {
        let layers: Vec<Value> = [2, 2, 1, 0]
            .iter()
            .enumerate()
            .map(|(layer, &ready)| {
                let mut holders: Vec<Value> = (0..ready)
                    .map(|i| holder(&format!("p{i}"), "ready"))
                    .collect();
                holders.push(holder("late", "loading"));
                json!({"layer": layer, "holders": holders})
            })
            .collect();
        let coverage: CoverageReport =
            serde_json::from_value(json!({"epoch": 1, "complete": false, "layers": layers}))
                .unwrap();
        assert_eq!(
            redundancy_line(&coverage, 4),
            "ready holders per layer: 0..2: 2 holders, 2..3: 1 holder, 3..4: 0 holders"
        );
    }

    #[test]
    fn a_member_with_no_map_yet_says_so() {
        let mut document = tracker_document();
        let fields = document.as_object_mut().unwrap();
        for tracker_only in ["peers", "admission", "banned", "route_boundaries"] {
            fields.remove(tracker_only);
        }
        fields.insert("role".to_owned(), json!("peer"));
        for unknown in ["coverage", "span", "tracker", "tracker_http", "batching"] {
            fields.insert(unknown.to_owned(), Value::Null);
        }
        let table = status_table(&parse(&document));
        assert!(table.contains("coverage none heard yet"), "{table}");
        assert!(table.contains("tracker none yet (term 2) \n"), "{table}");
        assert!(
            table.contains("…cker0001      -        -         -      local"),
            "{table}"
        );
    }

    #[test]
    fn events_are_decoded_whatever_the_chunking() {
        let stream = concat!(
            ": keep-alive\n\n",
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Pa\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"ris 🗼\"}}]}\r\n\r\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3}}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        let expected = vec![
            StreamEvent::Delta("Pa".to_owned()),
            StreamEvent::Delta("ris 🗼".to_owned()),
            StreamEvent::Usage {
                prompt_tokens: 9,
                completion_tokens: 3,
            },
            StreamEvent::Done,
        ];
        for piece in [1, 2, 7, 64, stream.len()] {
            let mut decoder = SseDecoder::default();
            let mut events = Vec::new();
            for chunk in stream.chunks(piece) {
                events.extend(decoder.push(chunk).unwrap());
            }
            assert_eq!(events, expected, "in pieces of {piece} bytes");
        }
    }

    #[test]
    fn errors_and_garbage_in_a_stream_are_reported() {
        let mut decoder = SseDecoder::default();
        let events = decoder
            .push(b"data: {\"error\":{\"message\":\"route lost\",\"code\":\"route_lost\"}}\n")
            .unwrap();
        assert_eq!(events, [StreamEvent::Error("route lost".to_owned())]);
        assert!(
            decoder
                .push(b"data: {not json\n")
                .unwrap_err()
                .contains("not JSON")
        );
        let mut endless = SseDecoder::default();
        assert!(endless.push(&vec![b'x'; MAX_EVENT_LINE + 1]).is_err());
    }
}
