//! What a member builds when it starts as the tracker or takes the role over: the book of
//! peers (handed to the control loop, its only writer), the completion engine routing over
//! the table the book publishes, and the OpenAI-style API.

use std::sync::Arc;

use meshnet_model::TextSide;
use meshnet_planner::PeerCapacity;

use crate::book_routes::OwnedBook;
use crate::engine::MeshEngine;
use crate::error::PeerError;
use crate::member::{Settings, TrackerParts};
use crate::remote::Failover;
use crate::routing::MeshRoutes;
use crate::span_host::SpanHost;
use crate::tracker::TrackerBook;

/// The tracker's parts (the completion engine over the book's published routes, and the API)
/// and its book of peers, for the control loop to own.
pub(crate) async fn build_tracker_parts(
    host: &Arc<SpanHost>,
    own: PeerCapacity,
    http_url: &str,
    settings: &Settings,
) -> Result<(TrackerParts, OwnedBook), PeerError> {
    let model = host.model();
    let local_peer = own.peer.clone();
    let book = TrackerBook::new(
        model.id().to_owned(),
        model.shape().clone(),
        own.peer.clone(),
        own,
        http_url.to_owned(),
        settings.announce_interval,
    )?;
    let (book, routes) = OwnedBook::new(book);
    let routes = Arc::new(routes);
    let opened = Arc::clone(model.model());
    let chat_template = settings.chat_template.clone();
    let text = tokio::task::spawn_blocking(move || TextSide::of(&opened, chat_template.as_deref()))
        .await
        .map_err(|e| PeerError::Internal(e.to_string()))??;
    let failover = Failover {
        routes: Arc::clone(&routes) as Arc<dyn MeshRoutes>,
        policy: settings.failover.clone(),
        verify: settings.verify.clone(),
        metrics: settings.client.metrics().clone(),
    };
    let engine = Arc::new(
        MeshEngine::new(
            local_peer,
            model.id().to_owned(),
            text,
            Arc::clone(host),
            failover,
            settings.client.clone(),
            settings.admission,
        )
        .with_prefill_in_flight(settings.prefill_in_flight)
        .with_speculation(settings.max_draft, settings.gate_drafts)
        .with_direct_return(
            Arc::clone(&settings.returns),
            settings.return_endpoint.clone(),
        )
        .with_grants(Arc::clone(&settings.grants))
        .with_structured_output(),
    );
    let api = meshnet_api::openai_router(Arc::clone(&engine) as _);
    Ok((
        TrackerParts {
            routes,
            engine,
            api,
        },
        book,
    ))
}
