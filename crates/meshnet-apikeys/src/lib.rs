//! API keys and per-key quotas of a member's OpenAI-style API.
//!
//! - [`parse_key_file`] reads the `--api-keys` file: one key (or its SHA-256) per line with
//!   optional limits, `<key | sha256:HEX> [id=NAME] [rpm=N] [tpm=N]`; plaintext keys are hashed
//!   at once, so only hashes are kept.
//! - [`Window`] is one key's usage over the last [`WINDOW_SECONDS`] seconds in one-second
//!   buckets: it admits a request or says how many whole seconds until it would be admitted.
//! - [`KeyBook`] holds every key with its window: which key a bearer token is
//!   ([`KeyBook::find`]), may it make this request now ([`KeyBook::admit`]), and settling a
//!   request's tokens afterwards ([`KeyBook::settle`]).
//!
//! Time is passed in as a [`Duration`](std::time::Duration) since any fixed start (a
//! [`Clock`]), so the logic is tested without sleeping. The crate does no I/O.

mod book;
mod clock;
mod file;
mod window;

pub use book::{KeyBook, KeyRef, Ticket};
pub use clock::{Clock, ManualClock, SystemClock};
pub use file::{KeyEntry, KeyHash, Limits, hash_key, parse_key_file};
pub use window::{LimitKind, WINDOW_SECONDS, Window, WindowVerdict};

/// Everything that can be wrong with a key file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeysError {
    /// One line is malformed.
    #[error("line {line}: {problem}")]
    Line {
        /// The line's number, from 1.
        line: usize,
        /// What is wrong with it.
        problem: String,
    },
    /// The file holds no key, which would lock every client out.
    #[error("the file holds no key")]
    NoKeys,
}
