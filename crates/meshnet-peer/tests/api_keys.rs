#![allow(clippy::unwrap_used)]
//! `--api-keys` on real members: the API's routes need a key on the tracker and on a member
//! that passes requests on to it, the other routes stay open, and `/metrics` counts by key id.

mod common;

use std::time::{Duration, Instant};

use common::{config, converged, wait_for};
use meshnet_peer::RunningPeer;
use serde_json::{Value, json};

const KEYS: &str = "sk-test-one id=one rpm=100 tpm=100000\n";

async fn member(tracker: Option<&RunningPeer>, layers: u32) -> RunningPeer {
    let bootstrap = match tracker {
        Some(tracker) => tracker.p2p_addrs().await.unwrap(),
        None => Vec::new(),
    };
    let mut config = config(tracker.is_none(), layers, bootstrap);
    config.api_keys = Some(meshnet_apikeys::parse_key_file(KEYS).unwrap());
    meshnet_peer::start(config).await.unwrap()
}

async fn chat(base: &str, model: &str, key: Option<&str>) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(
            &json!({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 2, "temperature": 0}),
        );
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let answer = request.send().await.unwrap();
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap())
}

async fn sample(base: &str, series: &str) -> Option<f64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_routes_need_a_key_on_every_member_and_the_rest_stay_open() {
    let tracker = member(None, 10).await;
    let peer = member(Some(&tracker), 20).await;
    wait_for("coverage", &tracker, |s| converged(s, &[&peer])).await;
    let started = Instant::now();
    while peer.status().tracker_http.is_none() {
        assert!(
            started.elapsed() < common::DEADLINE,
            "the peer never learnt the tracker's URL"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let model = tracker.model_id().to_owned();
    let at_tracker = tracker.http_url().to_owned();
    let at_peer = peer.http_url().to_owned();

    let (mut prompt_tokens, mut completion_tokens) = (0.0, 0.0);
    for base in [&at_tracker, &at_peer] {
        for path in ["/", "/status", "/metrics"] {
            let open = reqwest::get(format!("{base}{path}")).await.unwrap();
            assert_eq!(open.status().as_u16(), 200, "{base}{path}");
        }
        let (status, body) = chat(base, &model, None).await;
        assert_eq!(status, 401, "{base}: {body}");
        assert_eq!(body["error"]["code"], "invalid_api_key");
        let (status, body) = chat(base, &model, Some("sk-test-two")).await;
        assert_eq!(status, 401, "{base}: {body}");
        let (status, body) = chat(base, &model, Some("sk-test-one")).await;
        assert_eq!(status, 200, "{base}: {body}");
        prompt_tokens += body["usage"]["prompt_tokens"].as_f64().unwrap();
        completion_tokens += body["usage"]["completion_tokens"].as_f64().unwrap();
    }

    // The tracker admitted the direct request and the one the peer passed on, and made both
    // answers; the peer admitted one and made none.
    let requests = "meshnet_api_key_requests_total{key=\"one\"}";
    let prompt = "meshnet_api_key_tokens_total{key=\"one\",kind=\"prompt\"}";
    let completion = "meshnet_api_key_tokens_total{key=\"one\",kind=\"completion\"}";
    let missing = "meshnet_api_unauthorized_total{reason=\"missing\"}";
    let invalid = "meshnet_api_unauthorized_total{reason=\"invalid\"}";
    assert_eq!(sample(&at_tracker, requests).await, Some(2.0));
    assert_eq!(sample(&at_tracker, prompt).await, Some(prompt_tokens));
    assert_eq!(
        sample(&at_tracker, completion).await,
        Some(completion_tokens)
    );
    assert_eq!(sample(&at_tracker, missing).await, Some(1.0));
    assert_eq!(sample(&at_tracker, invalid).await, Some(1.0));
    assert_eq!(sample(&at_peer, requests).await, Some(1.0));
    assert_eq!(sample(&at_peer, prompt).await, None);
    assert_eq!(sample(&at_peer, missing).await, Some(1.0));
    assert_eq!(sample(&at_peer, invalid).await, Some(1.0));

    peer.shutdown().await;
    tracker.shutdown().await;
}
