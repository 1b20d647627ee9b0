#![allow(clippy::unwrap_used)]
//! Members others cannot dial, in one process over the libp2p memory transport: they announce
//! no HTTP endpoint, reserve a slot on the tracker's relay, and activations reach them over
//! libp2p streams (`/p2p/<id>` hops). The chat gives the text a mesh of reachable members
//! gives, and a peer outside the coverage map gets no stream served.

mod common;

use common::{converged, peer, wait_for};
use meshnet_peer::RunningPeer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A greedy chat through the tracker's API; its text.
async fn chat(tracker: &RunningPeer) -> String {
    let body: serde_json::Value = reqwest::Client::new()
        .post(format!(
            "{}/chat/completions",
            tracker.openai_base_url().unwrap()
        ))
        .json(&serde_json::json!({
            "model": tracker.model_id(),
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
            "temperature": 0,
            "max_tokens": 16,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {body}"))
        .to_owned()
}

/// Starts a member that others cannot dial, holding at most `layers` layers.
async fn hidden_peer(layers: u32, via: &RunningPeer) -> RunningPeer {
    let mut config = common::config(false, layers, via.p2p_addrs().await.unwrap());
    config.assume_reachable = false;
    meshnet_peer::start(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_behind_nat_serve_over_libp2p_streams_with_the_text_of_reachable_ones() {
    let reachable_text = {
        let tracker = common::tracker(10).await;
        let first = peer(10, &tracker).await;
        let second = peer(10, &tracker).await;
        wait_for("coverage", &tracker, |s| converged(s, &[&first, &second])).await;
        let text = chat(&tracker).await;
        for member in [second, first, tracker] {
            member.shutdown().await;
        }
        text
    };
    assert!(!reachable_text.is_empty());

    let tracker = common::tracker(10).await;
    let first = hidden_peer(10, &tracker).await;
    let second = hidden_peer(10, &tracker).await;
    for member in [&first, &second] {
        assert_eq!(
            member.announced_http_url(),
            None,
            "announced an HTTP endpoint"
        );
    }
    wait_for("coverage", &tracker, |s| converged(s, &[&first, &second])).await;
    wait_for(
        "both hidden members reachable through the relay",
        &tracker,
        |_| {
            [&first, &second]
                .iter()
                .all(|member| !member.status().network.relayed_addresses.is_empty())
        },
    )
    .await;
    assert_eq!(chat(&tracker).await, reachable_text);

    let status = tracker.status();
    assert_eq!(
        status.network.reachability,
        meshnet_p2p::Reachability::Public
    );
    for hidden in [&first, &second] {
        let report = status
            .peers
            .as_ref()
            .unwrap()
            .iter()
            .find(|report| &report.peer == hidden.peer_id())
            .unwrap();
        assert_eq!(report.http, None);
        assert_eq!(
            report.path,
            meshnet_peer::status::MemberPath::DirectP2p,
            "the hidden member dialed the tracker"
        );
    }
    let first_status = first.status();
    assert_eq!(
        first_status.network.reachability,
        meshnet_p2p::Reachability::Unknown
    );
    assert_eq!(
        first_status.network.paths.get(second.peer_id()).copied(),
        Some(meshnet_peer::status::MemberPath::Relayed),
        "{:?}",
        first_status.network
    );

    // A node of the same model outside the coverage map reaches the hidden member through the
    // relay, but no stream of it is served.
    let (outsider, _events) = common::outsider(&tracker).await;
    let refused_before = first.status().rejected_messages;
    let answer = tokio::time::timeout(common::DEADLINE, async {
        loop {
            // Until the outsider has heard where the hidden member is, opening fails.
            let Ok(mut stream) = outsider.open_http_stream(first.peer_id()).await else {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            let request = "DELETE /sessions/00000000-0000-0000-0000-000000000000 HTTP/1.1\r\n\
                           host: x\r\ncontent-length: 0\r\n\r\n";
            let _ = stream.write_all(request.as_bytes()).await;
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer).await;
            return answer;
        }
    })
    .await
    .expect("the outsider never reached the hidden member");
    assert!(
        answer.is_empty(),
        "an outsider was answered: {}",
        String::from_utf8_lossy(&answer)
    );
    wait_for("the refusal to be counted", &first, |s| {
        s.rejected_messages > refused_before
            && s.recent_rejections
                .iter()
                .any(|r| r.topic == "activation-stream")
    })
    .await;

    outsider.shutdown().await;
    for member in [second, first, tracker] {
        member.shutdown().await;
    }
}
