//! The order in which a session's chunks enter a span.
//!
//! A pipelined prefill (ADR-0021) has several chunks of one session travelling at once, each
//! on its own request, so a chunk may reach a peer before the one ahead of it. The KV cache
//! takes a session's chunks only in position order, so a chunk that arrives early waits
//! (bounded) until the chunks before it have been handed to the span's compute thread; the
//! thread then runs them in that order. A chunk whose turn never comes goes ahead after the
//! wait and is refused by the cache as a gap, as before.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use meshnet_model::SessionId;

/// How long a chunk waits for the chunks before it. They left the previous hop earlier, so
/// only the network or a busy receiving thread can put them behind.
pub const CHUNK_TURN_WAIT: Duration = Duration::from_secs(2);

/// Sessions remembered before the ones untouched for [`FORGET_AFTER`] are dropped.
const PRUNE_ABOVE: usize = 1024;

/// How long a session's place is remembered after its last chunk when it was never ended.
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Where each session's next chunk starts, as far as chunks have entered the span.
#[derive(Debug, Default)]
pub struct ChunkOrder {
    next: Mutex<HashMap<SessionId, (usize, Instant)>>,
    moved: Condvar,
}

impl ChunkOrder {
    /// Waits, at most `patience`, until every chunk of `session` before `position` has
    /// entered (a session starts at 0). Returns whether the turn came; a caller whose turn did
    /// not come goes ahead anyway and gets the cache's refusal.
    pub fn wait_turn(&self, session: SessionId, position: usize, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        let mut next = self.lock();
        loop {
            let entered = next.get(&session).map_or(0, |(end, _)| *end);
            if position <= entered {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            next = self
                .moved
                .wait_timeout(next, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Records that the chunk of `session` ending at `end` has entered the span, letting the
    /// next one go.
    pub fn entered(&self, session: SessionId, end: usize) {
        let mut next = self.lock();
        let now = Instant::now();
        if next.len() >= PRUNE_ABOVE {
            next.retain(|_, (_, at)| now.duration_since(*at) < FORGET_AFTER);
        }
        let place = next.entry(session).or_insert((0, now));
        *place = (place.0.max(end), now);
        drop(next);
        self.moved.notify_all();
    }

    /// Forgets `session` (it ended); a chunk waiting for it stops waiting at its deadline.
    pub fn forget(&self, session: SessionId) {
        self.lock().remove(&session);
    }

    #[cfg(test)]
    fn remembered(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SessionId, (usize, Instant)>> {
        self.next.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc::channel;

    use super::*;

    fn session(n: u128) -> SessionId {
        uuid::Uuid::from_u128(n)
    }

    #[test]
    fn a_first_chunk_and_the_chunk_next_in_line_go_at_once() {
        let order = ChunkOrder::default();
        assert!(order.wait_turn(session(1), 0, Duration::ZERO));
        order.entered(session(1), 128);
        assert!(order.wait_turn(session(1), 128, Duration::ZERO));
        // Another session's place is its own.
        assert!(!order.wait_turn(session(2), 128, Duration::ZERO));
    }

    #[test]
    fn an_early_chunk_waits_until_the_one_before_it_has_entered() {
        let order = Arc::new(ChunkOrder::default());
        let (done, finished) = channel();
        let waiting = Arc::clone(&order);
        let early = std::thread::spawn(move || {
            let came = waiting.wait_turn(session(7), 128, Duration::from_secs(30));
            done.send(()).unwrap();
            came
        });
        // The early chunk is still waiting: its turn has not come.
        assert!(finished.recv_timeout(Duration::from_millis(100)).is_err());
        order.entered(session(7), 128);
        assert!(early.join().unwrap());
    }

    #[test]
    fn a_chunk_whose_turn_never_comes_goes_ahead_at_its_deadline() {
        let order = ChunkOrder::default();
        order.entered(session(3), 128);
        let started = Instant::now();
        assert!(!order.wait_turn(session(3), 384, Duration::from_millis(50)));
        let waited = started.elapsed();
        // At its deadline, late only by what the machine's load delays a thread.
        assert!(
            waited >= Duration::from_millis(50) && waited < Duration::from_millis(1050),
            "{waited:?}"
        );
    }

    #[test]
    fn an_ended_session_is_forgotten() {
        let order = ChunkOrder::default();
        order.entered(session(4), 64);
        assert_eq!(order.remembered(), 1);
        order.forget(session(4));
        assert_eq!(order.remembered(), 0);
        assert!(!order.wait_turn(session(4), 64, Duration::ZERO));
    }
}
