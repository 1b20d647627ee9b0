//! A userspace link emulator for meshnet's testbeds.
//!
//! The kernels the testbeds run on have no `netem`, so delay and bandwidth come from a TCP relay
//! instead: a member dials the relay's listening address, the relay dials the real member, and
//! every byte between them is held back as one direction of a real link would hold it.
//!
//! - [`shape`]: pure arithmetic, no I/O. A [`LinkShape`] (one-way delay, jitter, a token-bucket
//!   rate and burst) and the [`Shaper`] that says when each chunk of a byte stream may be
//!   delivered: never reordered, never before arrival plus delay, never more than burst plus
//!   rate times time.
//! - [`relay`]: the tokio relay, one [`Shaper`] per direction shared by all of a link's
//!   connections, bounded queues, end of stream and errors passed on as a half-close.
//! - [`selftest`]: an echo server behind a relay, in-process, and the round-trip time and
//!   throughput measured through it against the setting.
//!
//! The `meshnet-linkem` binary runs relays (`relay`) and the self-test (`selftest`).

pub mod error;
pub mod relay;
pub mod selftest;
pub mod shape;

pub use error::LinkemError;
pub use relay::Relay;
pub use selftest::SelftestReport;
pub use shape::{LinkShape, Shaper};
