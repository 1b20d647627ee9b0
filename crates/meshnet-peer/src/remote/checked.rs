//! Checked sessions (ADR-0026): the entry drives the route hop by hop, sends every hop's input
//! to a second holder of the same layers as well (the shadow), and takes an output only when
//! both are equal bit for bit. A disagreement is settled by a third holder recomputing the
//! step from the hop's recorded inputs; the holder it contradicts is convicted, and the
//! session fails over to a route without it (the replay rebuilds every cache, checked again),
//! so no token computed from a wrong output of a checked session reaches the user.

use std::future::Future;
use std::sync::Arc;

use candle_core::Tensor;
use meshnet_model::{ModelError, SessionId};
use meshnet_node::{HopFailure, HopFailureKind};
use meshnet_types::PeerId;
use meshnet_wire::{ActivationFrame, Activations, FrameMeta, Hop, Route};

use super::{RemoteStage, RouteState, SendError, hop_error, to_hidden};
use crate::grants::GRANT_TTL;
use crate::routing::PlannedHop;
use crate::verify::{self, Evidence, Testimony, Verdict};

/// What a checked session keeps: each hop's shadow (where the mesh has a second holder) and
/// every input each hop was sent, for an arbiter to replay.
#[derive(Clone, Debug, Default)]
pub(super) struct Checks {
    /// The second holder of each hop's layers, by hop.
    shadows: Vec<Option<PlannedHop>>,
    /// Every input each hop was sent (and its shadow agreed on), by hop.
    inputs: Vec<Vec<Activations>>,
    /// Whether two holders disagreed on a step of this route.
    disputed: bool,
}

impl Checks {
    /// The shadows, which hold the session as well.
    pub(super) fn shadow_hops(&self) -> impl Iterator<Item = &PlannedHop> {
        self.shadows.iter().flatten()
    }

    /// The holders that passed the checks of a session that ended without a disagreement
    /// and checked at least one step: every hop that had a shadow, and its shadow.
    pub(super) fn passed<'a>(&'a self, hops: &'a [PlannedHop]) -> Vec<&'a PeerId> {
        let checked_a_step = self.inputs.first().is_some_and(|inputs| !inputs.is_empty());
        if self.disputed || !checked_a_step {
            return Vec::new();
        }
        hops.iter()
            .zip(&self.shadows)
            .filter_map(|(hop, shadow)| Some([&hop.peer, &shadow.as_ref()?.peer]))
            .flatten()
            .collect()
    }
}

impl RemoteStage {
    /// Decides whether the session on `state`'s route is checked and picks each hop's shadow:
    /// checked when it was sampled, or when a hop's holder or a holder that could shadow it is
    /// on probation (holders with the fewest checked sessions take the shadow's seat first, so
    /// a newcomer is checked without its output being used).
    pub(super) fn attach_checks(&self, state: &mut RouteState) {
        state.checks = None;
        let policy = &self.failover.verify;
        if !policy.is_on() {
            return;
        }
        let routes = &self.failover.routes;
        let mut taken: Vec<PeerId> = state.hops.iter().map(|hop| hop.peer.clone()).collect();
        taken.extend(state.avoid.all());
        let mut probation = false;
        let mut shadows = Vec::with_capacity(state.hops.len());
        for hop in state.hops.iter() {
            let shadow = routes.holders(hop.layers, &taken).into_iter().next();
            probation |= policy.on_probation(routes.verified_sessions(&hop.peer));
            if let Some(shadow) = &shadow {
                probation |= policy.on_probation(routes.verified_sessions(&shadow.peer));
                // One session id per peer: a peer shadows one hop at most.
                taken.push(shadow.peer.clone());
            }
            shadows.push(shadow);
        }
        if (state.sampled || probation) && shadows.iter().any(Option::is_some) {
            state.checks = Some(Checks {
                inputs: vec![Vec::new(); shadows.len()],
                shadows,
                disputed: false,
            });
        }
    }

    /// Sends `hidden` at `position` of `session` through the route hop by hop, each hop's
    /// output checked against its shadow's; records every hop's input once the step passed.
    pub(super) fn send_checked(
        &self,
        state: &mut RouteState,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
    ) -> Result<Tensor, SendError> {
        let mut current =
            Activations::from_tensor(hidden).map_err(|e| SendError::Other(e.into()))?;
        let fork_from = state.fork_from(position);
        let hops = Arc::clone(&state.hops);
        let mut inputs = Vec::with_capacity(hops.len());
        for (index, hop) in hops.iter().enumerate() {
            let step = Step {
                session,
                position,
                fork_from,
            };
            let output = self.run_checked_hop(state, index, hop, step, &current)?;
            inputs.push(std::mem::replace(&mut current, output));
        }
        if let Some(checks) = &mut state.checks {
            for (recorded, input) in checks.inputs.iter_mut().zip(inputs) {
                recorded.push(input);
            }
        }
        to_hidden(current)
    }

    /// Runs hop `index` of the route on `input`, and on its shadow when it has one: the output
    /// when both agree, else the failure of the holder an arbiter convicted.
    fn run_checked_hop(
        &self,
        state: &mut RouteState,
        index: usize,
        hop: &PlannedHop,
        step: Step,
        input: &Activations,
    ) -> Result<Activations, SendError> {
        let shadow = state
            .checks
            .as_ref()
            .and_then(|checks| checks.shadows.get(index).cloned().flatten());
        let primary = self.post_alone(hop, step, input.clone())?;
        let Some(shadow) = shadow else {
            return self.runtime.block_on(primary);
        };
        let second = self.post_alone(&shadow, step, input.clone())?;
        let (primary, second) = self
            .runtime
            .block_on(futures::future::join(primary, second));
        let (primary, second) = (primary?, second?);
        if verify::same_bits(&primary, &second) {
            return Ok(primary);
        }
        let dispute = Dispute {
            index,
            hop,
            shadow: &shadow,
            step,
            input,
            primary: &primary,
            second: &second,
        };
        Err(self.settle(state, dispute))
    }

    /// Settles a disagreement: a third holder recomputes the step; the holder it contradicts
    /// is convicted (with the evidence) and named in the failure. Without a verdict both are
    /// kept off the session, and the failure names the route's own holder.
    fn settle(&self, state: &mut RouteState, dispute: Dispute<'_>) -> SendError {
        if let Some(checks) = &mut state.checks {
            checks.disputed = true;
        }
        let routes = &self.failover.routes;
        let mut avoid = state.avoid.all();
        avoid.extend([dispute.hop.peer.clone(), dispute.shadow.peer.clone()]);
        let arbiter = routes
            .holders(dispute.hop.layers, &avoid)
            .into_iter()
            .max_by_key(|holder| routes.verified_sessions(&holder.peer));
        let recomputed = arbiter.as_ref().and_then(|arbiter| {
            self.recompute(state, dispute.index, arbiter, dispute.step, dispute.input)
                .map_err(|_| tracing::warn!(arbiter = %arbiter.peer, "the arbiter failed to recompute a disputed step"))
                .ok()
        });
        let verdict = verify::judge(dispute.primary, dispute.second, recomputed.as_ref());
        let (Some(arbiter), Some(recomputed)) = (arbiter, recomputed) else {
            return self.undecided(state, &dispute);
        };
        let (convicted, convicted_output, witness, witness_output) = match verdict {
            Verdict::PrimaryWrong => (dispute.hop, dispute.primary, dispute.shadow, dispute.second),
            Verdict::ShadowWrong => (dispute.shadow, dispute.second, dispute.hop, dispute.primary),
            Verdict::Undecided => return self.undecided(state, &dispute),
        };
        let evidence = Evidence {
            session: dispute.step.session.to_string(),
            position: dispute.step.position as u64,
            tokens: dispute.input.shape().dims().get(1).copied().unwrap_or(0) as u64,
            layers: dispute.hop.layers,
            convicted: testimony(&convicted.peer, convicted_output),
            witness: testimony(&witness.peer, witness_output),
            arbiter: testimony(&arbiter.peer, &recomputed),
        };
        routes.convict(&convicted.peer, evidence, self.failover.verify.ban_duration);
        self.failover.metrics.count_conviction();
        wrong_output(
            convicted,
            format!(
                "its output differed from {}'s for the same input, and {} recomputed {}'s",
                witness.peer, arbiter.peer, witness.peer
            ),
        )
    }

    /// Two holders disagreed and nobody could decide: both stay off this session (the
    /// failover keeps the route's own holder off routes for a while).
    fn undecided(&self, state: &mut RouteState, dispute: &Dispute<'_>) -> SendError {
        tracing::warn!(
            primary = %dispute.hop.peer,
            shadow = %dispute.shadow.peer,
            layers = %dispute.hop.layers,
            position = dispute.step.position,
            "two holders computed different outputs and no arbiter could decide"
        );
        if !state.avoid.failed.contains(&dispute.shadow.peer) {
            state.avoid.failed.push(dispute.shadow.peer.clone());
        }
        wrong_output(
            dispute.hop,
            format!(
                "its output differed from {}'s for the same input and no third holder could decide",
                dispute.shadow.peer
            ),
        )
    }

    /// `arbiter`'s output for the disputed step: hop `index`'s recorded inputs replayed under
    /// a session of its own, then the step itself. The session is freed afterwards.
    fn recompute(
        &self,
        state: &RouteState,
        index: usize,
        arbiter: &PlannedHop,
        step: Step,
        input: &Activations,
    ) -> Result<Activations, SendError> {
        let own = Step {
            session: SessionId::new_v4(),
            position: 0,
            fork_from: None,
        };
        let recorded = state
            .checks
            .as_ref()
            .and_then(|checks| checks.inputs.get(index))
            .map_or(&[][..], Vec::as_slice);
        let result = (|| {
            let mut at = own;
            for frame in recorded {
                self.runtime
                    .block_on(self.post_alone(arbiter, at, frame.clone())?)?;
                at.position += frame.shape().dims().get(1).copied().unwrap_or(0);
            }
            at.position = step.position;
            self.runtime
                .block_on(self.post_alone(arbiter, at, input.clone())?)
        })();
        self.free_in_background(std::slice::from_ref(arbiter).iter(), own.session);
        result
    }

    /// The send of `activations` to `hop` alone (its output comes back to the entry), with a
    /// grant for that one hop; it fails as soon as the tracker stops hearing `hop`.
    fn post_alone(
        &self,
        hop: &PlannedHop,
        step: Step,
        activations: Activations,
    ) -> Result<impl Future<Output = Result<Activations, SendError>> + Send + 'static, SendError>
    {
        let other = |error: meshnet_wire::WireError| SendError::Other(error.into());
        let alone = Route::new(vec![
            Hop::new(hop.layers, hop.endpoint.to_string()).map_err(other)?,
        ])
        .map_err(other)?;
        let grant = match &self.grants {
            Some(signer) => {
                let (value, _) =
                    signer
                        .issue(step.session, alone, GRANT_TTL)
                        .map_err(|reason| {
                            SendError::Other(ModelError::Stage {
                                stage: hop.endpoint.to_string(),
                                source: reason.into(),
                            })
                        })?;
                Some(Arc::from(value))
            }
            None => None,
        };
        let frame = ActivationFrame {
            meta: FrameMeta {
                session: step.session,
                chunk_index: 0,
                chunk_total: 1,
                position: step.position as u64,
                layers: hop.layers,
                route: Route::new(Vec::new()).map_err(other)?,
                grant,
                fork_from: step.fork_from,
                return_to: None,
                rewind: false,
            },
            activations,
        };
        let client = self.client.clone();
        let routes = Arc::clone(&self.failover.routes);
        let hop = hop.clone();
        let encoding = self.encoding;
        // Like every hop, a shadow that stops announcing fails the step at once rather than
        // after the hop timeout.
        Ok(async move {
            let hops = std::slice::from_ref(&hop);
            tokio::select! {
                answer = client.forward(&hop.endpoint, frame, encoding) => answer
                    .map(|answer| answer.activations)
                    .map_err(|error| hop_error(hops, error)),
                silent = super::first_silent_hop(routes.as_ref(), hops) => Err(silent),
            }
        })
    }
}

/// Where a frame of a checked session goes in its session.
#[derive(Clone, Copy, Debug)]
struct Step {
    session: SessionId,
    position: usize,
    fork_from: Option<SessionId>,
}

/// A step on which a hop's holder and its shadow computed different outputs.
struct Dispute<'a> {
    index: usize,
    hop: &'a PlannedHop,
    shadow: &'a PlannedHop,
    step: Step,
    input: &'a Activations,
    primary: &'a Activations,
    second: &'a Activations,
}

fn testimony(peer: &PeerId, output: &Activations) -> Testimony {
    Testimony {
        peer: peer.clone(),
        output_sha256: verify::output_digest(output),
    }
}

/// The failure that takes the session off `hop`.
fn wrong_output(hop: &PlannedHop, message: String) -> SendError {
    let mut failure = HopFailure::new(
        hop.endpoint.to_string(),
        HopFailureKind::WrongOutput,
        message,
    );
    failure.peer = Some(hop.peer.clone());
    SendError::Hop(Box::new(failure))
}
