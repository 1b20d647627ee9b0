#![allow(clippy::unwrap_used)]
//! Whole meshes in one process losing members: a hop that dies mid-generation, a peer that
//! leaves gracefully, and a tracker that dies.

mod common;

use std::time::Instant;

use common::{DEADLINE, converged, peer, tracker, wait_for};
use meshnet_peer::RunningPeer;
use meshnet_peer::status::StatusReport;

/// The prompt of [`chat`].
const PROMPT: &str = "Tell me a long story about a lighthouse keeper.";

/// The most tokens of [`chat`]'s answer.
const MAX_TOKENS: usize = 40;

/// A greedy chat long enough to be cut in the middle.
fn chat(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    })
}

/// The text [`chat`] must get from a mesh whose tracker routes over the boundaries it reports
/// in `status`.
async fn expected_answer(status: &StatusReport) -> String {
    let boundaries = status
        .route_boundaries
        .clone()
        .expect("the tracker has a route");
    common::reference_chat(PROMPT, &boundaries, MAX_TOKENS).await
}

/// The whole text of a non-streaming answer from `base`.
async fn answer(base: &str, model: &str) -> String {
    let response = reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .json(&chat(model, false))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Streams the chat from `base`, calling `at_delta` with the number of content deltas so far
/// after each one; returns the text, and fails on any error event.
async fn stream(base: &str, model: &str, mut at_delta: impl AsyncFnMut(usize)) -> String {
    let mut response = reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .json(&chat(model, true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut pending = String::new();
    let mut text = String::new();
    let mut deltas = 0;
    loop {
        let chunk = response.chunk().await.expect("the stream broke");
        let Some(chunk) = chunk else {
            panic!("the stream ended without [DONE]; text so far: {text:?}");
        };
        pending.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return text;
            }
            let value: serde_json::Value = serde_json::from_str(data).unwrap();
            assert!(value.get("error").is_none(), "error event: {value}");
            if let Some(piece) = value["choices"][0]["delta"]["content"].as_str() {
                text.push_str(piece);
                deltas += 1;
                at_delta(deltas).await;
            }
        }
    }
}

/// A tracker holding layers 0..10 and two peers that can each hold the other 20: both end up
/// holding 10..30, so either can carry a generation.
async fn redundant_mesh() -> (RunningPeer, RunningPeer, RunningPeer) {
    let tracker = tracker(10).await;
    let a = peer(20, &tracker).await;
    let b = peer(20, &tracker).await;
    wait_for("two ready holders of 10..30", &tracker, |s| {
        converged(s, &[&a, &b])
            && s.coverage
                .as_ref()
                .unwrap()
                .layers
                .iter()
                .all(|layer| layer.layer < 10 || layer.holders.len() == 2)
    })
    .await;
    (tracker, a, b)
}

/// Which of `peers` the running generation goes through: the one with a session.
async fn the_busy_one(peers: [&RunningPeer; 2]) -> &RunningPeer {
    let started = Instant::now();
    loop {
        if let Some(busy) = peers.iter().find(|p| p.status().active_sessions > 0) {
            return busy;
        }
        assert!(started.elapsed() < DEADLINE, "no peer runs the session");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hop_that_dies_mid_generation_is_replaced_and_the_text_is_unchanged() {
    let (tracker, a, b) = redundant_mesh().await;
    let base = tracker.openai_base_url().unwrap();
    let model = tracker.model_id().to_owned();
    let reference = answer(&base, &model).await;

    let mut a = Some(a);
    let mut b = Some(b);
    let mut killed = None;
    let mut banned_on_resume = None;
    let text = stream(&base, &model, async |deltas| {
        if deltas == 8 {
            let busy = the_busy_one([a.as_ref().unwrap(), b.as_ref().unwrap()])
                .await
                .peer_id()
                .clone();
            let dying = if &busy == a.as_ref().unwrap().peer_id() {
                a.take().unwrap()
            } else {
                b.take().unwrap()
            };
            killed = Some(dying.peer_id().clone());
            dying.shutdown().await;
        }
        if deltas > 8 && banned_on_resume.is_none() {
            // The first tokens after the failover: the ban is fresh. (By the end of the
            // stream its backoff may have run out on a slow machine, and the dead peer,
            // silent since, may have left the book with it.)
            let status = tracker.status();
            if status.failovers > 0 {
                banned_on_resume = status.banned;
            }
        }
    })
    .await;
    assert_eq!(text, reference, "the failover changed the text");
    let killed = killed.expect("a peer was stopped mid-generation");
    let banned = banned_on_resume.expect("the stream went on after the failover");
    assert!(
        banned.iter().any(|ban| ban.peer == killed),
        "the dead peer is banned once the stream resumes: {banned:?}"
    );
    let status: StatusReport = tracker.status();
    assert_eq!(status.failovers, 1, "one failover");
    // Still off routes: banned, or forgotten as silent.
    let still_banned = status.banned.unwrap().iter().any(|ban| ban.peer == killed);
    let still_known = status
        .peers
        .unwrap()
        .iter()
        .any(|known| known.peer == killed);
    assert!(
        still_banned || !still_known,
        "the dead peer is neither banned nor forgotten"
    );
    // The survivor freed the session the failover replayed onto it.
    let survivor = a.or(b).unwrap();
    let started = Instant::now();
    while survivor.status().active_sessions > 0 {
        assert!(started.elapsed() < DEADLINE, "the session was not freed");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    survivor.shutdown().await;
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_leaving_mid_generation_finishes_it_and_goes_once_others_hold_its_layers() {
    let (tracker, a, b) = redundant_mesh().await;
    let base = tracker.openai_base_url().unwrap();
    let model = tracker.model_id().to_owned();
    let reference = answer(&base, &model).await;

    let mut leaving = None;
    let text = stream(&base, &model, async |deltas| {
        if deltas == 5 {
            let busy = the_busy_one([&a, &b]).await;
            leaving = Some(busy.peer_id().clone());
            // Starts the leave; it must wait for the running session.
            let outcome = tokio::time::timeout(
                std::time::Duration::from_millis(1),
                busy.leave(std::time::Duration::from_secs(30)),
            )
            .await;
            assert!(outcome.is_err(), "left while its session was still running");
        }
    })
    .await;
    assert_eq!(text, reference, "leaving changed the text");
    let leaving = leaving.unwrap();
    let (goer, stayer) = if *a.peer_id() == leaving {
        (a, b)
    } else {
        (b, a)
    };
    assert!(goer.status().leaving);
    let outcome = goer.leave(std::time::Duration::from_secs(30)).await;
    assert!(
        matches!(outcome, meshnet_peer::LeaveOutcome::Clean { .. }),
        "{outcome:?}"
    );
    // No failover was needed, and new generations avoid the leaving peer.
    assert_eq!(tracker.status().failovers, 0);
    assert_eq!(answer(&base, &model).await, reference);
    assert_eq!(goer.status().active_sessions, 0);
    goer.shutdown().await;
    wait_for("coverage without the one that left", &tracker, |s| {
        converged(s, &[&stayer])
    })
    .await;
    stayer.shutdown().await;
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_takes_over_when_the_tracker_dies_and_the_old_one_rejoins_as_a_peer() {
    let tracker_config = common::config(true, 10, vec![]);
    let tracker_key = tracker_config.keypair.clone().unwrap();
    let old_tracker = meshnet_peer::start(tracker_config).await.unwrap();
    // Both peers have the memory for the tracker's part, so both are on the succession list.
    let a = peer(20, &old_tracker).await;
    let b = peer(20, &old_tracker).await;
    let status = wait_for("coverage and two successors", &old_tracker, |s| {
        converged(s, &[&a, &b]) && s.succession.len() == 2
    })
    .await;
    assert_eq!(status.term, 1);
    let heir_id = status.succession[0].clone();
    let (heir, other) = if *a.peer_id() == heir_id {
        (a, b)
    } else {
        (b, a)
    };
    let model = old_tracker.model_id().to_owned();
    let old_id = old_tracker.peer_id().clone();
    // Every member answers the API, the others through the tracker.
    let through_other = format!("{}/v1", other.http_url());
    let reference = answer(&through_other, &model).await;
    assert_eq!(
        reference,
        expected_answer(&status).await,
        "before the takeover"
    );

    old_tracker.shutdown().await;
    let died = Instant::now();
    let taken = wait_for("the heir to take over", &heir, |s| {
        s.role == meshnet_peer::status::Role::Tracker
            && s.coverage.as_ref().is_some_and(|c| c.complete)
            && s.route_boundaries.is_some()
    })
    .await;
    assert_eq!(taken.term, 2);
    // A client pointed at the other member gets answers again, exactly what one process
    // computes over the new route's boundaries.
    let again = answer(&through_other, &model).await;
    let healed = died.elapsed();
    assert_eq!(again, expected_answer(&taken).await, "after the takeover");
    assert!(
        other.status().tracker.as_ref() == Some(heir.peer_id()),
        "the other member follows the heir"
    );
    eprintln!("the mesh answered again {healed:?} after its tracker died");

    // The old tracker, started again with its identity, loses to the higher term and joins
    // as a peer.
    let mut config = common::config(true, 10, heir.p2p_addrs().await.unwrap());
    config.keypair = Some(tracker_key);
    let rejoined = meshnet_peer::start(config).await.unwrap();
    assert_eq!(rejoined.peer_id(), &old_id);
    let stepped_down = wait_for("the old tracker to step down", &rejoined, |s| {
        s.role == meshnet_peer::status::Role::Peer && s.tracker.as_ref() == Some(heir.peer_id())
    })
    .await;
    // The map it follows names where the heir answers, so it passes chats on at once.
    assert_eq!(stepped_down.tracker_http.as_deref(), Some(heir.http_url()));
    let settled = wait_for(
        "the heir's map to settle with the old tracker in it",
        &heir,
        |s| {
            converged(s, &[&other, &rejoined])
                && s.peers
                    .as_ref()
                    .is_some_and(|peers| peers.iter().any(|p| &p.peer == rejoined.peer_id()))
        },
    )
    .await;
    assert_eq!(settled.role, meshnet_peer::status::Role::Tracker);
    let through_old = format!("{}/v1", rejoined.http_url());
    let through_rejoined = answer(&through_old, &model).await;
    assert_eq!(
        heir.status().route_boundaries,
        settled.route_boundaries,
        "the route held still while the chat ran"
    );
    assert_eq!(
        through_rejoined,
        expected_answer(&settled).await,
        "through the old tracker, now a peer"
    );
    rejoined.shutdown().await;
    other.shutdown().await;
    heir.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_claimed_by_a_member_off_the_succession_list_is_rejected_and_counted() {
    let tracker = tracker(10).await;
    let victim = peer(20, &tracker).await;
    wait_for("coverage and a successor", &tracker, |s| {
        converged(s, &[&victim]) && s.succession.len() == 1
    })
    .await;

    // A member of the mesh that is not on the list claims a later term.
    let (usurper, _events) = common::outsider(&tracker).await;
    let usurper_id = usurper.local_peer_id();
    let refused = |status: &StatusReport| {
        status.recent_rejections.iter().any(|rejection| {
            rejection.from == usurper_id
                && rejection.topic.ends_with("/coverage")
                && rejection.reason.contains("succession list")
        })
    };
    let started = Instant::now();
    let mut epoch = u64::MAX / 2;
    while !refused(&victim.status()) {
        assert!(started.elapsed() < DEADLINE, "the claim never arrived");
        epoch += 1;
        usurper
            .publish_coverage(meshnet_p2p::CoverageMessage {
                model_id: tracker.model_id().to_owned(),
                term: 99,
                succession: vec![usurper_id.clone()],
                tracker_http: "http://127.0.0.1:9".into(),
                epoch,
                sequence: epoch,
                num_layers: 30,
                map: meshnet_planner::CoverageMap::empty(epoch),
                announce_interval_ms: common::ANNOUNCE.as_millis() as u64,
            })
            .await
            .unwrap();
        tokio::time::sleep(common::ANNOUNCE).await;
    }
    let status = victim.status();
    assert!(status.rejected_messages >= 1);
    assert_eq!(status.tracker.as_ref(), Some(tracker.peer_id()));
    assert_eq!(status.term, 1);
    assert!(
        status.coverage.as_ref().is_some_and(|c| c.complete),
        "the victim still holds the tracker's map"
    );
    usurper.shutdown().await;
    victim.shutdown().await;
    tracker.shutdown().await;
}
