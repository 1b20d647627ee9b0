//! One key's usage over a sliding window of [`WINDOW_SECONDS`] seconds, in one-second buckets.
//!
//! A request admitted at time `t` counts (as one request and its tokens) in the bucket of the
//! whole second `s = floor(t)`, and leaves the window at `s + 60`: it counts while
//! `now < s + 60`. A window thus holds at most 60 buckets whatever the traffic. A request is
//! admitted when, with it, the requests in the window stay within `rpm` and the tokens within
//! `tpm`; otherwise the answer is how many whole seconds (rounded up, at least 1) until enough
//! buckets leave for it to be admitted, were nothing else to arrive.

use std::collections::VecDeque;
use std::time::Duration;

use crate::Limits;

/// The window's length in seconds: limits are per minute.
pub const WINDOW_SECONDS: u64 = 60;

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
}

impl LimitKind {
    /// The metric label and the word in messages: `rpm` or `tpm`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "rpm",
            LimitKind::Tokens => "tpm",
        }
    }
}

/// What the window says to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowVerdict {
    /// Admitted and counted.
    Admitted,
    /// Over a limit: retry in `retry_after_seconds` (the later of the limits over, when both
    /// are; `by` names the one that waits longer, requests on a tie).
    Limited {
        /// The limit that keeps the request out longest.
        by: LimitKind,
        /// Whole seconds until the request would be admitted.
        retry_after_seconds: u64,
        /// That limit.
        limit: u64,
        /// What the window holds of it now.
        used: u64,
    },
    /// The request alone reserves more tokens than `tpm`: it never fits.
    TooLarge {
        /// The tokens it reserves.
        reserved: u64,
        /// The key's tokens-per-minute limit.
        tpm: u64,
    },
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    second: u64,
    requests: u64,
    tokens: u64,
}

/// One key's requests and tokens over the last [`WINDOW_SECONDS`] seconds.
#[derive(Clone, Debug, Default)]
pub struct Window {
    buckets: VecDeque<Bucket>,
}

impl Window {
    /// An empty window.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests and tokens counted at `now`.
    pub fn used(&mut self, now: Duration) -> (u64, u64) {
        self.expire(now);
        self.buckets.iter().fold((0, 0), |(requests, tokens), b| {
            (requests + b.requests, tokens.saturating_add(b.tokens))
        })
    }

    /// Admits one request reserving `reserve` tokens at `now` under `limits`, and counts it;
    /// or says why not. Under a token limit a request needs room for at least one token, so
    /// a key with its tokens spent waits even for a request that reserves none.
    pub fn admit(&mut self, now: Duration, limits: Limits, reserve: u64) -> WindowVerdict {
        if let Some(tpm) = limits.tpm
            && reserve > tpm
        {
            return WindowVerdict::TooLarge {
                reserved: reserve,
                tpm,
            };
        }
        let (requests, tokens) = self.used(now);
        let mut refusal: Option<WindowVerdict> = None;
        if let Some(rpm) = limits.rpm
            && requests + 1 > rpm
        {
            let wait = self.wait_for(now, requests + 1 - rpm, |b| b.requests);
            refusal = Some(limited(LimitKind::Requests, wait, rpm, requests));
        }
        if let Some(tpm) = limits.tpm
            && tokens.saturating_add(reserve.max(1)) > tpm
        {
            let wait = self.wait_for(now, tokens.saturating_add(reserve.max(1)) - tpm, |b| {
                b.tokens
            });
            let longer = match refusal {
                Some(WindowVerdict::Limited {
                    retry_after_seconds,
                    ..
                }) => wait > retry_after_seconds,
                _ => true,
            };
            if longer {
                refusal = Some(limited(LimitKind::Tokens, wait, tpm, tokens));
            }
        }
        if let Some(refusal) = refusal {
            return refusal;
        }
        let bucket = self.bucket_at(now);
        bucket.requests += 1;
        bucket.tokens = bucket.tokens.saturating_add(reserve);
        WindowVerdict::Admitted
    }

    /// Settles a request admitted at `admitted` that reserved `reserved` tokens and used
    /// `used`: the reservation leaves its bucket (if still in the window) and `used` is
    /// counted at `now`.
    pub fn settle(&mut self, admitted: Duration, reserved: u64, used: u64, now: Duration) {
        self.expire(now);
        let second = admitted.as_secs();
        if let Some(bucket) = self.buckets.iter_mut().find(|b| b.second == second) {
            bucket.tokens -= reserved.min(bucket.tokens);
        }
        if used > 0 {
            let bucket = self.bucket_at(now);
            bucket.tokens = bucket.tokens.saturating_add(used);
        }
    }

    /// Whether nothing is counted at `now` (the window may be forgotten).
    pub fn is_idle(&mut self, now: Duration) -> bool {
        self.expire(now);
        self.buckets.is_empty()
    }

    /// Drops the buckets that left the window at `now`.
    fn expire(&mut self, now: Duration) {
        let second = now.as_secs();
        while self
            .buckets
            .front()
            .is_some_and(|b| b.second + WINDOW_SECONDS <= second)
        {
            self.buckets.pop_front();
        }
    }

    /// The bucket of `now`'s second, made if needed. Time never runs backwards for a window:
    /// a `now` before the newest bucket counts in the newest bucket.
    fn bucket_at(&mut self, now: Duration) -> &mut Bucket {
        let second = now.as_secs();
        let newest = self.buckets.back().map(|b| b.second);
        if newest.is_none_or(|newest| newest < second) {
            self.buckets.push_back(Bucket {
                second,
                requests: 0,
                tokens: 0,
            });
        }
        let last = self.buckets.len() - 1;
        &mut self.buckets[last]
    }

    /// Whole seconds from `now` until the oldest buckets that hold `need` of `amount` leave.
    fn wait_for(&self, now: Duration, need: u64, amount: impl Fn(&Bucket) -> u64) -> u64 {
        let mut freed = 0u64;
        for bucket in &self.buckets {
            freed = freed.saturating_add(amount(bucket));
            if freed >= need {
                return seconds_until(now, bucket.second + WINDOW_SECONDS);
            }
        }
        WINDOW_SECONDS
    }
}

fn limited(by: LimitKind, retry_after_seconds: u64, limit: u64, used: u64) -> WindowVerdict {
    WindowVerdict::Limited {
        by,
        retry_after_seconds,
        limit,
        used,
    }
}

/// Whole seconds from `now` until `second`, rounded up, at least 1.
fn seconds_until(now: Duration, second: u64) -> u64 {
    let left = Duration::from_secs(second).saturating_sub(now);
    let whole = left.as_secs() + u64::from(left.subsec_nanos() > 0);
    whole.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    const RPM2: Limits = Limits {
        rpm: Some(2),
        tpm: None,
    };

    #[test]
    fn rpm_refuses_the_third_request_until_the_first_leaves() {
        let mut window = Window::new();
        assert_eq!(window.admit(ms(10_250), RPM2, 0), WindowVerdict::Admitted);
        assert_eq!(window.admit(ms(30_000), RPM2, 0), WindowVerdict::Admitted);
        // The first left its bucket (second 10) at 70 s: from 40.5 s that is 29.5 s, so 30.
        assert_eq!(
            window.admit(ms(40_500), RPM2, 0),
            WindowVerdict::Limited {
                by: LimitKind::Requests,
                retry_after_seconds: 30,
                limit: 2,
                used: 2
            }
        );
        assert_eq!(
            window.admit(ms(69_999), RPM2, 0),
            WindowVerdict::Limited {
                by: LimitKind::Requests,
                retry_after_seconds: 1,
                limit: 2,
                used: 2
            }
        );
        assert_eq!(window.admit(ms(70_000), RPM2, 0), WindowVerdict::Admitted);
        assert_eq!(window.used(ms(70_000)), (2, 0));
    }

    #[test]
    fn tpm_waits_for_enough_tokens_to_leave() {
        let limits = Limits {
            rpm: None,
            tpm: Some(100),
        };
        let mut window = Window::new();
        assert_eq!(window.admit(ms(0), limits, 30), WindowVerdict::Admitted);
        assert_eq!(window.admit(ms(5_000), limits, 30), WindowVerdict::Admitted);
        assert_eq!(window.admit(ms(9_000), limits, 30), WindowVerdict::Admitted);
        // 90 used; 50 more needs 40 freed: the buckets of 0 s and 5 s, gone at 65 s.
        assert_eq!(
            window.admit(ms(20_000), limits, 50),
            WindowVerdict::Limited {
                by: LimitKind::Tokens,
                retry_after_seconds: 45,
                limit: 100,
                used: 90
            }
        );
        assert_eq!(
            window.admit(ms(20_000), limits, 10),
            WindowVerdict::Admitted
        );
        // Spent: even a request reserving nothing waits for the first bucket to leave.
        assert_eq!(
            window.admit(ms(21_000), limits, 0),
            WindowVerdict::Limited {
                by: LimitKind::Tokens,
                retry_after_seconds: 39,
                limit: 100,
                used: 100
            }
        );
        assert_eq!(
            window.admit(ms(21_000), limits, 101),
            WindowVerdict::TooLarge {
                reserved: 101,
                tpm: 100
            }
        );
    }

    #[test]
    fn the_longer_wait_of_two_limits_is_answered() {
        let limits = Limits {
            rpm: Some(1),
            tpm: Some(10),
        };
        let mut window = Window::new();
        assert_eq!(window.admit(ms(1_000), limits, 4), WindowVerdict::Admitted);
        window.settle(ms(1_000), 4, 3, ms(2_000));
        window.settle(ms(1_000), 0, 7, ms(30_000));
        // Requests free at 61 s; 5 tokens need the buckets of 2 s (3) and 30 s (7) gone, at 90 s.
        assert_eq!(
            window.admit(ms(40_000), limits, 5),
            WindowVerdict::Limited {
                by: LimitKind::Tokens,
                retry_after_seconds: 50,
                limit: 10,
                used: 10
            }
        );
    }

    #[test]
    fn settling_replaces_the_reservation_with_the_tokens_used() {
        let limits = Limits {
            rpm: None,
            tpm: Some(1000),
        };
        let mut window = Window::new();
        assert_eq!(window.admit(ms(0), limits, 500), WindowVerdict::Admitted);
        assert_eq!(window.used(ms(1)), (1, 500));
        window.settle(ms(0), 500, 120, ms(3_000));
        assert_eq!(window.used(ms(3_000)), (1, 120));
        // A reservation whose bucket already left is not taken twice.
        assert_eq!(
            window.admit(ms(4_000), limits, 200),
            WindowVerdict::Admitted
        );
        window.settle(ms(4_000), 200, 50, ms(80_000));
        assert_eq!(window.used(ms(80_000)), (0, 50));
        assert!(!window.is_idle(ms(139_999)));
        assert!(window.is_idle(ms(140_000)));
    }

    proptest! {
        /// Whatever the arrivals, no 60 s span ever holds more than rpm admitted requests.
        #[test]
        fn never_more_than_rpm_in_any_window(
            rpm in 1u64..6,
            gaps in proptest::collection::vec(0u64..20_000, 1..80),
        ) {
            let limits = Limits { rpm: Some(rpm), tpm: None };
            let mut window = Window::new();
            let mut now = 0u64;
            let mut admitted: Vec<u64> = Vec::new();
            for gap in gaps {
                now += gap;
                if window.admit(ms(now), limits, 0) == WindowVerdict::Admitted {
                    admitted.push(now / 1000);
                }
            }
            for (i, &start) in admitted.iter().enumerate() {
                let inside = admitted[i..].iter().take_while(|&&s| s < start + WINDOW_SECONDS).count();
                prop_assert!(inside as u64 <= rpm);
            }
        }

        /// Retry-After is exact: the same request is admitted after it, and not a second before.
        #[test]
        fn retry_after_is_exact(
            rpm in 1u64..4,
            tpm in 10u64..100,
            arrivals in proptest::collection::vec((0u64..30_000, 0u64..10), 1..40),
        ) {
            let limits = Limits { rpm: Some(rpm), tpm: Some(tpm) };
            let mut window = Window::new();
            let mut now = 0u64;
            for (gap, tokens) in arrivals {
                now += gap;
                let before = window.clone();
                match window.admit(ms(now), limits, tokens) {
                    WindowVerdict::Admitted => {}
                    WindowVerdict::TooLarge { .. } => prop_assert!(false, "reserve below tpm"),
                    WindowVerdict::Limited { retry_after_seconds, .. } => {
                        let mut later = before.clone();
                        let at = now + retry_after_seconds * 1000;
                        prop_assert_eq!(
                            later.admit(ms(at), limits, tokens),
                            WindowVerdict::Admitted
                        );
                        if retry_after_seconds > 1 {
                            let mut earlier = before.clone();
                            let at = now + (retry_after_seconds - 1) * 1000;
                            let early = earlier.admit(ms(at), limits, tokens);
                            prop_assert!(early != WindowVerdict::Admitted);
                        }
                    }
                }
            }
        }
    }
}
