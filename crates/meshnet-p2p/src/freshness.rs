//! Which announcements are news.
//!
//! An announcement is its sender's state, and only the newest counts. Gossipsub forgets the ids
//! of messages it has seen after a minute; on a mesh so loaded that messages wait longer than
//! that in queues, an old announcement comes round again as if new, and a peer that left long
//! ago keeps being announced by the messages it sent before it went (seen with a hundred
//! members on one core: ten departed peers stayed in the tracker's book for five minutes).
//! A node therefore accepts a peer's announcement only if its sender's clock
//! (`sent_at_unix_ms`) is later than every announcement of that peer it accepted before; an
//! older or repeated one is ignored, which also stops it from travelling further.
//!
//! The rule trusts each sender's own clock only against itself, so clocks need not agree
//! between peers. A sender whose clock steps back is ignored until its clock passes the newest
//! time it sent before. Pure data.

use std::collections::HashMap;

use meshnet_types::PeerId;

use crate::events::P2pEvent;
use crate::validation::Verdict;

/// The most announcers remembered; past it the one whose newest announcement is the oldest is
/// forgotten.
pub(crate) const MAX_REMEMBERED_ANNOUNCERS: usize = 65_536;

/// The newest announcement time accepted from each peer.
#[derive(Debug, Default)]
pub(crate) struct AnnouncementFreshness {
    newest: HashMap<PeerId, u64>,
}

impl AnnouncementFreshness {
    /// Whether an announcement of `peer` sent at `sent_at_unix_ms` (the sender's clock) is
    /// newer than every one accepted from it before; if so, it becomes the newest.
    pub(crate) fn admit(&mut self, peer: &PeerId, sent_at_unix_ms: u64) -> bool {
        if let Some(newest) = self.newest.get_mut(peer) {
            if sent_at_unix_ms <= *newest {
                return false;
            }
            *newest = sent_at_unix_ms;
            return true;
        }
        if self.newest.len() >= MAX_REMEMBERED_ANNOUNCERS {
            self.forget_oldest();
        }
        self.newest.insert(peer.clone(), sent_at_unix_ms);
        true
    }

    /// The newest announcement time accepted from `peer`, if any.
    pub(crate) fn newest(&self, peer: &PeerId) -> Option<u64> {
        self.newest.get(peer).copied()
    }

    /// `verdict`, unless it accepts an announcement not newer than one already accepted from
    /// the same peer: that one is ignored (neither delivered nor propagated). An accepted
    /// announcement becomes the newest of its peer.
    pub(crate) fn screen(&mut self, verdict: Verdict) -> Verdict {
        if let Verdict::Accept(Some(event)) = &verdict
            && let P2pEvent::Announcement { from, announcement } = event.as_ref()
        {
            let sent_at = announcement.sent_at_unix_ms;
            if !self.admit(from, sent_at) {
                let newest = self.newest(from).unwrap_or_default();
                return Verdict::Ignore(format!(
                    "stale announcement: sent at {sent_at} ms, one sent at {newest} ms was accepted"
                ));
            }
        }
        verdict
    }

    fn forget_oldest(&mut self) {
        let oldest = self
            .newest
            .iter()
            .min_by_key(|(_, sent_at)| **sent_at)
            .map(|(peer, _)| peer.clone());
        if let Some(peer) = oldest {
            self.newest.remove(&peer);
        }
    }

    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.newest.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An accepting verdict on an announcement of `peer` sent at `sent_at`.
    fn accepted_announcement(peer: &str, sent_at: u64) -> Verdict {
        Verdict::Accept(Some(Box::new(P2pEvent::announcement_for_tests(
            peer, sent_at,
        ))))
    }

    #[test]
    fn a_stale_accepted_announcement_is_ignored_and_other_verdicts_pass() {
        let mut freshness = AnnouncementFreshness::default();
        assert_eq!(
            freshness.screen(accepted_announcement("a", 10)),
            accepted_announcement("a", 10)
        );
        assert_eq!(
            freshness.screen(accepted_announcement("a", 9)),
            Verdict::Ignore(
                "stale announcement: sent at 9 ms, one sent at 10 ms was accepted".to_owned()
            )
        );
        assert_eq!(
            freshness.screen(accepted_announcement("a", 11)),
            accepted_announcement("a", 11)
        );
        let rejected = Verdict::Reject("undecodable", "bad bytes".to_owned());
        assert_eq!(freshness.screen(rejected.clone()), rejected);
        assert_eq!(
            freshness.screen(Verdict::Accept(None)),
            Verdict::Accept(None)
        );
        assert_eq!(freshness.newest(&PeerId::new("a")), Some(11));
    }

    #[test]
    fn only_a_later_announcement_of_the_same_peer_is_news() {
        let mut freshness = AnnouncementFreshness::default();
        let a = PeerId::new("a");
        let b = PeerId::new("b");
        assert!(freshness.admit(&a, 1_000));
        // The same message again, and an older one, are not news.
        assert!(!freshness.admit(&a, 1_000));
        assert!(!freshness.admit(&a, 999));
        assert!(freshness.admit(&a, 1_001));
        assert!(!freshness.admit(&a, 1_000));
        assert_eq!(freshness.newest(&a), Some(1_001));
        // Each peer is judged against its own clock only.
        assert!(freshness.admit(&b, 5));
        assert!(freshness.admit(&b, 6));
        assert_eq!(freshness.newest(&b), Some(6));
    }

    #[test]
    fn a_full_record_forgets_the_peer_whose_newest_announcement_is_oldest() {
        let mut freshness = AnnouncementFreshness::default();
        for i in 0..MAX_REMEMBERED_ANNOUNCERS as u64 {
            assert!(freshness.admit(&PeerId::new(format!("p{i}")), 1_000 + i));
        }
        assert!(freshness.admit(&PeerId::new("late"), 10));
        assert_eq!(freshness.remembered(), MAX_REMEMBERED_ANNOUNCERS);
        // The one with the oldest announcement went, not the newcomer.
        assert_eq!(freshness.newest(&PeerId::new("late")), Some(10));
        assert_eq!(freshness.newest(&PeerId::new("p0")), None);
        assert_eq!(freshness.newest(&PeerId::new("p1")), Some(1_001));
    }
}
