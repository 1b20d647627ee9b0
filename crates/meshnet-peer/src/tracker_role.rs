//! What a member builds when it starts as the tracker or takes the role over: the book of
//! peers, the completion engine planning routes over it, and the OpenAI-style API.

use std::sync::{Arc, Mutex};

use meshnet_model::TextSide;
use meshnet_planner::PeerCapacity;

use crate::engine::MeshEngine;
use crate::error::PeerError;
use crate::member::{Settings, TrackerParts};
use crate::remote::Failover;
use crate::routing::MeshRoutes;
use crate::shard::ShardHost;
use crate::tracker::TrackerBook;

/// The tracker's parts: its book of peers, the completion engine over it, and the API.
pub(crate) async fn build_tracker_parts(
    host: &Arc<ShardHost>,
    own: PeerCapacity,
    http_url: &str,
    settings: &Settings,
) -> Result<TrackerParts, PeerError> {
    let model = host.model();
    let local_peer = own.peer.clone();
    let book = Arc::new(Mutex::new(TrackerBook::new(
        model.id().to_owned(),
        model.shape().clone(),
        own.peer.clone(),
        own,
        http_url.to_owned(),
        settings.announce_interval,
    )?));
    let opened = Arc::clone(model.model());
    let chat_template = settings.chat_template.clone();
    let text = tokio::task::spawn_blocking(move || TextSide::of(&opened, chat_template.as_deref()))
        .await
        .map_err(|e| PeerError::Internal(e.to_string()))??;
    let failover = Failover {
        routes: Arc::clone(&book) as Arc<dyn MeshRoutes>,
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
        .with_grants(Arc::clone(&settings.grants))
        .with_structured_output(),
    );
    let api = meshnet_api::openai_router(Arc::clone(&engine) as _);
    Ok(TrackerParts { book, engine, api })
}
