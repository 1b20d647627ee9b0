//! Coverage-first, memory-aware span planner for meshnet.
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
//!    or fixed by configuration). Every other peer keeps its current span, in
//!    the format it already holds it in, if that still fits its memory; a span
//!    that no longer fits is shrunk in place. Everything else a peer holds
//!    (other pieces, other formats, layers past the model's end) is dropped.
//! 2. **Cover.** Gaps are closed left to right, each by the repair that loads
//!    the fewest bytes per gap layer it covers: grow a span that can reach the
//!    gap, place a free peer (best fit), or move a peer whose layers all have
//!    other holders. If that cannot close every gap but the peers' combined
//!    reach can, spans are laid end to end from scratch, so coverage is exact:
//!    whenever a contiguous cover exists, the plan has one.
//! 3. **Redundancy.** Remaining peers take, one by one, the window of layers
//!    with the least summed throughput behind it.
//! 4. **Rebalance.** A span is grown or moved only if that raises the weakest
//!    layer's throughput by more than the hysteresis (20 % by default). The
//!    threshold is on throughput alone: a move that clears it is made however
//!    many bytes it reloads (among equal gains, the one loading fewer layers
//!    wins). Moves repeat until none clears the threshold, so a plan is a
//!    fixed point: replanning its own map gives no directives.
//!
//! Newly placed and moved peers run the best quantization their memory allows
//! for their span length, after reserving KV cache for every layer they hold;
//! kept spans stay in their current format. [`baseline`] holds a Petals-like
//! greedy placement used by the `meshnet-sim` simulator for comparison, and
//! [`scenario`] generates realistic volunteer meshes.

pub mod baseline;
mod error;
mod model;
mod planner;
pub mod scenario;
mod types;

pub use error::PlanError;
pub use model::{MAX_LAYERS, ModelShape, TransformerDimensions};
pub use planner::{CoverageReport, Plan, Planner, PlannerConfig};
pub use types::{CoverageMap, Directive, LayerHolder, PeerCapacity, SpanHolding};
