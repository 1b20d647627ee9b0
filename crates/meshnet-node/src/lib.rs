//! The meshnet node: the HTTP activation plane and its client.
//!
//! [`ActivationPlane`] serves `POST /forward` (ADR-0008): it decodes a binary activation frame,
//! hands it to a [`SpanExecutor`] on a blocking thread, forwards the result to the next hop named
//! in the frame's route (ADR-0011), and answers with the final hidden states in the request's
//! encoding. [`ForwardClient`] is the sending side. Errors map to HTTP status codes in one place,
//! [`NodeError`]'s `IntoResponse`, with a JSON body `{"error":{"code","message"}}`; when a later
//! hop of the route failed, the body also names that hop (`failed_hop`), and
//! [`ClientError::hop_failure`] gives the sender a [`HopFailure`]: which hop failed, its status
//! and code, and whether sending again may succeed.
//!
//! With direct return (ADR-0031) the entry's frames name a return address: the route's last
//! hop posts the output straight to the entry's `POST /return`, where a [`ReturnDesk`] admits
//! it by ticket, and answers `202` back along the route.
//!
//! A hop may also name a peer by id (`/p2p/<peer id>`, for a peer others cannot dial): then
//! the same requests travel over a byte stream to it ([`stream`]), opened by a
//! [`stream::StreamOpener`] the application provides (a libp2p stream, direct or relayed).

mod activation;
mod client;
mod error;
mod error_body;
mod executor;
mod hop;
mod return_desk;
pub mod stream;

pub use activation::{ActivationPlane, ForwardGate};
pub use client::{ClientError, DEFAULT_HOP_TIMEOUT, Delivery, ForwardClient};
pub use error::NodeError;
pub use error_body::{ErrorBody, ErrorDetail};
pub use executor::{ExecutorError, SpanExecutor};
pub use hop::{HopFailure, HopFailureKind};
pub use return_desk::{AwaitedReturn, DEFAULT_RETURN_CAPACITY, ReturnDesk};

/// Frames up to this many bytes (raw or encoded) are encoded and decoded on the async worker
/// that handles them: a decode step's frame (one token, a few KiB) takes microseconds, less than
/// the hand-off to the blocking pool and back, which a hop would otherwise pay four times.
pub(crate) const INLINE_CODEC_BYTES: usize = 32 * 1024;

/// Runs codec work on `bytes` bytes: inline when small ([`INLINE_CODEC_BYTES`]), else on the
/// blocking pool as [`blocking`] does.
pub(crate) async fn codec<T, F>(bytes: usize, work: F) -> Result<T, String>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    if bytes <= INLINE_CODEC_BYTES {
        Ok(work())
    } else {
        blocking(work).await
    }
}

/// The work decoding a received frame takes, in bytes: its body, or the raw size its
/// `X-Meshnet-Shape` declares when larger (a small compressed body may unpack to much more).
pub(crate) fn decode_bytes(headers: &axum::http::HeaderMap, body_len: usize) -> usize {
    meshnet_wire::header::read_meta(headers)
        .map_or(body_len, |(shape, _)| shape.byte_len().max(body_len))
}

/// Runs CPU-bound work (decoding, compression, layer compute) on tokio's blocking pool, off the
/// async workers. A panic in `work` comes back as an error message.
pub(crate) async fn blocking<T, F>(work: F) -> Result<T, String>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| format!("worker task failed: {e}"))
}
