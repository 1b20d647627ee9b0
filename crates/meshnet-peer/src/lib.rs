//! The meshnet peer: everything a member of the mesh runs, as a library the `meshnet-peer`
//! binary and the whole-mesh tests share.
//!
//! - [`mesh_model`]: the model a mesh runs, its id (name plus content hash) and its memory
//!   shape for the planner.
//! - [`shard`]: the span slot — load, drop with draining, and the activation plane's
//!   executor.
//! - [`tracker`]: the tracker's book of peers, planning rounds, coverage map and directives.
//! - [`routing`]: choosing the hops of a generation over ready peers.
//! - [`remote`]: the remote part of a route as one stage of the generation loop.
//! - [`engine`]: the completion engine behind the OpenAI-style API.
//! - [`status`]: the JSON of `GET /status`.
//! - [`runtime`]: starting a peer (either role) and its control loop.

pub mod engine;
mod error;
pub mod mesh_model;
pub mod remote;
pub mod routing;
pub mod runtime;
pub mod shard;
pub mod status;
pub mod tracker;

pub use error::PeerError;
pub use runtime::{PeerConfig, RunningPeer, start};
