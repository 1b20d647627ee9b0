//! The crate's error type and its single mapping to HTTP status and OpenAI error bodies.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::engine::EngineError;

/// How long clients are told to wait when the mesh does not cover the model.
pub const NOT_COVERED_RETRY_AFTER_SECONDS: u64 = 10;

/// `Retry-After` on a 503 for a generation whose route failed beyond repair.
pub const ROUTE_LOST_RETRY_AFTER_SECONDS: u64 = 2;

/// Everything the API can answer with instead of a completion.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something unsupported (400).
    #[error("{message}")]
    InvalidRequest {
        /// The request field at fault, if one is.
        param: Option<String>,
        /// What is wrong, for the client.
        message: String,
    },
    /// The request body exceeds the size limit (413).
    #[error("the request body is larger than {limit} bytes")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request names a model this peer does not serve (404).
    #[error("The model `{0}` does not exist or is not served by this mesh")]
    ModelNotFound(String),
    /// No endpoint has this path (404).
    #[error("Invalid URL ({method} {path})")]
    UnknownUrl {
        /// The request method.
        method: String,
        /// The request path.
        path: String,
    },
    /// The path exists but not for this method (405).
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed {
        /// The request method.
        method: String,
        /// The request path.
        path: String,
    },
    /// The request carries no API key, or one this member does not accept (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The request's API key is over one of its per-minute limits (429).
    #[error("{message}")]
    RateLimited {
        /// Which limit, how far over, and when to retry, for the client.
        message: String,
        /// Whole seconds until the request would be admitted.
        retry_after_seconds: u64,
    },
    /// The engine refused or abandoned the generation; status depends on the variant.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl ApiError {
    /// A 400 for `param` (or the whole request when `None`).
    pub(crate) fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            param: param.map(str::to_owned),
            message: message.into(),
        }
    }

    /// The HTTP status, OpenAI error `type` and `code`, and `Retry-After` seconds for this error.
    /// This is the one place errors are classified.
    fn classify(&self) -> Classification {
        const INVALID: &str = "invalid_request_error";
        const RATE: &str = "rate_limit_error";
        const SERVER: &str = "server_error";
        let class = |status, kind, code, retry_after| Classification {
            status,
            kind,
            code,
            retry_after,
        };
        match self {
            Self::InvalidRequest { .. } | Self::Engine(EngineError::InvalidRequest { .. }) => {
                class(StatusCode::BAD_REQUEST, INVALID, None, None)
            }
            Self::PayloadTooLarge { .. } => class(
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                Some("request_too_large"),
                None,
            ),
            Self::ModelNotFound(_) => class(
                StatusCode::NOT_FOUND,
                INVALID,
                Some("model_not_found"),
                None,
            ),
            Self::UnknownUrl { .. } => {
                class(StatusCode::NOT_FOUND, INVALID, Some("unknown_url"), None)
            }
            Self::MethodNotAllowed { .. } => class(
                StatusCode::METHOD_NOT_ALLOWED,
                INVALID,
                Some("method_not_allowed"),
                None,
            ),
            Self::Unauthorized(_) => class(
                StatusCode::UNAUTHORIZED,
                INVALID,
                Some("invalid_api_key"),
                None,
            ),
            Self::RateLimited {
                retry_after_seconds,
                ..
            }
            | Self::Engine(EngineError::Busy {
                retry_after_seconds,
                ..
            }) => class(
                StatusCode::TOO_MANY_REQUESTS,
                RATE,
                Some("rate_limit_exceeded"),
                Some(*retry_after_seconds),
            ),
            Self::Engine(EngineError::NotCovered(_)) => class(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                Some("model_not_covered"),
                Some(NOT_COVERED_RETRY_AFTER_SECONDS),
            ),
            Self::Engine(EngineError::RouteLost(_)) => class(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                Some("route_lost"),
                Some(ROUTE_LOST_RETRY_AFTER_SECONDS),
            ),
            Self::Engine(EngineError::Upstream(_)) => class(
                StatusCode::BAD_GATEWAY,
                SERVER,
                Some("upstream_error"),
                None,
            ),
            Self::Engine(EngineError::Internal(_)) => class(
                StatusCode::INTERNAL_SERVER_ERROR,
                SERVER,
                Some("internal_error"),
                None,
            ),
        }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        self.classify().status
    }

    /// The request field at fault, if any.
    fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. }
            | Self::Engine(EngineError::InvalidRequest { param, .. }) => param.as_deref(),
            Self::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// The OpenAI error envelope `{"error": {...}}` for this error.
    pub fn body(&self) -> ErrorBody {
        let class = self.classify();
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: class.kind,
                param: self.param().map(str::to_owned),
                code: class.code,
            },
        }
    }
}

struct Classification {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    retry_after: Option<u64>,
}

/// The OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    /// The error itself.
    pub error: ErrorDetail,
}

/// The inside of an OpenAI error envelope.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    /// Human-readable explanation.
    pub message: String,
    /// The error class, e.g. `invalid_request_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, or `null`.
    pub param: Option<String>,
    /// A machine-readable code, or `null`.
    pub code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let class = self.classify();
        let mut response = (class.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = class.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_their_statuses() {
        let cases = [
            (
                EngineError::InvalidRequest {
                    param: Some("max_tokens".into()),
                    message: "too long".into(),
                },
                400,
            ),
            (
                EngineError::Busy {
                    reason: "the queue is full".into(),
                    retry_after_seconds: 3,
                },
                429,
            ),
            (EngineError::NotCovered("layers 4..8".into()), 503),
            (EngineError::Upstream("peer gone".into()), 502),
            (EngineError::RouteLost("peer gone, no other".into()), 503),
            (EngineError::Internal("bug".into()), 500),
        ];
        for (error, status) in cases {
            assert_eq!(ApiError::from(error).status().as_u16(), status);
        }
    }

    #[test]
    fn engine_invalid_request_keeps_its_param_and_message() {
        let body = ApiError::from(EngineError::InvalidRequest {
            param: Some("max_tokens".into()),
            message: "too long".into(),
        })
        .body();
        assert_eq!(body.error.param.as_deref(), Some("max_tokens"));
        assert_eq!(body.error.message, "too long");
        assert_eq!(body.error.kind, "invalid_request_error");
        assert_eq!(body.error.code, None);
    }

    #[test]
    fn retry_after_is_set_for_busy_and_not_covered_only() {
        let busy = ApiError::from(EngineError::Busy {
            reason: "the queue is full".into(),
            retry_after_seconds: 7,
        })
        .into_response();
        assert_eq!(busy.headers()[header::RETRY_AFTER], "7");
        let not_covered = ApiError::from(EngineError::NotCovered("x".into())).into_response();
        assert_eq!(
            not_covered.headers()[header::RETRY_AFTER],
            NOT_COVERED_RETRY_AFTER_SECONDS.to_string().as_str()
        );
        let upstream = ApiError::from(EngineError::Upstream("x".into())).into_response();
        assert!(upstream.headers().get(header::RETRY_AFTER).is_none());
    }
}
