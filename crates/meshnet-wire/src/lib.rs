//! The meshnet activation wire format (ADR-0008, ADR-0010, ADR-0011).
//!
//! Hidden states travel between peers as an HTTP body of little-endian bfloat16 values,
//! optionally zstd-compressed at level 1, with everything else in `X-Meshnet-*` headers. This
//! crate is the synchronous, I/O-free part of that: the [`ActivationFrame`] and its
//! [`FrameMeta`], the exact header mapping ([`header`]), bounded decoding that never allocates
//! past the declared shape or the configured [`Limits`], conversions between bfloat16, bytes and
//! candle tensors, 128-token prefill chunking ([`chunk`]), and the tracker's grants that admit
//! a frame to a member ([`grant`]; parsing and route checks only, no cryptography).
//!
//! ```
//! use meshnet_wire::{ActivationFrame, Activations, Encoding, FrameMeta, Limits, Route, Shape};
//! use half::bf16;
//! use meshnet_types::LayerSpan;
//!
//! let activations = Activations::new(Shape::new(&[1, 2, 3])?, vec![bf16::ONE; 6])?;
//! let meta = FrameMeta {
//!     session: uuid::Uuid::new_v4(),
//!     chunk_index: 0,
//!     chunk_total: 1,
//!     position: 0,
//!     layers: LayerSpan::new(0, 10),
//!     route: Route::default(),
//!     grant: None,
//!     fork_from: None,
//!     return_to: None,
//!     rewind: false,
//! };
//! let frame = ActivationFrame { meta, activations };
//! let encoded = frame.encode(Encoding::Zstd);
//! let decoded = ActivationFrame::decode(&encoded.headers, &encoded.body, &Limits::default())?;
//! assert_eq!(decoded, frame);
//! # Ok::<(), meshnet_wire::WireError>(())
//! ```

mod activations;
pub mod chunk;
mod endpoint;
mod error;
mod frame;
pub mod grant;
pub mod header;
pub mod return_address;
mod shape;
#[cfg(feature = "candle")]
mod tensor;

pub use activations::{Activations, bf16_from_le_bytes, bf16_to_le_bytes, write_le_bytes};
pub use chunk::{PREFILL_CHUNK_TOKENS, PrefillChunk, reassemble, split_prefill};
pub use endpoint::{Endpoint, NotAnEndpoint, PEER_ENDPOINT_PREFIX};
pub use error::{ErrorClass, WireError};
pub use frame::{
    ActivationFrame, DEFAULT_MAX_FRAME_BYTES, EncodedFrame, Limits, ZSTD_LEVEL, decode_payload,
    encode_payload,
};
pub use header::{Encoding, FrameMeta, Hop, Route};
pub use return_address::{ReturnAddress, ReturnTicket};
pub use shape::{MAX_DIMS, Shape};

/// The version of the wire format this build speaks, sent in `X-Meshnet-Wire-Version`.
pub const WIRE_VERSION: u32 = 1;
