//! The sending side of the activation plane: posts a frame to a peer and reads its answer.

use std::time::Duration;

use meshnet_wire::header::WIRE_VERSION_HEADER;
use meshnet_wire::{ActivationFrame, Encoding, Limits, WireError};

use crate::blocking;
use crate::error::ErrorBody;

/// How long a hop may take, end to end, before the sender gives up.
pub const DEFAULT_HOP_TIMEOUT: Duration = Duration::from_secs(120);

/// Why sending a frame to a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The HTTP client could not be built (for example, its TLS backend failed to start).
    #[error("cannot build the HTTP client: {reason}")]
    Setup {
        /// What the HTTP library reported.
        reason: String,
    },
    /// The endpoint is not a usable URL.
    #[error("invalid peer endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The peer could not be reached or the connection broke.
    #[error("peer {endpoint} unreachable: {reason}")]
    Unreachable {
        /// The peer's endpoint.
        endpoint: String,
        /// The transport's complaint.
        reason: String,
    },
    /// The peer did not answer in time.
    #[error("peer {endpoint} did not answer within {timeout:?}")]
    Timeout {
        /// The peer's endpoint.
        endpoint: String,
        /// The time allowed.
        timeout: Duration,
    },
    /// The peer answered with an error.
    #[error("peer {endpoint} answered {status} {code}: {message}")]
    Rejected {
        /// The peer's endpoint.
        endpoint: String,
        /// The HTTP status.
        status: u16,
        /// The error code from the JSON body (or `unknown`).
        code: String,
        /// The error message from the JSON body (or the raw body, cut short).
        message: String,
        /// The wire version the peer speaks, when it said.
        peer_wire_version: Option<String>,
    },
    /// The peer answered 200 with a frame that does not decode.
    #[error("peer {endpoint} sent an invalid frame: {source}")]
    BadResponse {
        /// The peer's endpoint.
        endpoint: String,
        /// What is wrong with the frame.
        source: WireError,
    },
    /// The peer's answer does not belong to the request (session, chunk or position differ).
    #[error("peer {endpoint} answered for the wrong request: {reason}")]
    MismatchedResponse {
        /// The peer's endpoint.
        endpoint: String,
        /// What differs.
        reason: String,
    },
}

impl ClientError {
    /// A short, stable code for this error.
    pub fn code(&self) -> &'static str {
        match self {
            ClientError::Setup { .. } => "client_setup_failed",
            ClientError::InvalidEndpoint { .. } => "next_hop_invalid_endpoint",
            ClientError::Unreachable { .. } => "next_hop_unreachable",
            ClientError::Timeout { .. } => "next_hop_timeout",
            ClientError::Rejected { .. } => "next_hop_rejected",
            ClientError::BadResponse { .. } => "next_hop_bad_response",
            ClientError::MismatchedResponse { .. } => "next_hop_mismatched_response",
        }
    }
}

/// Sends activation frames to peers over HTTP.
#[derive(Debug, Clone)]
pub struct ForwardClient {
    http: reqwest::Client,
    limits: Limits,
    timeout: Duration,
}

impl ForwardClient {
    /// A client that accepts answers within `limits` and waits at most `timeout` per hop.
    ///
    /// Fails with [`ClientError::Setup`] when the HTTP client cannot be built.
    pub fn new(limits: Limits, timeout: Duration) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ClientError::Setup {
                reason: error_chain(&e),
            })?;
        Ok(ForwardClient {
            http,
            limits,
            timeout,
        })
    }

    /// Posts `frame` to `{endpoint}/forward` in `encoding` and returns the peer's answer frame.
    ///
    /// The answer must carry the same session, chunk and position; its body is read no further
    /// than the limits allow.
    pub async fn forward(
        &self,
        endpoint: &str,
        frame: ActivationFrame,
        encoding: Encoding,
    ) -> Result<ActivationFrame, ClientError> {
        let url = forward_url(endpoint)?;
        let sent_meta = frame.meta.clone();
        let encoded = blocking(move || frame.into_encoded(encoding))
            .await
            .map_err(|reason| ClientError::Unreachable {
                endpoint: endpoint.to_owned(),
                reason,
            })?;
        let transport = |e: reqwest::Error| self.transport_error(endpoint, e);
        let mut response = self
            .http
            .post(url)
            .headers(encoded.headers)
            .body(encoded.body)
            .send()
            .await
            .map_err(transport)?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = read_bounded(&mut response, &self.limits)
            .await
            .map_err(|e| match e {
                BodyError::Transport(e) => transport(e),
                BodyError::TooLarge(source) => ClientError::BadResponse {
                    endpoint: endpoint.to_owned(),
                    source,
                },
            })?;
        if !status.is_success() {
            return Err(rejection(endpoint, status.as_u16(), &headers, &body));
        }
        let limits = self.limits;
        let answer = blocking(move || ActivationFrame::decode(&headers, &body, &limits))
            .await
            .map_err(|reason| ClientError::Unreachable {
                endpoint: endpoint.to_owned(),
                reason,
            })?
            .map_err(|source| ClientError::BadResponse {
                endpoint: endpoint.to_owned(),
                source,
            })?;
        let m = &answer.meta;
        if m.session != sent_meta.session
            || m.chunk_index != sent_meta.chunk_index
            || m.chunk_total != sent_meta.chunk_total
            || m.position != sent_meta.position
        {
            return Err(ClientError::MismatchedResponse {
                endpoint: endpoint.to_owned(),
                reason: format!(
                    "sent session {} chunk {}/{} at {}, got session {} chunk {}/{} at {}",
                    sent_meta.session,
                    sent_meta.chunk_index,
                    sent_meta.chunk_total,
                    sent_meta.position,
                    m.session,
                    m.chunk_index,
                    m.chunk_total,
                    m.position
                ),
            });
        }
        Ok(answer)
    }

    /// Asks the peer at `endpoint` to free `session` (`DELETE {endpoint}/sessions/{id}`).
    pub async fn end_session(
        &self,
        endpoint: &str,
        session: uuid::Uuid,
    ) -> Result<(), ClientError> {
        let mut url = forward_url(endpoint)?;
        let path = url.path().trim_end_matches("forward").to_owned();
        url.set_path(&format!("{path}sessions/{session}"));
        let response = self
            .http
            .delete(url)
            .header(WIRE_VERSION_HEADER, meshnet_wire::WIRE_VERSION)
            .send()
            .await
            .map_err(|e| self.transport_error(endpoint, e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let headers = response.headers().clone();
        let body = response.bytes().await.unwrap_or_default();
        Err(rejection(endpoint, status.as_u16(), &headers, &body))
    }

    fn transport_error(&self, endpoint: &str, e: reqwest::Error) -> ClientError {
        if e.is_timeout() {
            ClientError::Timeout {
                endpoint: endpoint.to_owned(),
                timeout: self.timeout,
            }
        } else {
            ClientError::Unreachable {
                endpoint: endpoint.to_owned(),
                reason: error_chain(&e),
            }
        }
    }
}

/// The full `source()` chain of an error in one line (reqwest's top-level message alone says
/// little).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn forward_url(endpoint: &str) -> Result<reqwest::Url, ClientError> {
    let invalid = |reason: String| ClientError::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let base = reqwest::Url::parse(endpoint).map_err(|e| invalid(e.to_string()))?;
    if !matches!(base.scheme(), "http" | "https") {
        return Err(invalid(format!(
            "expected an http:// or https:// URL, got scheme {}",
            base.scheme()
        )));
    }
    let mut url = base;
    let path = format!("{}/forward", url.path().trim_end_matches('/'));
    url.set_path(&path);
    Ok(url)
}

enum BodyError {
    Transport(reqwest::Error),
    TooLarge(WireError),
}

async fn read_bounded(
    response: &mut reqwest::Response,
    limits: &Limits,
) -> Result<Vec<u8>, BodyError> {
    if let Some(declared) = response.content_length() {
        limits
            .check_body_len(declared)
            .map_err(BodyError::TooLarge)?;
    }
    let mut body = Vec::with_capacity(
        response
            .content_length()
            .map_or(0, |n| n as usize)
            .min(limits.max_body_bytes()),
    );
    while let Some(chunk) = response.chunk().await.map_err(BodyError::Transport)? {
        limits
            .check_body_len((body.len() + chunk.len()) as u64)
            .map_err(BodyError::TooLarge)?;
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn rejection(
    endpoint: &str,
    status: u16,
    headers: &reqwest::header::HeaderMap,
    body: &[u8],
) -> ClientError {
    let (code, message) = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(parsed) => (parsed.error.code, parsed.error.message),
        Err(_) => {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            ("unknown".to_owned(), text)
        }
    };
    ClientError::Rejected {
        endpoint: endpoint.to_owned(),
        status,
        code,
        message,
        peer_wire_version: headers
            .get(WIRE_VERSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_url_appends_the_path() {
        assert_eq!(
            forward_url("http://127.0.0.1:8081").unwrap().as_str(),
            "http://127.0.0.1:8081/forward"
        );
        assert_eq!(
            forward_url("http://h:1/mesh/").unwrap().as_str(),
            "http://h:1/mesh/forward"
        );
        assert!(forward_url("ftp://h").is_err());
        assert!(forward_url("not a url").is_err());
    }
}
