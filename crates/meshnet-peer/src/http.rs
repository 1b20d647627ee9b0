//! The member's HTTP server: the activation plane, `/status`, `/health`, and on the tracker
//! the OpenAI-style API, on one listener.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt;
use axum::{Json, Router};
use meshnet_api::openai_router;
use meshnet_node::{ActivationPlane, ForwardClient, SpanExecutor};
use meshnet_wire::Limits;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::PeerError;
use crate::member::Member;
use crate::status::StatusReport;

/// Every route this member answers.
pub(crate) fn router(member: &Arc<Member>, client: ForwardClient) -> Router {
    let executor: Arc<dyn SpanExecutor> = Arc::clone(&member.host) as Arc<dyn SpanExecutor>;
    let router = ActivationPlane::new(executor, Limits::default(), client)
        .router()
        .merge(
            Router::new()
                .route("/status", get(status_handler))
                .route("/health", get(health_handler))
                .with_state(Arc::clone(member)),
        );
    match member.tracker_parts() {
        Some(parts) => openai_router(Arc::clone(&parts.engine) as _).merge(router),
        None => router,
    }
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
