//! What the terminal commands `meshnet-peer status` and `meshnet-peer chat` need besides
//! HTTP: the coverage map and peers of a `/status` answer as a text table, and a decoder of
//! the OpenAI-style API's server-sent events. Both are pure: the binary does the I/O.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::Value;

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

fn text<'a>(value: &'a Value, key: &str) -> &'a str {
    value.get(key).and_then(Value::as_str).unwrap_or("")
}

/// `[a, b)` of a span object (`{"layers": [a, b], ...}`) as `a..b`.
fn span_text(span: &Value) -> Option<String> {
    let layers = span.get("layers")?.as_array()?;
    Some(format!("{}..{}", layers.first()?, layers.get(1)?))
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
    /// (when there is one), the sessions and the step time.
    fn fill_from(&mut self, member: &Value) {
        if let Some(span) = member.get("span").filter(|s| !s.is_null()) {
            self.span = span_text(span).unwrap_or_default();
            self.state = text(span, "state").to_owned();
            self.quantization = text(span, "quantization").to_owned();
        }
        self.sessions = member
            .get("active_sessions")
            .map(ToString::to_string)
            .unwrap_or_default();
        self.latency = step_millis(member);
    }
}

/// A `/status` answer as text: the member, the model and tracker, a line per layer range with
/// its holders, and a row per peer. Works on any member (a non-tracker knows the coverage map
/// but not the tracker's book of peers, so its rows come from the map).
pub fn status_table(status: &Value) -> String {
    let mut out = String::new();
    let model = status.get("model").cloned().unwrap_or(Value::Null);
    let layers = model.get("layers").and_then(Value::as_u64).unwrap_or(0);
    let _ = writeln!(
        out,
        "member  {} ({}) at {}",
        text(status, "peer"),
        text(status, "role"),
        text(status, "http")
    );
    let _ = writeln!(out, "model   {} ({layers} layers)", text(&model, "id"));
    let _ = writeln!(
        out,
        "tracker {} (term {}) {}",
        status
            .get("tracker")
            .and_then(Value::as_str)
            .unwrap_or("none yet"),
        status.get("term").and_then(Value::as_u64).unwrap_or(0),
        text(status, "tracker_http")
    );
    let coverage = status.get("coverage").filter(|c| !c.is_null());
    match coverage {
        Some(coverage) => {
            let complete = coverage.get("complete").and_then(Value::as_bool) == Some(true);
            let _ = writeln!(
                out,
                "coverage {} (epoch {})",
                if complete { "complete" } else { "INCOMPLETE" },
                coverage.get("epoch").and_then(Value::as_u64).unwrap_or(0)
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
    let mut rows: Vec<(String, PeerRow)> = rows.into_iter().collect();
    rows.sort_by_key(|(peer, row)| (first_layer(&row.span), peer.clone()));
    for (peer, row) in &rows {
        let _ = writeln!(
            out,
            "{:<14} {:<8} {:<9} {:<6} {:<12} {:>8} {:>10}  {}",
            short_id(peer),
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
        let _ = writeln!(out, "{}", redundancy_line(coverage, layers));
    }
    out
}

/// A member's milliseconds per decode step (`forward_latency_ms`) with one decimal.
fn step_millis(member: &Value) -> String {
    member
        .get("forward_latency_ms")
        .and_then(Value::as_f64)
        .map(|ms| format!("{ms:.1}"))
        .unwrap_or_default()
}

/// The first layer of a span written `a..b` (spans not held sort last).
fn first_layer(span: &str) -> u64 {
    span.split_once("..")
        .and_then(|(first, _)| first.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The peers of a status answer, by id: the member itself, the tracker's book, and every
/// holder in the coverage map.
fn peer_rows(status: &Value, coverage: Option<&Value>) -> BTreeMap<String, PeerRow> {
    let mut rows: BTreeMap<String, PeerRow> = BTreeMap::new();
    let holders = coverage
        .and_then(|c| c.get("layers"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(|layer| {
            let index = layer.get("layer").and_then(Value::as_u64).unwrap_or(0);
            layer
                .get("holders")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(move |holder| (index, holder))
        });
    // Spans from the map: the first and last layer each peer holds.
    let mut held: BTreeMap<String, (u64, u64, String, String)> = BTreeMap::new();
    for (layer, holder) in holders {
        let entry = held.entry(text(holder, "peer").to_owned()).or_insert((
            layer,
            layer,
            text(holder, "state").to_owned(),
            text(holder, "quantization").to_owned(),
        ));
        entry.0 = entry.0.min(layer);
        entry.1 = entry.1.max(layer);
    }
    for (peer, (first, last, state, quantization)) in held {
        rows.insert(
            peer,
            PeerRow {
                span: format!("{first}..{}", last + 1),
                state,
                quantization,
                ..PeerRow::default()
            },
        );
    }
    let own = rows.entry(text(status, "peer").to_owned()).or_default();
    own.fill_from(status);
    own.path = "local".to_owned();
    own.note = format!("this member ({})", text(status, "role"));
    for known in status
        .get("peers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let row = rows.entry(text(known, "peer").to_owned()).or_default();
        row.fill_from(known);
        row.path = text(known, "path").to_owned();
        if known.get("leaving").and_then(Value::as_bool) == Some(true) {
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
fn redundancy_line(coverage: &Value, layers: u64) -> String {
    let mut counts = vec![0usize; layers as usize];
    for layer in coverage
        .get("layers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let index = layer
            .get("layer")
            .and_then(Value::as_u64)
            .unwrap_or(u64::MAX) as usize;
        if let Some(count) = counts.get_mut(index) {
            *count = layer
                .get("holders")
                .and_then(Value::as_array)
                .map_or(0, |holders| {
                    holders
                        .iter()
                        .filter(|holder| text(holder, "state") == "ready")
                        .count()
                });
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

    #[test]
    fn the_table_lists_every_holder_with_its_span_and_the_redundancy() {
        let tracker = "12D3KooWTrackerTrackerTracker0001";
        let a = "12D3KooWPeerAAAAAAAAAAAAAAAAAAAA";
        let b = "12D3KooWPeerBBBBBBBBBBBBBBBBBBBB";
        let layers: Vec<Value> = (0..6)
            .map(|layer| {
                let holders = match layer {
                    0 | 1 => vec![holder(tracker, "ready")],
                    2 | 3 => vec![holder(a, "ready"), holder(b, "loading")],
                    _ => vec![holder(b, "ready")],
                };
                json!({"layer": layer, "holders": holders})
            })
            .collect();
        let status = json!({
            "peer": tracker, "role": "tracker", "http": "http://127.0.0.1:8080",
            "model": {"id": "tiny", "layers": 6},
            "tracker": tracker, "term": 2, "tracker_http": "http://127.0.0.1:8080",
            "span": {"layers": [0, 2], "quantization": "q4_1", "state": "ready"},
            "active_sessions": 1,
            "coverage": {"epoch": 7, "complete": true, "layers": layers},
            "peers": [
                {"peer": a, "span": {"layers": [2, 4], "quantization": "q4_1", "state": "ready"},
                 "path": "direct-http", "active_sessions": 0, "forward_latency_ms": 2.25,
                 "leaving": false},
                {"peer": b, "span": {"layers": [4, 6], "quantization": "q4_1", "state": "ready"},
                 "path": "direct-http", "active_sessions": 0, "forward_latency_ms": 1.0,
                 "leaving": true}
            ]
        });
        let table = status_table(&status);
        assert!(table.contains("tiny (6 layers)"), "{table}");
        assert!(table.contains("(term 2)"), "{table}");
        assert!(table.contains("coverage complete (epoch 7)"), "{table}");
        let row = |id: &str| {
            table
                .lines()
                .find(|line| line.starts_with(&short_id(id)))
                .unwrap_or_else(|| panic!("no row for {id} in\n{table}"))
                .split_whitespace()
                .collect::<Vec<_>>()
        };
        assert_eq!(row(tracker)[1..3], ["0..2", "ready"]);
        assert_eq!(row(a)[1..5], ["2..4", "ready", "q4_1", "direct-http"]);
        assert_eq!(row(a)[6], "2.2");
        assert_eq!(row(b)[1], "4..6");
        assert_eq!(*row(b).last().unwrap(), "leaving");
        // Rows in route order.
        let order: Vec<usize> = [tracker, a, b]
            .iter()
            .map(|id| table.find(&short_id(id)).unwrap())
            .collect();
        assert!(order.is_sorted(), "{table}");
        assert!(
            table.contains("ready holders per layer: 0..6: 1 holder"),
            "{table}"
        );
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
        assert_eq!(
            redundancy_line(&json!({"layers": layers}), 4),
            "ready holders per layer: 0..2: 2 holders, 2..3: 1 holder, 3..4: 0 holders"
        );
    }

    #[test]
    fn a_member_with_no_map_yet_says_so() {
        let status = json!({"peer": "p", "role": "peer", "model": {"id": "m", "layers": 3},
                            "coverage": null, "span": null});
        let table = status_table(&status);
        assert!(table.contains("coverage none heard yet"), "{table}");
        assert!(table.contains("tracker none yet"), "{table}");
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
