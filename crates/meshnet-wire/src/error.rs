//! The one error type of the wire crate.

use crate::WIRE_VERSION;

/// Longest excerpt of an offending header value quoted back in an error message.
const QUOTE_LIMIT: usize = 64;

/// Quotes an untrusted value for an error message, cut to a bounded length.
pub(crate) fn quote(value: &str) -> String {
    if value.len() <= QUOTE_LIMIT {
        return value.to_owned();
    }
    let mut end = QUOTE_LIMIT;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &value[..end])
}

/// Everything that can be wrong with an activation frame, its headers or its body.
///
/// Every message names the header or field at fault and, where it helps, what was expected
/// and what was received.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A required header is absent.
    #[error("missing header {name}")]
    MissingHeader {
        /// The header's name.
        name: &'static str,
    },
    /// A header is present but its value cannot be read.
    #[error("invalid header {name}: expected {expected}, got {got:?}")]
    InvalidHeader {
        /// The header's name.
        name: &'static str,
        /// What a valid value looks like.
        expected: &'static str,
        /// The received value (cut to a bounded length).
        got: String,
    },
    /// The sender speaks another version of the wire format.
    #[error("wire version mismatch in X-Meshnet-Wire-Version: expected {expected}, got {got:?}")]
    VersionMismatch {
        /// The version this build speaks.
        expected: u32,
        /// The version the sender declared.
        got: String,
    },
    /// The body is not `application/octet-stream`.
    #[error("unsupported Content-Type: expected application/octet-stream, got {got:?}")]
    UnsupportedContentType {
        /// The received content type, or `(none)`.
        got: String,
    },
    /// The declared dtype is not `bfloat16`.
    #[error("unsupported X-Meshnet-Dtype: expected bfloat16, got {got:?}")]
    UnsupportedDtype {
        /// The received dtype.
        got: String,
    },
    /// The declared body encoding is unknown.
    #[error("unsupported X-Meshnet-Encoding: expected one of {expected}, got {got:?}")]
    UnsupportedEncoding {
        /// The encodings this build understands.
        expected: &'static str,
        /// The received encoding.
        got: String,
    },
    /// The shape is syntactically or semantically invalid.
    #[error("invalid shape in {field}: {reason}, got {got:?}")]
    InvalidShape {
        /// Where the shape came from (a header name or a function argument).
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
        /// The received shape.
        got: String,
    },
    /// The declared shape describes more bytes than this receiver accepts (or than fit in memory).
    #[error(
        "frame too large: shape {shape} needs {declared_bytes} bytes, the limit is {limit} bytes"
    )]
    FrameTooLarge {
        /// The declared shape as text.
        shape: String,
        /// The bytes the shape needs, saturated at `u128::MAX` on overflow.
        declared_bytes: u128,
        /// The configured maximum.
        limit: usize,
    },
    /// The body on the wire is longer than this receiver accepts.
    #[error("body too large: {body_bytes} bytes on the wire, the limit is {limit} bytes")]
    BodyTooLarge {
        /// Bytes received so far (or declared by Content-Length).
        body_bytes: u64,
        /// The configured maximum.
        limit: usize,
    },
    /// The (decompressed) payload does not have the length the shape declares.
    #[error(
        "payload length does not match X-Meshnet-Shape {shape}: expected {expected} bytes, got {got}"
    )]
    LengthMismatch {
        /// The declared shape as text.
        shape: String,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes received (for zstd: `more than expected` is reported as `expected + 1`).
        got: usize,
    },
    /// The zstd stream inflates past the size the shape declares.
    #[error("zstd body inflates past X-Meshnet-Shape {shape}: expected {expected} bytes, got more")]
    DecompressedTooLarge {
        /// The declared shape as text.
        shape: String,
        /// Bytes the shape needs.
        expected: usize,
    },
    /// The zstd stream is corrupt or truncated.
    #[error("corrupt zstd body: {reason}")]
    CorruptCompression {
        /// The decoder's complaint.
        reason: String,
    },
    /// Chunk index and total disagree.
    #[error(
        "invalid chunk numbering: X-Meshnet-Chunk-Index {index} must be below X-Meshnet-Chunk-Total {total}"
    )]
    ChunkOutOfRange {
        /// The declared chunk index.
        index: u32,
        /// The declared chunk total.
        total: u32,
    },
    /// A list of prefill chunks cannot be put back together.
    #[error("cannot reassemble prefill chunks: {reason}")]
    Reassembly {
        /// What is wrong with the chunks.
        reason: String,
    },
    /// The activations do not have the number of elements their shape declares.
    #[error("activations of shape {shape} need {expected} elements, got {got}")]
    ElementCount {
        /// The shape as text.
        shape: String,
        /// Elements the shape needs.
        expected: usize,
        /// Elements supplied.
        got: usize,
    },
    /// A `/forward` request carries no grant (`X-Meshnet-Grant`).
    #[error("no grant: a /forward over HTTP needs the tracker's grant in X-Meshnet-Grant")]
    GrantMissing,
    /// The grant is malformed, expired, signed by another than the tracker, for another
    /// session, or the frame is not travelling its route.
    #[error("grant refused: {reason}")]
    GrantRefused {
        /// Why.
        reason: String,
    },
    /// A `POST /return` carries no ticket (`X-Meshnet-Return-Ticket`).
    #[error("no return ticket: a /return needs the ticket of the frame in X-Meshnet-Return-Ticket")]
    ReturnTicketMissing,
    /// A `POST /return` whose ticket is malformed, unknown, already used, or not for the
    /// session, chunk and position of the frame it carries.
    #[error("return refused: {reason}")]
    ReturnRefused {
        /// Why.
        reason: String,
    },
    /// A candle tensor could not be converted.
    #[cfg(feature = "candle")]
    #[error("tensor conversion failed: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// The class of a [`WireError`], for mapping to a transport status in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Malformed input (HTTP 400).
    Malformed,
    /// The sender speaks another wire version (HTTP 400, answered with `X-Meshnet-Wire-Version`).
    VersionMismatch,
    /// Larger than the receiver accepts (HTTP 413).
    TooLarge,
    /// Unknown encoding, dtype or content type (HTTP 415).
    Unsupported,
    /// No credential (HTTP 401).
    Unauthenticated,
    /// A credential that does not permit the request (HTTP 403).
    Forbidden,
    /// The body does not match the declared shape (HTTP 422).
    LengthMismatch,
    /// A local programming or conversion error, not the peer's fault (HTTP 500).
    Internal,
}

impl WireError {
    /// The class of this error.
    pub fn class(&self) -> ErrorClass {
        match self {
            WireError::MissingHeader { .. }
            | WireError::InvalidHeader { .. }
            | WireError::InvalidShape { .. }
            | WireError::CorruptCompression { .. }
            | WireError::ChunkOutOfRange { .. } => ErrorClass::Malformed,
            WireError::VersionMismatch { .. } => ErrorClass::VersionMismatch,
            WireError::FrameTooLarge { .. } | WireError::BodyTooLarge { .. } => {
                ErrorClass::TooLarge
            }
            WireError::UnsupportedContentType { .. }
            | WireError::UnsupportedDtype { .. }
            | WireError::UnsupportedEncoding { .. } => ErrorClass::Unsupported,
            WireError::LengthMismatch { .. } | WireError::DecompressedTooLarge { .. } => {
                ErrorClass::LengthMismatch
            }
            WireError::Reassembly { .. } | WireError::ElementCount { .. } => ErrorClass::Internal,
            WireError::GrantMissing => ErrorClass::Unauthenticated,
            WireError::GrantRefused { .. } => ErrorClass::Forbidden,
            WireError::ReturnTicketMissing => ErrorClass::Unauthenticated,
            WireError::ReturnRefused { .. } => ErrorClass::Forbidden,
            #[cfg(feature = "candle")]
            WireError::Tensor(_) => ErrorClass::Internal,
        }
    }

    /// A short machine-readable code for this error, stable across releases.
    pub fn code(&self) -> &'static str {
        match self {
            WireError::MissingHeader { .. } => "missing_header",
            WireError::InvalidHeader { .. } => "invalid_header",
            WireError::VersionMismatch { .. } => "wire_version_mismatch",
            WireError::UnsupportedContentType { .. } => "unsupported_content_type",
            WireError::UnsupportedDtype { .. } => "unsupported_dtype",
            WireError::UnsupportedEncoding { .. } => "unsupported_encoding",
            WireError::InvalidShape { .. } => "invalid_shape",
            WireError::FrameTooLarge { .. } => "frame_too_large",
            WireError::BodyTooLarge { .. } => "body_too_large",
            WireError::LengthMismatch { .. } => "length_mismatch",
            WireError::DecompressedTooLarge { .. } => "decompressed_too_large",
            WireError::CorruptCompression { .. } => "corrupt_compression",
            WireError::ChunkOutOfRange { .. } => "chunk_out_of_range",
            WireError::Reassembly { .. } => "reassembly_failed",
            WireError::ElementCount { .. } => "element_count_mismatch",
            WireError::GrantMissing => "grant_missing",
            WireError::GrantRefused { .. } => "grant_refused",
            WireError::ReturnTicketMissing => "return_ticket_missing",
            WireError::ReturnRefused { .. } => "return_refused",
            #[cfg(feature = "candle")]
            WireError::Tensor(_) => "tensor_conversion_failed",
        }
    }

    /// Builds a version-mismatch error for a received version string.
    pub(crate) fn version_mismatch(got: &str) -> Self {
        WireError::VersionMismatch {
            expected: WIRE_VERSION,
            got: quote(got),
        }
    }
}
