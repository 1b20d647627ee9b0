#![allow(clippy::unwrap_used)]
//! The faulty member (feature `faulty-member`): a peer that corrupts its frames changes what the
//! mesh computes, and one that corrupts none computes exactly what an honest peer does.

mod common;

use std::sync::Arc;

use common::{converged, tracker, wait_for};
use meshnet_peer::RunningPeer;
use meshnet_peer::faulty::{CorruptionMode, FaultyFrames};

/// Tokens each chat generates.
const TOKENS: usize = 6;

/// A tracker holding 10 layers and one peer holding the other 20, which corrupts frames as
/// `faulty` says.
async fn mesh(faulty: Arc<FaultyFrames>) -> (RunningPeer, RunningPeer) {
    let tracker = tracker(10).await;
    let mut config = common::config(false, 20, tracker.p2p_addrs().await.unwrap());
    config.faulty = Some(faulty);
    let peer = meshnet_peer::start(config).await.unwrap();
    wait_for("full coverage", &tracker, |s| converged(s, &[&peer])).await;
    (tracker, peer)
}

/// The text and every token's log-probability of a greedy chat of [`TOKENS`] tokens.
async fn greedy_logprobs(tracker: &RunningPeer) -> (String, Vec<f64>) {
    let response = reqwest::Client::new()
        .post(format!(
            "{}/chat/completions",
            tracker.openai_base_url().unwrap()
        ))
        .json(&serde_json::json!({
            "model": tracker.model_id(),
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": TOKENS,
            "logprobs": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    let choice = &body["choices"][0];
    let logprobs = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["logprob"].as_f64().unwrap())
        .collect();
    let text = choice["message"]["content"].as_str().unwrap().to_owned();
    (text, logprobs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_corrupting_every_frame_changes_the_answer_and_one_corrupting_none_does_not() {
    let honest = Arc::new(FaultyFrames::new(0.0, CorruptionMode::SignFlip, 1).unwrap());
    let (tracker, peer) = mesh(Arc::clone(&honest)).await;
    let (honest_text, honest_logprobs) = greedy_logprobs(&tracker).await;
    assert_eq!(honest_logprobs.len(), TOKENS);
    assert_eq!(honest.corrupted(), 0);
    peer.shutdown().await;
    tracker.shutdown().await;

    let liar = Arc::new(FaultyFrames::new(1.0, CorruptionMode::SignFlip, 1).unwrap());
    let (tracker, peer) = mesh(Arc::clone(&liar)).await;
    let (_, lying_logprobs) = greedy_logprobs(&tracker).await;
    // One prefill chunk, then a decode step for every token after the first.
    assert_eq!(liar.corrupted(), TOKENS as u64);
    assert_ne!(
        lying_logprobs[0].to_bits(),
        honest_logprobs[0].to_bits(),
        "a corrupted prefill changes the first token's distribution"
    );
    peer.shutdown().await;
    tracker.shutdown().await;

    // Another honest mesh answers bit for bit as the first: the difference was the lies.
    let honest_again = Arc::new(FaultyFrames::new(0.0, CorruptionMode::Noise, 1).unwrap());
    let (tracker, peer) = mesh(honest_again).await;
    let (text, logprobs) = greedy_logprobs(&tracker).await;
    assert_eq!((text, logprobs), (honest_text, honest_logprobs));
    peer.shutdown().await;
    tracker.shutdown().await;
}
