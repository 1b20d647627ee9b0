//! The receiving side of the activation plane: `POST /forward`.
//!
//! A request carries one frame. The peer runs the frame's layers, then, if the route names
//! further hops, posts the result to the next one (which does the same) and answers with what
//! comes back: the hidden states after the last layer of the route travel back up the chain to
//! the sender. Answers use the request's encoding.
//!
//! With direct return (ADR-0031) the frame names the entry's return address: the last hop
//! posts the output there and answers `202` with no body, which each hop passes back up; if
//! the entry cannot be reached that way, the output travels back along the route as before.
//! `POST /return` is the entry's side: it admits an output by the ticket its frame carried.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use meshnet_metrics::Direction;
use meshnet_types::LayerSpan;
use meshnet_wire::grant::GrantedFrame;
use meshnet_wire::header::read_return_ticket;
use meshnet_wire::header::{Encoding, check_wire_version};
use meshnet_wire::return_address::RETURN_TICKET;
use meshnet_wire::{ActivationFrame, Limits, ReturnAddress, WireError};

use crate::client::{Delivery, ForwardClient};
use crate::error::NodeError;
use crate::executor::{ExecutorError, SpanExecutor};
use crate::return_desk::ReturnDesk;
use crate::{blocking, codec, decode_bytes};

/// Decides from a `/forward` request's headers alone, before its body is read, whether to
/// serve it: [`WireError::GrantMissing`] (401) or [`WireError::GrantRefused`] (403) refuse it.
pub trait ForwardGate: Send + Sync {
    /// `Ok` to serve the frame these headers describe.
    fn admit(&self, frame: &GrantedFrame<'_>) -> Result<(), WireError>;
}

/// What `POST /forward` needs: the layers to run, the limits to enforce, a client for the
/// next hop, and who may send.
#[derive(Clone)]
pub struct ActivationPlane {
    executor: Arc<dyn SpanExecutor>,
    limits: Limits,
    client: ForwardClient,
    gate: Option<Arc<dyn ForwardGate>>,
    returns: Option<Arc<ReturnDesk>>,
}

/// How long the last hop tries to post a route's output to the entry before sending it back
/// along the route instead.
pub const RETURN_TIMEOUT: Duration = Duration::from_secs(10);

impl ActivationPlane {
    /// An activation plane over `executor`, enforcing `limits` on requests and on answers from the
    /// next hop.
    pub fn new(executor: Arc<dyn SpanExecutor>, limits: Limits, client: ForwardClient) -> Self {
        ActivationPlane {
            executor,
            limits,
            client,
            gate: None,
            returns: None,
        }
    }

    /// The same plane, admitting on `POST /return` the outputs `desk` awaits (without one,
    /// every return is refused).
    pub fn with_returns(mut self, desk: Arc<ReturnDesk>) -> Self {
        self.returns = Some(desk);
        self
    }

    /// The same plane, serving only the requests `gate` admits (without one, anyone's).
    pub fn with_gate(mut self, gate: Arc<dyn ForwardGate>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// The routes of the activation plane: `POST /forward`, `POST /return` (a route's output
    /// for this entry), `DELETE /sessions/{id}` (frees a session's KV cache on this peer) and
    /// `GET /ping` (an empty `204`, for measuring round trips).
    pub fn router(self) -> Router {
        Router::new()
            .route("/forward", post(forward))
            .route("/ping", get(|| async { StatusCode::NO_CONTENT }))
            .route("/return", post(return_output))
            .route("/sessions/{session}", delete(end_session))
            .with_state(Arc::new(self))
    }

    /// Runs one frame through this peer and the rest of its route, sending it onward in
    /// `encoding`: the hidden states after the route's last layer, or word that the last hop
    /// posted them to the frame's return address.
    pub async fn handle(
        &self,
        frame: ActivationFrame,
        encoding: Encoding,
    ) -> Result<Delivery, NodeError> {
        let executor = Arc::clone(&self.executor);
        let my_layers = frame.meta.layers;
        let metrics = self.client.metrics().clone();
        let (meta, output) = blocking(move || {
            if !executor.accepts(&frame.meta) {
                return Err(ExecutorError::LayersNotServed {
                    requested: my_layers,
                    served: executor.served_layers(),
                });
            }
            let started = Instant::now();
            let output = executor.forward(&frame.meta, frame.activations)?;
            metrics.record_forward_compute(started.elapsed());
            Ok((frame.meta, output))
        })
        .await
        .map_err(NodeError::Internal)??;

        let Some((next, rest)) = meta.route.pop_next() else {
            let return_to = meta.return_to.clone();
            let mut meta = meta;
            meta.route = Default::default();
            meta.grant = None;
            meta.fork_from = None;
            meta.return_to = None;
            meta.rewind = false;
            let output = ActivationFrame {
                meta,
                activations: output,
            };
            return Ok(match return_to {
                Some(address) => self.return_directly(&address, output, encoding).await,
                None => Delivery::Answered(Box::new(output)),
            });
        };
        let mut onward = meta.clone();
        onward.layers = next.layers;
        onward.route = rest;
        let answer = self
            .client
            .forward_delivering(
                &next.endpoint,
                ActivationFrame {
                    meta: onward,
                    activations: output,
                },
                encoding,
            )
            .await?;
        let Delivery::Answered(answer) = answer else {
            return Ok(Delivery::ReturnedDirectly);
        };
        let mut meta = answer.meta;
        meta.layers = LayerSpan::new(my_layers.start, meta.layers.end.max(my_layers.end));
        Ok(Delivery::Answered(Box::new(ActivationFrame {
            meta,
            activations: answer.activations,
        })))
    }

    /// Posts the route's `output` to the entry at `address`; when that fails, the output goes
    /// back along the route instead.
    async fn return_directly(
        &self,
        address: &ReturnAddress,
        output: ActivationFrame,
        encoding: Encoding,
    ) -> Delivery {
        let posting = self.client.return_output(address, output.clone(), encoding);
        match tokio::time::timeout(RETURN_TIMEOUT, posting).await {
            Ok(Ok(())) => Delivery::ReturnedDirectly,
            Ok(Err(error)) => {
                tracing::debug!(entry = %address.endpoint, %error, "direct return failed; answering along the route");
                Delivery::Answered(Box::new(output))
            }
            Err(_) => {
                tracing::debug!(entry = %address.endpoint, "direct return timed out; answering along the route");
                Delivery::Answered(Box::new(output))
            }
        }
    }
}

/// `POST /forward`: decode, run, forward along the route, answer in the request's encoding.
async fn forward(
    State(plane): State<Arc<ActivationPlane>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, NodeError> {
    // The version comes first: a peer of another version learns ours before anything else.
    check_wire_version(&headers)?;
    if let Some(gate) = &plane.gate {
        gate.admit(&GrantedFrame::from_headers(&headers)?)?;
    }
    let declared_len = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared_len {
        plane.limits.check_body_len(len)?;
    }
    let body = read_limited(body, plane.limits.max_body_bytes()).await?;
    let limits = plane.limits;
    let encoded_received = body.len();
    let (frame, encoding) = codec(decode_bytes(&headers, encoded_received), move || {
        let frame = ActivationFrame::decode(&headers, &body, &limits)?;
        let encoding = Encoding::from_headers(&headers)?;
        Ok::<_, NodeError>((frame, encoding))
    })
    .await
    .map_err(NodeError::Internal)??;

    let metrics = plane.client.metrics();
    metrics.count_wire_bytes(
        Direction::Received,
        frame.activations.raw_len(),
        encoded_received,
    );
    let session = frame.meta.session;
    let answer = plane.handle(frame, encoding).await.inspect_err(|e| {
        tracing::debug!(%session, error = %e, "forward failed");
    })?;
    let Delivery::Answered(answer) = answer else {
        return Ok(with_wire_version(StatusCode::ACCEPTED.into_response()));
    };
    let raw_sent = answer.activations.raw_len();
    let encoded = codec(raw_sent, move || answer.into_encoded(encoding))
        .await
        .map_err(NodeError::Internal)?;
    metrics.count_wire_bytes(Direction::Sent, raw_sent, encoded.body.len());
    Ok((StatusCode::OK, encoded.headers, encoded.body).into_response())
}

/// `DELETE /sessions/{id}`: frees the session's KV cache here (204; unknown sessions too, so
/// the call is idempotent). A malformed id is a 400.
async fn end_session(
    State(plane): State<Arc<ActivationPlane>>,
    Path(session): Path<String>,
) -> Result<Response, NodeError> {
    let session = uuid::Uuid::parse_str(&session).map_err(|_| {
        NodeError::Wire(meshnet_wire::WireError::InvalidHeader {
            name: "the session in /sessions/{id}",
            expected: "a UUID",
            got: session.chars().take(64).collect(),
        })
    })?;
    let executor = Arc::clone(&plane.executor);
    blocking(move || executor.end_session(session))
        .await
        .map_err(NodeError::Internal)?;
    Ok(with_wire_version(StatusCode::NO_CONTENT.into_response()))
}

/// `response` with this build's `X-Meshnet-Wire-Version`.
fn with_wire_version(mut response: Response) -> Response {
    response.headers_mut().insert(
        meshnet_wire::header::WIRE_VERSION_HEADER,
        axum::http::HeaderValue::from(meshnet_wire::WIRE_VERSION),
    );
    response
}

/// `POST /return`: a route's output for a frame this entry sent. The ticket is checked before
/// the body is read (401 without one, 403 for one no frame awaits), the frame against what
/// the ticket was drawn for (403); 204 once the output is handed over.
async fn return_output(
    State(plane): State<Arc<ActivationPlane>>,
    mut headers: HeaderMap,
    body: Body,
) -> Result<Response, NodeError> {
    check_wire_version(&headers)?;
    let ticket = read_return_ticket(&headers)?;
    // The ticket is the request's credential, not part of the frame (whose own return
    // address, a ticket with an endpoint, must be absent).
    headers.remove(RETURN_TICKET);
    let desk = plane.returns.as_ref().ok_or(WireError::ReturnRefused {
        reason: "this member awaits no outputs".to_owned(),
    })?;
    desk.check(ticket)?;
    let body = read_limited(body, plane.limits.max_body_bytes()).await?;
    let limits = plane.limits;
    let encoded_received = body.len();
    let frame = codec(decode_bytes(&headers, encoded_received), move || {
        ActivationFrame::decode(&headers, &body, &limits)
    })
    .await
    .map_err(NodeError::Internal)??;
    plane.client.metrics().count_wire_bytes(
        Direction::Received,
        frame.activations.raw_len(),
        encoded_received,
    );
    desk.deliver(ticket, frame)?;
    plane.client.metrics().count_direct_return();
    Ok(with_wire_version(StatusCode::NO_CONTENT.into_response()))
}

/// Reads a request body, refusing (413) as soon as it passes `limit` bytes.
async fn read_limited(body: Body, limit: usize) -> Result<bytes::Bytes, NodeError> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(meshnet_wire::WireError::BodyTooLarge {
            body_bytes: limit as u64 + 1,
            limit,
        }
        .into()),
        Err(e) => Err(NodeError::BodyRead(e.to_string())),
    }
}
