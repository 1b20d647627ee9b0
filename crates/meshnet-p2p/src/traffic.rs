//! Counts of the gossip a node sends and receives: the payload bytes of the control messages
//! (announcements, coverage maps, directives), not gossipsub's own framing, control traffic or
//! duplicates, which the node never sees.

use std::sync::atomic::{AtomicU64, Ordering};

/// Gossip payload counters, shared by the event loop (which counts) and its handles (which
/// read).
#[derive(Debug, Default)]
pub(crate) struct TrafficCounters {
    published_messages: AtomicU64,
    published_bytes: AtomicU64,
    received_messages: AtomicU64,
    received_bytes: AtomicU64,
}

impl TrafficCounters {
    /// Counts a message of `bytes` this node published.
    pub(crate) fn published(&self, bytes: usize) {
        self.published_messages.fetch_add(1, Ordering::Relaxed);
        self.published_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Counts a message of `bytes` this node received (once per message, whatever the verdict).
    pub(crate) fn received(&self, bytes: usize) {
        self.received_messages.fetch_add(1, Ordering::Relaxed);
        self.received_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// The counts now.
    pub(crate) fn snapshot(&self) -> GossipTraffic {
        GossipTraffic {
            published_messages: self.published_messages.load(Ordering::Relaxed),
            published_bytes: self.published_bytes.load(Ordering::Relaxed),
            received_messages: self.received_messages.load(Ordering::Relaxed),
            received_bytes: self.received_bytes.load(Ordering::Relaxed),
        }
    }
}

/// How much gossip a node has published and received since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GossipTraffic {
    /// Messages this node published.
    pub published_messages: u64,
    /// Their payload bytes.
    pub published_bytes: u64,
    /// Messages this node received from others (each once, before validation).
    pub received_messages: u64,
    /// Their payload bytes.
    pub received_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_per_direction() {
        let counters = TrafficCounters::default();
        counters.published(100);
        counters.received(40);
        counters.received(2);
        assert_eq!(
            counters.snapshot(),
            GossipTraffic {
                published_messages: 1,
                published_bytes: 100,
                received_messages: 2,
                received_bytes: 42,
            }
        );
    }
}
