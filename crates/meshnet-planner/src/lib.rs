//! Coverage-first, memory-aware shard planner for meshnet.
//!
//! meshnet runs one large language model split across volunteer machines.
//! Every peer holds one contiguous, half-open span of transformer layers
//! `[start, end)`; the tracker peer holds `[0..k)` plus the token embedding and
//! the LM head. This crate decides who holds what. It is pure logic: no I/O,
//! no clocks, no randomness, so the same inputs always give the same plan.
//!
//! A [`Planner`] takes the current [`CoverageMap`] and the live peers'
//! [`PeerCapacity`] list and returns a [`Plan`]: the [`Directive`]s to publish
//! (`LoadShard` / `DropShard`), the map after they are applied, and a
//! [`CoverageReport`]. A plan runs in four phases:
//!
//! 1. **Retain.** The tracker gets `[0..k)` (`k` as large as its memory allows,
//!    or fixed by configuration). Every other peer keeps its current span if it
//!    still fits its memory; a span that no longer fits is shrunk in place.
//! 2. **Cover.** Gaps are closed left to right, cheapest repair first: grow a
//!    span that can reach the gap, else place a free peer (best fit), else move
//!    a peer whose layers all have other holders. If that cannot close every gap
//!    but the peers' combined reach can, spans are laid end to end from scratch,
//!    so coverage is exact: whenever a contiguous cover exists, the plan has one.
//! 3. **Redundancy.** Remaining peers take, one by one, the window of layers
//!    with the least summed throughput behind it.
//! 4. **Rebalance.** A healthy span is grown or moved only if that raises the
//!    weakest layer's throughput by more than the hysteresis (20 % by default).
//!
//! Each peer runs the best quantization its memory allows for its span length,
//! after reserving KV cache for every layer it holds. [`baseline`] holds a
//! Petals-like greedy placement used by the `meshnet-sim` simulator for
//! comparison, and [`scenario`] generates realistic volunteer meshes.

pub mod baseline;
mod error;
mod model;
mod planner;
pub mod scenario;
mod types;

pub use error::PlanError;
pub use model::{ModelShape, Quantization, TransformerDimensions};
pub use planner::{CoverageReport, Plan, Planner, PlannerConfig};
pub use types::{
    CoverageMap, Directive, LayerHolder, LayerSpan, PeerCapacity, PeerId, PeerState, ShardHolding,
};
