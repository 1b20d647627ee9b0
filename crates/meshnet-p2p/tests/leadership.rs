#![allow(clippy::unwrap_used)]
//! Who leads is decided by the control plane and reported as `Leadership` events: a member that
//! claims the role hears `Leads`, and a tracker whose mesh elected another (a later term
//! reaching it while it yields, as a restarted tracker does) hears `Follows` with
//! `stepped_down`, before the map that deposed it. Over the in-memory transport; every wait is
//! bounded.

mod common;

use common::{Node, next_event, publish_until};

use std::time::Duration;

use libp2p::identity::Keypair;
use meshnet_p2p::{CoverageMessage, Leadership, P2pConfig, P2pEvent, Role, TransportChoice};
use meshnet_planner::CoverageMap;

const MODEL: &str = "leadership-model";

/// A node over the in-memory transport; a tracker yields to any later term for an hour after
/// its start (as a restarted tracker does while its mesh may have elected another).
async fn start(role: Role, bootstrap: &[&Node]) -> Node {
    let mut config = P2pConfig::new(Keypair::generate_ed25519(), MODEL, role);
    config.transport = TransportChoice::Memory;
    config.listen = vec!["/memory/0".parse().unwrap()];
    config.bootstrap = bootstrap.iter().map(|node| node.address.clone()).collect();
    config.assume_reachable = true;
    config.takeover_silence = Duration::ZERO;
    config.tracker_start_grace = Duration::from_secs(3600);
    Node::spawn(config).await
}

/// An empty coverage map of `term` from `publisher`.
fn map(publisher: &Node, term: u64) -> CoverageMessage {
    CoverageMessage {
        model_id: MODEL.into(),
        term,
        succession: Vec::new(),
        tracker_http: format!("http://{}.invalid:8080", publisher.id),
        epoch: 1,
        sequence: 1,
        num_layers: 30,
        map: CoverageMap::empty(1),
        announce_interval_ms: 2000,
    }
}

#[tokio::test]
async fn a_claim_is_reported_as_leading_and_the_deposed_tracker_steps_down_before_the_map() {
    let mut tracker = start(Role::Tracker, &[]).await;
    let mut claimant = start(
        Role::Peer {
            pinned_tracker: None,
        },
        &[&tracker],
    )
    .await;

    claimant.handle.take_tracker_role(2).await.unwrap();
    let leads = next_event(&mut claimant.events, |event| match event {
        P2pEvent::Leadership(leadership) => Some(leadership),
        _ => None,
    })
    .await;
    assert_eq!(leads, Leadership::Leads { term: 2 });

    let claim = map(&claimant, 2);
    let mut order = Vec::new();
    let delivered = publish_until(
        || claimant.handle.publish_coverage(claim.clone()),
        &mut tracker.events,
        |event| match event {
            P2pEvent::Leadership(leadership) => {
                order.push(leadership);
                None
            }
            P2pEvent::Coverage { from, coverage } if from == claimant.id => Some(coverage),
            _ => None,
        },
    )
    .await;
    assert_eq!(delivered, claim);
    assert_eq!(
        order,
        [Leadership::Follows {
            tracker: claimant.id.clone(),
            term: 2,
            stepped_down: true,
        }],
        "one leadership event, before the map"
    );
    assert_eq!(
        tracker.handle.tracker().await.unwrap(),
        Some(claimant.id.clone())
    );
}
