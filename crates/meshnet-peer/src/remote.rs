//! The part of a route that runs on other peers, seen by the generation loop as one stage.
//!
//! The entry posts each chunk to the first hop with the rest of the route in the frame
//! (source routing); every hop runs its layers and posts to the next; the last hop's output
//! comes back up the chain. Ending a session asks every hop to free its KV cache.

use candle_core::{DType, Device, Tensor};
use meshnet_model::{ModelError, SessionId, Stage};
use meshnet_node::{ClientError, ForwardClient};
use meshnet_types::LayerSpan;
use meshnet_wire::{ActivationFrame, Activations, Encoding, FrameMeta, Hop, Route};
use tokio::runtime::Handle;

use crate::routing::PlannedHop;

/// How long the entry waits for a hop to confirm it freed a session.
pub const END_SESSION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The remote hops of one generation.
pub struct RemoteStage {
    hops: Vec<PlannedHop>,
    /// The first hop's layers and the route after it, built once for every frame.
    first_layers: LayerSpan,
    onward: Route,
    client: ForwardClient,
    runtime: Handle,
    encoding: Encoding,
}

impl RemoteStage {
    /// A stage over `hops` (at least one, none empty), sending frames with `client` on
    /// `runtime` in `encoding`. Its methods block: call them from a blocking thread, never from
    /// an async worker.
    pub fn new(
        hops: Vec<PlannedHop>,
        client: ForwardClient,
        runtime: Handle,
        encoding: Encoding,
    ) -> Result<Self, ModelError> {
        let invalid = |reason: String| ModelError::Stage {
            stage: "remote hops".to_owned(),
            source: reason.into(),
        };
        let (first, rest) = hops
            .split_first()
            .ok_or_else(|| invalid("the route has no hop".to_owned()))?;
        let first_layers = first.layers;
        if first_layers.is_empty() {
            return Err(invalid(format!("empty layer span for peer {}", first.peer)));
        }
        let onward = rest
            .iter()
            .map(|hop| Hop::new(hop.layers, hop.endpoint.clone()).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(invalid)?;
        let onward = Route::new(onward)?;
        Ok(RemoteStage {
            hops,
            first_layers,
            onward,
            client,
            runtime,
            encoding,
        })
    }

    /// The hops, in order.
    pub fn hops(&self) -> &[PlannedHop] {
        &self.hops
    }

    fn error(&self, reason: impl std::fmt::Display) -> ModelError {
        ModelError::Stage {
            stage: self.name(),
            source: reason.to_string().into(),
        }
    }

    /// A failed send as a stage error whose source is the [`meshnet_node::HopFailure`] of the
    /// hop that actually failed, named by its peer id when it is one of this route's hops.
    fn hop_error(&self, error: ClientError) -> ModelError {
        let source: Box<dyn std::error::Error + Send + Sync> = match error.hop_failure() {
            Some(mut failure) => {
                failure.peer = self
                    .hops
                    .iter()
                    .find(|hop| hop.endpoint == failure.endpoint)
                    .map(|hop| hop.peer.clone());
                Box::new(failure)
            }
            None => Box::new(error),
        };
        ModelError::Stage {
            stage: self.name(),
            source,
        }
    }
}

impl Stage for RemoteStage {
    fn forward(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
    ) -> meshnet_model::Result<Tensor> {
        let first = self
            .hops
            .first()
            .ok_or_else(|| self.error("the route has no hop"))?;
        let frame = ActivationFrame {
            meta: FrameMeta {
                session,
                chunk_index: 0,
                chunk_total: 1,
                position: position as u64,
                layers: self.first_layers,
                route: self.onward.clone(),
            },
            activations: Activations::from_tensor(&hidden)?,
        };
        let answer = self
            .runtime
            .block_on(self.client.forward(&first.endpoint, frame, self.encoding))
            .map_err(|e| self.hop_error(e))?;
        Ok(answer
            .activations
            .into_tensor(&Device::Cpu)?
            .to_dtype(DType::F32)?)
    }

    fn end_session(&self, session: SessionId) {
        // All hops at once, each given a few seconds: a dead hop must not hold up the others
        // (peers also drop sessions left idle).
        let ends = self.hops.iter().map(|hop| async move {
            let freed = tokio::time::timeout(
                END_SESSION_TIMEOUT,
                self.client.end_session(&hop.endpoint, session),
            )
            .await;
            (hop, freed)
        });
        for (hop, freed) in self.runtime.block_on(futures::future::join_all(ends)) {
            match freed {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%session, peer = %hop.peer, %error, "could not free the session on a hop");
                }
                Err(_) => {
                    tracing::warn!(%session, peer = %hop.peer, "freeing the session on a hop timed out");
                }
            }
        }
    }

    fn name(&self) -> String {
        self.hops
            .iter()
            .map(|hop| format!("{} (layers {})", hop.endpoint, hop.layers))
            .collect::<Vec<_>>()
            .join(" -> ")
    }
}
