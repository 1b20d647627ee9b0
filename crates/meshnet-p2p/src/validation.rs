//! Admission checks for gossip messages, applied before anything propagates.

use libp2p::PeerId;

use crate::events::P2pEvent;
use crate::ids::mesh_peer_id;
use crate::messages::{CoverageMessage, DirectiveMessage, PeerAnnouncement, TopicKind, decode};

/// What to do with a received gossip message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// Propagate it; report the event (if any) to the application.
    Accept(Option<Box<P2pEvent>>),
    /// Neither propagate nor penalise (cannot judge it yet).
    Ignore(String),
    /// Invalid: drop it and report the reason.
    Reject(String),
}

/// What a node knows when it judges a message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admission<'a> {
    /// Our model; messages for other models are rejected.
    pub(crate) model_id: &'a str,
    /// This node.
    pub(crate) local_peer: PeerId,
    /// The tracker whose coverage maps and directives are accepted, once known.
    pub(crate) tracker: Option<PeerId>,
}

impl Admission<'_> {
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
            Err(Verdict::Reject(format!(
                "message is for model {model_id:?}, this mesh runs {:?}",
                self.model_id
            )))
        }
    }

    fn check_tracker(&self, source: PeerId) -> Result<(), Verdict> {
        match self.tracker {
            None => Err(Verdict::Ignore(
                "no tracker known yet to authorise tracker messages".to_owned(),
            )),
            Some(tracker) if tracker == source => Ok(()),
            Some(tracker) => Err(Verdict::Reject(format!(
                "sent by {source}, which is not the tracker {tracker}"
            ))),
        }
    }

    fn judge_announcement(&self, source: PeerId, data: &[u8]) -> Verdict {
        let announcement: PeerAnnouncement = match decode(data) {
            Ok(announcement) => announcement,
            Err(error) => return Verdict::Reject(format!("undecodable announcement: {error}")),
        };
        if let Err(verdict) = self.check_model(&announcement.model_id) {
            return verdict;
        }
        if announcement.peer != mesh_peer_id(&source) {
            return Verdict::Reject(format!(
                "announcement names peer {} but is signed by {source}",
                announcement.peer
            ));
        }
        Verdict::Accept(Some(Box::new(P2pEvent::Announcement {
            from: mesh_peer_id(&source),
            announcement,
        })))
    }

    fn judge_coverage(&self, source: PeerId, data: &[u8]) -> Verdict {
        let coverage: CoverageMessage = match decode(data) {
            Ok(coverage) => coverage,
            Err(error) => return Verdict::Reject(format!("undecodable coverage map: {error}")),
        };
        if let Err(verdict) = self
            .check_model(&coverage.model_id)
            .and_then(|()| self.check_tracker(source))
        {
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
            Err(error) => return Verdict::Reject(format!("undecodable directive: {error}")),
        };
        if let Err(verdict) = self
            .check_model(&directive.model_id)
            .and_then(|()| self.check_tracker(source))
        {
            return verdict;
        }
        if let Some(stray) = directive
            .directives
            .iter()
            .find(|inner| *inner.peer() != directive.target)
        {
            return Verdict::Reject(format!(
                "directive message for {} carries a directive for {}",
                directive.target,
                stray.peer()
            ));
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
            memory_bytes: 1 << 30,
            quantizations: vec![Quantization::Bf16],
            throughput: 10.0,
            kv_tokens: 2048,
            span: None,
            free_kv_tokens: 2048,
            active_sessions: 0,
            is_tracker: false,
            sent_at_unix_ms: 0,
        }
    }

    fn directive(target: PeerId, inner_peer: PeerId) -> DirectiveMessage {
        DirectiveMessage {
            model_id: "m".into(),
            target: mesh_peer_id(&target),
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
        matches!(verdict, Verdict::Reject(_))
    }

    #[test]
    fn announcements_must_name_their_signer_and_model() {
        let (me, alice, bob) = (peer(), peer(), peer());
        let admission = Admission {
            model_id: "m",
            local_peer: me,
            tracker: None,
        };
        let good = encode(&announcement(alice, "m")).unwrap();
        assert!(matches!(
            admission.judge(TopicKind::Announce, alice, &good),
            Verdict::Accept(Some(event)) if matches!(*event, P2pEvent::Announcement { ref from, .. } if *from == mesh_peer_id(&alice))
        ));
        assert!(is_reject(&admission.judge(TopicKind::Announce, bob, &good)));
        let other_model = encode(&announcement(alice, "other")).unwrap();
        assert!(is_reject(&admission.judge(
            TopicKind::Announce,
            alice,
            &other_model
        )));
        assert!(is_reject(&admission.judge(
            TopicKind::Announce,
            alice,
            b"garbage"
        )));
    }

    #[test]
    fn coverage_needs_the_authorised_tracker() {
        let (me, tracker, intruder) = (peer(), peer(), peer());
        let coverage = encode(&CoverageMessage {
            model_id: "m".into(),
            epoch: 1,
            sequence: 1,
            num_layers: 4,
            map: CoverageMap::empty(1),
        })
        .unwrap();
        let unknown = Admission {
            model_id: "m",
            local_peer: me,
            tracker: None,
        };
        assert!(matches!(
            unknown.judge(TopicKind::Coverage, tracker, &coverage),
            Verdict::Ignore(_)
        ));
        let known = Admission {
            tracker: Some(tracker),
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
        let admission = Admission {
            model_id: "m",
            local_peer: me,
            tracker: Some(tracker),
        };
        let to_me = encode(&directive(me, me)).unwrap();
        let to_other = encode(&directive(other, other)).unwrap();
        assert!(matches!(
            admission.judge(TopicKind::Directives, tracker, &to_me),
            Verdict::Accept(Some(event)) if matches!(*event, P2pEvent::Directive { .. })
        ));
        assert_eq!(
            admission.judge(TopicKind::Directives, tracker, &to_other),
            Verdict::Accept(None)
        );
        assert!(is_reject(&admission.judge(
            TopicKind::Directives,
            other,
            &to_me
        )));
        let mismatched = encode(&directive(me, other)).unwrap();
        assert!(is_reject(&admission.judge(
            TopicKind::Directives,
            tracker,
            &mismatched
        )));
    }
}
