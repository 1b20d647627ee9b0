//! The error of parsing the vocabulary from text.

/// Why a text is not a valid span, peer id or quantization.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TypesError {
    /// Not a layer span such as `10..20`.
    #[error("{0:?} is not a layer span such as 10..20 (start <= end)")]
    Span(String),
    /// An empty or malformed peer id.
    #[error("{0:?} is not a peer id")]
    PeerId(String),
    /// A weight format this project does not know.
    #[error("unknown quantization {0:?} (one of nf4, q4_1, int8, q8_0, bf16)")]
    Quantization(String),
}
