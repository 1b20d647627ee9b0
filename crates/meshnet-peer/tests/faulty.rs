#![allow(clippy::unwrap_used)]
//! The faulty member (feature `faulty-member`): a peer that corrupts its frames changes what the
//! mesh computes, and one that corrupts none computes exactly what an honest peer does. With
//! checks on (ADR-0026), a liar is caught and banned before its lies reach a user, and honest
//! members checked on every session are never accused.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{converged, wait_for};
use meshnet_peer::RunningPeer;
use meshnet_peer::faulty::{CorruptionMode, FaultyFrames};
use meshnet_peer::status::StatusReport;
use meshnet_peer::verify::VerifyPolicy;
use meshnet_types::LayerSpan;

/// `body` (its model filled in) answered by `tracker`'s chat completions, which must say 200.
async fn chat_completion(
    client: &reqwest::Client,
    tracker: &RunningPeer,
    mut body: serde_json::Value,
) -> serde_json::Value {
    body["model"] = tracker.model_id().into();
    let response = client
        .post(format!(
            "{}/chat/completions",
            tracker.openai_base_url().unwrap()
        ))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    response.json().await.unwrap()
}

/// Tokens each chat generates.
const TOKENS: usize = 6;

/// A tracker holding 10 layers and one peer holding the other 20, which corrupts frames as
/// `faulty` says.
async fn mesh(faulty: Arc<FaultyFrames>) -> (RunningPeer, RunningPeer) {
    let mut tracker_config = common::config(true, 10, vec![]);
    // One frame per token: the test counts the frames the peer corrupted.
    tracker_config.max_draft = 0;
    let tracker = meshnet_peer::start(tracker_config).await.unwrap();
    let mut config = common::config(false, 20, tracker.p2p_addrs().await.unwrap());
    config.faulty = Some(faulty);
    let peer = meshnet_peer::start(config).await.unwrap();
    wait_for("full coverage", &tracker, |s| converged(s, &[&peer])).await;
    (tracker, peer)
}

/// The text and every token's log-probability of a greedy chat of [`TOKENS`] tokens.
async fn greedy_logprobs(tracker: &RunningPeer) -> (String, Vec<f64>) {
    let body = chat_completion(
        &reqwest::Client::new(),
        tracker,
        serde_json::json!({
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": TOKENS,
            "logprobs": true,
        }),
    )
    .await;
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

/// A tracker holding 10 layers that checks sessions as `verify` says.
async fn checking_tracker(verify: VerifyPolicy) -> RunningPeer {
    let mut config = common::config(true, 10, vec![]);
    config.verify = verify;
    meshnet_peer::start(config).await.unwrap()
}

/// A peer holding the 20 layers after the tracker's, corrupting frames as `faulty` says.
async fn holder(tracker: &RunningPeer, faulty: Option<Arc<FaultyFrames>>) -> RunningPeer {
    let mut config = common::config(false, 20, tracker.p2p_addrs().await.unwrap());
    config.faulty = faulty;
    meshnet_peer::start(config).await.unwrap()
}

/// Whether the tracker's book has `peer` announcing a ready span (what routes are made of).
fn ready_in_book(status: &StatusReport, peer: &RunningPeer) -> bool {
    status.peers.iter().flatten().any(|known| {
        &known.peer == peer.peer_id()
            && known
                .span
                .as_ref()
                .is_some_and(|span| span.state == meshnet_types::SpanState::Ready)
    })
}

/// A tracker checking as `verify` says and two honest holders of the layers after its own,
/// both ready in its book.
async fn two_holders(verify: VerifyPolicy) -> (RunningPeer, [RunningPeer; 2]) {
    let tracker = checking_tracker(verify).await;
    let first = holder(&tracker, None).await;
    let second = holder(&tracker, None).await;
    wait_for("two holders", &tracker, |s| {
        converged(s, &[&first, &second]) && ready_in_book(s, &first) && ready_in_book(s, &second)
    })
    .await;
    (tracker, [first, second])
}

/// Probation for every new member, no sampling, bans of an hour.
fn probation_only() -> VerifyPolicy {
    VerifyPolicy {
        sample_rate: 0.0,
        probation_sessions: 3,
        ban_duration: Duration::from_secs(3600),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_liar_on_probation_is_caught_in_its_first_session_and_the_user_reads_the_honest_text() {
    let (tracker, [first, second]) = two_holders(probation_only()).await;
    // Both are on probation: this session is checked, one holder shadowing the other.
    let honest = greedy_logprobs(&tracker).await;
    // (Counted when the session ends on the hops, just after the answer.)
    wait_for("a checked session", &tracker, |s| s.checked_sessions == 1).await;

    let lies = Arc::new(FaultyFrames::new(1.0, CorruptionMode::SignFlip, 7).unwrap());
    let liar = holder(&tracker, Some(Arc::clone(&lies))).await;
    wait_for("the tracker routing to the liar", &tracker, |s| {
        converged(s, &[&first, &second, &liar]) && ready_in_book(s, &liar)
    })
    .await;
    // The newcomer has passed no check: it takes a seat in the next session, is contradicted
    // by the other holders, and the session finishes on honest members.
    let answer = greedy_logprobs(&tracker).await;
    assert!(lies.corrupted() >= 1, "the liar never computed a frame");
    assert_eq!(answer, honest, "the user read text computed from a lie");

    let status = tracker.status();
    assert_eq!(status.convictions, 1);
    let banned = status.banned.unwrap();
    let ban = banned
        .iter()
        .find(|ban| &ban.peer == liar.peer_id())
        .unwrap();
    let evidence = ban
        .evidence
        .as_ref()
        .expect("a conviction keeps its evidence");
    let honest_ids = [first.peer_id(), second.peer_id()];
    assert_eq!(&evidence.convicted.peer, liar.peer_id());
    assert!(honest_ids.contains(&&evidence.witness.peer));
    assert!(honest_ids.contains(&&evidence.arbiter.peer));
    assert_ne!(evidence.witness.peer, evidence.arbiter.peer);
    assert_eq!(
        evidence.arbiter.output_sha256,
        evidence.witness.output_sha256
    );
    assert_ne!(
        evidence.convicted.output_sha256,
        evidence.witness.output_sha256
    );
    assert_eq!(evidence.layers, LayerSpan::new(10, 30));
    assert!(ban.remaining_ms > 3_000_000, "{}", ban.remaining_ms);

    // Banned, it serves no more sessions: the next answer is honest without a dispute.
    let corrupted = lies.corrupted();
    assert_eq!(greedy_logprobs(&tracker).await, honest);
    assert_eq!(lies.corrupted(), corrupted);
    for peer in [liar, second, first, tracker] {
        peer.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_mesh_checked_on_every_session_bans_nobody_in_200_sessions() {
    const SESSIONS: usize = 200;
    let tracker = checking_tracker(VerifyPolicy {
        sample_rate: 1.0,
        ..probation_only()
    })
    .await;
    let mut holders = Vec::new();
    for _ in 0..3 {
        holders.push(holder(&tracker, None).await);
    }
    let all: Vec<&RunningPeer> = holders.iter().collect();
    wait_for("three holders", &tracker, |s| {
        converged(s, &all) && all.iter().all(|holder| ready_in_book(s, holder))
    })
    .await;
    let mut answers = Vec::new();
    for _ in 0..SESSIONS / AT_ONCE {
        let batch = (0..AT_ONCE).map(|_| short_greedy_text(&tracker));
        answers.extend(futures::future::join_all(batch).await);
    }
    assert!(
        answers.iter().all(|answer| answer == &answers[0]),
        "{answers:?}"
    );
    let status = wait_for("every session counted as checked", &tracker, |s| {
        s.checked_sessions == SESSIONS as u64
    })
    .await;
    assert_eq!(status.convictions, 0);
    assert_eq!(status.failovers, 0);
    assert!(status.banned.unwrap().is_empty());
    for peer in holders {
        peer.shutdown().await;
    }
    tracker.shutdown().await;
}

/// The text of a greedy chat of two tokens (a prefill and one decode step).
async fn short_greedy_text(tracker: &RunningPeer) -> String {
    let body = chat_completion(
        &reqwest::Client::new(),
        tracker,
        serde_json::json!({
            "messages": [{"role": "user", "content": "Name a colour."}],
            "temperature": 0,
            "max_tokens": 2,
        }),
    )
    .await;
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Tokens each chat of [`detection_table`] asks for: an answer of a usual length, so a liar
/// corrupting a fraction of its frames lies in a realistic share of sessions.
const DETECTION_TOKENS: usize = 32;

/// Chats [`detection_table`] runs at once.
const AT_ONCE: usize = 4;

/// The greedy answer of [`detection_table`]'s chats: every token and the bits of its
/// log-probability.
async fn scored_tokens(client: &reqwest::Client, tracker: &RunningPeer) -> Vec<(String, u64)> {
    let body = chat_completion(
        client,
        tracker,
        serde_json::json!({
            "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
            "temperature": 0,
            "max_tokens": DETECTION_TOKENS,
            "logprobs": true,
        }),
    )
    .await;
    body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            (
                entry["token"].as_str().unwrap().to_owned(),
                entry["logprob"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}

/// [`AT_ONCE`] chats at once: the tokens among their answers that differ from `honest`.
async fn wrong_tokens_of_a_batch(tracker: &RunningPeer, honest: &[(String, u64)]) -> usize {
    let client = reqwest::Client::new();
    let batch = (0..AT_ONCE).map(|_| scored_tokens(&client, tracker));
    futures::future::join_all(batch)
        .await
        .iter()
        .map(|answer| wrong_tokens(answer, honest))
        .sum()
}

/// The tokens of `answer` that differ from `honest` (a token or its log-probability changed,
/// or one too many or too few).
fn wrong_tokens(answer: &[(String, u64)], honest: &[(String, u64)]) -> usize {
    let changed = answer.iter().zip(honest).filter(|(a, b)| a != b).count();
    changed + answer.len().abs_diff(honest.len())
}

/// The checked sessions the tracker's book says `peer` passed.
fn verified_sessions(status: &StatusReport, peer: &RunningPeer) -> u32 {
    status
        .peers
        .iter()
        .flatten()
        .find(|known| &known.peer == peer.peer_id())
        .map_or(0, |known| known.verified_sessions)
}

/// Whether the tracker convicted someone since it counted `before` convictions; panics when
/// `liar` is not among the convicted (honest holders are checked by [`close_mesh`]).
fn liar_convicted(tracker: &RunningPeer, liar: &RunningPeer, before: u64) -> bool {
    let status = tracker.status();
    if status.convictions == before {
        return false;
    }
    let convicted: Vec<_> = status
        .banned
        .iter()
        .flatten()
        .filter_map(|ban| Some(ban.evidence.as_ref()?.convicted.peer.clone()))
        .collect();
    assert!(
        convicted.contains(liar.peer_id()),
        "someone else than the liar was convicted: {convicted:?}"
    );
    true
}

/// One run of [`detection_table`]: a holder joins, honest until it passed `probation`
/// checked sessions, then corrupts frames as `lies` says. Returns the sessions from its first
/// lie until it was convicted (`None`: not within `limit`) and the tokens users received
/// meanwhile that differ from the honest answer's.
async fn one_liar(
    tracker: &RunningPeer,
    honest: &[(String, u64)],
    lies: Arc<FaultyFrames>,
    probation: u32,
    limit: usize,
) -> (Option<usize>, usize) {
    let liar = holder(tracker, Some(Arc::clone(&lies))).await;
    wait_for("the liar in the book", tracker, |s| ready_in_book(s, &liar)).await;
    for _ in 0..25 {
        if verified_sessions(&tracker.status(), &liar) >= probation {
            break;
        }
        assert_eq!(wrong_tokens_of_a_batch(tracker, honest).await, 0);
    }
    assert!(verified_sessions(&tracker.status(), &liar) >= probation);
    lies.lie_from_now();
    let before = tracker.status().convictions;
    let (mut sessions, mut wrong_tokens, mut detected) = (0, 0, None);
    while sessions < limit && detected.is_none() {
        wrong_tokens += wrong_tokens_of_a_batch(tracker, honest).await;
        sessions += AT_ONCE;
        if liar_convicted(tracker, &liar, before) {
            detected = Some(sessions);
        }
    }
    liar.shutdown().await;
    (detected, wrong_tokens)
}

/// One run of the newcomer row of [`detection_table`]: a holder corrupting every frame from
/// its first joins; chats run one at a time until it computed a frame. Returns whether it was
/// convicted in that first session and the tokens users received that differ from the
/// honest answer's.
async fn one_newcomer(tracker: &RunningPeer, honest: &[(String, u64)], seed: u64) -> (bool, usize) {
    let lies = Arc::new(FaultyFrames::new(1.0, CorruptionMode::Noise, seed).unwrap());
    let liar = holder(tracker, Some(Arc::clone(&lies))).await;
    wait_for("the newcomer in the book", tracker, |s| {
        ready_in_book(s, &liar)
    })
    .await;
    let before = tracker.status().convictions;
    let client = reqwest::Client::new();
    let mut wrong = 0;
    for _ in 0..20 {
        wrong += wrong_tokens(&scored_tokens(&client, tracker).await, honest);
        if lies.corrupted() > 0 {
            break;
        }
    }
    assert!(lies.corrupted() > 0, "the newcomer served no session");
    let caught = liar_convicted(tracker, &liar, before);
    liar.shutdown().await;
    (caught, wrong)
}

/// A tracker checking as `verify` says and two honest holders of the same layers, ready and
/// past their probation, with the honest answer of [`scored_tokens`].
async fn honest_mesh(verify: VerifyPolicy) -> (RunningPeer, [RunningPeer; 2], Vec<(String, u64)>) {
    let probation = verify.probation_sessions;
    let (tracker, [first, second]) = two_holders(verify).await;
    let honest = scored_tokens(&reqwest::Client::new(), &tracker).await;
    assert_eq!(honest.len(), DETECTION_TOKENS);
    let past_probation = |s: &StatusReport| {
        [&first, &second]
            .iter()
            .all(|h| verified_sessions(s, h) >= probation)
    };
    for _ in 0..25 {
        if past_probation(&tracker.status()) {
            break;
        }
        assert_eq!(wrong_tokens_of_a_batch(&tracker, &honest).await, 0);
    }
    assert!(past_probation(&tracker.status()));
    (tracker, [first, second], honest)
}

/// Asserts that no honest holder was convicted, shuts the mesh down and returns how many
/// were (0).
async fn close_mesh(tracker: RunningPeer, honest_holders: [RunningPeer; 2]) -> usize {
    let convicted: Vec<_> = tracker
        .status()
        .banned
        .into_iter()
        .flatten()
        .filter_map(|ban| Some(ban.evidence?.convicted.peer))
        .collect();
    let honest_convicted = honest_holders
        .iter()
        .filter(|holder| convicted.contains(holder.peer_id()))
        .count();
    assert_eq!(honest_convicted, 0, "an honest member was convicted");
    for peer in honest_holders.into_iter().rev() {
        peer.shutdown().await;
    }
    tracker.shutdown().await;
    honest_convicted
}

fn median(list: &[usize]) -> String {
    list.get(list.len() / 2)
        .map_or("-".to_owned(), usize::to_string)
}

fn max(list: &[usize]) -> String {
    list.last().map_or("-".to_owned(), usize::to_string)
}

/// A number from the environment variable `name`, or `default`.
fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map_or(default, |value| value.parse().unwrap())
}

/// The detection table of ADR-0026 (benches/README.md). A tracker and two honest holders of
/// the same layers field, run after run, a third holder:
/// - a newcomer corrupting every frame: is it convicted in the first session it serves?
/// - one honest until it passed its probation, then corrupting a fraction of its frames
///   (noise): chats of [`DETECTION_TOKENS`] greedy tokens run [`AT_ONCE`] at a time until it is
///   convicted or `MESHNET_DETECTION_SESSIONS` (200) sessions ran since its first lie.
///
/// Prints runs detected, sessions until detection, tokens users received that differ from the
/// honest answer's, and honest members convicted (asserted 0). Run by hand:
/// `cargo test -p meshnet-peer --features faulty-member --test faulty -- --ignored --nocapture`
/// (`MESHNET_DETECTION_RUNS`, default 20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a table for benches/README.md: many minutes"]
async fn detection_table() {
    let runs = setting("MESHNET_DETECTION_RUNS", 20);
    let limit = setting("MESHNET_DETECTION_SESSIONS", 200);
    let policy = |rate: f64| VerifyPolicy {
        sample_rate: rate,
        ..probation_only()
    };
    let (tracker, holders, honest) = honest_mesh(policy(VerifyPolicy::default().sample_rate)).await;
    let mut caught = 0;
    let mut wrong = Vec::new();
    for run in 0..runs {
        let (in_first, wrong_tokens) = one_newcomer(&tracker, &honest, run as u64).await;
        caught += usize::from(in_first);
        wrong.push(wrong_tokens);
    }
    wrong.sort_unstable();
    let honest_convicted = close_mesh(tracker, holders).await;
    println!(
        "| newcomer corrupting every frame | caught in its first session | wrong tokens users saw (max) | honest members convicted |"
    );
    println!("|---|---|---|---|");
    println!(
        "| 100% | {caught}/{runs} | {} | {honest_convicted} |",
        max(&wrong)
    );
    println!();
    println!(
        "| frames corrupted | sample rate | detected within {limit} sessions | sessions from the first lie (median, max) | wrong tokens users saw (median, max) | honest members convicted |"
    );
    println!("|---|---|---|---|---|---|");
    for fraction in [1.0, 0.1, 0.01] {
        for rate in [0.1, 0.2] {
            let verify = policy(rate);
            let probation = verify.probation_sessions;
            let (tracker, holders, honest) = honest_mesh(verify).await;
            let mut found = Vec::new();
            let mut wrong = Vec::new();
            for run in 0..runs {
                let lies = FaultyFrames::new(fraction, CorruptionMode::Noise, run as u64)
                    .unwrap()
                    .honest_first(u64::MAX);
                let (detected, wrong_tokens) =
                    one_liar(&tracker, &honest, Arc::new(lies), probation, limit).await;
                found.extend(detected);
                wrong.push(wrong_tokens);
            }
            found.sort_unstable();
            wrong.sort_unstable();
            let honest_convicted = close_mesh(tracker, holders).await;
            println!(
                "| {:.0}% | {:.0}% | {}/{runs} | {}, {} | {}, {} | {honest_convicted} |",
                fraction * 100.0,
                rate * 100.0,
                found.len(),
                median(&found),
                max(&found),
                median(&wrong),
                max(&wrong)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn choices_sharing_a_checked_prefill_each_equal_the_single_answer() {
    let (tracker, [first, second]) = two_holders(VerifyPolicy {
        sample_rate: 1.0,
        ..probation_only()
    })
    .await;
    let single = short_greedy_text(&tracker).await;
    let body = chat_completion(
        &reqwest::Client::new(),
        &tracker,
        serde_json::json!({
            "messages": [{"role": "user", "content": "Name a colour."}],
            "temperature": 0,
            "max_tokens": 2,
            "n": 3,
        }),
    )
    .await;
    let texts: Vec<&str> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|choice| choice["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(texts, [single.as_str(); 3]);
    let status = tracker.status();
    assert_eq!((status.convictions, status.failovers), (0, 0));
    for peer in [second, first, tracker] {
        peer.shutdown().await;
    }
}
