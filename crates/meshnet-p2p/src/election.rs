//! Who the tracker is, as pure state: the tracker this node follows (or is), its term and
//! succession list, when its last coverage map came, and what a Kademlia tracker record may
//! change. The event loop feeds it what arrives (times passed in) and carries out the
//! decisions it returns on the swarm.
//!
//! Records are unsigned: they help a member find a tracker, never move it from the one it
//! follows (only that tracker's signed coverage maps and a listed successor's do), and never
//! set a term.

use std::time::{Duration, Instant};

use libp2p::{Multiaddr, PeerId};

use crate::ids::libp2p_peer_id;
use crate::messages::TrackerRecord;
use crate::validation::PublishRules;

/// The label under which refused tracker records are counted and reported.
pub(crate) const TRACKER_RECORD_TOPIC: &str = "tracker-record";

/// What to do with a tracker record found in the DHT.
#[derive(Debug, PartialEq)]
pub(crate) enum RecordDecision {
    /// It is for another model (named here): ignore it.
    OtherModel(String),
    /// It names no valid peer id: ignore it.
    InvalidPeer {
        /// The peer id as written in the record.
        peer: String,
        /// Why it does not parse.
        error: String,
    },
    /// It names a tracker this node must not follow: count and report it.
    Rejected {
        /// The tracker the record names.
        peer: PeerId,
        /// The stable code it is counted under.
        code: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// The record already followed, or an older copy of it left elsewhere in the DHT.
    AlreadyKnown,
    /// A copy of `term` left behind by an earlier tracker `peer`: ignore it.
    Stale {
        /// The tracker the record names.
        peer: PeerId,
        /// The term it names.
        term: u64,
    },
    /// `peer` is the tracker now: dial it at `addresses` unless connected, and report
    /// `record` to the application.
    Follow {
        /// The tracker.
        peer: PeerId,
        /// The addresses of the record that parse.
        addresses: Vec<Multiaddr>,
        /// Whether this node followed another tracker (or none) before.
        newly_discovered: bool,
        /// The record.
        record: TrackerRecord,
    },
}

/// What an accepted coverage map changed.
#[derive(Debug, PartialEq)]
pub(crate) enum Following {
    /// It came from the tracker already followed.
    Same,
    /// It came from a new tracker, followed from now on.
    NewTracker {
        /// The tracker followed before.
        previous: Option<PeerId>,
        /// Whether this node was the tracker and steps down.
        stepped_down: bool,
    },
}

/// The tracker this node follows or is, and what authorises a change of tracker.
pub(crate) struct TrackerElection {
    /// This node.
    local_peer: PeerId,
    /// Whether this node is the tracker now.
    is_tracker: bool,
    /// The current tracker's term (0 before one is known).
    term: u64,
    /// Who may take over from the tracker: the list of the tracker this node follows, or its
    /// own while it is the tracker (empty before the first map, and on a pinned peer).
    succession: Vec<PeerId>,
    /// When the last coverage map of the followed tracker arrived.
    heard_tracker_at: Option<Instant>,
    /// A follower accepts a takeover only after this long without its tracker's maps.
    takeover_silence: Duration,
    /// Until when a node started as tracker yields to a later term from anyone.
    start_grace_until: Option<Instant>,
    /// Whether this node ever followed a tracker other than itself.
    followed_another: bool,
    /// The only tracker a peer accepts, when pinned.
    pinned_tracker: Option<PeerId>,
    /// The tracker whose coverage and directives are accepted.
    tracker: Option<PeerId>,
    /// The last tracker record reported to the application.
    discovered_record: Option<TrackerRecord>,
    /// The record this node (as tracker) keeps in the DHT.
    own_record: Option<TrackerRecord>,
}

impl TrackerElection {
    /// A node started as the tracker (term 1), yielding to any later claim until
    /// `start_grace_until`.
    pub(crate) fn started_as_tracker(
        local_peer: PeerId,
        takeover_silence: Duration,
        start_grace_until: Instant,
    ) -> Self {
        Self {
            is_tracker: true,
            term: 1,
            tracker: Some(local_peer),
            start_grace_until: Some(start_grace_until),
            ..Self::started_as_peer(local_peer, None, takeover_silence)
        }
    }

    /// A peer, following `pinned_tracker` only when pinned, else whoever it discovers.
    pub(crate) fn started_as_peer(
        local_peer: PeerId,
        pinned_tracker: Option<PeerId>,
        takeover_silence: Duration,
    ) -> Self {
        Self {
            local_peer,
            is_tracker: false,
            term: 0,
            succession: Vec::new(),
            heard_tracker_at: None,
            takeover_silence,
            start_grace_until: None,
            followed_another: false,
            pinned_tracker,
            tracker: pinned_tracker,
            discovered_record: None,
            own_record: None,
        }
    }

    /// Whether this node is the tracker now.
    pub(crate) fn is_tracker(&self) -> bool {
        self.is_tracker
    }

    /// The tracker whose coverage maps and directives are accepted.
    pub(crate) fn tracker(&self) -> Option<PeerId> {
        self.tracker
    }

    /// The record this node, as tracker, keeps in the DHT.
    pub(crate) fn own_record(&self) -> Option<&TrackerRecord> {
        self.own_record.as_ref()
    }

    /// Keeps `record` as the one this node stores (and re-stores) in the DHT.
    pub(crate) fn set_own_record(&mut self, record: TrackerRecord) {
        self.own_record = Some(record);
    }

    /// Whether this node has its tracker: it found the record, or it hears the tracker's
    /// coverage maps. Until then it looks the record up every few seconds (and whenever a new
    /// DHT neighbour appears); after, only to refresh it, so a hundred members do not keep
    /// the DHT busy with queries whose answer they have.
    pub(crate) fn reaches_tracker(&self) -> bool {
        self.discovered_record.is_some() || self.heard_tracker_at.is_some()
    }

    /// Makes this node the tracker of `term` (a takeover after the tracker went silent).
    pub(crate) fn take_role(&mut self, term: u64) {
        self.is_tracker = true;
        self.tracker = Some(self.local_peer);
        self.term = term;
    }

    /// This node, if it is the tracker, publishes a coverage map of `term` naming
    /// `succession`: who may take over from it is that list.
    pub(crate) fn on_own_coverage(&mut self, term: u64, succession: &[meshnet_types::PeerId]) {
        if !self.is_tracker {
            return;
        }
        self.succession = parse_succession(succession);
        self.term = self.term.max(term);
    }

    /// What this node knows at `now` when it judges a tracker message for `model_id`.
    pub(crate) fn publish_rules<'a>(&'a self, model_id: &'a str, now: Instant) -> PublishRules<'a> {
        let judged_without_list =
            self.yields_to_any_claim(now) || self.knows_tracker_by_record_only();
        PublishRules {
            model_id,
            local_peer: self.local_peer,
            tracker: self.tracker,
            term: self.term,
            succession: (!judged_without_list).then_some(self.succession.as_slice()),
            tracker_silent: self.is_tracker
                || self
                    .heard_tracker_at
                    .is_none_or(|at| now.saturating_duration_since(at) >= self.takeover_silence),
        }
    }

    /// Whether this unpinned peer knows its tracker only from a Kademlia record and has
    /// accepted no coverage map yet. Records are unsigned and anyone can store one, so a
    /// record names whom to dial, not whom to trust: until a first signed map settles the
    /// tracker (and its succession list), a map from another claimant of a later term is
    /// judged without a list, or a forged record would strand the newcomer.
    fn knows_tracker_by_record_only(&self) -> bool {
        !self.is_tracker && self.pinned_tracker.is_none() && self.heard_tracker_at.is_none()
    }

    /// Whether this node was started as tracker moments ago (before `now`) and has followed
    /// nobody: it may be a restarted tracker whose mesh has elected a successor, so a later
    /// term wins whoever claims it.
    fn yields_to_any_claim(&self, now: Instant) -> bool {
        self.is_tracker
            && !self.followed_another
            && self.start_grace_until.is_some_and(|until| now < until)
    }

    /// Records a coverage map of `term` from `tracker`, naming `succession`, accepted at
    /// `now`: a new tracker (a takeover this node accepted) is followed from now on, and a node
    /// that was the tracker steps down. The term never goes back.
    pub(crate) fn on_coverage(
        &mut self,
        tracker: PeerId,
        term: u64,
        succession: &[meshnet_types::PeerId],
        now: Instant,
    ) -> Following {
        let following = if self.tracker == Some(tracker) {
            Following::Same
        } else {
            let previous = self.tracker;
            let stepped_down = self.is_tracker;
            if stepped_down {
                self.is_tracker = false;
                self.own_record = None;
            }
            self.tracker = Some(tracker);
            self.discovered_record = None;
            self.followed_another = true;
            Following::NewTracker {
                previous,
                stepped_down,
            }
        };
        self.heard_tracker_at = Some(now);
        self.term = self.term.max(term);
        self.succession = if self.pinned_tracker.is_some() {
            Vec::new()
        } else {
            parse_succession(succession)
        };
        following
    }

    /// Judges a tracker `record` found in the DHT by a node running `model_id`; when it is
    /// followed, it is the discovered record from now on.
    pub(crate) fn on_tracker_record(
        &mut self,
        model_id: &str,
        record: TrackerRecord,
    ) -> RecordDecision {
        if record.model_id != model_id {
            return RecordDecision::OtherModel(record.model_id);
        }
        let peer: PeerId = match record.peer.as_str().parse() {
            Ok(peer) => peer,
            Err(error) => {
                return RecordDecision::InvalidPeer {
                    peer: record.peer.to_string(),
                    error: error.to_string(),
                };
            }
        };
        if let Some(refusal) = self.refusal(peer, &record) {
            return refusal;
        }
        let addresses = record
            .addresses
            .iter()
            .filter_map(|address| address.parse().ok())
            .collect();
        let newly_discovered = self.tracker != Some(peer);
        self.tracker = Some(peer);
        self.discovered_record = Some(record.clone());
        RecordDecision::Follow {
            peer,
            addresses,
            newly_discovered,
            record,
        }
    }

    /// Why a valid `record` naming `peer` is not followed, if it is not.
    fn refusal(&self, peer: PeerId, record: &TrackerRecord) -> Option<RecordDecision> {
        if let Some(pinned) = self.pinned_tracker
            && pinned != peer
        {
            return Some(RecordDecision::Rejected {
                peer,
                code: "not_pinned_tracker",
                reason: format!(
                    "a tracker record names {peer}, but this member is pinned to tracker {pinned}"
                ),
            });
        }
        if let Some(previous) = &self.discovered_record
            && (previous == record
                || (previous.peer == record.peer && record.epoch < previous.epoch))
        {
            // Stale copies elsewhere in the DHT must not roll the record back.
            return Some(RecordDecision::AlreadyKnown);
        }
        let current = self.tracker.filter(|current| *current != peer)?;
        if record.term > self.term {
            return Some(RecordDecision::Rejected {
                peer,
                code: "not_followed_tracker",
                reason: format!(
                    "a tracker record names {peer} with term {}, but this member follows \
                     {current} (term {}); only signed coverage maps change the tracker",
                    record.term, self.term
                ),
            });
        }
        Some(RecordDecision::Stale {
            peer,
            term: record.term,
        })
    }
}

/// The libp2p ids of a succession list (ids that do not parse are left out).
fn parse_succession(list: &[meshnet_types::PeerId]) -> Vec<PeerId> {
    list.iter()
        .filter_map(|peer| libp2p_peer_id(peer).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::mesh_peer_id;

    const MODEL: &str = "tiny-model";
    const SILENCE: Duration = Duration::from_secs(10);

    /// A record of `term` and `epoch` naming `peer` at one address (and one that does not
    /// parse).
    fn record(peer: PeerId, term: u64, epoch: u64) -> TrackerRecord {
        TrackerRecord {
            peer: mesh_peer_id(&peer),
            addresses: vec!["/ip4/10.0.0.1/tcp/4001".to_owned(), "junk".to_owned()],
            http_endpoint: "http://10.0.0.1:8080".to_owned(),
            epoch,
            term,
            model_id: MODEL.to_owned(),
        }
    }

    fn peer_election() -> TrackerElection {
        TrackerElection::started_as_peer(PeerId::random(), None, SILENCE)
    }

    /// A peer that follows `tracker` of `term` after one of its coverage maps at `now`.
    fn follower_of(tracker: PeerId, term: u64, now: Instant) -> TrackerElection {
        let mut election = peer_election();
        election.on_coverage(tracker, term, &[], now);
        election
    }

    #[test]
    fn a_first_record_is_followed_and_its_tracker_dialed_at_its_addresses() {
        let tracker = PeerId::random();
        let mut election = peer_election();
        assert!(!election.reaches_tracker());
        assert_eq!(
            election.on_tracker_record(MODEL, record(tracker, 1, 1)),
            RecordDecision::Follow {
                peer: tracker,
                addresses: vec!["/ip4/10.0.0.1/tcp/4001".parse().unwrap()],
                newly_discovered: true,
                record: record(tracker, 1, 1),
            }
        );
        assert_eq!(election.tracker(), Some(tracker));
        assert!(election.reaches_tracker());
    }

    #[test]
    fn the_same_record_or_an_older_epoch_of_it_is_already_known() {
        let tracker = PeerId::random();
        let mut election = peer_election();
        election.on_tracker_record(MODEL, record(tracker, 1, 5));
        assert_eq!(
            election.on_tracker_record(MODEL, record(tracker, 1, 5)),
            RecordDecision::AlreadyKnown
        );
        assert_eq!(
            election.on_tracker_record(MODEL, record(tracker, 1, 4)),
            RecordDecision::AlreadyKnown,
            "a stale copy must not roll the record back"
        );
        assert!(matches!(
            election.on_tracker_record(MODEL, record(tracker, 1, 6)),
            RecordDecision::Follow {
                newly_discovered: false,
                ..
            }
        ));
    }

    #[test]
    fn a_record_never_moves_a_member_from_the_tracker_it_follows() {
        let (tracker, other) = (PeerId::random(), PeerId::random());
        let mut election = follower_of(tracker, 3, Instant::now());
        assert_eq!(
            election.on_tracker_record(MODEL, record(other, 4, 1)),
            RecordDecision::Rejected {
                peer: other,
                code: "not_followed_tracker",
                reason: format!(
                    "a tracker record names {other} with term 4, but this member follows \
                     {tracker} (term 3); only signed coverage maps change the tracker"
                ),
            }
        );
        assert_eq!(
            election.on_tracker_record(MODEL, record(other, 3, 1)),
            RecordDecision::Stale {
                peer: other,
                term: 3
            }
        );
        assert_eq!(
            election.on_tracker_record(MODEL, record(other, 2, 9)),
            RecordDecision::Stale {
                peer: other,
                term: 2
            }
        );
        assert_eq!(election.tracker(), Some(tracker));
        assert!(matches!(
            election.on_tracker_record(MODEL, record(tracker, 3, 1)),
            RecordDecision::Follow {
                newly_discovered: false,
                ..
            }
        ));
    }

    #[test]
    fn a_pinned_member_refuses_a_record_naming_another_tracker() {
        let (pinned, other) = (PeerId::random(), PeerId::random());
        let mut election =
            TrackerElection::started_as_peer(PeerId::random(), Some(pinned), SILENCE);
        assert_eq!(election.tracker(), Some(pinned));
        assert_eq!(
            election.on_tracker_record(MODEL, record(other, 9, 1)),
            RecordDecision::Rejected {
                peer: other,
                code: "not_pinned_tracker",
                reason: format!(
                    "a tracker record names {other}, but this member is pinned to tracker {pinned}"
                ),
            }
        );
        assert!(matches!(
            election.on_tracker_record(MODEL, record(pinned, 1, 1)),
            RecordDecision::Follow {
                newly_discovered: false,
                ..
            }
        ));
    }

    #[test]
    fn a_record_of_another_model_or_without_a_peer_id_is_ignored() {
        let mut election = peer_election();
        let mut foreign = record(PeerId::random(), 1, 1);
        foreign.model_id = "other-model".to_owned();
        assert_eq!(
            election.on_tracker_record(MODEL, foreign),
            RecordDecision::OtherModel("other-model".to_owned())
        );
        let mut nameless = record(PeerId::random(), 1, 1);
        nameless.peer = meshnet_types::PeerId::new("not-a-peer-id");
        assert!(matches!(
            election.on_tracker_record(MODEL, nameless),
            RecordDecision::InvalidPeer { peer, .. } if peer == "not-a-peer-id"
        ));
        assert_eq!(election.tracker(), None);
    }

    #[test]
    fn a_map_of_a_new_tracker_replaces_the_followed_one_and_the_term_never_goes_back() {
        let (tracker, successor) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        let mut election = follower_of(tracker, 3, now);
        assert_eq!(
            election.on_coverage(successor, 5, &[], now),
            Following::NewTracker {
                previous: Some(tracker),
                stepped_down: false
            }
        );
        assert_eq!(election.tracker(), Some(successor));
        assert_eq!(election.publish_rules(MODEL, now).term, 5);
        assert_eq!(
            election.on_coverage(successor, 4, &[], now),
            Following::Same
        );
        assert_eq!(election.publish_rules(MODEL, now).term, 5);
    }

    #[test]
    fn a_tracker_that_follows_another_steps_down_and_drops_its_record() {
        let local = PeerId::random();
        let successor = PeerId::random();
        let now = Instant::now();
        let mut election = TrackerElection::started_as_tracker(local, SILENCE, now);
        election.set_own_record(record(local, 1, 1));
        assert_eq!(
            election.on_coverage(successor, 2, &[], now),
            Following::NewTracker {
                previous: Some(local),
                stepped_down: true
            }
        );
        assert!(!election.is_tracker());
        assert_eq!(election.own_record(), None);
    }

    #[test]
    fn a_fresh_tracker_judges_claims_without_a_list_until_its_grace_ends() {
        let (local, heir) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        let grace_until = now + Duration::from_secs(30);
        let mut election = TrackerElection::started_as_tracker(local, SILENCE, grace_until);
        election.on_own_coverage(7, &[mesh_peer_id(&heir)]);
        let rules = election.publish_rules(MODEL, now);
        assert_eq!(rules.succession, None);
        assert_eq!((rules.tracker, rules.term), (Some(local), 7));
        assert!(
            rules.tracker_silent,
            "a tracker judges rival claims at once"
        );
        assert_eq!(
            election.publish_rules(MODEL, grace_until).succession,
            Some(&[heir][..])
        );
    }

    #[test]
    fn a_member_that_knows_its_tracker_by_record_only_judges_claims_without_a_list() {
        let (tracker, heir) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        let mut election = peer_election();
        election.on_tracker_record(MODEL, record(tracker, 1, 1));
        assert_eq!(election.publish_rules(MODEL, now).succession, None);
        let list = [
            mesh_peer_id(&heir),
            meshnet_types::PeerId::new("not-a-peer-id"),
        ];
        election.on_coverage(tracker, 1, &list, now);
        let rules = election.publish_rules(MODEL, now);
        assert_eq!(rules.succession, Some(&[heir][..]));
        assert!(!rules.tracker_silent);
        assert!(
            !election
                .publish_rules(MODEL, now + SILENCE - Duration::from_millis(1))
                .tracker_silent
        );
        assert!(election.publish_rules(MODEL, now + SILENCE).tracker_silent);
    }

    #[test]
    fn a_pinned_member_keeps_no_succession_list() {
        let (pinned, heir) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        let mut election =
            TrackerElection::started_as_peer(PeerId::random(), Some(pinned), SILENCE);
        election.on_coverage(pinned, 1, &[mesh_peer_id(&heir)], now);
        assert_eq!(election.publish_rules(MODEL, now).succession, Some(&[][..]));
    }

    #[test]
    fn taking_the_role_makes_this_node_the_tracker_of_that_term() {
        let local = PeerId::random();
        let mut election = TrackerElection::started_as_peer(local, None, SILENCE);
        election.on_own_coverage(9, &[]);
        assert_eq!(
            election.publish_rules(MODEL, Instant::now()).term,
            0,
            "not the tracker yet"
        );
        election.take_role(4);
        assert!(election.is_tracker());
        assert_eq!(election.tracker(), Some(local));
        assert_eq!(election.publish_rules(MODEL, Instant::now()).term, 4);
        election.on_own_coverage(3, &[]);
        assert_eq!(election.publish_rules(MODEL, Instant::now()).term, 4);
    }
}
