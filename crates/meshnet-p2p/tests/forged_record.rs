#![allow(clippy::unwrap_used)]
//! A member that is not the tracker stores a tracker record naming itself (at a higher term
//! than the tracker's, or at the tracker's own term) and publishes coverage maps of that term.
//! These tests pin what each kind of member does about it, event by event, over the in-memory
//! transport. Every wait is bounded by [`DEADLINE`]; messages are re-published until the
//! expected event arrives.
//!
//! The DHT keeps one record per key in each node's store and takes whichever copy arrives
//! last, whoever published it; records carry no signature. So the tests never rely on which
//! copy a lookup meets, except that a node's first lookup asks only its bootstrap node.
//!
//! Observers judge takeover claims at once (no takeover silence), so a refused claim is always
//! reported as rejected; with a silence it is first ignored (neither delivered nor reported)
//! while the tracker is heard. The tracker yields to no claim after its start (no grace).

mod common;

use common::{DEADLINE, Node, next_event, publish_until};

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use libp2p::identity::Keypair;
use meshnet_p2p::{
    CoverageMessage, Leadership, P2pConfig, P2pEvent, Role, TopicKind, TrackerRecord,
    TransportChoice, topic_name,
};
use meshnet_planner::{CoverageMap, SpanHolding};
use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState, claim_beats};
use tokio::sync::watch;
use tokio::time::timeout;
use tracing::dispatcher::DefaultGuard;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::util::SubscriberInitExt as _;

const MODEL: &str = "forged-record-model";

/// The term of the genuine tracker's maps and record.
const TRACKER_TERM: u64 = 1;

/// The term of the forger's record and maps in the higher-term variants.
const HIGHER_TERM: u64 = 99;

/// The topic label of tracker-record rejections.
const RECORD_TOPIC: &str = "tracker-record";

/// A node over the in-memory transport, bootstrapped from `bootstrap`. Records change only when
/// a test stores one (no republication during a test), lookups repeat every 200 ms, claims are
/// judged at once and a tracker has no start grace.
async fn start(role: Role, bootstrap: &[&Node]) -> Node {
    start_as(Keypair::generate_ed25519(), role, bootstrap).await
}

async fn start_as(keypair: Keypair, role: Role, bootstrap: &[&Node]) -> Node {
    let mut config = P2pConfig::new(keypair, MODEL, role);
    config.transport = TransportChoice::Memory;
    config.listen = vec!["/memory/0".parse().unwrap()];
    config.bootstrap = bootstrap.iter().map(|node| node.address.clone()).collect();
    config.assume_reachable = true;
    config.tracker_lookup_interval = Duration::from_millis(200);
    config.tracker_refresh_interval = Duration::from_millis(200);
    config.record_republish_interval = Duration::from_secs(3600);
    config.takeover_silence = Duration::ZERO;
    config.tracker_start_grace = Duration::ZERO;
    Node::spawn(config).await
}

/// The tracker, its record (epoch 1) stored in the DHT.
async fn start_tracker_with_record() -> Node {
    let tracker = start(Role::Tracker, &[]).await;
    tracker
        .handle
        .set_tracker_record(genuine_record(&tracker, 1))
        .await
        .unwrap();
    tracker
}

/// The forger: a member pinned to itself, so it takes no other tracker's maps or term (and
/// never finds its own record stale), that stores a record naming itself at `term`.
async fn start_forger(term: u64, bootstrap: &[&Node]) -> Node {
    let keypair = Keypair::generate_ed25519();
    let itself = meshnet_p2p::mesh_peer_id(&keypair.public().to_peer_id());
    let forger = start_as(
        keypair,
        Role::Peer {
            pinned_tracker: Some(itself),
        },
        bootstrap,
    )
    .await;
    forger
        .handle
        .set_tracker_record(forged_record(&forger, term))
        .await
        .unwrap();
    forger
}

/// Collects the debug log of this crate from every node of a test: they all run on the test's
/// thread, where the collector is the default for as long as the guard lives.
struct DebugLog {
    text: watch::Receiver<String>,
    _guard: DefaultGuard,
}

/// Appends what it is given to the log text.
#[derive(Clone)]
struct LogSink(Arc<watch::Sender<String>>);

impl Write for LogSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(bytes);
        self.0.send_modify(|log| log.push_str(&text));
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl DebugLog {
    fn capture() -> Self {
        let (sender, text) = watch::channel(String::new());
        let sink = LogSink(Arc::new(sender));
        let guard = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::new("meshnet_p2p=debug"))
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish()
            .set_default();
        DebugLog {
            text,
            _guard: guard,
        }
    }

    /// Waits until a line contains `needle`.
    async fn logged(&mut self, needle: &str) {
        timeout(DEADLINE, self.text.wait_for(|text| text.contains(needle)))
            .await
            .unwrap_or_else(|_| panic!("{needle:?} was not logged before the deadline"))
            .unwrap();
    }
}

fn unpinned() -> Role {
    Role::Peer {
        pinned_tracker: None,
    }
}

/// The record the tracker stores: itself, at its term (its addresses are filled in).
fn genuine_record(tracker: &Node, epoch: u64) -> TrackerRecord {
    TrackerRecord {
        peer: tracker.id.clone(),
        addresses: Vec::new(),
        http_endpoint: "http://tracker.invalid:8080".into(),
        epoch,
        term: TRACKER_TERM,
        model_id: MODEL.into(),
    }
}

/// The record the forger stores under the tracker key: itself, at `term`.
fn forged_record(forger: &Node, term: u64) -> TrackerRecord {
    TrackerRecord {
        peer: forger.id.clone(),
        addresses: Vec::new(),
        http_endpoint: "http://forger.invalid:8080".into(),
        epoch: 7,
        term,
        model_id: MODEL.into(),
    }
}

/// A coverage map of `term` and `epoch` published by `publisher`, which holds every layer.
fn map(publisher: &Node, term: u64, epoch: u64) -> CoverageMessage {
    CoverageMessage {
        model_id: MODEL.into(),
        term,
        succession: Vec::new(),
        tracker_http: format!("http://{}.invalid:8080", publisher.id),
        epoch,
        sequence: epoch,
        num_layers: 30,
        map: CoverageMap {
            epoch,
            holdings: vec![SpanHolding {
                peer: publisher.id.clone(),
                layers: LayerSpan::new(0, 30),
                quantization: Quantization::Q8_0,
                state: SpanState::Ready,
            }],
        },
        announce_interval_ms: 2000,
    }
}

/// Why a member that follows `follows` at `current_term` refuses a record naming `named` at a
/// later `term`.
fn record_refusal(named: &PeerId, term: u64, follows: &PeerId, current_term: u64) -> String {
    format!(
        "a tracker record names {named} with term {term}, but this member follows {follows} \
         (term {current_term}); only signed coverage maps change the tracker"
    )
}

/// Why a member that follows `current` at `current_term` (with a succession list naming
/// nobody) refuses a map of `term` from `claimant`: the claim does not beat the current one,
/// or it does but the claimant is not on the list.
fn claim_refusal(claimant: &PeerId, term: u64, current: &PeerId, current_term: u64) -> String {
    if claim_beats(claimant, term, current, current_term) {
        format!(
            "{claimant} claims tracker term {term}, but tracker {current} did not name it in its \
             succession list"
        )
    } else {
        format!(
            "sent by {claimant}, which is not the tracker {current} (its term {term} does not \
             beat the current term {current_term})"
        )
    }
}

/// Events about connections and listeners, which every phase may see.
fn is_background(event: &P2pEvent) -> bool {
    matches!(
        event,
        P2pEvent::ListeningOn(_)
            | P2pEvent::PeerConnected(_)
            | P2pEvent::PeerDisconnected(_)
            | P2pEvent::Reachability { .. }
    )
}

/// Fails the test on an event the phase does not allow.
fn unexpected<T>(event: P2pEvent) -> Option<T> {
    assert!(is_background(&event), "unexpected event: {event:?}");
    None
}

/// Whether `event` rejects a tracker record naming `named` for `expected_reason`.
fn is_record_refusal(event: &P2pEvent, named: &PeerId, expected_reason: &str) -> bool {
    matches!(
        event,
        P2pEvent::Rejected { from, topic, reason }
            if topic == RECORD_TOPIC && from == named && reason == expected_reason
    )
}

/// Whether `event` rejects a coverage map from `sender` for `expected_reason`.
fn is_map_refusal(event: &P2pEvent, sender: &PeerId, expected_reason: &str) -> bool {
    matches!(
        event,
        P2pEvent::Rejected { from, topic, reason }
            if *topic == topic_name(MODEL, TopicKind::Coverage)
                && from == sender
                && reason == expected_reason
    )
}

/// Whether `event` delivers a coverage map from `sender` of `epoch` at most.
fn is_map_from(event: &P2pEvent, sender: &PeerId, up_to_epoch: u64) -> bool {
    matches!(
        event,
        P2pEvent::Coverage { from, coverage } if from == sender && coverage.epoch <= up_to_epoch
    )
}

/// The leadership event of a member that starts following `tracker` of `term` (it never led).
fn follows(tracker: &Node, term: u64) -> P2pEvent {
    P2pEvent::Leadership(Leadership::Follows {
        tracker: tracker.id.clone(),
        term,
        stepped_down: false,
    })
}

/// Waits for `node`'s first tracker record, checks it is `expected` (with the publisher's
/// addresses filled in) and that `node` now follows the peer it names.
async fn first_record_is(node: &mut Node, expected: &TrackerRecord) {
    let found = next_event(&mut node.events, |event| match event {
        P2pEvent::TrackerDiscovered(record) => Some(record),
        other => unexpected(other),
    })
    .await;
    assert!(!found.addresses.is_empty(), "the publisher fills them in");
    assert_eq!(
        found,
        TrackerRecord {
            addresses: found.addresses.clone(),
            ..expected.clone()
        }
    );
    assert_eq!(
        node.handle.tracker().await.unwrap(),
        Some(expected.peer.clone())
    );
}

/// (a) A member that follows the tracker's maps, when another member stores a record naming
/// itself at `forged_term` and publishes maps of that term: its `tracker()` stays the tracker,
/// it reports the record as rejected when its term is higher than the tracker's (at the same
/// term the record is stale to it: ignored, only logged), it rejects the forger's map and
/// delivers the tracker's next one, and it reports no tracker discovery.
async fn a_follower_keeps_its_tracker(forged_term: u64) {
    let mut log = DebugLog::capture();
    let tracker = start_tracker_with_record().await;
    let mut follower = start(unpinned(), &[&tracker]).await;
    first_record_is(&mut follower, &genuine_record(&tracker, 1)).await;
    let first = map(&tracker, TRACKER_TERM, 1);
    let delivered = publish_until(
        || tracker.handle.publish_coverage(first.clone()),
        &mut follower.events,
        |event| match event {
            P2pEvent::Coverage { from, coverage } if from == tracker.id => Some(coverage),
            other => unexpected(other),
        },
    )
    .await;
    assert_eq!(delivered, first);

    let forger = start_forger(forged_term, &[&tracker, &follower]).await;
    let forged_record_refused = record_refusal(&forger.id, forged_term, &tracker.id, TRACKER_TERM);
    let record_is_reported = forged_term > TRACKER_TERM;
    if record_is_reported {
        next_event(&mut follower.events, |event| {
            if is_record_refusal(&event, &forger.id, &forged_record_refused) {
                return Some(());
            }
            if is_map_from(&event, &tracker.id, 1) {
                return None;
            }
            unexpected(event)
        })
        .await;
    } else {
        // Only the follower looks records up and knows a term of its own: the tracker never
        // looks, and the forger follows itself at term 0.
        log.logged(&format!(
            "stale tracker record ignored record={} term={forged_term}",
            forger.id
        ))
        .await;
    }
    // Allowed from here on: further refusals of the record (when reported at all) and late
    // copies of the tracker's maps; never a map from the forger or a tracker discovery.
    let background = |event: &P2pEvent, epoch: u64| {
        (record_is_reported && is_record_refusal(event, &forger.id, &forged_record_refused))
            || is_map_from(event, &tracker.id, epoch)
    };

    forgers_map_refused_and_trackers_delivered(
        &mut follower,
        &tracker,
        &forger,
        forged_term,
        background,
    )
    .await;
}

/// The forger publishes a map of `forged_term` until `member` refuses it as a claim, then the
/// tracker publishes its next map (epoch 2) until `member` delivers it; `member` still follows
/// the tracker. Events for which `background` (given the tracker's last epoch) holds may come
/// in between; any other fails the test.
async fn forgers_map_refused_and_trackers_delivered(
    member: &mut Node,
    tracker: &Node,
    forger: &Node,
    forged_term: u64,
    background: impl Fn(&P2pEvent, u64) -> bool,
) {
    let forged_map_refused = claim_refusal(&forger.id, forged_term, &tracker.id, TRACKER_TERM);
    let forged_map = map(forger, forged_term, 666);
    publish_until(
        || forger.handle.publish_coverage(forged_map.clone()),
        &mut member.events,
        |event| {
            if is_map_refusal(&event, &forger.id, &forged_map_refused) {
                return Some(());
            }
            if background(&event, 1) {
                return None;
            }
            unexpected(event)
        },
    )
    .await;

    let next = map(tracker, TRACKER_TERM, 2);
    let delivered = publish_until(
        || tracker.handle.publish_coverage(next.clone()),
        &mut member.events,
        |event| match event {
            P2pEvent::Coverage { from, coverage } if from == tracker.id && coverage.epoch == 2 => {
                Some(coverage)
            }
            event if is_map_refusal(&event, &forger.id, &forged_map_refused) => None,
            event if background(&event, 1) => None,
            other => unexpected(other),
        },
    )
    .await;
    assert_eq!(delivered, next);
    assert_eq!(
        member.handle.tracker().await.unwrap(),
        Some(tracker.id.clone())
    );
}

/// (a) with a record of a higher term than the tracker's.
#[tokio::test]
async fn a_follower_keeps_its_tracker_despite_a_forged_record_of_a_higher_term() {
    a_follower_keeps_its_tracker(HIGHER_TERM).await;
}

/// (a) with a record of the tracker's own term.
#[tokio::test]
async fn a_follower_keeps_its_tracker_despite_a_forged_record_of_the_same_term() {
    a_follower_keeps_its_tracker(TRACKER_TERM).await;
}

/// (b) A newcomer whose only contact is the forger, which stored a record naming itself at
/// `forged_term`. It follows the forged record (its first lookup meets only the forger's copy)
/// and, holding no map yet, rejects the tracker's genuine record (a record never moves a
/// member from the tracker it follows, and one known by record only is at term 0). The
/// tracker's first map takes it over; from then on it rejects the forger's maps and delivers
/// the tracker's.
async fn a_newcomer_handed_a_forged_record_settles_on_the_tracker(forged_term: u64) {
    let tracker = start_tracker_with_record().await;
    let forger = start_forger(forged_term, &[&tracker]).await;
    let mut newcomer = start(unpinned(), &[&forger]).await;
    first_record_is(&mut newcomer, &forged_record(&forger, forged_term)).await;

    // The tracker stores its record again, as it does every republish interval: the newcomer's
    // next lookups meet it, and refuse it.
    tracker
        .handle
        .set_tracker_record(genuine_record(&tracker, 2))
        .await
        .unwrap();
    let genuine_refused = record_refusal(&tracker.id, TRACKER_TERM, &forger.id, 0);
    next_event(&mut newcomer.events, |event| {
        is_record_refusal(&event, &tracker.id, &genuine_refused)
            .then_some(())
            .or_else(|| unexpected(event))
    })
    .await;
    assert_eq!(
        newcomer.handle.tracker().await.unwrap(),
        Some(forger.id.clone())
    );

    // The first map moves it from the forger to the tracker: one leadership event, then the map.
    let first = map(&tracker, TRACKER_TERM, 1);
    let mut switched = 0;
    let delivered = publish_until(
        || tracker.handle.publish_coverage(first.clone()),
        &mut newcomer.events,
        |event| match event {
            event if event == follows(&tracker, TRACKER_TERM) => {
                switched += 1;
                None
            }
            P2pEvent::Coverage { from, coverage } if from == tracker.id => Some(coverage),
            event if is_record_refusal(&event, &tracker.id, &genuine_refused) => None,
            other => unexpected(other),
        },
    )
    .await;
    assert_eq!(delivered, first);
    assert_eq!(switched, 1, "one leadership event before the map");
    assert_eq!(
        newcomer.handle.tracker().await.unwrap(),
        Some(tracker.id.clone())
    );

    // Allowed from here on: the genuine record, now followed; refusals of the forged one
    // (silent at the tracker's term, where it is stale); late copies of the tracker's maps.
    let forged_record_refused = record_refusal(&forger.id, forged_term, &tracker.id, TRACKER_TERM);
    let background = |event: &P2pEvent, epoch: u64| match event {
        P2pEvent::TrackerDiscovered(record) => record.peer == tracker.id,
        event => {
            (forged_term > TRACKER_TERM
                && is_record_refusal(event, &forger.id, &forged_record_refused))
                || is_map_from(event, &tracker.id, epoch)
        }
    };
    forgers_map_refused_and_trackers_delivered(
        &mut newcomer,
        &tracker,
        &forger,
        forged_term,
        background,
    )
    .await;
}

/// (b) with a record of a higher term than the tracker's.
#[tokio::test]
async fn a_newcomer_handed_a_forged_record_of_a_higher_term_settles_on_the_tracker() {
    a_newcomer_handed_a_forged_record_settles_on_the_tracker(HIGHER_TERM).await;
}

/// (b) with a record of the tracker's own term.
#[tokio::test]
async fn a_newcomer_handed_a_forged_record_of_the_same_term_settles_on_the_tracker() {
    a_newcomer_handed_a_forged_record_settles_on_the_tracker(TRACKER_TERM).await;
}

/// The limit of an unpinned member: before its first map, any signed map whose claim beats
/// term 0 settles its tracker. When the forger's map of `forged_term` comes before any of the
/// tracker's, a newcomer that found the forged record and one that found the genuine record
/// alike deliver it, follow the forger, and reject the tracker's maps from then on; the record
/// makes no difference. A peer pinned to the tracker rejects the forger's map and delivers the
/// tracker's.
async fn the_first_map_decides_for_an_unpinned_newcomer(forged_term: u64) {
    let tracker = start_tracker_with_record().await;
    let mut told_truth = start(unpinned(), &[&tracker]).await;
    first_record_is(&mut told_truth, &genuine_record(&tracker, 1)).await;
    let mut pinned = start(
        Role::Peer {
            pinned_tracker: Some(tracker.id.clone()),
        },
        &[&tracker],
    )
    .await;
    let forger = start_forger(forged_term, &[&tracker, &told_truth, &pinned]).await;
    let mut told_lie = start(unpinned(), &[&forger]).await;
    first_record_is(&mut told_lie, &forged_record(&forger, forged_term)).await;

    // Before a map, records naming the other candidate are refused; afterwards, the record
    // naming the forger is followed again and the tracker's is stale.
    let refused_records = |event: &P2pEvent| match event {
        P2pEvent::Rejected { topic, .. } if topic == RECORD_TOPIC => true,
        P2pEvent::TrackerDiscovered(record) => record.peer == forger.id,
        _ => false,
    };
    let forged_map = map(&forger, forged_term, 666);
    // The one told the truth follows the tracker by record and switches to the forger (a
    // leadership event before the map); the one told the lie follows the forger already.
    for (newcomer, switches) in [(&mut told_lie, 0), (&mut told_truth, 1)] {
        let mut switched = 0;
        let delivered = publish_until(
            || forger.handle.publish_coverage(forged_map.clone()),
            &mut newcomer.events,
            |event| match event {
                event if event == follows(&forger, forged_term) => {
                    switched += 1;
                    None
                }
                P2pEvent::Coverage { from, coverage } if from == forger.id => Some(coverage),
                event if refused_records(&event) => None,
                other => unexpected(other),
            },
        )
        .await;
        assert_eq!(delivered, forged_map);
        assert_eq!(
            switched, switches,
            "leadership events before the forger's map"
        );
    }
    let refused_by_pinned = claim_refusal(&forger.id, forged_term, &tracker.id, 0);
    publish_until(
        || forger.handle.publish_coverage(forged_map.clone()),
        &mut pinned.events,
        |event| match event {
            event if is_map_refusal(&event, &forger.id, &refused_by_pinned) => Some(()),
            P2pEvent::TrackerDiscovered(record) if record.peer == tracker.id => None,
            P2pEvent::Rejected { topic, from, .. }
                if topic == RECORD_TOPIC && from == forger.id =>
            {
                None
            }
            other => unexpected(other),
        },
    )
    .await;

    let genuine_map = map(&tracker, TRACKER_TERM, 1);
    let refused_by_captured = claim_refusal(&tracker.id, TRACKER_TERM, &forger.id, forged_term);
    for newcomer in [&mut told_lie, &mut told_truth] {
        publish_until(
            || tracker.handle.publish_coverage(genuine_map.clone()),
            &mut newcomer.events,
            |event| match event {
                event if is_map_refusal(&event, &tracker.id, &refused_by_captured) => Some(()),
                event if refused_records(&event) || is_map_from(&event, &forger.id, 666) => None,
                other => unexpected(other),
            },
        )
        .await;
        assert_eq!(
            newcomer.handle.tracker().await.unwrap(),
            Some(forger.id.clone())
        );
    }
    let delivered = publish_until(
        || tracker.handle.publish_coverage(genuine_map.clone()),
        &mut pinned.events,
        |event| match event {
            P2pEvent::Coverage { from, coverage } if from == tracker.id => Some(coverage),
            event if is_map_refusal(&event, &forger.id, &refused_by_pinned) => None,
            P2pEvent::TrackerDiscovered(record) if record.peer == tracker.id => None,
            P2pEvent::Rejected { topic, from, .. }
                if topic == RECORD_TOPIC && from == forger.id =>
            {
                None
            }
            other => unexpected(other),
        },
    )
    .await;
    assert_eq!(delivered, genuine_map);
    assert_eq!(
        pinned.handle.tracker().await.unwrap(),
        Some(tracker.id.clone())
    );
}

/// The first map decides, with a forged term higher than the tracker's.
#[tokio::test]
async fn the_forgers_map_of_a_higher_term_heard_first_captures_unpinned_newcomers() {
    the_first_map_decides_for_an_unpinned_newcomer(HIGHER_TERM).await;
}

/// The first map decides, with a forged term equal to the tracker's.
#[tokio::test]
async fn the_forgers_map_of_the_same_term_heard_first_captures_unpinned_newcomers() {
    the_first_map_decides_for_an_unpinned_newcomer(TRACKER_TERM).await;
}
