//! What checking sessions against second holders costs (ADR-0026): a tracker holding 10 layers
//! and three members each holding the other 20, in one process (the real runtime on the libp2p
//! memory transport, the default model). For each setting, a fresh mesh answers warm-up
//! chats (which also take every member through its probation), then
//! `MESHNET_BENCH_SESSIONS` (default 48) greedy chats of `MAX_TOKENS` tokens, `AT_ONCE` at a time.
//! The anchor is the same mesh with checks off. Every setting is measured once per round
//! (`MESHNET_BENCH_ROUNDS`, default 3), each round in a rotated order, so a drift of the
//! machine during the run reaches every setting alike. Prints a markdown table: sessions
//! checked, aggregate tokens/s, and the ratio to the anchor, overall and per round.
//!
//! Needs the default model (`scripts/fetch-model.sh`). Run with
//! `cargo bench -p meshnet-benches --bench verification`.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use meshnet_peer::RunningPeer;
use meshnet_peer::verify::VerifyPolicy;
use meshnet_testkit::Kit;
use serde_json::json;

const TRACKER_LAYERS: u32 = 10;
const HOLDER_LAYERS: u32 = 20;
const HOLDERS: usize = 3;
const MAX_TOKENS: u64 = 32;
const AT_ONCE: usize = 4;
/// Enough warm-up chats for every holder to pass the default probation.
const WARM_UP: usize = 12;
const PROMPT: &str = "Write one sentence about the sea.";

/// The count in the environment variable `name` (at least `min`), or `default`.
fn count_setting(name: &str, min: usize, default: usize) -> usize {
    match std::env::var(name) {
        Ok(value) => match value.trim().parse::<usize>() {
            Ok(n) if n >= min => n,
            _ => panic!("{name} must be an integer >= {min}, got {value:?}"),
        },
        Err(_) => default,
    }
}

struct Measured {
    sessions: usize,
    checked: u64,
    tokens: u64,
    wall: Duration,
    texts_equal: bool,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64()
    }
}

/// One greedy chat's text and completion tokens.
async fn chat(client: &reqwest::Client, tracker: &RunningPeer) -> (String, u64) {
    let body = json!({
        "model": tracker.model_id(),
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    });
    let url = format!("{}/chat/completions", tracker.openai_base_url().unwrap());
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let answer: serde_json::Value =
        serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    let text = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    (text, answer["usage"]["completion_tokens"].as_u64().unwrap())
}

/// `count` chats, `AT_ONCE` at a time.
async fn chats(tracker: &RunningPeer, count: usize) -> Vec<(String, u64)> {
    let client = reqwest::Client::new();
    let mut answers = Vec::with_capacity(count);
    for _ in 0..count / AT_ONCE {
        let batch = (0..AT_ONCE).map(|_| chat(&client, tracker));
        answers.extend(futures::future::join_all(batch).await);
    }
    answers
}

async fn mesh(kit: &Kit, verify: VerifyPolicy) -> (RunningPeer, Vec<RunningPeer>) {
    let mut config = kit.config(true, TRACKER_LAYERS, Vec::new());
    config.verify = verify;
    let tracker = meshnet_peer::start(config).await.unwrap();
    let mut holders = Vec::new();
    for _ in 0..HOLDERS {
        holders.push(kit.peer(HOLDER_LAYERS, &tracker).await.unwrap());
    }
    let started = Instant::now();
    loop {
        let status = tracker.status();
        let ready = status.peers.iter().flatten().filter(|peer| {
            peer.span
                .as_ref()
                .is_some_and(|span| span.state == meshnet_types::SpanState::Ready)
        });
        if ready.count() == HOLDERS && status.coverage.is_some_and(|c| c.complete) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the mesh did not converge"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (tracker, holders)
}

async fn measure(kit: &Kit, verify: VerifyPolicy, count: usize) -> Measured {
    let (tracker, holders) = mesh(kit, verify).await;
    chats(&tracker, WARM_UP).await;
    // Sessions are counted as checked when they end on the hops, just after their answers.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let checked_before = tracker.status().checked_sessions;
    let started = Instant::now();
    let answers = chats(&tracker, count).await;
    let wall = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let checked = tracker.status().checked_sessions - checked_before;
    for holder in holders {
        holder.shutdown().await;
    }
    tracker.shutdown().await;
    Measured {
        sessions: answers.len(),
        checked,
        tokens: answers.iter().map(|(_, tokens)| tokens).sum(),
        wall,
        texts_equal: answers.iter().all(|(text, _)| text == &answers[0].0),
    }
}

/// The settings measured: checks off (the anchor) first, then sample rates.
fn settings() -> Vec<(String, VerifyPolicy)> {
    let default_rate = VerifyPolicy::default().sample_rate;
    let at = |rate: f64| VerifyPolicy {
        sample_rate: rate,
        ..VerifyPolicy::default()
    };
    let label = |rate: f64| match rate {
        1.0 => "sample 1.00 (every session)".to_owned(),
        rate if rate == default_rate => format!("sample {rate:.2} (default)"),
        rate => format!("sample {rate:.2}"),
    };
    let mut settings = vec![("checks off (anchor)".to_owned(), VerifyPolicy::OFF)];
    settings.extend([0.05, 0.1, 0.2, 1.0].map(|rate| (label(rate), at(rate))));
    settings
}

/// Aggregate tokens per second over `runs`.
fn rate(runs: &[Measured]) -> f64 {
    let tokens: u64 = runs.iter().map(|run| run.tokens).sum();
    let wall: f64 = runs.iter().map(|run| run.wall.as_secs_f64()).sum();
    tokens as f64 / wall
}

fn main() {
    let count = count_setting("MESHNET_BENCH_SESSIONS", AT_ONCE, 48);
    let rounds = count_setting("MESHNET_BENCH_ROUNDS", 1, 3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let kit = Kit::with_default_model(Duration::from_millis(500)).unwrap();
    let settings = settings();
    // A run thrown away first: the model in the page cache, the allocator and the CPU warm.
    runtime.block_on(measure(&kit, VerifyPolicy::OFF, AT_ONCE));
    let mut results: Vec<Vec<Measured>> = settings.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        // Each round starts one setting later, so a drift of the machine spreads over all.
        for offset in 0..settings.len() {
            let index = (round + offset) % settings.len();
            let verify = settings[index].1.clone();
            results[index].push(runtime.block_on(measure(&kit, verify, count)));
        }
    }
    print_table(&settings, &results, count, rounds);
}

fn print_table(
    settings: &[(String, VerifyPolicy)],
    results: &[Vec<Measured>],
    count: usize,
    rounds: usize,
) {
    let anchor = &results[0];
    println!();
    println!(
        "## Checking sessions: {rounds} rounds of {count} greedy {MAX_TOKENS}-token chats per \
         setting, {AT_ONCE} at a time, a tracker and {HOLDERS} holders of the same layers in one \
         process"
    );
    println!();
    println!(
        "| setting | sessions checked | tokens/s | / checks off | / checks off, per round | texts equal |"
    );
    println!("|---|---|---|---|---|---|");
    for ((label, _), runs) in settings.iter().zip(results) {
        let per_round: Vec<String> = runs
            .iter()
            .zip(anchor)
            .map(|(run, off)| format!("{:.3}", run.rate() / off.rate()))
            .collect();
        println!(
            "| {label} | {} / {} | {:.1} | {:.3} | {} | {} |",
            runs.iter().map(|run| run.checked).sum::<u64>(),
            runs.iter().map(|run| run.sessions).sum::<usize>(),
            rate(runs),
            rate(runs) / rate(anchor),
            per_round.join(", "),
            if runs.iter().all(|run| run.texts_equal) {
                "yes"
            } else {
                "no"
            }
        );
    }
}
