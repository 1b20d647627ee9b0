//! The member's HTTP server: the activation plane, `/status`, `/health`, `/metrics`, the live
//! coverage page at `/`, and the OpenAI-style API, on one listener.

use std::net::SocketAddr;
use std::sync::Arc;

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use meshnet_node::{ActivationPlane, ForwardClient, SpanExecutor};
use meshnet_wire::Limits;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower::ServiceExt;

use crate::error::PeerError;
use crate::grants::MemberGate;
use crate::member::Member;
use crate::status::StatusReport;

/// Every route this member answers: the activation plane, `/status`, `/health`, `/metrics`
/// (the text exposition of `registry`), the coverage page at `/`, and the OpenAI-style API
/// under `/v1` with `/tokenize` and `/detokenize` (served by the tracker itself; any other
/// member passes the request on to the tracker it follows, so clients may point at any
/// member). With `api_keys`, the API's routes (only they) need one of its keys.
pub(crate) fn router(
    member: &Arc<Member>,
    client: ForwardClient,
    registry: Arc<meshnet_metrics::Registry>,
    api_keys: Option<Arc<meshnet_api::ApiKeyGuard>>,
) -> Router {
    let api = Router::new()
        .route("/v1", any(openai_handler))
        .route("/v1/{*rest}", any(openai_handler))
        .route("/tokenize", any(openai_handler))
        .route("/detokenize", any(openai_handler));
    let api = match api_keys {
        Some(guard) => meshnet_api::require_api_keys(api, guard),
        None => api,
    };
    activation_plane(member, client)
        .merge(
            Router::new()
                .route("/metrics", get(metrics_handler))
                .with_state(registry),
        )
        .merge(
            Router::new()
                .route("/", get(coverage_page))
                .route("/status", get(status_handler))
                .route("/health", get(health_handler))
                .merge(api)
                .fallback(unknown_path)
                .with_state(Arc::clone(member)),
        )
        .layer(axum::middleware::from_fn(refuse_oversized_bodies))
}

/// The activation plane's routes (`/forward`, `/return`, `/sessions/{id}`) over this member's spans: served
/// on the HTTP listener and on libp2p streams.
pub(crate) fn activation_plane(member: &Arc<Member>, client: ForwardClient) -> Router {
    let executor: Arc<dyn SpanExecutor> = Arc::clone(&member.host) as Arc<dyn SpanExecutor>;
    let followed = Arc::clone(member);
    let gate = MemberGate::new(Arc::new(move || followed.followed_tracker()));
    ActivationPlane::new(executor, Limits::default(), client)
        .with_gate(Arc::new(gate))
        .with_returns(Arc::clone(&member.settings.returns))
        .router()
}

/// The most of an oversized body read (and dropped) before answering 413, so that a client
/// that writes its whole body before reading gets the answer rather than a reset connection.
const OVERSIZED_DRAIN_BYTES: u64 = 1 << 30;

/// How long reading an oversized body may take before the answer goes out anyway.
const OVERSIZED_DRAIN_TIME: Duration = Duration::from_secs(30);

/// Whether `path` belongs to the OpenAI-style API (`/v1/...`, `/tokenize`, `/detokenize`).
fn is_api_path(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/") || path == "/tokenize" || path == "/detokenize"
}

/// The largest body `path` accepts.
fn body_limit(path: &str) -> usize {
    if is_api_path(path) {
        meshnet_api::MAX_BODY_BYTES
    } else if path == "/forward" || path == "/return" {
        Limits::default().max_body_bytes()
    } else {
        // Status, health and session ends carry no body.
        64 * 1024
    }
}

/// Answers a request whose declared length passes its path's limit with 413 and a JSON error
/// (in the API's shape under `/v1`, the activation plane's elsewhere), after reading and
/// dropping the body (bounded), so that the client sees the answer. Bodies of unknown length
/// are limited by the handlers themselves.
async fn refuse_oversized_bodies(request: Request, next: axum::middleware::Next) -> Response {
    let limit = body_limit(request.uri().path());
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    let Some(declared) = declared.filter(|&length| length > limit as u64) else {
        return next.run(request).await;
    };
    let api = is_api_path(request.uri().path());
    let mut body = request.into_body().into_data_stream();
    let drained = tokio::time::timeout(OVERSIZED_DRAIN_TIME, async {
        let mut read = 0u64;
        while read < OVERSIZED_DRAIN_BYTES.min(declared) {
            match futures::StreamExt::next(&mut body).await {
                Some(Ok(chunk)) => read += chunk.len() as u64,
                _ => break,
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::debug!(declared, "gave up reading an oversized body");
    }
    if api {
        meshnet_api::ApiError::PayloadTooLarge { limit }.into_response()
    } else {
        meshnet_node::NodeError::Wire(meshnet_wire::WireError::BodyTooLarge {
            body_bytes: declared,
            limit,
        })
        .into_response()
    }
}

/// Marks an API request one member passed on to the tracker.
const PROXIED_HEADER: &str = "x-meshnet-proxied";

/// How long a proxied API request may take to start answering (a generation streams after).
const PROXY_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `/v1/...`, `/tokenize` and `/detokenize`: the tracker's own API, or the tracker's answer
/// to the same request.
async fn openai_handler(State(member): State<Arc<Member>>, request: Request) -> Response {
    if let Some(parts) = member.tracker_parts() {
        return match parts.api.oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
    }
    if request.headers().contains_key(PROXIED_HEADER) {
        // Passed on by a member that took this one for the tracker: passing it on again could
        // loop while the members disagree (a takeover in progress).
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "tracker_unavailable",
            "this member is not the tracker (a takeover may be in progress); retry shortly"
                .to_owned(),
        );
    }
    let Some(tracker) = member.tracker_url() else {
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "tracker_unavailable",
            "this member follows no tracker yet; retry shortly".to_owned(),
        );
    };
    proxy(&member, &tracker, request).await
}

/// Passes `request` on to the tracker at `tracker`, streaming its answer back.
async fn proxy(member: &Member, tracker: &str, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, meshnet_api::MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(_) => {
            return api_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!(
                    "the request body is larger than {} bytes",
                    meshnet_api::MAX_BODY_BYTES
                ),
            );
        }
    };
    let path = parts
        .uri
        .path_and_query()
        .map_or("/v1", |path| path.as_str());
    let url = format!("{}{path}", tracker.trim_end_matches('/'));
    let mut outgoing = member
        .proxy
        .request(parts.method, &url)
        .header(PROXIED_HEADER, "1")
        .body(body);
    for name in [header::CONTENT_TYPE, header::ACCEPT, header::AUTHORIZATION] {
        if let Some(value) = parts.headers.get(&name) {
            outgoing = outgoing.header(name, value);
        }
    }
    let answer = match outgoing.send().await {
        Ok(answer) => answer,
        Err(error) => {
            tracing::warn!(%tracker, %error, "passing an API request to the tracker failed");
            return api_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "tracker_unavailable",
                format!("the tracker at {tracker} did not answer ({error}); retry shortly"),
            );
        }
    };
    let mut response = Response::builder().status(answer.status());
    for name in [
        header::CONTENT_TYPE,
        header::RETRY_AFTER,
        header::CACHE_CONTROL,
        header::HeaderName::from_static(meshnet_api::ROUTE_HEADER),
    ] {
        if let Some(value) = answer.headers().get(&name) {
            response = response.header(name, value);
        }
    }
    response
        .body(Body::from_stream(answer.bytes_stream()))
        .unwrap_or_else(|error| {
            api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                error.to_string(),
            )
        })
}

/// An error in the OpenAI shape.
fn api_error(status: StatusCode, code: &str, message: String) -> Response {
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    (
        status,
        Json(serde_json::json!({
            "error": {"message": message, "type": kind, "param": null, "code": code}
        })),
    )
        .into_response()
}

/// Any path this member does not serve.
async fn unknown_path(uri: axum::http::Uri) -> Response {
    api_error(
        StatusCode::NOT_FOUND,
        "unknown_url",
        format!("unknown path {}", uri.path()),
    )
}

/// The client a member passes API requests to the tracker with.
pub(crate) fn proxy_client() -> Result<reqwest::Client, PeerError> {
    reqwest::Client::builder()
        .connect_timeout(PROXY_CONNECT_TIMEOUT)
        .build()
        .map_err(|error| PeerError::Internal(format!("building the API proxy client: {error}")))
}

/// Binds the HTTP listener and reads back its address.
pub(crate) async fn bind(address: SocketAddr) -> Result<(TcpListener, SocketAddr), PeerError> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|source| PeerError::Io {
            what: format!("binding the HTTP server to {address}"),
            source,
        })?;
    let bound = listener.local_addr().map_err(|source| PeerError::Io {
        what: "reading the HTTP server's address".to_owned(),
        source,
    })?;
    Ok((listener, bound))
}

/// The HTTP base URL a member announces, if any:
/// - `advertised`, when the operator gave one;
/// - none when the member is not `reachable`: others cannot dial it, and reach it over libp2p
///   streams instead;
/// - the bound address, when bound to one (a loopback one means the whole mesh runs on this
///   machine);
/// - bound to all interfaces: an address of its libp2p listeners that is neither loopback nor
///   unspecified (loopback only when it has no other). Never the unspecified address.
pub(crate) fn announced_url(
    advertised: Option<String>,
    bound: SocketAddr,
    reachable: bool,
    p2p_listen: &[libp2p::Multiaddr],
) -> Option<String> {
    if advertised.is_some() {
        return advertised;
    }
    let url = |ip: std::net::IpAddr| Some(default_url(SocketAddr::new(ip, bound.port())));
    let ip = bound.ip();
    if !reachable {
        return None;
    }
    if !ip.is_unspecified() {
        return url(ip);
    }
    let listen_ips: Vec<std::net::IpAddr> = p2p_listen
        .iter()
        .filter_map(listen_ip)
        .filter(|ip| !ip.is_unspecified() && (ip.is_ipv4() || bound.is_ipv6()))
        .collect();
    let chosen = listen_ips
        .iter()
        .find(|ip| !ip.is_loopback())
        .or_else(|| listen_ips.first())
        .copied()
        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    url(chosen)
}

/// The IP address a libp2p listen address is on, if it names one.
pub(crate) fn listen_ip(address: &libp2p::Multiaddr) -> Option<std::net::IpAddr> {
    address.iter().find_map(|part| match part {
        libp2p::multiaddr::Protocol::Ip4(ip) => Some(std::net::IpAddr::V4(ip)),
        libp2p::multiaddr::Protocol::Ip6(ip) => Some(std::net::IpAddr::V6(ip)),
        _ => None,
    })
}

/// `http://` and the bound address (127.0.0.1 when bound to all interfaces).
pub(crate) fn default_url(bound: SocketAddr) -> String {
    let host = if bound.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        bound.ip().to_string()
    };
    format!("http://{host}:{}", bound.port())
}

/// Serves `router` on `listener` until `stop` turns true.
pub(crate) fn serve(
    listener: TcpListener,
    router: Router,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        // Activation frames are small and latency-bound: send each write at once.
        let listener = listener.tap_io(|tcp| {
            if let Err(error) = tcp.set_nodelay(true) {
                tracing::debug!(%error, "could not set TCP_NODELAY");
            }
        });
        if let Err(error) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(%error, "the HTTP server failed");
        }
    })
}

/// The live coverage page: one self-contained file, embedded in the binary.
const COVERAGE_PAGE: &str = include_str!("page/index.html");

async fn coverage_page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        COVERAGE_PAGE,
    )
        .into_response()
}

/// The Prometheus text exposition of every family this member exports.
async fn metrics_handler(State(registry): State<Arc<meshnet_metrics::Registry>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        meshnet_metrics::encode(&registry),
    )
        .into_response()
}

async fn status_handler(State(member): State<Arc<Member>>) -> Json<StatusReport> {
    Json(StatusReport::of(&member))
}

async fn health_handler(State(member): State<Arc<Member>>) -> Response {
    match member.health() {
        Ok(detail) => Json(serde_json::json!({"status": "ok", "detail": detail})).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "unavailable", "detail": reason})),
        )
            .into_response(),
    }
}
