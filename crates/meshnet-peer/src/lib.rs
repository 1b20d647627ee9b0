//! The meshnet peer: everything a member of the mesh runs, as a library the `meshnet-peer`
//! binary and the whole-mesh tests share (ADR-0029 has the module map).
//!
//! - [`config`]: how a member is started.
//! - [`runtime`]: starting a member (either role) and the handle to a running one.
//! - `member`: the state the HTTP handlers and the control loop share, with the role as a type.
//! - `control`: the control loop (announcing, directives, reaping, and the tracker's planning).
//! - `http`: the HTTP server (activation plane, `/status`, `/health`, the OpenAI-style API).
//! - [`mesh_model`]: the model a mesh runs, its id (name plus content hash) and its memory
//!   shape for the planner.
//! - [`span_host`]: the span slot — load, drop with draining, and the activation plane's
//!   executor.
//! - [`batcher`]: the compute thread that runs every session's work on a span in shared passes.
//! - [`chunk_order`]: a session's chunks enter a span in position order.
//! - [`tracker`]: the tracker's book of peers, planning rounds, coverage map and directives.
//! - [`route_table`]: what the book knows of the members (peers, bans, checked sessions, the
//!   planned map) as one value, with the routes, holders and succession read from it.
//! - `book_routes`: the book owned by the control loop, the route table it publishes, and the
//!   commands generations send it.
//! - `tracker_role`: what a member builds when it starts as the tracker or takes the role over.
//! - [`routing`]: choosing the hops of a generation over ready peers.
//! - [`route_gates`]: what the draft gates of earlier generations timed, per route.
//! - [`remote`]: the remote part of a route as one stage of the generation loop.
//! - [`engine`]: the completion engine behind the OpenAI-style API.
//! - `tool_use`: a chat's tools and calls through the template, the grammar that makes the
//!   model call one, and the calls read out of the answer.
//! - [`status`]: the JSON of `GET /status`; `rejections`: the refused gossip it lists.
//! - `locking`: the poison-tolerant lock every module takes its mutexes with.
//! - [`console`]: the text table of `meshnet-peer status` and the server-sent-event decoder of
//!   `meshnet-peer chat`.

pub mod admission;
pub mod batcher;
mod book_routes;
pub mod chunk_order;
pub mod config;
pub mod console;
mod control;
pub mod election;
pub mod engine;
mod error;
#[cfg(feature = "faulty-member")]
pub mod faulty;
pub mod grants;
mod http;
pub mod latency;
mod locking;
mod member;
pub mod mesh_model;
mod p2p_plane;
mod rejections;
pub mod remote;
pub mod route_gates;
pub mod route_table;
pub mod routing;
pub mod runtime;
pub mod span_host;
pub mod status;
mod tool_use;
pub mod tracker;
mod tracker_role;
pub mod verify;

#[cfg(all(feature = "faulty-member", not(debug_assertions)))]
compile_error!(
    "the faulty-member feature corrupts frames on purpose; it exists in debug builds only"
);

pub use config::PeerConfig;
pub use error::PeerError;
pub use runtime::{LeaveOutcome, RunningPeer, start};
