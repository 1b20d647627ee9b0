//! A userspace link emulator for meshnet's testbeds.
//!
//! The kernels the testbeds run on have no `netem`, so delay and bandwidth have to come from a
//! userspace relay between the members; this crate holds its pieces.
//!
//! - [`shape`]: pure arithmetic, no I/O. A [`LinkShape`] (one-way delay, jitter, a token-bucket
//!   rate and burst) and the [`Shaper`] that says when each chunk of a byte stream may be
//!   delivered: never reordered, never before arrival plus delay, never more than burst plus
//!   rate times time.

pub mod shape;

pub use shape::{LinkShape, Shaper};
