//! meshnet's shared vocabulary, defined once for every crate of the workspace.
//!
//! - [`LayerSpan`]: a half-open range of transformer layers `[start, end)`, the unit of work a
//!   peer serves, the planner assigns and a frame names.
//! - [`PeerId`]: a member's identity, the text form of its libp2p peer id. `meshnet-p2p` is the
//!   only place that converts it to and from libp2p's own type. [`claim_beats`] orders two
//!   claims to the tracker role.
//! - [`Quantization`]: a weight format a layer can be held in.
//! - [`SamplingConfig`]: how a generation chooses its tokens, carried whole from the API to
//!   the sampler.
//! - [`SpanState`]: whether a held span is loading, serving, or draining its last sessions.
//!
//! Each has `Display`, `FromStr` and serde forms; the crate has no runtime and does no I/O.

mod error;
mod peer;
mod quantization;
mod sampling;
mod span;

pub use error::TypesError;
pub use peer::{PeerId, claim_beats};
pub use quantization::Quantization;
pub use sampling::SamplingConfig;
pub use span::{LayerSpan, SpanState};
