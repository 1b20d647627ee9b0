//! The sending side of the activation plane: posts a frame to a peer and reads its answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method};
use meshnet_metrics::{Direction, HopPath, Metrics};
use meshnet_wire::header::WIRE_VERSION_HEADER;
use meshnet_wire::return_address::RETURN_TICKET;
use meshnet_wire::{
    ActivationFrame, Encoding, Endpoint, FrameMeta, Limits, ReturnAddress, WireError,
};

use crate::error_body::ErrorBody;
use crate::hop::{HopFailure, HopFailureKind};
use crate::stream::{StreamFailure, StreamOpener};
use crate::{codec, decode_bytes};

/// How long a hop may take, end to end, before the sender gives up.
pub const DEFAULT_HOP_TIMEOUT: Duration = Duration::from_secs(120);

/// How many streams a request to a peer named by id is sent on before its failure counts: a
/// receiver drops an inbound stream it has no room to accept yet, unread.
const STREAM_ATTEMPTS: u32 = 5;

/// The pause before sending on a new stream, times the attempt that failed, plus up to as much
/// again at random (so streams dropped together are not sent together again).
const STREAM_RETRY_PAUSE: Duration = Duration::from_millis(5);

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
        /// The hop further down the route that actually failed, when the peer answered because
        /// its own next hop failed (the `failed_hop` member of the error body).
        failed_hop: Option<Box<HopFailure>>,
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

    /// The failure of the hop that actually failed: the one further down the route that the
    /// peer named, if it named one, otherwise the peer this error is about. `None` when no hop
    /// was involved (the client could not be built).
    pub fn hop_failure(&self) -> Option<HopFailure> {
        let (endpoint, kind, message) = match self {
            ClientError::Setup { .. } => return None,
            ClientError::Rejected {
                endpoint,
                failed_hop: Some(downstream),
                ..
            } => {
                let mut failure = HopFailure::clone(downstream);
                failure.reported_by = Some(endpoint.clone());
                return Some(failure);
            }
            ClientError::InvalidEndpoint { endpoint, reason } => {
                (endpoint, HopFailureKind::InvalidEndpoint, reason.clone())
            }
            ClientError::Unreachable { endpoint, reason } => {
                (endpoint, HopFailureKind::Unreachable, reason.clone())
            }
            ClientError::Timeout { endpoint, timeout } => (
                endpoint,
                HopFailureKind::Timeout,
                format!("no answer within {timeout:?}"),
            ),
            ClientError::Rejected {
                endpoint,
                status,
                code,
                message,
                ..
            } => (
                endpoint,
                HopFailureKind::Rejected {
                    status: *status,
                    code: code.clone(),
                },
                message.clone(),
            ),
            ClientError::BadResponse { endpoint, source } => {
                (endpoint, HopFailureKind::BadResponse, source.to_string())
            }
            ClientError::MismatchedResponse { endpoint, reason } => {
                (endpoint, HopFailureKind::MismatchedResponse, reason.clone())
            }
        };
        Some(HopFailure::new(endpoint.clone(), kind, message))
    }

    /// Whether sending the frame again may succeed (see [`HopFailureKind::retryable`]); a
    /// client that could not be built never will.
    pub fn retryable(&self) -> bool {
        self.hop_failure()
            .is_some_and(|failure| failure.retryable())
    }
}

/// Sends activation frames to peers: over HTTP to a URL, or over a stream (see
/// [`crate::stream`]) to a peer named `/p2p/<id>`.
#[derive(Clone)]
pub struct ForwardClient {
    http: reqwest::Client,
    limits: Limits,
    timeout: Duration,
    metrics: Metrics,
    streams: Option<Arc<dyn StreamOpener>>,
}

impl std::fmt::Debug for ForwardClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardClient")
            .field("limits", &self.limits)
            .field("timeout", &self.timeout)
            .field("streams", &self.streams.is_some())
            .finish_non_exhaustive()
    }
}

/// An answer from a peer: status, headers, body, and the path it travelled.
/// What became of a frame posted to `/forward`.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// The route's output came back along the route.
    Answered(Box<ActivationFrame>),
    /// The route's last hop posted the output to the frame's return address (`202`).
    ReturnedDirectly,
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
    path: HopPath,
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
            metrics: Metrics::detached(),
            streams: None,
        })
    }

    /// The same client, reaching peers named `/p2p/<id>` over streams `opener` opens.
    pub fn with_streams(mut self, opener: Arc<dyn StreamOpener>) -> Self {
        self.streams = Some(opener);
        self
    }

    /// The same client, counting its round trips and wire bytes (and those of the activation
    /// plane that sends with it) in `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Where this client counts.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Posts `frame` to `{endpoint}/forward` in `encoding` and returns the peer's answer frame.
    ///
    /// The answer must carry the same session, chunk and position; its body is read no further
    /// than the limits allow. A frame with a return address may be answered
    /// [`Delivery::ReturnedDirectly`]: use [`Self::forward_delivering`] for those.
    pub async fn forward(
        &self,
        target: &Endpoint,
        frame: ActivationFrame,
        encoding: Encoding,
    ) -> Result<ActivationFrame, ClientError> {
        match self.forward_delivering(target, frame, encoding).await? {
            Delivery::Answered(frame) => Ok(*frame),
            Delivery::ReturnedDirectly => Err(ClientError::MismatchedResponse {
                endpoint: target.to_string(),
                reason: "answered 202: the output went to the return address".to_owned(),
            }),
        }
    }

    /// [`Self::forward`] for a frame that may carry a return address: the answer is the output
    /// frame, or word that the route's last hop posted the output to the return address
    /// (`202 Accepted`; refused as a mismatched answer when the frame had no return address).
    pub async fn forward_delivering(
        &self,
        target: &Endpoint,
        frame: ActivationFrame,
        encoding: Encoding,
    ) -> Result<Delivery, ClientError> {
        let endpoint = &target.to_string();
        let started = Instant::now();
        let sent_meta = frame.meta.clone();
        let answer = self.post_frame(target, "forward", frame, encoding).await?;
        if answer.status == 202 {
            if sent_meta.return_to.is_none() {
                return Err(ClientError::MismatchedResponse {
                    endpoint: endpoint.to_owned(),
                    reason: "answered 202 to a frame without a return address".to_owned(),
                });
            }
            self.metrics
                .record_forward_request(endpoint, answer.path, started.elapsed());
            return Ok(Delivery::ReturnedDirectly);
        }
        let path = answer.path;
        let answer = self.read_frame(endpoint, answer).await?;
        self.metrics
            .record_forward_request(endpoint, path, started.elapsed());
        check_answer_matches(endpoint, &sent_meta, &answer.meta)?;
        Ok(Delivery::Answered(Box::new(answer)))
    }

    /// Posts a route's output `frame` to the entry at `address` (`POST {endpoint}/return`
    /// with the address's ticket), in `encoding`.
    pub async fn return_output(
        &self,
        address: &ReturnAddress,
        frame: ActivationFrame,
        encoding: Encoding,
    ) -> Result<(), ClientError> {
        let endpoint = &address.endpoint.to_string();
        let mut frame = frame;
        frame.meta.return_to = None;
        let ticket = address.ticket;
        let answer = self
            .post_frame_with(
                &address.endpoint,
                "return",
                frame,
                encoding,
                move |headers| {
                    if let Ok(value) = http::HeaderValue::try_from(ticket.to_string()) {
                        headers.insert(RETURN_TICKET, value);
                    }
                },
            )
            .await?;
        accepted(endpoint, &answer)
    }

    /// Encodes `frame` and posts it to `{target}/{path}`; a non-2xx answer is the peer's
    /// rejection.
    async fn post_frame(
        &self,
        target: &Endpoint,
        path: &str,
        frame: ActivationFrame,
        encoding: Encoding,
    ) -> Result<Answer, ClientError> {
        let answer = self
            .post_frame_with(target, path, frame, encoding, |_| ())
            .await?;
        accepted(&target.to_string(), &answer)?;
        Ok(answer)
    }

    /// Encodes `frame`, lets `extra` add headers, and posts it to `{target}/{path}`.
    async fn post_frame_with(
        &self,
        target: &Endpoint,
        path: &str,
        frame: ActivationFrame,
        encoding: Encoding,
        extra: impl FnOnce(&mut HeaderMap),
    ) -> Result<Answer, ClientError> {
        let raw_sent = frame.activations.raw_len();
        let mut encoded = codec(raw_sent, move || frame.into_encoded(encoding))
            .await
            .map_err(|reason| ClientError::Unreachable {
                endpoint: target.to_string(),
                reason,
            })?;
        extra(&mut encoded.headers);
        self.metrics
            .count_wire_bytes(Direction::Sent, raw_sent, encoded.body.len());
        self.send(target, Method::POST, path, encoded.headers, encoded.body)
            .await
    }

    /// Decodes the frame of a 2xx answer, within the limits.
    async fn read_frame(
        &self,
        endpoint: &str,
        answer: Answer,
    ) -> Result<ActivationFrame, ClientError> {
        let Answer { headers, body, .. } = answer;
        let limits = self.limits;
        let encoded_received = body.len();
        let frame = codec(decode_bytes(&headers, encoded_received), move || {
            ActivationFrame::decode(&headers, &body, &limits)
        })
        .await
        .map_err(|reason| ClientError::Unreachable {
            endpoint: endpoint.to_owned(),
            reason,
        })?
        .map_err(|source| ClientError::BadResponse {
            endpoint: endpoint.to_owned(),
            source,
        })?;
        self.metrics.count_wire_bytes(
            Direction::Received,
            frame.activations.raw_len(),
            encoded_received,
        );
        Ok(frame)
    }

    /// Asks the peer at `endpoint` to free `session` (`DELETE {endpoint}/sessions/{id}`).
    pub async fn end_session(
        &self,
        target: &Endpoint,
        session: uuid::Uuid,
    ) -> Result<(), ClientError> {
        let endpoint = &target.to_string();
        let mut headers = HeaderMap::new();
        headers.insert(
            WIRE_VERSION_HEADER,
            http::HeaderValue::from(meshnet_wire::WIRE_VERSION),
        );
        let answer = self
            .send(
                target,
                Method::DELETE,
                &format!("sessions/{session}"),
                headers,
                Bytes::new(),
            )
            .await?;
        accepted(endpoint, &answer)
    }

    /// The round trip of an empty request to the activation plane at `target` (`GET
    /// {endpoint}/ping`), once its connection is open: a connection is opened (or taken from
    /// the pool) by a first request, and the second is timed.
    pub async fn ping(&self, target: &Endpoint) -> Result<Duration, ClientError> {
        let endpoint = &target.to_string();
        let answer = self
            .send(target, Method::GET, "ping", HeaderMap::new(), Bytes::new())
            .await?;
        accepted(endpoint, &answer)?;
        let started = Instant::now();
        let answer = self
            .send(target, Method::GET, "ping", HeaderMap::new(), Bytes::new())
            .await?;
        accepted(endpoint, &answer)?;
        Ok(started.elapsed())
    }

    /// Sends one request to `endpoint` (`path` relative to its base) and reads the answer,
    /// its body within the limits: over HTTP for a URL, over a stream for `/p2p/<id>`.
    async fn send(
        &self,
        target: &Endpoint,
        method: Method,
        path: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, ClientError> {
        let endpoint = &target.to_string();
        match target {
            Endpoint::Peer(peer) => {
                let exchange =
                    self.send_on_stream(endpoint, peer.as_str(), method, path, headers, body);
                tokio::time::timeout(self.timeout, exchange)
                    .await
                    .map_err(|_| ClientError::Timeout {
                        endpoint: endpoint.to_owned(),
                        timeout: self.timeout,
                    })?
            }
            Endpoint::Http(_) => self.send_http(endpoint, method, path, headers, body).await,
        }
    }

    async fn send_http(
        &self,
        endpoint: &str,
        method: Method,
        path: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, ClientError> {
        let url = endpoint_url(endpoint, path)?;
        let transport = |e: reqwest::Error| self.transport_error(endpoint, e);
        let mut response = self
            .http
            .request(method, url)
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(transport)?;
        let status = response.status().as_u16();
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
        Ok(Answer {
            status,
            headers,
            body: Bytes::from(body),
            path: HopPath::DirectHttp,
        })
    }

    async fn send_on_stream(
        &self,
        endpoint: &str,
        peer: &str,
        method: Method,
        path: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Answer, ClientError> {
        let unreachable = |reason: String| ClientError::Unreachable {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let Some(opener) = &self.streams else {
            return Err(ClientError::InvalidEndpoint {
                endpoint: endpoint.to_owned(),
                reason: "this member has no libp2p node to reach peers by id".to_owned(),
            });
        };
        let mut attempt = 1;
        let (answer, path) = loop {
            let opened = opener.open(peer).await.map_err(unreachable)?;
            match crate::stream::exchange(
                opened.io,
                method.clone(),
                &format!("/{path}"),
                headers.clone(),
                body.clone(),
                self.limits.max_body_bytes(),
            )
            .await
            {
                Ok(answer) => break (answer, opened.path),
                Err(StreamFailure::Unanswered(reason)) if attempt < STREAM_ATTEMPTS => {
                    tracing::debug!(
                        endpoint,
                        attempt,
                        %reason,
                        "a stream ended before any answer: sending again on a new one"
                    );
                    tokio::time::sleep(retry_pause(attempt)).await;
                    attempt += 1;
                }
                Err(StreamFailure::Unanswered(reason) | StreamFailure::Transport(reason)) => {
                    return Err(unreachable(reason));
                }
                Err(StreamFailure::TooLarge(limit)) => {
                    return Err(ClientError::BadResponse {
                        endpoint: endpoint.to_owned(),
                        source: WireError::BodyTooLarge {
                            body_bytes: limit as u64 + 1,
                            limit,
                        },
                    });
                }
            }
        };
        Ok(Answer {
            status: answer.status.as_u16(),
            headers: answer.headers,
            body: answer.body,
            path,
        })
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

/// The pause before the next stream after `attempt` went unanswered: [`STREAM_RETRY_PAUSE`]
/// times `attempt`, plus a random part of as much.
fn retry_pause(attempt: u32) -> Duration {
    let base = STREAM_RETRY_PAUSE * attempt;
    // The clock's nanoseconds are random enough to spread a handful of retries.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos());
    base + base.mul_f64(f64::from(nanos % 1000) / 1000.0)
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

/// `{endpoint}/{path}` for an `http://` or `https://` endpoint.
fn endpoint_url(endpoint: &str, path: &str) -> Result<reqwest::Url, ClientError> {
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
    let path = format!("{}/{path}", url.path().trim_end_matches('/'));
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

fn rejection(endpoint: &str, status: u16, headers: &HeaderMap, body: &[u8]) -> ClientError {
    let (code, message, failed_hop) = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(parsed) => (
            parsed.error.code,
            parsed.error.message,
            parsed.error.failed_hop.map(Box::new),
        ),
        Err(_) => {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            ("unknown".to_owned(), text, None)
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
        failed_hop,
    }
}

/// `Ok` for a 2xx answer, else the peer's rejection as its error body states it.
fn accepted(endpoint: &str, answer: &Answer) -> Result<(), ClientError> {
    if (200..300).contains(&answer.status) {
        return Ok(());
    }
    Err(rejection(
        endpoint,
        answer.status,
        &answer.headers,
        &answer.body,
    ))
}

/// Refuses an answer for another session, chunk or position than the frame sent.
fn check_answer_matches(
    endpoint: &str,
    sent: &FrameMeta,
    got: &FrameMeta,
) -> Result<(), ClientError> {
    if (got.session, got.chunk_index, got.chunk_total, got.position)
        == (
            sent.session,
            sent.chunk_index,
            sent.chunk_total,
            sent.position,
        )
    {
        return Ok(());
    }
    Err(ClientError::MismatchedResponse {
        endpoint: endpoint.to_owned(),
        reason: format!(
            "sent session {} chunk {}/{} at {}, got session {} chunk {}/{} at {}",
            sent.session,
            sent.chunk_index,
            sent.chunk_total,
            sent.position,
            got.session,
            got.chunk_index,
            got.chunk_total,
            got.position
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_url_appends_the_path() {
        assert_eq!(
            endpoint_url("http://127.0.0.1:8081", "forward")
                .unwrap()
                .as_str(),
            "http://127.0.0.1:8081/forward"
        );
        assert_eq!(
            endpoint_url("http://h:1/mesh/", "forward")
                .unwrap()
                .as_str(),
            "http://h:1/mesh/forward"
        );
        assert!(endpoint_url("ftp://h", "forward").is_err());
        assert!(endpoint_url("not a url", "forward").is_err());
    }

    fn rejected(status: u16, code: &str, failed_hop: Option<HopFailure>) -> ClientError {
        ClientError::Rejected {
            endpoint: "http://first:1".to_owned(),
            status,
            code: code.to_owned(),
            message: "refused".to_owned(),
            peer_wire_version: Some("1".to_owned()),
            failed_hop: failed_hop.map(Box::new),
        }
    }

    #[test]
    fn each_client_error_is_classified_retryable_or_final() {
        let endpoint = || "http://first:1".to_owned();
        let cases = [
            (
                ClientError::Setup {
                    reason: "no TLS".to_owned(),
                },
                false,
            ),
            (
                ClientError::InvalidEndpoint {
                    endpoint: endpoint(),
                    reason: "no scheme".to_owned(),
                },
                false,
            ),
            (
                ClientError::Unreachable {
                    endpoint: endpoint(),
                    reason: "connection refused".to_owned(),
                },
                true,
            ),
            (
                ClientError::Unreachable {
                    endpoint: endpoint(),
                    reason: "connection reset by peer".to_owned(),
                },
                true,
            ),
            (
                ClientError::Timeout {
                    endpoint: endpoint(),
                    timeout: Duration::from_secs(1),
                },
                true,
            ),
            (rejected(500, "compute_failed", None), true),
            (rejected(502, "unknown", None), true),
            (rejected(503, "overloaded", None), true),
            (rejected(504, "next_hop_timeout", None), true),
            (rejected(429, "unknown", None), true),
            (rejected(400, "invalid_shape", None), false),
            (rejected(409, "layers_not_served", None), false),
            (rejected(413, "body_too_large", None), false),
            (rejected(422, "bad_activations", None), false),
            (
                ClientError::BadResponse {
                    endpoint: endpoint(),
                    source: WireError::BodyTooLarge {
                        body_bytes: 10,
                        limit: 1,
                    },
                },
                true,
            ),
            (
                ClientError::MismatchedResponse {
                    endpoint: endpoint(),
                    reason: "other session".to_owned(),
                },
                true,
            ),
        ];
        for (error, retryable) in cases {
            assert_eq!(error.retryable(), retryable, "{error}");
            if let Some(failure) = error.hop_failure() {
                assert_eq!(failure.endpoint, "http://first:1", "{error}");
                assert_eq!(failure.retryable(), retryable, "{error}");
                assert_eq!(failure.reported_by, None, "{error}");
            }
        }
    }

    #[test]
    fn a_rejection_that_names_a_later_hop_is_that_hops_failure() {
        let later = |kind| HopFailure::new("http://third:3", kind, "down there");
        // The first hop answered 502 because the third was unreachable: retryable, and about
        // the third hop even though the first one answered.
        let error = rejected(
            502,
            "next_hop_rejected",
            Some(later(HopFailureKind::Unreachable)),
        );
        let failure = error.hop_failure().unwrap();
        assert_eq!(failure.endpoint, "http://third:3");
        assert_eq!(failure.reported_by.as_deref(), Some("http://first:1"));
        assert_eq!(failure.code(), "unreachable");
        assert_eq!(failure.status(), None);
        assert!(error.retryable());
        // ... and final when the later hop refused the frame, though the first answered 502.
        let error = rejected(
            502,
            "next_hop_rejected",
            Some(later(HopFailureKind::Rejected {
                status: 409,
                code: "layers_not_served".to_owned(),
            })),
        );
        let failure = error.hop_failure().unwrap();
        assert_eq!(
            (failure.status(), failure.code()),
            (Some(409), "layers_not_served")
        );
        assert!(!error.retryable());
    }

    #[test]
    fn a_rejection_reads_code_message_and_failed_hop_from_the_body() {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(WIRE_VERSION_HEADER, "1".parse().unwrap());
        let body = br#"{"error":{"code":"next_hop_unreachable","message":"gone","failed_hop":{"endpoint":"http://third:3","code":"unreachable","message":"connection refused"}}}"#;
        match rejection("http://first:1", 502, &headers, body) {
            ClientError::Rejected {
                code,
                message,
                failed_hop,
                peer_wire_version,
                ..
            } => {
                assert_eq!(
                    (code.as_str(), message.as_str()),
                    ("next_hop_unreachable", "gone")
                );
                assert_eq!(peer_wire_version.as_deref(), Some("1"));
                let failed_hop = failed_hop.unwrap();
                assert_eq!(failed_hop.endpoint, "http://third:3");
                assert_eq!(failed_hop.kind, HopFailureKind::Unreachable);
            }
            other => panic!("expected a rejection, got {other}"),
        }
        // A body that is not ours: the raw text, no failed hop.
        match rejection("http://first:1", 503, &headers, b"busy") {
            ClientError::Rejected {
                code,
                message,
                failed_hop,
                ..
            } => {
                assert_eq!((code.as_str(), message.as_str()), ("unknown", "busy"));
                assert!(failed_hop.is_none());
            }
            other => panic!("expected a rejection, got {other}"),
        }
    }
}
