//! What a member reports of the gossip messages and peers it refused (listed in `/status`).

use meshnet_types::PeerId;
use serde::{Deserialize, Serialize};

/// One refused gossip message or peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectionReport {
    /// The signed sender (or the peer refused).
    pub from: PeerId,
    /// The gossip topic it came on (`identify` for a peer of another model).
    pub topic: String,
    /// Why it was refused.
    pub reason: String,
}

/// How many refusals `/status` lists.
pub(crate) const RECENT_REJECTIONS: usize = 16;

/// The refusals a member counted: how many, and the latest few. Written by the control loop,
/// read by `/status`.
#[derive(Debug, Default)]
pub(crate) struct Rejections {
    /// The count and the latest refusals, newest last, at most [`RECENT_REJECTIONS`].
    counted: std::sync::Mutex<(u64, std::collections::VecDeque<RejectionReport>)>,
}

impl Rejections {
    /// Counts `rejection` and keeps it among the recent ones.
    pub(crate) fn count(&self, rejection: RejectionReport) {
        let mut counted = crate::locking::lock(&self.counted);
        counted.0 += 1;
        if counted.1.len() == RECENT_REJECTIONS {
            counted.1.pop_front();
        }
        counted.1.push_back(rejection);
    }

    /// How many were counted, and the latest ones, oldest first.
    pub(crate) fn snapshot(&self) -> (u64, Vec<RejectionReport>) {
        let counted = crate::locking::lock(&self.counted);
        (counted.0, counted.1.iter().cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejection(n: usize) -> RejectionReport {
        RejectionReport {
            from: PeerId::new(format!("p{n}")),
            topic: "t".into(),
            reason: "r".into(),
        }
    }

    #[test]
    fn every_refusal_is_counted_and_the_latest_sixteen_kept_in_order() {
        let rejections = Rejections::default();
        for n in 0..20 {
            rejections.count(rejection(n));
        }
        let (total, recent) = rejections.snapshot();
        assert_eq!(total, 20);
        assert_eq!(recent, (4..20).map(rejection).collect::<Vec<_>>());
    }
}
