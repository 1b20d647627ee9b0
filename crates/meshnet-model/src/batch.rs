//! Several sessions' chunks computed in one pass over a span's weights.
//!
//! A span's matmuls cost about the same for one input row as for a handful (the weights are
//! read once either way), so concurrent sessions go faster together: their rows share every
//! matmul while each keeps its own positions, KV cache and attention. A batched chunk's result
//! has the bits it would have alone.

use candle_core::Tensor;

use crate::kv_cache::SessionId;

/// One session's chunk in a batch.
#[derive(Debug, Clone)]
pub struct BatchItem {
    /// The session whose KV cache the chunk continues.
    pub session: SessionId,
    /// The absolute position of the chunk's first token.
    pub position: usize,
    /// The chunk's hidden states, `[1, tokens, hidden]`, any float dtype.
    pub hidden: Tensor,
}
