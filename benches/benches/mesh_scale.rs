//! Many members in one process (the real runtime, tracker and planner on the libp2p memory
//! transport, the default model): time to converge on complete coverage, gossip per peer per
//! second once converged, and time to re-cover after ten random peers stop at once. Prints a
//! markdown table. The test `meshnet-testkit/tests/scale.rs` runs the same scenario with
//! deadlines.
//!
//! `MESHNET_SCALE_PEERS` (default 100), `MESHNET_SCALE_LEAVE` (10), `MESHNET_SCALE_ANNOUNCE_MS`
//! (the interval members start at, default 2000; the tracker stretches it in a large mesh),
//! `MESHNET_SCALE_SEED` (1). Needs the default model
//! (`scripts/fetch-model.sh`). Run with `cargo bench -p meshnet-benches --bench mesh_scale`.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use meshnet_testkit::Kit;
use meshnet_testkit::scale::{ANNOUNCE_INTERVAL, ScaleConfig, run};

fn setting(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(value) => value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a whole number, got {value:?}")),
        Err(_) => default,
    }
}

fn main() {
    // `cargo bench` passes --bench; nothing else is expected.
    let announce = Duration::from_millis(setting(
        "MESHNET_SCALE_ANNOUNCE_MS",
        ANNOUNCE_INTERVAL.as_millis() as u64,
    ));
    let defaults = ScaleConfig::default();
    let config = ScaleConfig {
        peers: setting("MESHNET_SCALE_PEERS", defaults.peers as u64) as usize,
        leave: setting("MESHNET_SCALE_LEAVE", defaults.leave as u64) as usize,
        seed: setting("MESHNET_SCALE_SEED", defaults.seed),
        ..defaults
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let report = runtime.block_on(async {
        let kit = tokio::task::spawn_blocking(move || Kit::with_default_model(announce))
            .await
            .unwrap()
            .expect("the default model (bash scripts/fetch-model.sh)");
        run(&kit, &config).await.expect("the scenario")
    });
    println!(
        "mesh_scale: {} peers of {} layer(s) after a tracker of {}, announcements every {} ms, \
         seed {}",
        config.peers,
        config.peer_layers,
        config.tracker_layers,
        announce.as_millis(),
        config.seed
    );
    println!("{}", report.table());
}
