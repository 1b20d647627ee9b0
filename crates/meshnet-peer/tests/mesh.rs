#![allow(clippy::unwrap_used)]
//! Whole meshes in one process: coverage, authorisation, failure and discovery.

mod common;

use std::time::{Duration, Instant};

use common::{ANNOUNCE, converged, peer, tracker, wait_for};
use meshnet_p2p::{DirectiveMessage, SpanStatus};
use meshnet_planner::Directive;
use meshnet_types::{LayerSpan, SpanState};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tracker_and_five_peers_whose_memory_forces_all_of_them_reach_full_coverage() {
    // 5 layers on the tracker and 5 on each peer: exactly the model's 30.
    let tracker = tracker(5).await;
    let mut peers = Vec::new();
    for _ in 0..5 {
        peers.push(peer(5, &tracker).await);
    }
    let refs: Vec<_> = peers.iter().collect();
    let status = wait_for("full coverage", &tracker, |s| {
        s.peers.as_ref().is_some_and(|p| p.len() == 5) && converged(s, &refs)
    })
    .await;
    let coverage = status.coverage.unwrap();
    for layer in &coverage.layers {
        assert_eq!(
            layer.holders.len(),
            1,
            "layer {} has one holder",
            layer.layer
        );
    }
    for peer in &peers {
        let span = peer.current_span().expect("every peer takes part");
        assert_eq!(span.target.layers.len(), 5);
    }
    for peer in peers {
        peer.shutdown().await;
    }
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directive_forged_by_a_non_tracker_is_rejected_and_not_acted_on() {
    let tracker = tracker(10).await;
    let victim = peer(20, &tracker).await;
    wait_for("coverage", &tracker, |s| converged(s, &[&victim])).await;
    let before = victim.current_span().unwrap().target;

    // A member of the mesh that is not the tracker forges a directive to the victim.
    let (forger, _events) = common::outsider(&tracker).await;
    let forger_id = forger.local_peer_id();
    // The victim's rejection of this forger's directive, specifically.
    let rejected_forgery = |status: &meshnet_peer::status::StatusReport| {
        status.recent_rejections.iter().any(|rejection| {
            rejection.from == forger_id && rejection.topic.ends_with("/directives")
        })
    };
    let forged_span = LayerSpan::new(0, 3);
    let started = Instant::now();
    let mut sequence = u64::MAX / 2;
    while !rejected_forgery(&victim.status()) {
        assert!(
            started.elapsed() < common::DEADLINE,
            "the forged directive never arrived"
        );
        sequence += 1;
        forger
            .publish_directive(DirectiveMessage {
                model_id: tracker.model_id().to_owned(),
                target: victim.peer_id().to_owned(),
                term: u64::MAX / 2,
                epoch: u64::MAX / 2,
                sequence,
                directives: vec![Directive::LoadShard {
                    peer: victim.peer_id().clone(),
                    layers: forged_span,
                    quantization: before.quantization,
                }],
                span_after: Some(SpanStatus {
                    layers: forged_span,
                    quantization: before.quantization,
                    state: SpanState::Loading,
                }),
            })
            .await
            .unwrap();
        tokio::time::sleep(ANNOUNCE).await;
    }
    // The victim rejected it, counted it by reason in /metrics, and still holds what the
    // tracker assigned.
    let scrape = reqwest::get(format!("{}/metrics", victim.http_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let counted: f64 = scrape
        .lines()
        .filter(|line| {
            line.starts_with("meshnet_gossip_rejected_total{")
                && line.contains("topic=\"directives\"")
                && line.contains("reason=\"not_tracker\"")
        })
        .map(|line| line.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap())
        .sum();
    assert!(counted >= 1.0, "{scrape}");
    assert!(victim.status().loading.is_none());
    assert_eq!(victim.current_span().unwrap().target, before);
    let status = tracker.status();
    assert!(converged(&status, &[&victim]));
    forger.shutdown().await;
    victim.shutdown().await;
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dies_leaves_the_map_and_the_others_restore_coverage() {
    // Tracker 5 layers, four peers of 9: any three of them still cover the 25 others.
    let tracker = tracker(5).await;
    let mut peers = Vec::new();
    for _ in 0..4 {
        peers.push(peer(9, &tracker).await);
    }
    let refs: Vec<_> = peers.iter().collect();
    wait_for("full coverage", &tracker, |s| {
        s.peers.as_ref().is_some_and(|p| p.len() == 4) && converged(s, &refs)
    })
    .await;

    // Kill a peer that holds layers.
    let index = peers
        .iter()
        .position(|p| p.current_span().is_some())
        .unwrap();
    let dead = peers.remove(index);
    let dead_id = dead.peer_id().to_owned();
    dead.shutdown().await;
    let died = Instant::now();
    wait_for("the dead peer to leave the map", &tracker, |s| {
        let listed = s
            .peers
            .as_ref()
            .is_some_and(|p| p.iter().any(|peer| peer.peer == dead_id));
        let holding = s.coverage.as_ref().is_some_and(|c| {
            c.layers
                .iter()
                .any(|l| l.holders.iter().any(|h| h.peer == dead_id))
        });
        !listed && !holding
    })
    .await;
    println!(
        "dead peer left the map after {:?} (expiry {:?})",
        died.elapsed(),
        ANNOUNCE * 3
    );
    let refs: Vec<_> = peers.iter().collect();
    wait_for("coverage restored", &tracker, |s| converged(s, &refs)).await;
    println!("coverage restored {:?} after the death", died.elapsed());
    for peer in peers {
        peer.shutdown().await;
    }
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_knowing_only_a_non_tracker_member_finds_the_tracker_and_gets_a_span() {
    // Tracker 5 layers, A 13: the newcomer's 12 are needed to cover the model.
    let tracker = tracker(5).await;
    let member = peer(13, &tracker).await;
    wait_for("the member's span", &tracker, |s| {
        s.peers.as_ref().is_some_and(|p| p.len() == 1) && member.current_span().is_some()
    })
    .await;
    let newcomer = peer(12, &member).await;
    wait_for("full coverage with the newcomer", &tracker, |s| {
        converged(s, &[&member, &newcomer]) && newcomer.current_span().is_some()
    })
    .await;
    assert_eq!(
        newcomer.status().tracker.as_ref(),
        Some(tracker.peer_id()),
        "the newcomer found the tracker"
    );
    newcomer.shutdown().await;
    member.shutdown().await;
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_run_side_by_side_up_to_the_bound_then_wait_in_line_then_get_429() {
    // A tracker holding the whole model: a mesh of one, covered at once.
    let mut config = common::config(true, 30, vec![]);
    config.max_sessions = 2;
    config.max_queued_sessions = 1;
    let tracker = meshnet_peer::start(config).await.unwrap();
    wait_for("the tracker's span", &tracker, |s| {
        s.route_boundaries.is_some()
    })
    .await;
    let base = tracker.openai_base_url().unwrap();
    let http = reqwest::Client::new();
    let model = tracker.model_id().to_owned();
    let request = |seed: u64| {
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "temperature": 0.8,
            "seed": seed,
            "max_tokens": 1000,
            "stream": true,
        })
    };
    let short = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    });
    let mut streams = Vec::new();
    for seed in [1, 2] {
        let mut response = http
            .post(format!("{base}/chat/completions"))
            .json(&request(seed))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        // Both produce text at the same time.
        let mut seen = String::new();
        while !seen.contains("\"content\":\"") || seen.matches("data:").count() < 3 {
            let chunk = response.chunk().await.unwrap().expect("streaming");
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
        streams.push(response);
    }
    // A third waits in line for a slot.
    let waiting = tokio::spawn({
        let http = http.clone();
        let url = format!("{base}/chat/completions");
        let body = short.clone();
        async move {
            let response = http.post(url).json(&body).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<serde_json::Value>().await.unwrap())
        }
    });
    let status = wait_for("a request in line", &tracker, |s| {
        s.admission.as_ref().is_some_and(|a| a.queued == 1)
    })
    .await;
    let admission = status.admission.unwrap();
    assert_eq!((admission.running, admission.max_sessions), (2, 2));
    assert_eq!(admission.max_queued, 1);
    assert!(
        !waiting.is_finished(),
        "the third was answered while both slots ran"
    );
    // The line is full: a fourth is refused at once, and told why.
    let fourth = http
        .post(format!("{base}/chat/completions"))
        .json(&request(4))
        .send()
        .await
        .unwrap();
    assert_eq!(fourth.status().as_u16(), 429);
    assert!(fourth.headers().contains_key("retry-after"));
    let body: serde_json::Value = fourth.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("1 are waiting"), "{message}");
    // Once a client leaves, the one in line gets its slot and is served.
    drop(streams);
    let (status, answer) = tokio::time::timeout(Duration::from_secs(120), waiting)
        .await
        .expect("the request in line was served")
        .unwrap();
    assert_eq!(status, 200, "{answer}");
    assert!(answer["choices"][0]["message"]["content"].is_string());
    wait_for("the slots and the line to empty", &tracker, |s| {
        s.active_sessions == 0 && s.admission.as_ref().is_some_and(|a| a.queued == 0)
    })
    .await;
    tracker.shutdown().await;
}

/// Frames without the tracker's grant for their session and route are refused before any work
/// (401 without one, 403 with a forged, foreign or stretched one); granted frames that would
/// cost too much are refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frames_are_refused_before_any_work() {
    let (tracker, signer) = common::tracker_and_signer(10).await;
    let peer = peer(20, &tracker).await;
    wait_for("coverage", &tracker, |s| converged(s, &[&peer])).await;
    let span = peer.current_span().unwrap().target.layers;
    let hidden = common::model().description().hidden;
    let client = meshnet_node::ForwardClient::new(
        meshnet_wire::Limits::default(),
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    let grant_for = |signer: &meshnet_peer::grants::GrantSigner, session| {
        common::grant_to(signer, session, span, peer.http_url())
    };
    let frame = |session, position: u64, tokens: usize, grant| meshnet_wire::ActivationFrame {
        meta: meshnet_wire::FrameMeta {
            session,
            chunk_index: 0,
            chunk_total: 1,
            position,
            layers: span,
            route: meshnet_wire::Route::default(),
            grant,
            fork_from: None,
            return_to: None,
            rewind: false,
        },
        activations: meshnet_wire::Activations::new(
            meshnet_wire::Shape::new(&[tokens, hidden]).unwrap(),
            vec![half::bf16::ZERO; tokens * hidden],
        )
        .unwrap(),
    };
    let granted = |position: u64, tokens: usize| {
        let session = uuid::Uuid::new_v4();
        frame(session, position, tokens, grant_for(&signer, session))
    };
    let refused = |frame, code: &str| {
        let client = client.clone();
        let endpoint: meshnet_wire::Endpoint = peer.http_url().parse().unwrap();
        let code = code.to_owned();
        async move {
            match client
                .forward(&endpoint, frame, meshnet_wire::Encoding::Raw)
                .await
            {
                Err(meshnet_node::ClientError::Rejected {
                    code: got, status, ..
                }) => {
                    assert_eq!(got, code, "status {status}");
                }
                other => panic!("expected a {code} rejection, got {other:?}"),
            }
        }
    };
    // No grant: 401.
    refused(frame(uuid::Uuid::new_v4(), 0, 3, None), "grant_missing").await;
    // A grant signed by a key that is not the tracker's: 403.
    let stranger =
        meshnet_peer::grants::GrantSigner::new(libp2p::identity::Keypair::generate_ed25519());
    let session = uuid::Uuid::new_v4();
    refused(
        frame(session, 0, 3, grant_for(&stranger, session)),
        "grant_refused",
    )
    .await;
    // The tracker's grant for another session: 403.
    let other = uuid::Uuid::new_v4();
    refused(
        frame(session, 0, 3, grant_for(&signer, other)),
        "grant_refused",
    )
    .await;
    // The tracker's grant with the route stretched to a listener of the sender's choosing:
    // 403, and the listener is never contacted.
    let bait = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bait_url = format!("http://{}", bait.local_addr().unwrap());
    let mut stretched = frame(session, 0, 3, grant_for(&signer, session));
    stretched.meta.layers = meshnet_types::LayerSpan::new(span.start, span.end - 1);
    stretched.meta.route = meshnet_wire::Route::new(vec![
        meshnet_wire::Hop::new(
            meshnet_types::LayerSpan::new(span.end - 1, span.end),
            bait_url.clone(),
        )
        .unwrap(),
    ])
    .unwrap();
    refused(stretched, "grant_refused").await;
    let contacted =
        tokio::time::timeout(std::time::Duration::from_millis(200), bait.accept()).await;
    assert!(contacted.is_err(), "the peer connected to {bait_url}");
    // A position far past the session's cache (a 128 GB attention mask if it were built).
    refused(granted(1 << 34, 2), "position_conflict").await;
    // More tokens in one frame than a prefill chunk.
    refused(granted(0, 129), "bad_activations").await;
    // The peer still serves a proper, granted frame.
    let answer = client
        .forward(
            &peer.http_url().parse().unwrap(),
            granted(0, 3),
            meshnet_wire::Encoding::Raw,
        )
        .await
        .unwrap();
    assert_eq!(answer.activations.shape().dims(), &[1, 3, hidden]);
    peer.shutdown().await;
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hop_whose_kv_budget_is_full_answers_503_and_the_entry_gives_up_naming_it() {
    let (tracker, signer) = common::tracker_and_signer(10).await;
    let mut config = common::config(false, 20, tracker.p2p_addrs().await.unwrap());
    // Room for 16 tokens of KV cache per layer: any longer prompt overflows it.
    config.kv_tokens = 16;
    let peer = meshnet_peer::start(config).await.unwrap();
    wait_for("coverage", &tracker, |s| converged(s, &[&peer])).await;
    let span = peer.current_span().unwrap().target.layers;
    let hidden = common::model().description().hidden;

    // Straight to the peer: 64 tokens in one frame do not fit 16 tokens of cache.
    let client = meshnet_node::ForwardClient::new(
        meshnet_wire::Limits::default(),
        std::time::Duration::from_secs(30),
    )
    .unwrap();
    let session = uuid::Uuid::new_v4();
    let frame = meshnet_wire::ActivationFrame {
        meta: meshnet_wire::FrameMeta {
            session,
            chunk_index: 0,
            chunk_total: 1,
            position: 0,
            layers: span,
            route: meshnet_wire::Route::default(),
            grant: common::grant_to(&signer, session, span, peer.http_url()),
            fork_from: None,
            return_to: None,
            rewind: false,
        },
        activations: meshnet_wire::Activations::new(
            meshnet_wire::Shape::new(&[64, hidden]).unwrap(),
            vec![half::bf16::ZERO; 64 * hidden],
        )
        .unwrap(),
    };
    match client
        .forward(
            &peer.http_url().parse().unwrap(),
            frame,
            meshnet_wire::Encoding::Raw,
        )
        .await
    {
        Err(meshnet_node::ClientError::Rejected { status, code, .. }) => {
            assert_eq!((status, code.as_str()), (503, "overloaded"));
        }
        other => panic!("expected a 503 overloaded, got {other:?}"),
    }

    // Through the tracker's API: no other peer holds the layers, so the entry gives up at once
    // with a 503 naming the peer and its 503.
    let base = tracker.openai_base_url().unwrap();
    let response = reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .json(&serde_json::json!({
            "model": tracker.model_id(),
            "messages": [{
                "role": "user",
                "content": "Please write a long and detailed essay about the history of the \
                            city of Paris, its rivers, bridges, museums and people.",
            }],
            "max_tokens": 4,
            "temperature": 0,
        }))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "route_lost", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(&peer.peer_id().to_string()), "{body}");
    assert!(message.contains("503 overloaded"), "{body}");
    assert!(message.contains("busy"), "{body}");
    peer.shutdown().await;
    tracker.shutdown().await;
}

/// The body of a greedy chat request.
fn greedy_chat_body(
    model: &str,
    prompt: &str,
    max_tokens: u32,
    stop: &[&str],
    stream: bool,
) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stop": stop,
        "stream": stream,
    })
}

/// Posts a greedy chat to `base`; returns the text and the finish reason, from the JSON answer
/// or (with `stream`) from the joined SSE deltas.
async fn greedy_chat(
    base: &str,
    model: &str,
    prompt: &str,
    max_tokens: u32,
    stop: &[&str],
    stream: bool,
) -> (String, String) {
    post_chat(
        base,
        &greedy_chat_body(model, prompt, max_tokens, stop, stream),
    )
    .await
}

/// Posts the chat request `request` to `base`; returns the text and the finish reason, from the
/// JSON answer or (when the request streams) from the joined SSE deltas.
async fn post_chat(base: &str, request: &serde_json::Value) -> (String, String) {
    let stream = request["stream"].as_bool().unwrap_or(false);
    let response = reqwest::Client::new()
        .post(format!("{base}/chat/completions"))
        .json(request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let body = response.text().await.unwrap();
    if !stream {
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        let choice = &body["choices"][0];
        return (
            choice["message"]["content"].as_str().unwrap().to_owned(),
            choice["finish_reason"].as_str().unwrap().to_owned(),
        );
    }
    let mut text = String::new();
    let mut finish = String::new();
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        if let Some(content) = choice["delta"]["content"].as_str() {
            text.push_str(content);
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = reason.to_owned();
        }
    }
    (text, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_of_turn_and_max_tokens_set_the_finish_reason() {
    let tracker = meshnet_peer::start(common::config(true, 30, vec![]))
        .await
        .unwrap();
    wait_for("the tracker's span", &tracker, |s| {
        s.route_boundaries.is_some()
    })
    .await;
    let base = tracker.openai_base_url().unwrap();
    let model = tracker.model_id().to_owned();
    let prompt = "What is the capital of France?";
    // Ends on its own (the end-of-turn token) well before 64 tokens.
    let (full, reason) = greedy_chat(&base, &model, prompt, 64, &[], false).await;
    assert_eq!(reason, "stop", "{full:?}");
    assert!(full.contains("Paris"), "{full:?}");
    // "s Par" spans the tokens of " is" and " Paris": the answer ends right before it, in the
    // middle of a token.
    let stop = "s Par";
    let cut = full
        .find(stop)
        .expect("the greedy answer has the stop string");
    for stream in [false, true] {
        let (text, reason) = greedy_chat(&base, &model, prompt, 64, &[stop, "zzz"], stream).await;
        assert_eq!(text, &full[..cut], "stream: {stream}");
        assert_eq!(reason, "stop", "stream: {stream}");
        let (text, reason) = greedy_chat(&base, &model, prompt, 3, &[], stream).await;
        assert_eq!(reason, "length", "stream: {stream}: {text:?}");
        assert!(full.starts_with(&text), "stream: {stream}: {text:?}");
        assert!(text.len() < cut, "stream: {stream}: {text:?}");
        let (text, reason) = greedy_chat(&base, &model, prompt, 64, &[], stream).await;
        assert_eq!((text.as_str(), reason.as_str()), (full.as_str(), "stop"));
    }
    tracker.shutdown().await;
}

/// Sends `body_bytes` bytes to `path` as a client that writes its whole request before
/// reading, and returns what came back (status line, headers and body).
fn write_all_then_read(addr: std::net::SocketAddr, path: &str, body_bytes: usize) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: meshnet\r\nContent-Type: application/json\r\n\
         Content-Length: {body_bytes}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    let chunk = vec![b' '; 1 << 20];
    let mut left = body_bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        stream
            .write_all(&chunk[..n])
            .expect("the server reset the connection before the body was sent");
        left -= n;
    }
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413_with_a_json_reason_even_when_the_client_writes_them_whole() {
    let tracker = tracker(10).await;
    let addr = tracker.http_addr();
    let api = meshnet_api::MAX_BODY_BYTES + (1 << 20);
    let frame = meshnet_wire::Limits::default().max_body_bytes() + (1 << 20);
    let (api_answer, frame_answer) = tokio::task::spawn_blocking(move || {
        (
            write_all_then_read(addr, "/v1/chat/completions", api),
            write_all_then_read(addr, "/forward", frame),
        )
    })
    .await
    .unwrap();
    for (answer, code) in [
        (&api_answer, "request_too_large"),
        (&frame_answer, "body_too_large"),
    ] {
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        let body = &answer[answer.find("\r\n\r\n").unwrap() + 4..];
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"]["code"], code, "{json}");
    }
    tracker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_chats_are_batched_and_each_gets_the_text_it_gets_alone() {
    let tracker = tracker(10).await;
    let peer = meshnet_peer::start(common::config(
        false,
        20,
        tracker.p2p_addrs().await.unwrap(),
    ))
    .await
    .unwrap();
    wait_for("coverage", &tracker, |s| converged(s, &[&peer])).await;
    let base = tracker.openai_base_url().unwrap();
    let model = tracker.model_id().to_owned();
    // Different prompts and lengths, so the sessions sit at different positions and leave the
    // batch at different steps.
    let chats = [
        ("What is the capital of France?", 24),
        ("Name three primary colors.", 10),
        ("Write one sentence about the sea.", 32),
        ("Count from one to ten.", 16),
    ];
    let mut alone = Vec::new();
    for (prompt, max_tokens) in chats {
        alone.push(greedy_chat(&base, &model, prompt, max_tokens, &[], false).await);
    }
    let started =
        |status: &meshnet_peer::status::StatusReport| status.batching.map_or(0, |b| b.requests);
    let before = started(&peer.status());
    let mut together = tokio::task::JoinSet::new();
    for (index, (prompt, max_tokens)) in chats.into_iter().enumerate() {
        if index == chats.len() - 1 {
            // The last joins a batch that is already running.
            wait_for("the first chats to reach the peer", &peer, |s| {
                started(s) > before + 3
            })
            .await;
        }
        let (base, model) = (base.clone(), model.clone());
        together.spawn(async move {
            let answer = greedy_chat(&base, &model, prompt, max_tokens, &[], true).await;
            (index, answer)
        });
    }
    while let Some(outcome) = together.join_next().await {
        let (index, answer) = outcome.unwrap();
        assert_eq!(
            answer, alone[index],
            "chat {index} batched differs from alone"
        );
    }
    for member in [&tracker, &peer] {
        let batching = member.status().batching.unwrap();
        assert!(
            batching.largest_pass >= 2,
            "no pass took two sessions at once: {batching:?}"
        );
    }
    peer.shutdown().await;
    tracker.shutdown().await;
}

/// A prompt of several chunks, prefilled with up to four chunks travelling through two peers
/// at once, gives the text it gets when each chunk is answered before the next is computed,
/// and every hop frees the session afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_pipelined_through_two_peers_gives_the_text_of_one_chunk_at_a_time() {
    let prompt = format!(
        "{}Which animal did the sentence above name?",
        "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(30)
    );
    let mut answers = Vec::new();
    // Chunks in flight, and whether outputs return straight from the last hop.
    for (in_flight, direct_return) in [(1, false), (4, false), (4, true), (1, true)] {
        let mut config = common::config(true, 10, vec![]);
        config.prefill_in_flight = in_flight;
        config.direct_return = direct_return;
        // One frame per decode step, so every step's output is counted below.
        config.max_draft = 0;
        let tracker = meshnet_peer::start(config).await.unwrap();
        let first = peer(10, &tracker).await;
        let second = peer(10, &tracker).await;
        wait_for("coverage", &tracker, |s| converged(s, &[&first, &second])).await;
        let base = tracker.openai_base_url().unwrap();
        let model = tracker.model_id().to_owned();
        answers.push(greedy_chat(&base, &model, &prompt, 12, &[], false).await);
        // Every prompt chunk and every decode step came straight back, or none did.
        let returned = direct_returns(&tracker).await;
        if direct_return {
            let chunks = 3; // the prompt's tokens in 128-token chunks
            assert!(returned >= chunks + 11, "{returned} direct returns");
        } else {
            assert_eq!(returned, 0);
        }
        for member in [&first, &second] {
            wait_for("the hops to free the session", member, |s| {
                s.active_sessions == 0
            })
            .await;
        }
        for member in [second, first, tracker] {
            member.shutdown().await;
        }
    }
    assert!(
        answers.windows(2).all(|pair| pair[0] == pair[1]),
        "{answers:?}"
    );
    assert!(!answers[0].0.is_empty());
}

/// `meshnet_direct_returns_total` in `member`'s `/metrics`.
async fn direct_returns(member: &meshnet_peer::RunningPeer) -> u64 {
    metric(member, "meshnet_direct_returns_total").await
}

/// The value of the metric `name` in `member`'s `/metrics`.
async fn metric(member: &meshnet_peer::RunningPeer, name: &str) -> u64 {
    let scrape = reqwest::get(format!("{}/metrics", member.http_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .map(|value| value.parse::<f64>().unwrap() as u64)
        .unwrap_or_else(|| panic!("no {name} in {scrape}"))
}

/// The text and finish reason of a greedy chat whose request sets `max_draft` to 0 (no
/// drafts, whatever the tracker's own draft length).
async fn chat_without_drafts(
    base: &str,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> (String, String) {
    let mut request = greedy_chat_body(model, prompt, max_tokens, &[], false);
    request["max_draft"] = 0.into();
    post_chat(base, &request).await
}

/// Speculative decoding through two peers (drafts verified in one trip, every hop's cache
/// cut back past a rejected draft with the next frame) gives the greedy text of one token
/// per trip, with outputs returning along the route or straight from the last hop; the
/// tracker's `/metrics` count what was drafted and accepted. A request's `max_draft` of 0
/// turns drafting off for that request alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_through_two_peers_gives_the_text_of_one_token_per_trip() {
    let prompt = "Copy this list exactly, one item per line: apples, pears, plums, cherries, \
        grapes, lemons, apples, pears, plums, cherries, grapes, lemons.";
    let mut answers = Vec::new();
    for (max_draft, direct_return) in [(0, true), (8, true), (8, false)] {
        let mut config = common::config(true, 10, vec![]);
        config.max_draft = max_draft;
        // Every draft goes through whatever this machine's passes cost, so that some are
        // rejected and rewound.
        config.gate_drafts = false;
        config.direct_return = direct_return;
        let tracker = meshnet_peer::start(config).await.unwrap();
        let first = peer(10, &tracker).await;
        let second = peer(10, &tracker).await;
        wait_for("coverage", &tracker, |s| converged(s, &[&first, &second])).await;
        let base = tracker.openai_base_url().unwrap();
        let model = tracker.model_id().to_owned();
        if max_draft > 0 && direct_return {
            answers.push(chat_without_drafts(&base, &model, prompt, 40).await);
            let drafted = metric(&tracker, "meshnet_drafted_tokens_total").await;
            assert_eq!(drafted, 0, "a request with max_draft 0 drafted");
        }
        answers.push(greedy_chat(&base, &model, prompt, 40, &[], false).await);
        let drafted = metric(&tracker, "meshnet_drafted_tokens_total").await;
        let accepted = metric(&tracker, "meshnet_accepted_drafts_total").await;
        println!("max draft {max_draft}: drafted {drafted}, accepted {accepted}");
        if max_draft == 0 {
            assert_eq!((drafted, accepted), (0, 0));
        } else {
            assert!(accepted > 10, "drafted {drafted}, accepted {accepted}");
            assert!(accepted < drafted, "no draft was rejected: nothing rewound");
        }
        for member in [&first, &second] {
            wait_for("the hops to free the session", member, |s| {
                s.active_sessions == 0
            })
            .await;
        }
        for member in [second, first, tracker] {
            member.shutdown().await;
        }
    }
    assert!(
        answers.windows(2).all(|pair| pair[0] == pair[1]),
        "{answers:?}"
    );
    assert!(!answers[0].0.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_template_that_raises_is_a_400_with_its_message() {
    let dir = std::env::temp_dir().join(format!("meshnet-mesh-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("no-system.jinja");
    std::fs::write(
        &template,
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}\
         {% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n\
         {% endfor %}<|im_start|>assistant\n",
    )
    .unwrap();
    let mut config = common::config(true, 30, vec![]);
    config.chat_template = Some(template);
    let tracker = meshnet_peer::start(config).await.unwrap();
    wait_for("the tracker's span", &tracker, |s| {
        s.route_boundaries.is_some()
    })
    .await;
    let base = tracker.openai_base_url().unwrap();
    let model = tracker.model_id().to_owned();
    let ask = |messages: serde_json::Value| {
        reqwest::Client::new()
            .post(format!("{base}/chat/completions"))
            .json(&serde_json::json!({"model": model, "messages": messages, "max_tokens": 2}))
            .send()
    };
    let refused = ask(serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]))
    .await
    .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("System role not supported"), "{body}");
    let answered = ask(serde_json::json!([{"role": "user", "content": "Hi"}]))
        .await
        .unwrap();
    assert_eq!(answered.status().as_u16(), 200);
    tracker.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_answers_name_their_route_in_a_header_also_through_another_member() {
    let tracker = tracker(10).await;
    let peer = peer(20, &tracker).await;
    wait_for("coverage", &tracker, |s| converged(s, &[&peer])).await;
    let entry = tracker.current_span().unwrap().target.layers;
    let rest = peer.current_span().unwrap().target.layers;
    assert_eq!((entry.start, entry.end, rest.end), (0, rest.start, 30));
    let expected = format!(
        "{}:{}..{}, {}:{}..{}",
        tracker.peer_id(),
        entry.start,
        entry.end,
        peer.peer_id(),
        rest.start,
        rest.end
    );
    let started = Instant::now();
    while peer.status().tracker_http.is_none() {
        assert!(
            started.elapsed() < common::DEADLINE,
            "the peer never learnt the tracker's URL"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let through_tracker = tracker.openai_base_url().unwrap();
    let through_peer = format!("{}/v1", peer.http_url());
    let model = tracker.model_id().to_owned();
    for base in [&through_tracker, &through_peer] {
        for (path, stream) in [
            ("chat/completions", false),
            ("chat/completions", true),
            ("completions", false),
            ("completions", true),
        ] {
            let body = if path == "completions" {
                serde_json::json!({"model": model, "prompt": "Paris is", "max_tokens": 2, "stream": stream})
            } else {
                serde_json::json!({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                   "max_tokens": 2, "stream": stream})
            };
            let answer = reqwest::Client::new()
                .post(format!("{base}/{path}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let what = format!("{base}/{path}, stream {stream}");
            assert_eq!(answer.status().as_u16(), 200, "{what}");
            let route = answer.headers().get("x-meshnet-route").cloned();
            let text = answer.text().await.unwrap();
            assert_eq!(
                route.as_ref().map(|value| value.to_str().unwrap()),
                Some(expected.as_str()),
                "{what}: {text}"
            );
        }
    }
    // A request refused before a route is chosen names none.
    let refused = reqwest::Client::new()
        .post(format!("{through_peer}/chat/completions"))
        .json(
            &serde_json::json!({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 0}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    assert!(refused.headers().get("x-meshnet-route").is_none());
    peer.shutdown().await;
    tracker.shutdown().await;
}
