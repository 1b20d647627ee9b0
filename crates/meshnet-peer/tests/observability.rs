#![allow(clippy::unwrap_used)]
//! What a member shows of itself over HTTP besides `/status`: the Prometheus scrape at
//! `/metrics` and the coverage page at `/`, on a tracker and a peer in one process.

mod common;

use std::collections::BTreeMap;

use common::{converged, peer, tracker, wait_for};

/// One scrape: every sample's value by its name and labels as written (`name{a="b"}`).
struct Scrape {
    samples: BTreeMap<String, f64>,
    types: BTreeMap<String, String>,
}

impl Scrape {
    /// Reads Prometheus text exposition: `# TYPE name kind` lines and `series value` lines.
    fn parse(text: &str) -> Self {
        let mut samples = BTreeMap::new();
        let mut types = BTreeMap::new();
        for line in text.lines() {
            if let Some(declaration) = line.strip_prefix("# TYPE ") {
                let (name, kind) = declaration.split_once(' ').unwrap();
                types.insert(name.to_owned(), kind.to_owned());
            } else if !line.starts_with('#') && !line.is_empty() {
                let (series, value) = line.rsplit_once(' ').unwrap();
                let value: f64 = value
                    .parse()
                    .unwrap_or_else(|_| panic!("not a sample value: {line}"));
                samples.insert(series.to_owned(), value);
            }
        }
        Scrape { samples, types }
    }

    /// The sum of the samples of `name` whose label sets contain every one of `labels`.
    fn sum(&self, name: &str, labels: &[&str]) -> f64 {
        self.samples
            .iter()
            .filter(|(series, _)| {
                let (sample, set) = series.split_once('{').unwrap_or((series, ""));
                sample == name && labels.iter().all(|label| set.contains(label))
            })
            .map(|(_, value)| value)
            .sum()
    }
}

async fn scrape(base: &str) -> Scrape {
    let response = reqwest::get(format!("{base}/metrics")).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("text/plain") || content_type.contains("openmetrics"),
        "{content_type}"
    );
    Scrape::parse(&response.text().await.unwrap())
}

/// Families every member exports, with their kinds.
const FAMILIES: [(&str, &str); 22] = [
    ("meshnet_tokens_generated", "counter"),
    ("meshnet_time_to_first_token_seconds", "histogram"),
    ("meshnet_inter_token_latency_seconds", "histogram"),
    ("meshnet_forward_request_seconds", "histogram"),
    ("meshnet_forward_compute_seconds", "histogram"),
    ("meshnet_wire_bytes", "counter"),
    ("meshnet_directives_issued", "counter"),
    ("meshnet_directives_applied", "counter"),
    ("meshnet_gossip_accepted", "counter"),
    ("meshnet_gossip_rejected", "counter"),
    ("meshnet_p2p_connections_refused", "counter"),
    ("meshnet_failovers", "counter"),
    ("meshnet_api_key_requests", "counter"),
    ("meshnet_api_key_tokens", "counter"),
    ("meshnet_api_key_rate_limited", "counter"),
    ("meshnet_api_unauthorized", "counter"),
    ("meshnet_active_sessions", "gauge"),
    ("meshnet_queued_sessions", "gauge"),
    ("meshnet_kv_cache_used_bytes", "gauge"),
    ("meshnet_kv_cache_free_bytes", "gauge"),
    ("meshnet_load_progress_ratio", "gauge"),
    ("meshnet_served_layers", "gauge"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_chat_on_both_members_and_the_page_is_served() {
    let tracker = tracker(15).await;
    let peer = peer(15, &tracker).await;
    wait_for("full coverage", &tracker, |s| converged(s, &[&peer])).await;
    let (tracker_url, peer_url) = (tracker.http_url().to_owned(), peer.http_url().to_owned());

    let mut before = Vec::new();
    for (name, url) in [("tracker", &tracker_url), ("peer", &peer_url)] {
        let first = scrape(url).await;
        for (family, kind) in FAMILIES {
            assert_eq!(
                first.types.get(family).map(String::as_str),
                Some(kind),
                "{name}: {family}"
            );
        }
        assert!(
            first
                .types
                .keys()
                .any(|f| f.starts_with("libp2p_gossipsub")),
            "{name} exports libp2p's gossipsub metrics"
        );
        assert_eq!(first.sum("meshnet_served_layers", &[]), 15.0, "{name}");
        assert_eq!(first.sum("meshnet_load_progress_ratio", &[]), 1.0, "{name}");
        // A scrape changes nothing a scrape shows of traffic.
        let second = scrape(url).await;
        for sample in [
            "meshnet_tokens_generated_total",
            "meshnet_forward_compute_seconds_count",
            "meshnet_wire_bytes_total",
        ] {
            assert_eq!(first.sum(sample, &[]), second.sum(sample, &[]), "{sample}");
        }
        before.push(second);
    }
    // The peer was told its span at least once; a directive published before it joined the
    // topic is lost and sent again, so the tracker may have issued more than it applied, never
    // fewer (each message counts its directives on both sides).
    let issued = before[0].sum("meshnet_directives_issued_total", &[]);
    let applied = before[1].sum("meshnet_directives_applied_total", &[]);
    assert!(
        applied >= 1.0 && applied <= issued,
        "issued {issued}, applied {applied}"
    );
    assert_eq!(
        before[1].sum("meshnet_directives_issued_total", &[]),
        0.0,
        "a peer issues none"
    );
    assert_eq!(
        before[0].sum("meshnet_directives_applied_total", &[]),
        0.0,
        "the tracker applies none"
    );

    let answer: serde_json::Value = reqwest::Client::new()
        .post(format!("{tracker_url}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": tracker.model_id(),
            "messages": [{"role": "user", "content": "Count to five."}],
            "temperature": 0,
            "max_tokens": 6,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // Counting to five takes more than six tokens: the answer stops at the cap.
    assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
    let tokens = answer["usage"]["completion_tokens"].as_f64().unwrap();
    assert_eq!(tokens, 6.0, "{answer}");

    let tracker_after = scrape(&tracker_url).await;
    let peer_after = scrape(&peer_url).await;
    let grown = |before: &Scrape, after: &Scrape, name: &str, labels: &[&str]| {
        after.sum(name, labels) - before.sum(name, labels)
    };
    assert_eq!(
        grown(
            &before[0],
            &tracker_after,
            "meshnet_tokens_generated_total",
            &[]
        ),
        tokens
    );
    assert_eq!(
        grown(
            &before[0],
            &tracker_after,
            "meshnet_time_to_first_token_seconds_count",
            &[]
        ),
        1.0
    );
    assert_eq!(
        grown(
            &before[0],
            &tracker_after,
            "meshnet_inter_token_latency_seconds_count",
            &[]
        ),
        tokens - 1.0
    );
    let hop = format!("hop=\"{peer_url}\"");
    // The prompt's one chunk (it is under 128 tokens) and one frame per token after the first.
    assert_eq!(
        grown(
            &before[0],
            &tracker_after,
            "meshnet_forward_request_seconds_count",
            &[&hop, "path=\"direct-http\""],
        ),
        tokens
    );
    let sent_raw = grown(
        &before[0],
        &tracker_after,
        "meshnet_wire_bytes_total",
        &["direction=\"sent\"", "form=\"raw\""],
    );
    assert!(sent_raw > 0.0);
    // What the tracker sent is what the peer received.
    assert_eq!(
        grown(
            &before[1],
            &peer_after,
            "meshnet_wire_bytes_total",
            &["direction=\"received\"", "form=\"raw\""],
        ),
        sent_raw
    );
    assert!(
        grown(
            &before[1],
            &peer_after,
            "meshnet_forward_compute_seconds_count",
            &[]
        ) >= tokens
    );

    let page = reqwest::get(format!("{peer_url}/")).await.unwrap();
    assert_eq!(page.status().as_u16(), 200);
    assert!(
        page.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let html = page.text().await.unwrap();
    assert!(html.contains("id=\"coverage-grid\""));
    assert!(
        !html.contains("src=\"http"),
        "the page loads nothing from outside"
    );

    peer.shutdown().await;
    tracker.shutdown().await;
}
