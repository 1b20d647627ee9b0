//! The seam between the activation plane and whatever runs the layers.

use meshnet_types::LayerSpan;
use meshnet_wire::{Activations, FrameMeta};

/// Runs a contiguous span of transformer layers on one frame's activations.
///
/// The HTTP layer calls it from a blocking thread, never on the async workers, so an
/// implementation may compute for as long as it needs. It must be safe to call from several
/// threads at once (one call per in-flight request).
pub trait SpanExecutor: Send + Sync + 'static {
    /// The layers this peer can run right now, if any.
    fn served_layers(&self) -> Option<LayerSpan>;

    /// Runs `meta.layers` over `input` for `meta.session`, whose tokens start at absolute position
    /// `meta.position`, and returns the hidden states after the last of those layers.
    fn forward(&self, meta: &FrameMeta, input: Activations) -> Result<Activations, ExecutorError>;

    /// Whether this executor runs the layers `meta` asks for, for that session. The default:
    /// the layers lie within [`Self::served_layers`]. An executor that still finishes old
    /// sessions on layers it no longer serves says so here.
    fn accepts(&self, meta: &FrameMeta) -> bool {
        self.served_layers()
            .is_some_and(|s| s.start <= meta.layers.start && meta.layers.end <= s.end)
    }

    /// Frees whatever the executor keeps for `session` (its KV cache). Unknown sessions are
    /// ignored. The default keeps nothing per session, so it does nothing.
    fn end_session(&self, session: uuid::Uuid) {
        let _ = session;
    }
}

/// Why a span executor refused or failed a frame.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The frame asks for layers this peer does not hold.
    #[error("layers {requested} are not served here (serving {})", served.map_or_else(|| "nothing".to_owned(), |s| s.to_string()))]
    LayersNotServed {
        /// The layers the frame asked for.
        requested: LayerSpan,
        /// The layers this peer holds, if any.
        served: Option<LayerSpan>,
    },
    /// The frame's position does not continue the session's KV cache.
    #[error(
        "session position conflict: the cache expects position {expected}, the frame starts at {got}"
    )]
    PositionConflict {
        /// The next position the session's cache expects.
        expected: u64,
        /// The position the frame declared.
        got: u64,
    },
    /// The frame's session was to start as a copy of another session's cache
    /// (`X-Meshnet-Fork-From`), which this peer does not hold (or not far enough).
    #[error("the session cannot start from the one named in X-Meshnet-Fork-From: {0}")]
    ForkSource(String),
    /// The frame's activations do not fit the model (for example a wrong hidden size).
    #[error("activations do not fit the model: {0}")]
    BadActivations(String),
    /// The peer has no room for another session right now.
    #[error("no capacity for another session; retry later")]
    Overloaded,
    /// The computation itself failed.
    #[error("layer computation failed: {0}")]
    Compute(String),
}
