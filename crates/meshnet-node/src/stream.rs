//! The activation plane over byte streams between peers (libp2p streams, in practice): the same
//! HTTP/1.1 requests as over TCP, one request per stream, for peers others cannot dial.
//!
//! A hop names such a peer as `/p2p/<peer id>` instead of a URL ([`meshnet_wire::Endpoint::Peer`]). This module knows nothing of
//! libp2p: a [`StreamOpener`] opens the stream, [`serve_stream`] answers on one.

use std::future::Future;
use std::pin::Pin;

use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use meshnet_metrics::HopPath;
use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream to a peer.
pub trait PeerIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> PeerIo for T {}

/// An open stream and how it reaches the peer.
pub struct OpenedStream {
    /// The stream.
    pub io: Box<dyn PeerIo>,
    /// Direct or through a relay.
    pub path: HopPath,
}

/// What [`StreamOpener::open`] returns.
pub type OpenFuture = Pin<Box<dyn Future<Output = Result<OpenedStream, String>> + Send>>;

/// Opens streams to peers named by id.
pub trait StreamOpener: Send + Sync {
    /// A new stream to `peer`, or why there is none.
    fn open(&self, peer: &str) -> OpenFuture;
}

/// Answers the HTTP requests that arrive on `io` with `router`, until the other side closes
/// the stream.
pub async fn serve_stream(io: impl PeerIo, router: Router) {
    let service = TowerToHyperService::new(router);
    if let Err(error) = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .await
    {
        tracing::debug!(%error, "activation stream ended with an error");
    }
}

/// An answer read from a stream: status, headers and the whole body.
pub(crate) struct StreamAnswer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// Why a request on a stream failed.
pub(crate) enum StreamFailure {
    /// The stream ended before any of the answer came: the receiver may have dropped it unread
    /// (libp2p-stream drops an inbound stream that arrives while the one before it still waits
    /// to be accepted), so sending again on a new stream is worth a try.
    Unanswered(String),
    /// The stream broke or the answer is not HTTP.
    Transport(String),
    /// The answer's body passed `limit` bytes.
    TooLarge(usize),
}

/// Sends one request on `io` and reads the answer, its body at most `max_body` bytes.
pub(crate) async fn exchange(
    io: Box<dyn PeerIo>,
    method: Method,
    path: &str,
    headers: HeaderMap,
    body: Bytes,
    max_body: usize,
) -> Result<StreamAnswer, StreamFailure> {
    let transport = |error: hyper::Error| StreamFailure::Transport(error.to_string());
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(transport)?;
    // The connection task ends when the answer is read and the sender dropped.
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "activation stream closed with an error");
        }
    });
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .body(Full::new(body))
        .map_err(|error| StreamFailure::Transport(error.to_string()))?;
    *request.headers_mut() = headers;
    // HTTP/1.1 wants a Host; the stream already names the peer.
    request.headers_mut().insert(
        http::header::HOST,
        http::HeaderValue::from_static("meshnet"),
    );
    let response = sender
        .send_request(request)
        .await
        .map_err(|error| StreamFailure::Unanswered(error.to_string()))?;
    let (parts, body) = response.into_parts();
    let body = match Limited::new(body, max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.is::<LengthLimitError>() => {
            return Err(StreamFailure::TooLarge(max_body));
        }
        Err(error) => return Err(StreamFailure::Transport(error.to_string())),
    };
    Ok(StreamAnswer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}
