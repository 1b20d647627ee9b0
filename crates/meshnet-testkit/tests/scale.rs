//! Forty members in one process converge on complete coverage of the real model, and the rest
//! re-cover when ten leave at once (taking every holder of some layers with them). The figures
//! (times, gossip per peer) are printed here and tabulated by `cargo bench -p meshnet-benches
//! --bench mesh_scale`; this test holds the scenario to generous deadlines. Forty, not a
//! hundred: a hundred full members (each its own libp2p swarm with Noise, Yamux, Kademlia and
//! signed gossip) need more than the two cores CI has, and then they never settle.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use meshnet_testkit::Kit;
use meshnet_testkit::scale::{ScaleConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_peers_converge_and_re_cover_when_ten_leave_at_once() {
    let kit = tokio::task::spawn_blocking(|| Kit::with_default_model(Duration::from_secs(2)))
        .await
        .unwrap()
        .unwrap();
    let config = ScaleConfig {
        peers: 40,
        traffic_window: Duration::from_secs(5),
        ..ScaleConfig::default()
    };
    let report = run(&kit, &config).await.unwrap();
    eprintln!("{}", report.table());
    assert_eq!(report.members, 41);
    assert_eq!(report.left, 10);
    assert!(report.min_holders_converged >= 1, "{report:?}");
    assert!(report.min_holders_recovered >= 1, "{report:?}");
    // Every peer announces every interval and hears the others: gossip flows both ways.
    assert!(report.published_bytes_per_peer_s > 0.0, "{report:?}");
    assert!(
        report.received_bytes_per_peer_s > 20.0 * report.published_bytes_per_peer_s,
        "a peer hears the announcements of dozens of others: {report:?}"
    );
}
