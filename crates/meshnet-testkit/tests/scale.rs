//! Many members in one process converge on complete coverage of the real model, and the rest
//! re-cover when ten leave at once. The figures (times, gossip per peer) are printed here and
//! tabulated by `cargo bench -p meshnet-benches --bench mesh_scale`; these tests hold the
//! scenario to generous deadlines.
//!
//! Every member is a whole libp2p node (Noise, Yamux, Kademlia, signed gossip) and every
//! announcement reaches every member, so the work of the mesh grows with the square of the
//! members over the announcement interval, and here one machine's cores carry them all. Forty
//! members with the peers' default 2 s announcements run in the default test run, the peers all
//! on the last layer so that the test can require all of them as its holders. A hundred,
//! also starting at 2 s (the tracker stretches it to 5.5 s at 101 members), take longer: on two
//! cores the test build (dependencies optimised, ours not) converged in 25.5 s and re-covered
//! in 21.6 s. That test is ignored in the default run; `scripts/test.sh` runs it with
//! `cargo test --workspace --test scale -- --ignored`.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use meshnet_peer::tracker::scaled_announce_interval;
use meshnet_testkit::Kit;
use meshnet_testkit::scale::{ANNOUNCE_INTERVAL, ScaleConfig, run};

async fn scenario(announce_interval: Duration, config: ScaleConfig) {
    // RUST_LOG shows the members' logs (e.g. `meshnet_peer::tracker=info` for the tracker's
    // book); without it only errors.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let kit = tokio::task::spawn_blocking(move || Kit::with_default_model(announce_interval))
        .await
        .unwrap()
        .unwrap();
    let report = run(&kit, &config).await.unwrap();
    eprintln!("{}", report.table());
    assert_eq!(report.members, config.peers + 1);
    // Every peer announces at the interval the tracker advertises for the mesh's size.
    assert_eq!(
        report.peer_announce_intervals,
        [scaled_announce_interval(announce_interval, report.members)],
        "{report:?}"
    );
    assert_eq!(report.left, config.leave);
    // The thinnest layer after the tracker's has the holders the peers' budgets give: in
    // ScaleConfig::min_holders_bounds, converged and once `leave` peers are gone.
    let num_layers = kit.model.num_layers();
    let converged = config.min_holders_bounds(num_layers, config.peers);
    assert!(
        converged.contains(&report.min_holders_converged),
        "converged: the thinnest layer's holders should be in {converged:?}: {report:?}"
    );
    let recovered = config.min_holders_bounds(num_layers, config.peers - config.leave);
    assert!(
        recovered.contains(&report.min_holders_recovered),
        "recovered: the thinnest layer's holders should be in {recovered:?}: {report:?}"
    );
    // Every peer announces every interval and hears the others: gossip flows both ways.
    assert!(report.published_bytes_per_peer_s > 0.0, "{report:?}");
    let heard = (config.peers / 2) as f64;
    assert!(
        report.received_bytes_per_peer_s > heard * report.published_bytes_per_peer_s,
        "a peer hears the announcements of the others: {report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_peers_converge_and_re_cover_when_ten_leave_at_once() {
    // The tracker holds every layer of the default model (30) but the last, and every peer's
    // one-layer budget can only hold that one: it has forty holders, then thirty
    // (ScaleConfig::min_holders_bounds). After a tracker of six, forty one-layer peers spread
    // over 24 layers, and the thinnest has one holder, which convergence already checks.
    let config = ScaleConfig {
        peers: 40,
        tracker_layers: 29,
        traffic_window: Duration::from_secs(5),
        ..ScaleConfig::default()
    };
    scenario(Duration::from_secs(2), config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a hundred members take minutes: cargo test -p meshnet-testkit --test scale -- --ignored"]
async fn a_hundred_peers_converge_and_re_cover_when_ten_leave_at_once() {
    // The default scenario: a hundred peers, ten leave, five minutes per phase; members start
    // announcing every MESHNET_SCALE_ANNOUNCE_MS (default 2000, the peers' default).
    // One-layer peers over the 24 layers after the tracker's: the thinnest has at least one
    // holder and at most the even spread, 4 converged and 3 recovered; the planner guarantees
    // no more than one (ScaleConfig::min_holders_bounds).
    let interval = std::env::var("MESHNET_SCALE_ANNOUNCE_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(ANNOUNCE_INTERVAL, Duration::from_millis);
    let config = ScaleConfig {
        deadline: Duration::from_secs(420),
        ..ScaleConfig::default()
    };
    scenario(interval, config).await;
}
