//! The node's error type and its mapping to HTTP, in one place.

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use meshnet_wire::header::WIRE_VERSION_HEADER;
use meshnet_wire::{ErrorClass, WIRE_VERSION, WireError};

use crate::client::ClientError;
use crate::error_body::{ErrorBody, ErrorDetail};
use crate::executor::ExecutorError;

/// Seconds a client is asked to wait when a peer is overloaded.
const RETRY_AFTER_SECONDS: &str = "1";

/// Everything that can fail while serving a request.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The request's frame is malformed, too large or unsupported.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The body could not be read from the connection.
    #[error("could not read the request body: {0}")]
    BodyRead(String),
    /// The span executor refused or failed.
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    /// The next hop of the route failed.
    #[error(transparent)]
    NextHop(#[from] ClientError),
    /// A bug or a crashed worker on this peer.
    #[error("internal error: {0}")]
    Internal(String),
}

impl NodeError {
    /// The HTTP status and the stable code of this error.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            NodeError::Wire(e) => (
                match e.class() {
                    ErrorClass::Malformed | ErrorClass::VersionMismatch => StatusCode::BAD_REQUEST,
                    ErrorClass::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                    ErrorClass::Unsupported => StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    ErrorClass::LengthMismatch => StatusCode::UNPROCESSABLE_ENTITY,
                    ErrorClass::Unauthenticated => StatusCode::UNAUTHORIZED,
                    ErrorClass::Forbidden => StatusCode::FORBIDDEN,
                    ErrorClass::Internal => StatusCode::INTERNAL_SERVER_ERROR,
                },
                e.code(),
            ),
            NodeError::BodyRead(_) => (StatusCode::BAD_REQUEST, "body_read_failed"),
            NodeError::Executor(e) => match e {
                ExecutorError::LayersNotServed { .. } => {
                    (StatusCode::CONFLICT, "layers_not_served")
                }
                ExecutorError::PositionConflict { .. } => {
                    (StatusCode::CONFLICT, "position_conflict")
                }
                ExecutorError::ForkSource(_) => (StatusCode::CONFLICT, "fork_source_missing"),
                ExecutorError::BadActivations(_) => {
                    (StatusCode::UNPROCESSABLE_ENTITY, "bad_activations")
                }
                ExecutorError::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
                ExecutorError::Compute(_) => (StatusCode::INTERNAL_SERVER_ERROR, "compute_failed"),
            },
            NodeError::NextHop(e) => match e {
                ClientError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "next_hop_timeout"),
                ClientError::Setup { .. } => (StatusCode::INTERNAL_SERVER_ERROR, e.code()),
                _ => (StatusCode::BAD_GATEWAY, e.code()),
            },
            NodeError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for NodeError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if status.is_server_error() {
            tracing::warn!(%status, code, error = %self, "request failed");
        } else {
            tracing::debug!(%status, code, error = %self, "request rejected");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: code.to_owned(),
                message: self.to_string(),
                failed_hop: match &self {
                    NodeError::NextHop(e) => e.hop_failure(),
                    _ => None,
                },
            },
        };
        let mut response = (status, Json(body)).into_response();
        let headers = response.headers_mut();
        headers.insert(WIRE_VERSION_HEADER, HeaderValue::from(WIRE_VERSION));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}
