//! Events waiting for the application while its channel is full.
//!
//! Announcements are state, not history: only a peer's latest one matters, so a burst of them
//! (a hundred peers announcing every interval, an application busy planning) collapses to one
//! pending announcement per peer instead of pushing out a directive or a coverage map. Other
//! events wait in order, ahead of the announcements, up to [`MAX_QUEUED_EVENTS`]; a change of
//! leadership always waits (it is rare, and a lost one would leave a deposed tracker planning).
//! Pure data.

use std::collections::{HashMap, VecDeque};

use meshnet_types::PeerId;

use crate::events::P2pEvent;

/// The most events other than announcements that wait; past it new ones are dropped (and
/// counted): only a flood of rejected messages gets there.
pub(crate) const MAX_QUEUED_EVENTS: usize = 4096;

/// The most peers with an announcement waiting; past it the newest is dropped.
pub(crate) const MAX_QUEUED_ANNOUNCERS: usize = 65_536;

/// Events the application has not taken yet.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    events: VecDeque<P2pEvent>,
    /// Peers with a waiting announcement, oldest first.
    announcers: VecDeque<PeerId>,
    /// Each waiting peer's latest announcement event.
    announcements: HashMap<PeerId, P2pEvent>,
    /// Events dropped because the outbox was full.
    dropped: u64,
}

impl Outbox {
    /// Whether nothing waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty() && self.announcers.is_empty()
    }

    /// Keeps `event` until the application can take it; an announcement replaces the waiting
    /// one of the same peer (keeping its place). Returns false when it had to be dropped.
    pub(crate) fn push(&mut self, event: P2pEvent) -> bool {
        if let P2pEvent::Announcement { from, .. } = &event {
            if let Some(waiting) = self.announcements.get_mut(from) {
                *waiting = event;
                return true;
            }
            if self.announcers.len() >= MAX_QUEUED_ANNOUNCERS {
                self.dropped += 1;
                return false;
            }
            self.announcers.push_back(from.clone());
            self.announcements.insert(from.clone(), event);
            return true;
        }
        let droppable = !matches!(event, P2pEvent::Leadership(_));
        if droppable && self.events.len() >= MAX_QUEUED_EVENTS {
            self.dropped += 1;
            return false;
        }
        self.events.push_back(event);
        true
    }

    /// The next event to hand over: other events in order, then announcements, oldest peer
    /// first.
    pub(crate) fn pop(&mut self) -> Option<P2pEvent> {
        if let Some(event) = self.events.pop_front() {
            return Some(event);
        }
        let peer = self.announcers.pop_front()?;
        self.announcements.remove(&peer)
    }

    /// Events dropped so far because the outbox was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn announcement(peer: &str, sent_at: u64) -> P2pEvent {
        P2pEvent::announcement_for_tests(peer, sent_at)
    }

    fn sent_at(event: &P2pEvent) -> Option<(String, u64)> {
        match event {
            P2pEvent::Announcement { from, announcement } => {
                Some((from.to_string(), announcement.sent_at_unix_ms))
            }
            _ => None,
        }
    }

    #[test]
    fn other_events_go_first_and_announcements_collapse_to_the_latest() {
        let mut outbox = Outbox::default();
        outbox.push(announcement("a", 1));
        outbox.push(announcement("b", 1));
        outbox.push(P2pEvent::PeerConnected(PeerId::new("c")));
        outbox.push(announcement("a", 2));
        outbox.push(P2pEvent::PeerDisconnected(PeerId::new("c")));
        assert_eq!(
            outbox.pop(),
            Some(P2pEvent::PeerConnected(PeerId::new("c")))
        );
        assert_eq!(
            outbox.pop(),
            Some(P2pEvent::PeerDisconnected(PeerId::new("c")))
        );
        assert_eq!(
            outbox.pop().and_then(|e| sent_at(&e)),
            Some(("a".into(), 2))
        );
        assert_eq!(
            outbox.pop().and_then(|e| sent_at(&e)),
            Some(("b".into(), 1))
        );
        assert_eq!(outbox.pop(), None);
        assert!(outbox.is_empty());
        assert_eq!(outbox.dropped(), 0);
    }

    #[test]
    fn a_flood_of_other_events_is_bounded_and_counted() {
        let mut outbox = Outbox::default();
        for _ in 0..MAX_QUEUED_EVENTS {
            assert!(outbox.push(P2pEvent::PeerConnected(PeerId::new("x"))));
        }
        assert!(!outbox.push(P2pEvent::PeerConnected(PeerId::new("y"))));
        assert_eq!(outbox.dropped(), 1);
        // Announcements have their own room.
        assert!(outbox.push(announcement("a", 1)));
        // A change of leadership is never dropped, and keeps its place in order.
        let deposed = P2pEvent::Leadership(crate::events::Leadership::Follows {
            tracker: PeerId::new("t2"),
            term: 2,
            stepped_down: true,
        });
        assert!(outbox.push(deposed.clone()));
        assert_eq!(outbox.dropped(), 1);
        let order: Vec<P2pEvent> = std::iter::from_fn(|| outbox.pop()).collect();
        assert_eq!(order.len(), MAX_QUEUED_EVENTS + 2);
        assert_eq!(order[MAX_QUEUED_EVENTS], deposed);
    }

    proptest! {
        /// Whatever arrives, every peer's latest announcement comes out exactly once, after
        /// every other event, which come out in order.
        #[test]
        fn latest_announcement_of_every_peer_survives(
            arrivals in prop::collection::vec((0u8..6, any::<bool>()), 0..60),
        ) {
            let mut outbox = Outbox::default();
            let mut latest = std::collections::BTreeMap::new();
            let mut others = Vec::new();
            for (index, (peer, is_announcement)) in arrivals.iter().enumerate() {
                let name = format!("p{peer}");
                if *is_announcement {
                    latest.insert(name.clone(), index as u64);
                    outbox.push(announcement(&name, index as u64));
                } else {
                    others.push(name.clone());
                    outbox.push(P2pEvent::PeerConnected(PeerId::new(name)));
                }
            }
            let mut seen_others = Vec::new();
            let mut seen_latest = std::collections::BTreeMap::new();
            while let Some(event) = outbox.pop() {
                match sent_at(&event) {
                    Some((peer, at)) => {
                        prop_assert!(seen_latest.insert(peer, at).is_none());
                    }
                    None => {
                        prop_assert!(seen_latest.is_empty(), "an event after an announcement");
                        if let P2pEvent::PeerConnected(peer) = event {
                            seen_others.push(peer.to_string());
                        }
                    }
                }
            }
            prop_assert_eq!(seen_others, others);
            prop_assert_eq!(seen_latest, latest);
        }
    }
}
