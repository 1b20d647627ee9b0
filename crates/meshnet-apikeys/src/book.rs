//! Every key of a member with its window: who may make a request now, and settling tokens.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::file::{KeyEntry, hash_key};
use crate::window::{Window, WindowVerdict};

/// A key of a [`KeyBook`], found by [`KeyBook::find`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRef(usize);

/// An admitted request's claim on its key's window, to be settled with the tokens it used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    key: usize,
    admitted: Duration,
    reserved: u64,
}

impl Ticket {
    /// The tokens reserved at admission.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }
}

/// The keys of a member and their windows.
#[derive(Debug)]
pub struct KeyBook {
    entries: Vec<KeyEntry>,
    by_hash: HashMap<crate::KeyHash, usize>,
    windows: Mutex<Vec<Window>>,
}

impl KeyBook {
    /// A book of `entries` (as [`parse_key_file`](crate::parse_key_file) gives them), all
    /// windows empty.
    pub fn new(entries: Vec<KeyEntry>) -> Self {
        let by_hash = entries
            .iter()
            .enumerate()
            .map(|(index, entry)| (entry.hash, index))
            .collect();
        let windows = Mutex::new(vec![Window::new(); entries.len()]);
        Self {
            entries,
            by_hash,
            windows,
        }
    }

    /// The keys, in file order.
    pub fn entries(&self) -> &[KeyEntry] {
        &self.entries
    }

    /// The key `token` is, if any. The token is hashed, so the book never holds or compares
    /// plaintext; an empty token is no key.
    pub fn find(&self, token: &str) -> Option<KeyRef> {
        if token.is_empty() {
            return None;
        }
        self.by_hash.get(&hash_key(token)).copied().map(KeyRef)
    }

    /// The id `key` is counted under.
    pub fn id(&self, key: KeyRef) -> &str {
        &self.entries[key.0].id
    }

    /// Admits a request of `key` reserving `reserve` tokens at `now`: its ticket, or the
    /// window's refusal ([`WindowVerdict::Limited`] or [`WindowVerdict::TooLarge`]).
    pub fn admit(&self, key: KeyRef, reserve: u64, now: Duration) -> Result<Ticket, WindowVerdict> {
        let limits = self.entries[key.0].limits;
        match self.with_window(key.0, |window| window.admit(now, limits, reserve)) {
            WindowVerdict::Admitted => Ok(Ticket {
                key: key.0,
                admitted: now,
                reserved: reserve,
            }),
            refusal => Err(refusal),
        }
    }

    /// Settles `ticket`'s request, which used `used` tokens (prompt and completion), at `now`.
    pub fn settle(&self, ticket: Ticket, used: u64, now: Duration) {
        self.with_window(ticket.key, |window| {
            window.settle(ticket.admitted, ticket.reserved, used, now);
        });
    }

    /// Requests and tokens the window of the key with `id` holds at `now`.
    pub fn used(&self, id: &str, now: Duration) -> Option<(u64, u64)> {
        let key = self.entries.iter().position(|entry| entry.id == id)?;
        Some(self.with_window(key, |window| window.used(now)))
    }

    fn with_window<T>(&self, key: usize, f: impl FnOnce(&mut Window) -> T) -> T {
        // A panic while holding the lock cannot leave a window half-updated in a way that
        // matters more than refusing service; take the data either way.
        let mut windows = self
            .windows
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut windows[key])
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{LimitKind, parse_key_file};

    #[test]
    fn tokens_are_looked_up_by_hash_and_limited_per_key() {
        let book = KeyBook::new(
            parse_key_file(
                "alpha id=a rpm=1\n\
                 sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n",
            )
            .unwrap(),
        );
        let now = Duration::from_millis(2_500);
        assert_eq!(book.find("beta"), None);
        assert_eq!(book.find(""), None);
        assert_eq!(book.find("sha256:9f86"), None);
        let alpha = book.find("alpha").unwrap();
        assert_eq!(book.id(alpha), "a");
        let ticket = book.admit(alpha, 7, now).unwrap();
        assert_eq!(ticket.reserved(), 7);
        // The request of second 2 leaves at 62 s: 59.5 s from now, so 60.
        assert_eq!(
            book.admit(alpha, 0, now),
            Err(WindowVerdict::Limited {
                by: LimitKind::Requests,
                retry_after_seconds: 60,
                limit: 1,
                used: 1
            })
        );
        // Another key has its own window (and no limits).
        let test = book.find("test").unwrap();
        assert_eq!(book.id(test), "9f86d081");
        for _ in 0..5 {
            assert!(book.admit(test, 0, now).is_ok());
        }
        book.settle(ticket, 40, now);
        assert_eq!(book.used("a", now), Some((1, 40)));
        assert_eq!(book.used("9f86d081", now), Some((5, 0)));
    }
}
