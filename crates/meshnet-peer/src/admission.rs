//! Who may start a generation now. A bounded number run at once; past that, requests wait in
//! line, first come first served, a bounded number of them and each for a bounded time. Only a
//! request that finds the line full, or waits out its time, is refused (429): a burst is
//! served in turn instead of refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use meshnet_api::EngineError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How many generations run and wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Generations that run at once.
    pub max_running: usize,
    /// Requests that wait for a slot; one more is refused at once (0: no line).
    pub max_waiting: usize,
    /// How long a request waits for a slot before it is refused.
    pub max_wait: Duration,
}

/// The generation slots and the line for them.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: AdmissionLimits,
    /// One permit per generation that may run; tokio hands freed permits to waiters in order.
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
}

/// A place in the line, given up when dropped (admitted, timed out, or the client left).
struct PlaceInLine<'a>(&'a AtomicUsize);

impl Drop for PlaceInLine<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Admission {
    /// Slots and a line shaped by `limits`.
    pub(crate) fn new(limits: AdmissionLimits) -> Self {
        Admission {
            limits,
            slots: Arc::new(Semaphore::new(limits.max_running)),
            waiting: AtomicUsize::new(0),
        }
    }

    /// The limits.
    pub(crate) fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    /// Generations running now.
    pub(crate) fn running(&self) -> usize {
        self.limits.max_running - self.slots.available_permits()
    }

    /// Requests waiting for a slot now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// A slot, at once if one is free, else after the requests ahead in line; the slot is
    /// free again when the permit is dropped. Refused ([`EngineError::Busy`]) when the line is
    /// full or the wait runs out.
    pub(crate) async fn admit(&self) -> Result<OwnedSemaphorePermit, EngineError> {
        // A free permit is never left while others wait (they get it first), so this does
        // not jump the line.
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(permit);
        }
        let _place = self.take_place()?;
        let wait = self.limits.max_wait;
        match tokio::time::timeout(wait, Arc::clone(&self.slots).acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(closed)) => Err(EngineError::Internal(closed.to_string())),
            Err(_) => Err(EngineError::Busy {
                reason: format!(
                    "waited {} s in line while {} generations ran",
                    wait.as_secs_f64(),
                    self.limits.max_running
                ),
                retry_after_seconds: 1,
            }),
        }
    }

    fn take_place(&self) -> Result<PlaceInLine<'_>, EngineError> {
        let max = self.limits.max_waiting;
        self.waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |waiting| {
                (waiting < max).then_some(waiting + 1)
            })
            .map(|_| PlaceInLine(&self.waiting))
            .map_err(|_| EngineError::Busy {
                reason: format!(
                    "{} generations are running and {max} are waiting, the most this mesh queues",
                    self.limits.max_running
                ),
                retry_after_seconds: 1,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_running: usize, max_waiting: usize, max_wait_ms: u64) -> AdmissionLimits {
        AdmissionLimits {
            max_running,
            max_waiting,
            max_wait: Duration::from_millis(max_wait_ms),
        }
    }

    fn is_busy(result: &Result<OwnedSemaphorePermit, EngineError>, says: &str) -> bool {
        matches!(result, Err(EngineError::Busy { reason, .. }) if reason.contains(says))
    }

    #[tokio::test]
    async fn a_burst_waits_in_line_and_is_served_in_order() {
        let admission = Arc::new(Admission::new(limits(1, 2, 60_000)));
        let first = admission.admit().await.unwrap();
        let (order_tx, mut order) = tokio::sync::mpsc::channel(2);
        let mut waiters = Vec::new();
        for n in 0..2 {
            let waiter = Arc::clone(&admission);
            let order_tx = order_tx.clone();
            waiters.push(tokio::spawn(async move {
                let permit = waiter.admit().await.unwrap();
                order_tx.send(n).await.unwrap();
                permit
            }));
            // The first waiter is in line before the second asks.
            while admission.waiting() < n + 1 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!((admission.running(), admission.waiting()), (1, 2));
        // The line is full: one more is refused at once.
        assert!(is_busy(&admission.admit().await, "2 are waiting"));
        drop(first);
        let second = waiters.remove(0).await.unwrap();
        assert_eq!(order.recv().await, Some(0));
        assert_eq!((admission.running(), admission.waiting()), (1, 1));
        drop(second);
        let _third = waiters.remove(0).await.unwrap();
        assert_eq!(order.recv().await, Some(1));
        assert_eq!((admission.running(), admission.waiting()), (1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_waits_out_its_time_is_refused_and_leaves_the_line() {
        let admission = Admission::new(limits(1, 4, 100));
        let _running = admission.admit().await.unwrap();
        // The clock is the test's: it moves only when every task waits, straight to the
        // next deadline, so the wait is exactly the queue timeout.
        let asked = tokio::time::Instant::now();
        let refused = admission.admit().await;
        assert_eq!(asked.elapsed(), Duration::from_millis(100));
        assert!(is_busy(&refused, "waited 0.1 s in line"), "{refused:?}");
        assert_eq!(admission.waiting(), 0);
    }

    #[tokio::test]
    async fn a_client_that_leaves_the_line_gives_up_its_place() {
        let admission = Admission::new(limits(1, 1, 60_000));
        let _running = admission.admit().await.unwrap();
        {
            let waiting = admission.admit();
            tokio::pin!(waiting);
            // Polled once: in line, not admitted.
            assert!(futures::poll!(waiting.as_mut()).is_pending());
            assert_eq!(admission.waiting(), 1);
        }
        assert_eq!(admission.waiting(), 0);
    }

    #[tokio::test]
    async fn with_no_line_a_full_house_is_refused_at_once() {
        let admission = Admission::new(limits(2, 0, 60_000));
        let _a = admission.admit().await.unwrap();
        let _b = admission.admit().await.unwrap();
        assert!(is_busy(&admission.admit().await, "0 are waiting"));
        assert_eq!(admission.running(), 2);
    }
}
