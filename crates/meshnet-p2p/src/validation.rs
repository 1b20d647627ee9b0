//! Publish rules: the checks a gossip message passes before anything propagates.

use libp2p::PeerId;

use crate::events::P2pEvent;
use crate::ids::mesh_peer_id;
use crate::messages::{
    CoverageMessage, DirectiveMessage, MAX_RTT_ENTRIES, PeerAnnouncement, TopicKind, decode,
};

/// What to do with a received gossip message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Propagate it; report the event (if any) to the application.
    Accept(Option<Box<P2pEvent>>),
    /// Neither propagate nor penalise (cannot judge it yet).
    Ignore(String),
    /// Invalid: drop it and report the reason: a stable code (the metrics' label) and the
    /// detail.
    Reject(&'static str, String),
}

/// What a node knows when it judges a message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PublishRules<'a> {
    /// Our model; messages for other models are rejected.
    pub(crate) model_id: &'a str,
    /// This node.
    pub(crate) local_peer: PeerId,
    /// The tracker whose coverage maps and directives are accepted, once known.
    pub(crate) tracker: Option<PeerId>,
    /// That tracker's term (0 before any is known).
    pub(crate) term: u64,
    /// Who may take over from it: the succession list of the tracker this node follows (its
    /// own, on the tracker). `None` only on a node started as tracker, in its first seconds:
    /// then the highest term wins, whoever claims it.
    pub(crate) succession: Option<&'a [PeerId]>,
    /// Whether this node has heard no coverage map from its tracker for the takeover silence
    /// (always true on the tracker itself, which judges rival claims at once).
    pub(crate) tracker_silent: bool,
}

/// Whether a tracker claim of `term` by `claimant` beats the current tracker `current` of
/// `current_term` ([`meshnet_types::claim_beats`] on the mesh's peer ids).
pub(crate) fn claim_beats(claimant: PeerId, term: u64, current: PeerId, current_term: u64) -> bool {
    meshnet_types::claim_beats(
        &mesh_peer_id(&claimant),
        term,
        &mesh_peer_id(&current),
        current_term,
    )
}

impl PublishRules<'_> {
    /// Judges `data`, received on the `kind` topic and signed by `source`.
    pub(crate) fn judge(&self, kind: TopicKind, source: PeerId, data: &[u8]) -> Verdict {
        match kind {
            TopicKind::Announce => self.judge_announcement(source, data),
            TopicKind::Coverage => self.judge_coverage(source, data),
            TopicKind::Directives => self.judge_directive(source, data),
        }
    }

    fn check_model(&self, model_id: &str) -> Result<(), Verdict> {
        if model_id == self.model_id {
            Ok(())
        } else {
            Err(Verdict::Reject(
                "other_model",
                format!(
                    "message is for model {model_id:?}, this mesh runs {:?}",
                    self.model_id
                ),
            ))
        }
    }

    fn check_tracker(&self, source: PeerId) -> Result<(), Verdict> {
        match self.tracker {
            None => Err(Verdict::Ignore(
                "no tracker known yet to authorise tracker messages".to_owned(),
            )),
            Some(tracker) if tracker == source => Ok(()),
            Some(tracker) => Err(Verdict::Reject(
                "not_tracker",
                format!("sent by {source}, which is not the tracker {tracker}"),
            )),
        }
    }

    /// Checks that a message of `term` from the current tracker is not from an older term.
    fn check_term(&self, term: u64) -> Result<(), Verdict> {
        if term < self.term {
            Err(Verdict::Reject(
                "stale_term",
                format!(
                    "of tracker term {term}, older than the current term {}",
                    self.term
                ),
            ))
        } else {
            Ok(())
        }
    }

    /// Judges a claim by `claimant`, who is not the current tracker, to be the tracker of
    /// `term`: it must beat the current tracker ([`claim_beats`]) and be on the succession
    /// list (when this node has one).
    pub(crate) fn check_takeover(&self, claimant: PeerId, term: u64) -> Result<(), Verdict> {
        let Some(current) = self.tracker else {
            return Err(Verdict::Ignore(
                "no tracker known yet to authorise tracker messages".to_owned(),
            ));
        };
        if !claim_beats(claimant, term, current, self.term) {
            return Err(Verdict::Reject(
                "claim_too_weak",
                format!(
                    "sent by {claimant}, which is not the tracker {current} (its term {term} does \
                 not beat the current term {})",
                    self.term
                ),
            ));
        }
        if !self.tracker_silent {
            // Not the claimant's fault: this node may hear the old tracker a little longer.
            return Err(Verdict::Ignore(format!(
                "{claimant} claims tracker term {term}, but tracker {current} is still heard"
            )));
        }
        match self.succession {
            Some(list) if !list.contains(&claimant) => Err(Verdict::Reject(
                "off_succession",
                format!(
                    "{claimant} claims tracker term {term}, but tracker {current} did not name it \
                 in its succession list"
                ),
            )),
            _ => Ok(()),
        }
    }

    fn judge_announcement(&self, source: PeerId, data: &[u8]) -> Verdict {
        let announcement: PeerAnnouncement = match decode(data) {
            Ok(announcement) => announcement,
            Err(error) => {
                return Verdict::Reject(
                    "undecodable",
                    format!("undecodable announcement: {error}"),
                );
            }
        };
        if let Err(verdict) = self.check_model(&announcement.model_id) {
            return verdict;
        }
        if announcement.peer != mesh_peer_id(&source) {
            return Verdict::Reject(
                "spoofed_sender",
                format!(
                    "announcement names peer {} but is signed by {source}",
                    announcement.peer
                ),
            );
        }
        let rtts = &announcement.rtt_ms;
        if rtts.len() > MAX_RTT_ENTRIES
            || rtts.iter().any(|rtt| !rtt.ms.is_finite() || rtt.ms < 0.0)
        {
            return Verdict::Reject(
                "bad_rtt",
                format!(
                    "announcement carries {} round trips (at most {MAX_RTT_ENTRIES}, each finite \
                     and not negative)",
                    rtts.len()
                ),
            );
        }
        Verdict::Accept(Some(Box::new(P2pEvent::Announcement {
            from: mesh_peer_id(&source),
            announcement,
        })))
    }

    fn judge_coverage(&self, source: PeerId, data: &[u8]) -> Verdict {
        let coverage: CoverageMessage = match decode(data) {
            Ok(coverage) => coverage,
            Err(error) => {
                return Verdict::Reject(
                    "undecodable",
                    format!("undecodable coverage map: {error}"),
                );
            }
        };
        let authorised = self.check_model(&coverage.model_id).and_then(|()| {
            if self.tracker == Some(source) {
                self.check_term(coverage.term)
            } else {
                self.check_takeover(source, coverage.term)
            }
        });
        if let Err(verdict) = authorised {
            return verdict;
        }
        Verdict::Accept(Some(Box::new(P2pEvent::Coverage {
            from: mesh_peer_id(&source),
            coverage,
        })))
    }

    fn judge_directive(&self, source: PeerId, data: &[u8]) -> Verdict {
        let directive: DirectiveMessage = match decode(data) {
            Ok(directive) => directive,
            Err(error) => {
                return Verdict::Reject("undecodable", format!("undecodable directive: {error}"));
            }
        };
        if let Err(verdict) = self
            .check_model(&directive.model_id)
            .and_then(|()| self.check_tracker(source))
            .and_then(|()| self.check_term(directive.term))
        {
            return verdict;
        }
        if let Some(stray) = directive
            .directives
            .iter()
            .find(|inner| *inner.peer() != directive.target)
        {
            return Verdict::Reject(
                "stray_directive",
                format!(
                    "directive message for {} carries a directive for {}",
                    directive.target,
                    stray.peer()
                ),
            );
        }
        let for_us = directive.target == mesh_peer_id(&self.local_peer);
        Verdict::Accept(for_us.then(|| {
            Box::new(P2pEvent::Directive {
                from: mesh_peer_id(&source),
                directive,
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use libp2p::identity::Keypair;
    use meshnet_planner::{CoverageMap, Directive};
    use meshnet_types::{LayerSpan, PeerId as PlannerPeerId, Quantization};

    use super::*;
    use crate::messages::encode;

    fn peer() -> PeerId {
        Keypair::generate_ed25519().public().to_peer_id()
    }

    fn announcement(from: PeerId, model: &str) -> PeerAnnouncement {
        PeerAnnouncement {
            peer: mesh_peer_id(&from),
            model_id: model.into(),
            software_version: "0.1.0".into(),
            wire_version: 1,
            http_endpoints: vec![],
            p2p_addresses: Vec::new(),
            memory_bytes: 1 << 30,
            quantizations: vec![Quantization::Bf16],
            throughput: 10.0,
            kv_tokens: 2048,
            span: None,
            free_kv_tokens: 2048,
            active_sessions: 0,
            is_tracker: false,
            forward_latency_ms: 0.0,
            leaving: false,
            tracker_capable: true,
            sent_at_unix_ms: 0,
            tracker_silent_ms: None,
            rtt_ms: vec![],
        }
    }

    fn directive(target: PeerId, inner_peer: PeerId) -> DirectiveMessage {
        DirectiveMessage {
            model_id: "m".into(),
            target: mesh_peer_id(&target),
            term: 1,
            epoch: 1,
            sequence: 1,
            directives: vec![Directive::LoadShard {
                peer: PlannerPeerId::new(inner_peer.to_string()),
                layers: LayerSpan::new(0, 4),
                quantization: Quantization::Nf4,
            }],
            span_after: None,
        }
    }

    fn is_reject(verdict: &Verdict) -> bool {
        matches!(verdict, Verdict::Reject(..))
    }

    #[test]
    fn announcements_with_too_many_or_impossible_round_trips_are_rejected() {
        let (me, alice) = (peer(), peer());
        let rules = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: None,
            term: 0,
            succession: None,
            tracker_silent: true,
        };
        let with_rtts = |rtts: Vec<f32>| {
            let mut announcement = announcement(alice, "m");
            announcement.rtt_ms = rtts
                .into_iter()
                .enumerate()
                .map(|(i, ms)| crate::PeerRtt {
                    peer: PlannerPeerId::new(format!("p{i}")),
                    ms,
                })
                .collect();
            rules.judge(TopicKind::Announce, alice, &encode(&announcement).unwrap())
        };
        assert!(!is_reject(&with_rtts(vec![0.0, 12.5, 150.0])));
        assert!(!is_reject(&with_rtts(vec![3.0; MAX_RTT_ENTRIES])));
        assert!(is_reject(&with_rtts(vec![3.0; MAX_RTT_ENTRIES + 1])));
        for bad in [f32::NAN, f32::INFINITY, -1.0] {
            assert!(is_reject(&with_rtts(vec![1.0, bad])), "{bad}");
        }
    }

    #[test]
    fn announcements_must_name_their_signer_and_model() {
        let (me, alice, bob) = (peer(), peer(), peer());
        let rules = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: None,
            term: 0,
            succession: None,
            tracker_silent: true,
        };
        let good = encode(&announcement(alice, "m")).unwrap();
        assert!(matches!(
            rules.judge(TopicKind::Announce, alice, &good),
            Verdict::Accept(Some(event)) if matches!(*event, P2pEvent::Announcement { ref from, .. } if *from == mesh_peer_id(&alice))
        ));
        assert!(is_reject(&rules.judge(TopicKind::Announce, bob, &good)));
        let other_model = encode(&announcement(alice, "other")).unwrap();
        assert!(is_reject(&rules.judge(
            TopicKind::Announce,
            alice,
            &other_model
        )));
        assert!(is_reject(&rules.judge(
            TopicKind::Announce,
            alice,
            b"garbage"
        )));
    }

    #[test]
    fn coverage_needs_the_authorised_tracker() {
        let (me, tracker, intruder) = (peer(), peer(), peer());
        let coverage = encode(&coverage_of_term(1, vec![])).unwrap();
        let unknown = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: None,
            term: 0,
            succession: None,
            tracker_silent: true,
        };
        assert!(matches!(
            unknown.judge(TopicKind::Coverage, tracker, &coverage),
            Verdict::Ignore(_)
        ));
        let known = PublishRules {
            tracker: Some(tracker),
            term: 1,
            succession: Some(&[]),
            ..unknown
        };
        assert!(matches!(
            known.judge(TopicKind::Coverage, tracker, &coverage),
            Verdict::Accept(Some(event)) if matches!(*event, P2pEvent::Coverage { .. })
        ));
        assert!(is_reject(&known.judge(
            TopicKind::Coverage,
            intruder,
            &coverage
        )));
    }

    #[test]
    fn directives_reach_only_their_target() {
        let (me, other, tracker) = (peer(), peer(), peer());
        let rules = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: Some(tracker),
            term: 1,
            succession: None,
            tracker_silent: true,
        };
        let to_me = encode(&directive(me, me)).unwrap();
        let to_other = encode(&directive(other, other)).unwrap();
        assert!(matches!(
            rules.judge(TopicKind::Directives, tracker, &to_me),
            Verdict::Accept(Some(event)) if matches!(*event, P2pEvent::Directive { .. })
        ));
        assert_eq!(
            rules.judge(TopicKind::Directives, tracker, &to_other),
            Verdict::Accept(None)
        );
        assert!(is_reject(&rules.judge(
            TopicKind::Directives,
            other,
            &to_me
        )));
        let mismatched = encode(&directive(me, other)).unwrap();
        assert!(is_reject(&rules.judge(
            TopicKind::Directives,
            tracker,
            &mismatched
        )));
    }

    fn coverage_of_term(term: u64, succession: Vec<PlannerPeerId>) -> CoverageMessage {
        CoverageMessage {
            model_id: "m".into(),
            term,
            succession,
            tracker_http: "http://127.0.0.1:8080".into(),
            epoch: 1,
            sequence: 1,
            num_layers: 4,
            map: CoverageMap::empty(1),
            announce_interval_ms: 2000,
        }
    }

    #[test]
    fn only_a_listed_successor_of_a_higher_term_takes_over() {
        let (me, tracker, heir, stranger) = (peer(), peer(), peer(), peer());
        let list = [heir];
        let rules = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: Some(tracker),
            term: 3,
            succession: Some(&list),
            tracker_silent: true,
        };
        let claim = |term| encode(&coverage_of_term(term, vec![])).unwrap();
        assert!(matches!(
            rules.judge(TopicKind::Coverage, heir, &claim(4)),
            Verdict::Accept(Some(_))
        ));
        // Not listed: refused whatever the term.
        assert!(is_reject(&rules.judge(
            TopicKind::Coverage,
            stranger,
            &claim(4)
        )));
        assert!(is_reject(&rules.judge(
            TopicKind::Coverage,
            stranger,
            &claim(99)
        )));
        // Listed, but not a newer term than the living tracker's.
        assert!(is_reject(&rules.judge(
            TopicKind::Coverage,
            heir,
            &claim(2)
        )));
        // The tracker itself may not go back to an older term.
        assert!(is_reject(&rules.judge(
            TopicKind::Coverage,
            tracker,
            &claim(2)
        )));
        assert!(matches!(
            rules.judge(TopicKind::Coverage, tracker, &claim(3)),
            Verdict::Accept(Some(_))
        ));
        // A node that never followed a list (a started tracker) yields to any higher term.
        let fresh = PublishRules {
            succession: None,
            tracker: Some(me),
            term: 1,
            ..rules
        };
        assert!(matches!(
            fresh.judge(TopicKind::Coverage, stranger, &claim(2)),
            Verdict::Accept(Some(_))
        ));
        // Two trackers started by hand, both of term 1: the lower id wins.
        let verdict = fresh.judge(TopicKind::Coverage, stranger, &claim(1));
        if claim_beats(stranger, 1, me, 1) {
            assert!(matches!(verdict, Verdict::Accept(Some(_))));
        } else {
            assert!(is_reject(&verdict));
        }
    }

    #[test]
    fn directives_of_an_older_term_are_refused() {
        let (me, tracker) = (peer(), peer());
        let rules = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: Some(tracker),
            term: 2,
            succession: None,
            tracker_silent: true,
        };
        let mut old = directive(me, me);
        old.term = 1;
        assert!(is_reject(&rules.judge(
            TopicKind::Directives,
            tracker,
            &encode(&old).unwrap()
        )));
        old.term = 2;
        assert!(matches!(
            rules.judge(TopicKind::Directives, tracker, &encode(&old).unwrap()),
            Verdict::Accept(Some(_))
        ));
    }

    #[test]
    fn of_two_claims_exactly_one_wins() {
        for _ in 0..32 {
            let (a, b) = (peer(), peer());
            for (ta, tb) in [(1, 1), (1, 2), (2, 1), (5, 5)] {
                let a_wins = claim_beats(a, ta, b, tb);
                let b_wins = claim_beats(b, tb, a, ta);
                assert!(a_wins != b_wins, "{ta} vs {tb}: exactly one claim must win");
                if ta != tb {
                    assert_eq!(a_wins, ta > tb, "the higher term wins");
                }
            }
        }
    }

    #[test]
    fn a_successor_takes_over_only_once_the_tracker_is_no_longer_heard() {
        let (me, tracker, heir) = (peer(), peer(), peer());
        let list = [heir];
        let rules = PublishRules {
            model_id: "m",
            local_peer: me,
            tracker: Some(tracker),
            term: 1,
            succession: Some(&list),
            tracker_silent: false,
        };
        let claim = encode(&coverage_of_term(2, vec![])).unwrap();
        assert!(matches!(
            rules.judge(TopicKind::Coverage, heir, &claim),
            Verdict::Ignore(_)
        ));
        let silent = PublishRules {
            tracker_silent: true,
            ..rules
        };
        assert!(matches!(
            silent.judge(TopicKind::Coverage, heir, &claim),
            Verdict::Accept(Some(_))
        ));
        // A follower that knows no list yet accepts no takeover at all.
        let listless = PublishRules {
            succession: Some(&[]),
            ..silent
        };
        assert!(is_reject(&listless.judge(
            TopicKind::Coverage,
            heir,
            &claim
        )));
    }
}
