//! The part of a route that runs on other peers, seen by the generation loop as one stage,
//! and its failover.
//!
//! The entry posts each chunk to the first hop with the rest of the route in the frame
//! (source routing); every hop runs its layers and posts to the next; the last hop's output
//! comes back up the chain. Ending a session asks every hop to free its KV cache.
//!
//! The stage keeps every hidden state it has sent (the entry's output, as the wire carries it:
//! bfloat16). When a hop fails in a way another peer could get past (it is unreachable, timed
//! out, answered 5xx or 429, no longer serves the layers, or stopped announcing itself while
//! the stage waited for its answer), the stage keeps the failed peer
//! off routes, takes a new route from the tracker's book (waiting, bounded, for the mesh to
//! cover the layers again), replays the recorded hidden states through it frame by frame as
//! they were first sent (prefill chunks, then decode steps) under a new session id to rebuild
//! the KV caches, ends the old session on the hops that survived, and sends the step that
//! failed again. The generation loop never notices beyond the
//! pause (ADR-0018).
//!
//! A prompt's chunks are pipelined (ADR-0021): the stage sends a chunk on its way and returns
//! at once, so the entry computes the next chunk while the hops work on this one, keeping up
//! to `--prefill-chunks-in-flight` chunks travelling. A failure of any of them is handled as
//! above once every chunk still travelling has landed: the replay sends them all again.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use meshnet_model::{ModelError, SessionId, Stage};
use meshnet_node::{
    AwaitedReturn, ClientError, Delivery, ForwardClient, HopFailure, HopFailureKind, ReturnDesk,
};
use meshnet_types::{LayerSpan, PeerId};
use meshnet_wire::{
    ActivationFrame, Activations, Encoding, Endpoint, FrameMeta, Hop, ReturnAddress, Route,
};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::grants::{GRANT_TTL, GrantSigner};
use crate::locking::lock;
use crate::routing::{MeshRoutes, PlannedHop};
use crate::verify::VerifyPolicy;

mod checked;

use checked::Checks;

/// How long the entry waits for a hop to confirm it freed a session.
pub const END_SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a failover waiting for the mesh to cover the layers again looks for a route.
const RECOVERY_POLL: Duration = Duration::from_millis(200);

/// How often a send waiting for its answer checks that the route's hops still announce.
const SILENCE_POLL: Duration = Duration::from_millis(200);

/// Chunks of one prompt a route keeps travelling at once unless told otherwise
/// (`--prefill-chunks-in-flight`): one at each of a few hops.
pub const DEFAULT_PREFILL_IN_FLIGHT: usize = 4;

/// How a generation gets past a failed hop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailoverPolicy {
    /// Routes tried after one failure before the generation fails (each failed replay counts).
    pub attempts: u32,
    /// How long to wait for some peer to serve a layer nobody serves any more.
    pub recover_timeout: Duration,
}

impl Default for FailoverPolicy {
    /// Three attempts, a minute to re-cover a layer.
    fn default() -> Self {
        FailoverPolicy {
            attempts: 3,
            recover_timeout: Duration::from_secs(60),
        }
    }
}

/// Where a failing generation finds its next route, and what it counts.
#[derive(Clone)]
pub struct Failover {
    /// The routes, and the bans they respect.
    pub routes: Arc<dyn MeshRoutes>,
    /// The limits.
    pub policy: FailoverPolicy,
    /// Where failovers that got a generation going again are counted (for `/status` and
    /// `/metrics`).
    pub metrics: meshnet_metrics::Metrics,
    /// Which sessions are checked against a second holder of each hop (ADR-0026).
    pub verify: VerifyPolicy,
}

/// Where the last hop of a route posts the route's output (ADR-0031): the entry's own
/// activation plane, and the desk that awaits the outputs there.
#[derive(Clone)]
pub struct DirectReturn {
    /// Awaits the outputs.
    pub desk: Arc<ReturnDesk>,
    /// The entry's activation plane, as the hops reach it.
    pub endpoint: Endpoint,
}

/// How long the entry waits for an output the route said it returned directly: the last hop
/// answers only once the entry took the output, so this is a bound for a bug, not a delay.
const RETURNED_OUTPUT_WAIT: Duration = Duration::from_secs(5);

/// A generation that could not get past a failed hop.
#[derive(Debug, thiserror::Error)]
#[error(
    "the route failed and no failover got past it ({attempts} attempted): {reason}; last failure: {last}"
)]
pub struct RouteLost {
    /// Failovers attempted.
    pub attempts: u32,
    /// Why it stopped trying.
    pub reason: String,
    /// The last hop failure seen.
    pub last: HopFailure,
}

/// The route one generation currently takes, and what it has sent through it.
struct RouteState {
    hops: Arc<[PlannedHop]>,
    /// The first hop's layers and the route after it, built once for every frame.
    first_layers: LayerSpan,
    onward: Route,
    /// Every hop, first first: what a grant for this route names.
    full_route: Route,
    /// The session id on the hops: the generation's own until the first failover.
    session: Option<SessionId>,
    /// Every hidden state sent so far, in order (bfloat16, `[1, tokens, hidden]`).
    history: Vec<Tensor>,
    /// Tokens in `history`.
    history_tokens: usize,
    /// Peers this generation no longer uses.
    avoid: Avoid,
    /// Prompt chunks sent and not yet answered, oldest first (all of them in `history`).
    in_flight: VecDeque<JoinHandle<Result<Activations, SendError>>>,
    /// The answer to the newest chunk landed, until the prefill collects it.
    landed: Option<Tensor>,
    /// For a continuation of another generation's prompt: the session its first frame asks
    /// every hop to start from, and at which position (see [`RemoteStage::forked`]).
    fork: Option<(SessionId, usize)>,
    /// Whether the generation was drawn for checking (it stays so across failovers).
    sampled: bool,
    /// For a checked session: each hop's shadow and recorded inputs (see [`checked`]).
    checks: Option<Checks>,
    /// The history was cut back (rejected drafts): the next frame asks every hop to drop
    /// its cached positions from the frame's position on (`X-Meshnet-Rewind`).
    rewind_pending: bool,
}

impl RouteState {
    /// The session a frame at `position` asks every hop to start as a copy of: the parent of a
    /// continuation, on its first frame only.
    fn fork_from(&self, position: usize) -> Option<SessionId> {
        self.fork
            .filter(|&(_, at)| at == position)
            .map(|(parent, _)| parent)
    }
}

/// Peers one generation no longer uses.
#[derive(Clone, Debug, Default)]
struct Avoid {
    /// Failed (unreachable, timed out, broken, moved away).
    failed: Vec<PeerId>,
    /// Answered that they have no room (503 overloaded, 429).
    busy: Vec<PeerId>,
}

impl Avoid {
    fn all(&self) -> Vec<PeerId> {
        self.failed.iter().chain(&self.busy).cloned().collect()
    }
}

/// The remote hops of one generation.
pub struct RemoteStage {
    /// The first layer the remote hops run.
    start: u32,
    client: ForwardClient,
    runtime: Handle,
    encoding: Encoding,
    failover: Failover,
    prefill_in_flight: usize,
    state: Mutex<RouteState>,
    /// Signs the grant every frame carries (none: frames travel without one).
    grants: Option<Arc<GrantSigner>>,
    /// The grant issued last: for which session and route, and until when.
    grant: Mutex<Option<IssuedGrant>>,
    /// Where the route's last hop posts its output (none: it comes back along the route).
    direct_return: Option<DirectReturn>,
}

/// A grant issued for one session on one route.
struct IssuedGrant {
    session: SessionId,
    route: Route,
    value: Arc<str>,
    expires_unix_ms: u64,
}

/// Why a send failed.
enum SendError {
    /// A hop failed; another route may get past it.
    Hop(Box<HopFailure>),
    /// Anything else.
    Other(ModelError),
}

impl RemoteStage {
    /// A stage over `hops` (at least one, none empty, starting at layer `start`), sending
    /// frames with `client` on `runtime` in `encoding`, failing over as `failover` allows. Its
    /// methods block: call them from a blocking thread, never from an async worker.
    pub fn new(
        start: u32,
        hops: Vec<PlannedHop>,
        client: ForwardClient,
        runtime: Handle,
        encoding: Encoding,
        failover: Failover,
    ) -> Result<Self, ModelError> {
        let mut state = route_state(hops, Avoid::default())?;
        state.sampled = failover.verify.sampled(rand::random::<f64>());
        let stage = RemoteStage {
            start,
            client,
            runtime,
            encoding,
            failover,
            prefill_in_flight: DEFAULT_PREFILL_IN_FLIGHT,
            state: Mutex::new(state),
            grants: None,
            grant: Mutex::new(None),
            direct_return: None,
        };
        stage.attach_checks(&mut lock(&stage.state));
        Ok(stage)
    }

    /// The route's last hop posts every output straight to `direct` (see [`DirectReturn`])
    /// instead of back along the route.
    pub fn with_direct_return(mut self, direct: DirectReturn) -> Self {
        self.direct_return = Some(direct);
        self
    }

    /// Frames carry a grant `signer` signs for their session and route (see
    /// [`crate::grants`]); members serve no frame without one.
    pub fn with_grants(mut self, signer: Arc<GrantSigner>) -> Self {
        self.grants = Some(signer);
        self
    }

    /// The grant for `session` on the route of `state`: the last one issued while it is for
    /// them and has more than half its life left, else a new one.
    fn grant_for(
        &self,
        state: &RouteState,
        session: SessionId,
    ) -> Result<Option<Arc<str>>, SendError> {
        let Some(signer) = &self.grants else {
            return Ok(None);
        };
        let mut issued = self
            .grant
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        let half_life = GRANT_TTL.as_millis() as u64 / 2;
        if let Some(grant) = issued.as_ref()
            && grant.session == session
            && grant.route == state.full_route
            && grant.expires_unix_ms > now + half_life
        {
            return Ok(Some(Arc::clone(&grant.value)));
        }
        let (value, expires_unix_ms) =
            signer
                .issue(session, state.full_route.clone(), GRANT_TTL)
                .map_err(|reason| SendError::Other(stage_error(state, reason)))?;
        let value: Arc<str> = value.into();
        *issued = Some(IssuedGrant {
            session,
            route: state.full_route.clone(),
            value: Arc::clone(&value),
            expires_unix_ms,
        });
        Ok(Some(value))
    }

    /// A stage for another continuation of the prompt this stage has sent for `parent` (the
    /// generation's own session id): the same route and history, under a session whose first
    /// frame asks every hop to start it as a copy of `parent`'s cache (`X-Meshnet-Fork-From`)
    /// instead of sending the prompt again. A failover replays the whole history as usual.
    /// Call it once the prompt has landed, and keep `parent` alive on the hops until every
    /// continuation has sent its first frame.
    pub fn forked(&self, parent: SessionId) -> Result<RemoteStage, ModelError> {
        let state = lock(&self.state);
        let mut child = route_state(state.hops.to_vec(), state.avoid.clone())?;
        child.history = state.history.clone();
        child.history_tokens = state.history_tokens;
        child.fork = Some((state.session.unwrap_or(parent), state.history_tokens));
        child.sampled = state.sampled;
        child.checks = state.checks.clone();
        Ok(RemoteStage {
            start: self.start,
            client: self.client.clone(),
            runtime: self.runtime.clone(),
            encoding: self.encoding,
            failover: self.failover.clone(),
            prefill_in_flight: self.prefill_in_flight,
            state: Mutex::new(child),
            grants: self.grants.clone(),
            grant: Mutex::new(None),
            direct_return: self.direct_return.clone(),
        })
    }

    /// Keeps up to `chunks` of a prompt travelling at once (at least 1: each chunk waits for
    /// its answer before the next is computed).
    pub fn with_prefill_in_flight(mut self, chunks: usize) -> Self {
        self.prefill_in_flight = chunks.max(1);
        self
    }

    /// Sends `hidden` at `position` of `session` through the current route.
    fn send(
        &self,
        state: &mut RouteState,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
    ) -> Result<Tensor, SendError> {
        if state.checks.is_some() {
            return self.send_checked(state, session, position, hidden);
        }
        let answer = self
            .runtime
            .block_on(self.post(state, session, position, hidden)?)?;
        to_hidden(answer)
    }

    /// The send of `hidden` at `position` of `session` through the current route, as a future
    /// that owns what it needs (so it can run on a task of its own): the answer of the last
    /// hop, or the failure of the hop that failed or went silent.
    fn post(
        &self,
        state: &RouteState,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
    ) -> Result<impl Future<Output = Result<Activations, SendError>> + Send + 'static, SendError>
    {
        if state.hops.is_empty() {
            return Err(SendError::Other(stage_error(state, "the route has no hop")));
        }
        let activations =
            Activations::from_tensor(hidden).map_err(|e| SendError::Other(e.into()))?;
        let frame = ActivationFrame {
            meta: FrameMeta {
                session,
                chunk_index: 0,
                chunk_total: 1,
                position: position as u64,
                layers: state.first_layers,
                route: state.onward.clone(),
                grant: self.grant_for(state, session)?,
                fork_from: state.fork_from(position),
                return_to: None,
                rewind: state.rewind_pending,
            },
            activations,
        };
        let mut frame = frame;
        // With one remote hop its answer is already the shortest way back.
        let direct_return = self.direct_return.as_ref().filter(|_| state.hops.len() > 1);
        let awaited = direct_return.and_then(|direct| {
            let awaited = direct.desk.expect(&frame.meta)?;
            frame.meta.return_to = Some(ReturnAddress {
                endpoint: direct.endpoint.clone(),
                ticket: awaited.ticket(),
            });
            Some(awaited)
        });
        let client = self.client.clone();
        let routes = Arc::clone(&self.failover.routes);
        let hops = Arc::clone(&state.hops);
        let silent_hops = Arc::clone(&state.hops);
        let encoding = self.encoding;
        Ok(async move {
            let sending = async move {
                client
                    .forward_delivering(&hops[0].endpoint, frame, encoding)
                    .await
                    .map_err(|error| hop_error(&hops, error))
            };
            tokio::select! {
                output = deliver(sending, awaited, Arc::clone(&silent_hops)) => output,
                silent = first_silent_hop(routes.as_ref(), &silent_hops) => Err(silent),
            }
        })
    }

    /// Waits for the oldest chunk travelling. Its answer becomes `state.landed`; when it
    /// failed, the rest land first (so nothing of the old session still travels) and the
    /// generation fails over, the replay sending every chunk again and its last answer
    /// becoming `state.landed`.
    fn land_oldest(&self, state: &mut RouteState, generation: SessionId) -> Result<(), ModelError> {
        let Some(oldest) = state.in_flight.pop_front() else {
            return Ok(());
        };
        let failure = match self.runtime.block_on(oldest) {
            Ok(Ok(answer)) => match to_hidden(answer) {
                Ok(hidden) => {
                    state.landed = Some(hidden);
                    return Ok(());
                }
                Err(error) => error,
            },
            Ok(Err(error)) => error,
            Err(join) => SendError::Other(stage_error(
                state,
                format!("the task sending a chunk failed: {join}"),
            )),
        };
        self.land_all(state);
        match failure {
            SendError::Hop(failure) if reroutable(&failure) => {
                let mut attempts = 0;
                state.landed = self.fail_over(state, generation, *failure, &mut attempts)?;
                Ok(())
            }
            SendError::Hop(failure) => Err(hop_model_error(state, *failure)),
            SendError::Other(error) => Err(error),
        }
    }

    /// Waits for every chunk still travelling, whatever its answer.
    fn land_all(&self, state: &mut RouteState) {
        let travelling: Vec<_> = state.in_flight.drain(..).collect();
        if !travelling.is_empty() {
            self.runtime.block_on(futures::future::join_all(travelling));
        }
        state.landed = None;
    }

    /// Gets the generation past `failure`: a new route, the history replayed through it under
    /// a new session id. Fails when the attempts run out or no route appears in time.
    fn fail_over(
        &self,
        state: &mut RouteState,
        generation: SessionId,
        mut failure: HopFailure,
        attempts: &mut u32,
    ) -> Result<Option<Tensor>, ModelError> {
        let started = Instant::now();
        let policy = &self.failover.policy;
        while *attempts < policy.attempts {
            *attempts += 1;
            let attempt = *attempts;
            let culprit = culprit(state, &failure);
            let busy = is_busy(&failure);
            tracing::warn!(
                attempt,
                of = policy.attempts,
                peer = %culprit,
                cause = %failure,
                "failover: a hop failed; routing around it"
            );
            if !busy && !matches!(&failure.kind, HopFailureKind::Rejected { status: 409, .. }) {
                self.failover.routes.ban(&culprit, &failure.to_string());
            }
            let list = if busy {
                &mut state.avoid.busy
            } else {
                &mut state.avoid.failed
            };
            if !list.contains(&culprit) {
                list.push(culprit.clone());
            }
            let hops = match self.wait_for_route(&state.avoid) {
                Ok(hops) => hops,
                Err(reason) => {
                    return Err(route_lost(state, attempt, reason, failure));
                }
            };
            let mut next = route_state(hops, state.avoid.clone())?;
            next.history = std::mem::take(&mut state.history);
            next.history_tokens = state.history_tokens;
            next.session = Some(SessionId::new_v4());
            next.sampled = state.sampled;
            self.attach_checks(&mut next);
            let old = std::mem::replace(state, next);
            // The hops (and shadows) that survived free what they held (the generation's own
            // session id until the first failover).
            self.free_in_background(
                holders(&old).filter(|hop| hop.peer != culprit),
                old.session.unwrap_or(generation),
            );
            match self.replay(state) {
                Ok((replayed, last_answer)) => {
                    self.failover.metrics.count_failover();
                    tracing::info!(
                        attempt,
                        failed_peer = %culprit,
                        route = %describe(&state.hops),
                        replayed_tokens = replayed,
                        pause_ms = started.elapsed().as_millis() as u64,
                        "failover: the generation continues on a new route"
                    );
                    return Ok(last_answer);
                }
                Err(SendError::Hop(next)) if reroutable(&next) => failure = *next,
                Err(SendError::Hop(next)) => return Err(hop_model_error(state, *next)),
                Err(SendError::Other(error)) => return Err(error),
            }
        }
        Err(route_lost(
            state,
            policy.attempts,
            "every attempt failed".to_owned(),
            failure,
        ))
    }

    /// A route from the stage's first layer avoiding `avoid`, waiting up to the policy's
    /// recovery timeout for one to exist; at once an error when only busy holders are left
    /// (they serve the layers, so no new holder will come).
    fn wait_for_route(&self, avoid: &Avoid) -> Result<Vec<PlannedHop>, String> {
        let deadline = Instant::now() + self.failover.policy.recover_timeout;
        let mut logged = false;
        let all = avoid.all();
        loop {
            match self.failover.routes.route(self.start, &all) {
                Ok(hops) if !hops.is_empty() => return Ok(hops),
                Ok(_) => return Err("the tracker returned an empty route".to_owned()),
                Err(uncovered)
                    if self
                        .failover
                        .routes
                        .route(self.start, &avoid.failed)
                        .is_ok() =>
                {
                    return Err(format!("every holder of layer {} is busy", uncovered.layer));
                }
                Err(uncovered) => {
                    if Instant::now() >= deadline {
                        return Err(format!(
                            "{uncovered} within {:?}",
                            self.failover.policy.recover_timeout
                        ));
                    }
                    if !logged {
                        tracing::warn!(%uncovered, timeout = ?self.failover.policy.recover_timeout, "failover: waiting for the mesh to cover the layers again");
                        logged = true;
                    }
                    std::thread::sleep(RECOVERY_POLL);
                }
            }
        }
    }

    /// Sends the recorded history through the current route frame by frame, as it was first
    /// sent (the prompt's prefill chunks of at most 128 tokens, then one frame per decode
    /// step); returns the tokens replayed and the answer to the last frame.
    ///
    /// The frames keep their first shapes because attention over a chunk does not give
    /// bit-identical values to the same tokens decoded one by one: replaying the decode
    /// steps as one chunk changed the greedy text in 5 of 20 chaos runs (ADR-0018).
    fn replay(&self, state: &mut RouteState) -> Result<(usize, Option<Tensor>), SendError> {
        let session = state.session.unwrap_or_else(SessionId::new_v4);
        let mut position = 0;
        let mut last_answer = None;
        let history = state.history.clone();
        for frame in &history {
            last_answer = Some(self.send(state, session, position, frame)?);
            position += frame.dim(1).map_err(|e| SendError::Other(e.into()))?;
        }
        Ok((position, last_answer))
    }

    /// Asks every hop of `hops` to free `session`, without waiting.
    fn free_in_background<'a>(
        &self,
        hops: impl Iterator<Item = &'a PlannedHop>,
        session: SessionId,
    ) {
        let client = self.client.clone();
        let endpoints: Vec<Endpoint> = hops.map(|hop| hop.endpoint.clone()).collect();
        self.runtime.spawn(async move {
            for endpoint in endpoints {
                let _ = tokio::time::timeout(
                    END_SESSION_TIMEOUT,
                    client.end_session(&endpoint, session),
                )
                .await;
            }
        });
    }
}

/// The route state for `hops`, avoiding `avoid`.
fn route_state(hops: Vec<PlannedHop>, avoid: Avoid) -> Result<RouteState, ModelError> {
    let invalid = |reason: String| ModelError::Stage {
        stage: "remote hops".to_owned(),
        source: reason.into(),
    };
    let first = hops
        .first()
        .ok_or_else(|| invalid("the route has no hop".to_owned()))?;
    let first_layers = first.layers;
    if first_layers.is_empty() {
        return Err(invalid(format!("empty layer span for peer {}", first.peer)));
    }
    let all = hops
        .iter()
        .map(|hop| Hop::new(hop.layers, hop.endpoint.to_string()).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(invalid)?;
    let onward = Route::new(all[1..].to_vec())?;
    let full_route = Route::new(all)?;
    Ok(RouteState {
        hops: hops.into(),
        first_layers,
        onward,
        full_route,
        session: None,
        history: Vec::new(),
        history_tokens: 0,
        avoid,
        in_flight: VecDeque::new(),
        landed: None,
        fork: None,
        sampled: false,
        checks: None,
        rewind_pending: false,
    })
}

/// Cuts the recorded frames of `state` back to their first `len` tokens (fewer than it holds):
/// later frames are dropped and the one that straddles `len` keeps its first rows.
fn cut_history(state: &mut RouteState, len: usize) -> meshnet_model::Result<()> {
    while let Some(last) = state.history.pop() {
        let tokens = last.dim(1)?;
        let start = state.history_tokens - tokens;
        state.history_tokens = start;
        if start < len {
            state.history.push(last.narrow(1, 0, len - start)?);
            state.history_tokens = len;
        }
        if state.history_tokens <= len {
            break;
        }
    }
    Ok(())
}

/// Every peer holding the session of `state`: the route's hops and, for a checked session,
/// their shadows.
fn holders(state: &RouteState) -> impl Iterator<Item = &PlannedHop> {
    state
        .hops
        .iter()
        .chain(state.checks.iter().flat_map(Checks::shadow_hops))
}

/// A hop's answer as the `f32` hidden states the generation continues with.
fn to_hidden(answer: Activations) -> Result<Tensor, SendError> {
    answer
        .into_tensor(&Device::Cpu)
        .and_then(|t| Ok(t.to_dtype(DType::F32)?))
        .map_err(|e| SendError::Other(e.into()))
}

/// Resolves once a hop of `hops` stops announcing itself (stopped, cut off, or dead without
/// closing its connections), with that hop's failure; the answer it holds up may otherwise
/// only end with the hop timeout.
async fn first_silent_hop(routes: &dyn MeshRoutes, hops: &[PlannedHop]) -> SendError {
    let peers: Vec<PeerId> = hops.iter().map(|hop| hop.peer.clone()).collect();
    loop {
        tokio::time::sleep(SILENCE_POLL).await;
        let Some(peer) = routes.first_silent(&peers) else {
            continue;
        };
        let endpoint = hops
            .iter()
            .find(|hop| hop.peer == peer)
            .map_or_else(String::new, |hop| hop.endpoint.to_string());
        let mut failure = HopFailure::new(
            endpoint,
            HopFailureKind::Silent,
            "the tracker stopped hearing its announcements while waiting for the answer",
        );
        failure.peer = Some(peer);
        return SendError::Hop(Box::new(failure));
    }
}

/// The hops as `endpoint (layers a..b) -> ...`.
fn describe(hops: &[PlannedHop]) -> String {
    hops.iter()
        .map(|hop| format!("{} (layers {})", hop.endpoint, hop.layers))
        .collect::<Vec<_>>()
        .join(" -> ")
}

fn stage_error(state: &RouteState, reason: impl std::fmt::Display) -> ModelError {
    ModelError::Stage {
        stage: describe(&state.hops),
        source: reason.to_string().into(),
    }
}

/// A failed send: the [`HopFailure`] of the hop that actually failed, named by its peer id
/// when it is one of the route's `hops`.
fn hop_error(hops: &[PlannedHop], error: ClientError) -> SendError {
    match error.hop_failure() {
        Some(mut failure) => {
            failure.peer = hops
                .iter()
                .find(|hop| hop.endpoint.to_string() == failure.endpoint)
                .map(|hop| hop.peer.clone());
            SendError::Hop(Box::new(failure))
        }
        None => SendError::Other(ModelError::Stage {
            stage: describe(hops),
            source: Box::new(error),
        }),
    }
}

fn hop_model_error(state: &RouteState, failure: HopFailure) -> ModelError {
    ModelError::Stage {
        stage: describe(&state.hops),
        source: Box::new(failure),
    }
}

fn route_lost(state: &RouteState, attempts: u32, reason: String, last: HopFailure) -> ModelError {
    tracing::error!(attempts, %reason, last = %last, "failover: giving up");
    ModelError::Stage {
        stage: describe(&state.hops),
        source: Box::new(RouteLost {
            attempts,
            reason,
            last,
        }),
    }
}

/// The peer to blame for `failure`: the hop it names, else the first hop.
fn culprit(state: &RouteState, failure: &HopFailure) -> PeerId {
    failure
        .peer
        .clone()
        .or_else(|| state.hops.first().map(|hop| hop.peer.clone()))
        .unwrap_or_else(|| PeerId::new(failure.endpoint.clone()))
}

/// A hop that is merely busy (503 overloaded, 429): another holder may take the session, and
/// the hop stays routable for other generations.
/// The output of a frame `sending` posts: with a return address (`awaited`), whichever comes
/// first of the output posted to the entry and the answer along the route. The send goes on
/// in the background once the output is in: its `202` unwinding back up the route is not
/// waited for.
async fn deliver(
    sending: impl Future<Output = Result<Delivery, SendError>> + Send + 'static,
    awaited: Option<AwaitedReturn>,
    hops: Arc<[PlannedHop]>,
) -> Result<Activations, SendError> {
    let Some(mut awaited) = awaited else {
        return match sending.await? {
            Delivery::Answered(answer) => Ok(answer.activations),
            Delivery::ReturnedDirectly => Err(broken_return(
                &hops,
                "the route answered 202 to a frame without a return address",
            )),
        };
    };
    let mut sending = tokio::spawn(sending);
    let joined = tokio::select! {
        biased;
        returned = awaited.received() => match returned {
            Some(output) => return Ok(output.activations),
            None => (&mut sending).await,
        },
        joined = &mut sending => joined,
    };
    finish_sending(joined, awaited, &hops).await
}

/// The output of a send that has ended: its answer, or the output posted to the entry when
/// the answer says it was returned directly.
async fn finish_sending(
    joined: Result<Result<Delivery, SendError>, tokio::task::JoinError>,
    mut awaited: AwaitedReturn,
    hops: &[PlannedHop],
) -> Result<Activations, SendError> {
    let answer = joined.map_err(|join| {
        SendError::Other(ModelError::Stage {
            stage: describe(hops),
            source: format!("the task sending a frame failed: {join}").into(),
        })
    })??;
    match answer {
        Delivery::Answered(answer) => Ok(answer.activations),
        Delivery::ReturnedDirectly => {
            match tokio::time::timeout(RETURNED_OUTPUT_WAIT, awaited.received()).await {
                Ok(Some(output)) => Ok(output.activations),
                _ => Err(broken_return(
                    hops,
                    "the route said it returned the output, and none arrived",
                )),
            }
        }
    }
}

/// A route whose last hop claimed a direct return that did not happen: a broken answer of
/// that hop, which another route may get past.
fn broken_return(hops: &[PlannedHop], reason: &str) -> SendError {
    let Some(last) = hops.last() else {
        return SendError::Other(ModelError::Stage {
            stage: describe(hops),
            source: reason.to_owned().into(),
        });
    };
    let mut failure = HopFailure::new(
        last.endpoint.to_string(),
        HopFailureKind::BadResponse,
        reason,
    );
    failure.peer = Some(last.peer.clone());
    SendError::Hop(Box::new(failure))
}

fn is_busy(failure: &HopFailure) -> bool {
    matches!(&failure.kind, HopFailureKind::Rejected { status: 429, .. })
        || matches!(&failure.kind, HopFailureKind::Rejected { status: 503, code } if code == "overloaded")
}

/// Whether another route may get past `failure`: a retryable failure, or a hop that no longer
/// serves the layers (the route was planned on a map it has since left).
fn reroutable(failure: &HopFailure) -> bool {
    failure.retryable() || failure.kind.code() == "layers_not_served"
}

impl Stage for RemoteStage {
    fn forward(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
    ) -> meshnet_model::Result<Tensor> {
        // The wire carries bfloat16: recording that is recording exactly what was sent.
        let input = hidden.to_dtype(DType::BF16)?;
        let tokens = input.dim(1)?;
        let mut state = lock(&self.state);
        while !state.in_flight.is_empty() {
            self.land_oldest(&mut state, session)?;
        }
        state.landed = None;
        if position != state.history_tokens {
            return Err(stage_error(
                &state,
                format!(
                    "position {position} does not follow the {} tokens sent",
                    state.history_tokens
                ),
            ));
        }
        // Failed routes in a row for this step, replays included.
        let mut attempts = 0;
        loop {
            let on_hops = state.session.unwrap_or(session);
            match self.send(&mut state, on_hops, position, &input) {
                Ok(output) => {
                    state.history.push(input);
                    state.history_tokens += tokens;
                    state.rewind_pending = false;
                    return Ok(output);
                }
                Err(SendError::Hop(failure)) if reroutable(&failure) => {
                    self.fail_over(&mut state, session, *failure, &mut attempts)?;
                }
                Err(SendError::Hop(failure)) => return Err(hop_model_error(&state, *failure)),
                Err(SendError::Other(error)) => return Err(error),
            }
        }
    }

    fn start_chunk(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
    ) -> meshnet_model::Result<Option<Tensor>> {
        // A checked session runs hop by hop, one frame at a time.
        if self.prefill_in_flight <= 1 || lock(&self.state).checks.is_some() {
            return self.forward(session, position, hidden).map(Some);
        }
        let input = hidden.to_dtype(DType::BF16)?;
        let tokens = input.dim(1)?;
        let mut state = lock(&self.state);
        if position != state.history_tokens {
            return Err(stage_error(
                &state,
                format!(
                    "position {position} does not follow the {} tokens sent",
                    state.history_tokens
                ),
            ));
        }
        while state.in_flight.len() >= self.prefill_in_flight {
            self.land_oldest(&mut state, session)?;
        }
        let on_hops = state.session.unwrap_or(session);
        let post = match self.post(&state, on_hops, position, &input) {
            Ok(post) => post,
            Err(SendError::Hop(failure)) => return Err(hop_model_error(&state, *failure)),
            Err(SendError::Other(error)) => return Err(error),
        };
        state.history.push(input);
        state.history_tokens += tokens;
        state.rewind_pending = false;
        let sending = self.runtime.spawn(post);
        state.in_flight.push_back(sending);
        Ok(None)
    }

    fn finish_chunks(&self, session: SessionId) -> meshnet_model::Result<Option<Tensor>> {
        let mut state = lock(&self.state);
        while !state.in_flight.is_empty() {
            self.land_oldest(&mut state, session)?;
        }
        Ok(state.landed.take())
    }

    /// Every route but a checked session's (whose shadows and arbiters replay what each hop
    /// was sent) can take positions back.
    fn can_rewind(&self) -> bool {
        lock(&self.state).checks.is_none()
    }

    /// Cuts the recorded history back to `len` tokens; the next frame carries the rewind to
    /// every hop (no extra trip).
    fn rewind(&self, session: SessionId, len: usize) -> meshnet_model::Result<()> {
        let mut state = lock(&self.state);
        if state.checks.is_some() {
            return Err(stage_error(
                &state,
                "a checked session cannot take positions back",
            ));
        }
        while !state.in_flight.is_empty() {
            self.land_oldest(&mut state, session)?;
        }
        state.landed = None;
        if state.history_tokens <= len {
            return Ok(());
        }
        cut_history(&mut state, len)?;
        state.rewind_pending = true;
        Ok(())
    }

    fn end_session(&self, session: SessionId) {
        let (hops, on_hops) = {
            let mut state = lock(&self.state);
            self.land_all(&mut state);
            if let Some(checks) = &state.checks {
                let passed = checks.passed(&state.hops);
                if !passed.is_empty() {
                    self.failover.metrics.count_checked_session();
                }
                for peer in passed {
                    self.failover.routes.record_verified(peer);
                }
            }
            let hops: Vec<PlannedHop> = holders(&state).cloned().collect();
            (hops, state.session.unwrap_or(session))
        };
        // All hops at once, each given a few seconds: a dead hop must not hold up the others
        // (peers also drop sessions left idle).
        let ends = hops.iter().map(|hop| async move {
            let freed = tokio::time::timeout(
                END_SESSION_TIMEOUT,
                self.client.end_session(&hop.endpoint, on_hops),
            )
            .await;
            (hop, freed)
        });
        for (hop, freed) in self.runtime.block_on(futures::future::join_all(ends)) {
            match freed {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(session = %on_hops, peer = %hop.peer, %error, "could not free the session on a hop");
                }
                Err(_) => {
                    tracing::warn!(session = %on_hops, peer = %hop.peer, "freeing the session on a hop timed out");
                }
            }
        }
    }

    fn name(&self) -> String {
        describe(&lock(&self.state).hops)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use meshnet_node::{ActivationPlane, ExecutorError, SpanExecutor};
    use meshnet_wire::Limits;

    use super::*;
    use crate::routing::Uncovered;

    /// Stand-in layers: each adds 1 to every value.
    struct AddOnePerLayer;

    impl SpanExecutor for AddOnePerLayer {
        fn served_layers(&self) -> Option<LayerSpan> {
            Some(LayerSpan::new(10, 30))
        }

        fn forward(
            &self,
            meta: &FrameMeta,
            input: Activations,
        ) -> Result<Activations, ExecutorError> {
            let add = meta.layers.len() as f32;
            let (shape, values) = input.into_parts();
            let values = values
                .into_iter()
                .map(|v| half::bf16::from_f32(v.to_f32() + add))
                .collect();
            Activations::new(shape, values).map_err(|e| ExecutorError::Compute(e.to_string()))
        }
    }

    /// Two holders of 10..30: `stopped` (first choice until banned), then `healthy`.
    /// `stopped` counts as silent once `silent` is set.
    struct TwoHolders {
        stopped: PlannedHop,
        healthy: PlannedHop,
        silent: AtomicBool,
        banned: Mutex<Vec<(PeerId, String)>>,
    }

    impl MeshRoutes for TwoHolders {
        fn route(&self, _start: u32, avoid: &[PeerId]) -> Result<Vec<PlannedHop>, Uncovered> {
            let banned = lock(&self.banned)
                .iter()
                .any(|(p, _)| *p == self.stopped.peer);
            if banned || avoid.contains(&self.stopped.peer) {
                Ok(vec![self.healthy.clone()])
            } else {
                Ok(vec![self.stopped.clone()])
            }
        }

        fn ban(&self, peer: &PeerId, cause: &str) {
            lock(&self.banned).push((peer.clone(), cause.to_owned()));
        }

        fn first_silent(&self, peers: &[PeerId]) -> Option<PeerId> {
            (self.silent.load(Ordering::Relaxed) && peers.contains(&self.stopped.peer))
                .then(|| self.stopped.peer.clone())
        }
    }

    fn hop(peer: &str, endpoint: String) -> PlannedHop {
        PlannedHop {
            peer: PeerId::new(peer),
            endpoint: endpoint.parse().unwrap(),
            layers: LayerSpan::new(10, 30),
        }
    }

    /// Two holders of 10..30 at these URLs, neither silent nor banned yet.
    fn two_holders(stopped_url: String, healthy_url: String) -> Arc<TwoHolders> {
        Arc::new(TwoHolders {
            stopped: hop("stopped", stopped_url),
            healthy: hop("healthy", healthy_url),
            silent: AtomicBool::new(false),
            banned: Mutex::new(Vec::new()),
        })
    }

    /// The URL of a stopped process: it accepts connections and keeps them, answering
    /// nothing.
    async fn stopped_process_url() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        url
    }

    /// Marks `routes`' stopped holder silent shortly after a send to it started.
    fn mark_stopped_silent_soon(routes: Arc<TwoHolders>) {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            routes.silent.store(true, Ordering::Relaxed);
        });
    }

    /// Sends a three-token prompt of ones through `stage` as `session` and checks it came back
    /// within 30 s (long before the 60 s hop timeout: the `stopped` holder, the route's hop or
    /// its shadow, was given up on) with the healthy holder's 20 layers of +1.
    async fn prefill_on_the_healthy_holder(
        stage: &Arc<RemoteStage>,
        session: SessionId,
        stopped: &str,
    ) {
        let started = Instant::now();
        let prompt = Tensor::ones((1, 3, 4), DType::F32, &Device::Cpu).unwrap();
        let running = Arc::clone(stage);
        let output = tokio::task::spawn_blocking(move || running.forward(session, 0, prompt))
            .await
            .unwrap()
            .unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(30),
            "gave up on the stopped {stopped} only after {took:?}"
        );
        let values: Vec<f32> = output.flatten_all().unwrap().to_vec1().unwrap();
        assert!(values.iter().all(|v| *v == 21.0), "{values:?}");
    }

    /// The stopped holder, and only it, was banned once, for its silence.
    fn assert_banned_once_as_silent(routes: &TwoHolders) {
        let banned = lock(&routes.banned).clone();
        assert_eq!(banned.len(), 1, "{banned:?}");
        assert_eq!(banned[0].0, PeerId::new("stopped"));
        assert!(banned[0].1.contains("stopped announcing"), "{banned:?}");
    }

    /// A stage over the first route `routes` gives from layer 10, sending raw frames with
    /// `client`, and the failover it counts its failovers in.
    fn stage_over(routes: Arc<dyn MeshRoutes>, client: ForwardClient) -> (RemoteStage, Failover) {
        stage_checking(routes, client, VerifyPolicy::OFF)
    }

    /// [`stage_over`], its sessions checked as `verify` says.
    fn stage_checking(
        routes: Arc<dyn MeshRoutes>,
        client: ForwardClient,
        verify: VerifyPolicy,
    ) -> (RemoteStage, Failover) {
        let failover = Failover {
            routes,
            policy: FailoverPolicy::default(),
            metrics: meshnet_metrics::Metrics::detached(),
            verify,
        };
        let hops = failover.routes.route(10, &[]).unwrap();
        let stage = RemoteStage::new(
            10,
            hops,
            client,
            Handle::current(),
            Encoding::Raw,
            failover.clone(),
        )
        .unwrap();
        (stage, failover)
    }

    /// A hop that is stopped (it holds connections open and never answers) is given up on
    /// once it stops announcing, long before the hop timeout, and the step goes to the other
    /// holder with the history replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hop_that_stops_announcing_is_routed_around_before_its_timeout() {
        let client = ForwardClient::new(Limits::default(), Duration::from_secs(60)).unwrap();
        let healthy_url = serve(Arc::new(AddOnePerLayer), &client).await;
        let stopped_url = stopped_process_url().await;

        let routes = two_holders(stopped_url, healthy_url);
        let (stage, failover) = stage_over(Arc::clone(&routes) as _, client);
        let stage = Arc::new(stage);

        // The prefill goes to the stopped hop's holder before it stops: it never answers.
        // Mark it silent shortly after the send started.
        mark_stopped_silent_soon(Arc::clone(&routes));
        let session = SessionId::new_v4();
        prefill_on_the_healthy_holder(&stage, session, "hop").await;
        assert_banned_once_as_silent(&routes);
        assert_eq!(failover.metrics.failovers(), 1);

        // The next step continues on the healthy holder at the next position.
        let step = Tensor::ones((1, 1, 4), DType::F32, &Device::Cpu).unwrap();
        let running = Arc::clone(&stage);
        let next = tokio::task::spawn_blocking(move || running.forward(session, 3, step))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(next.dims(), &[1, 1, 4]);
        assert!(stage.name().contains("layers 10..30"));
    }

    /// Routes through `healthy`, with `stopped` as the shadow of checked sessions until it is
    /// banned; `stopped` counts as silent once `silent` is set.
    struct StoppedShadow(Arc<TwoHolders>);

    impl MeshRoutes for StoppedShadow {
        fn route(&self, _start: u32, _avoid: &[PeerId]) -> Result<Vec<PlannedHop>, Uncovered> {
            Ok(vec![self.0.healthy.clone()])
        }

        fn ban(&self, peer: &PeerId, cause: &str) {
            self.0.ban(peer, cause);
        }

        fn first_silent(&self, peers: &[PeerId]) -> Option<PeerId> {
            self.0.first_silent(peers)
        }

        fn holders(&self, _layers: LayerSpan, avoid: &[PeerId]) -> Vec<PlannedHop> {
            let banned = lock(&self.0.banned)
                .iter()
                .any(|(p, _)| *p == self.0.stopped.peer);
            let shadow = &self.0.stopped;
            if banned || avoid.contains(&shadow.peer) {
                Vec::new()
            } else {
                vec![shadow.clone()]
            }
        }
    }

    /// A checked session's shadow that is stopped is given up on once it stops announcing,
    /// like a hop of the route, not after the hop timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_shadow_that_stops_announcing_is_given_up_on_before_its_timeout() {
        let client = ForwardClient::new(Limits::default(), Duration::from_secs(60)).unwrap();
        let healthy_url = serve(Arc::new(AddOnePerLayer), &client).await;
        let stopped_url = stopped_process_url().await;
        let routes = Arc::new(StoppedShadow(two_holders(stopped_url, healthy_url)));
        let every_session = VerifyPolicy {
            sample_rate: 1.0,
            ..VerifyPolicy::default()
        };
        let (stage, _) = stage_checking(Arc::clone(&routes) as _, client, every_session);
        mark_stopped_silent_soon(Arc::clone(&routes.0));
        prefill_on_the_healthy_holder(&Arc::new(stage), SessionId::new_v4(), "shadow").await;
        assert_banned_once_as_silent(&routes.0);
    }

    /// Stand-in layers that add 1 per layer, record the position of every chunk they get and,
    /// while closed, hold every chunk until they are opened.
    #[derive(Default)]
    struct Gate {
        open: Mutex<bool>,
        opened: std::sync::Condvar,
        positions: Mutex<Vec<u64>>,
    }

    impl Gate {
        fn open(&self) {
            *lock(&self.open) = true;
            self.opened.notify_all();
        }

        fn arrived(&self) -> usize {
            lock(&self.positions).len()
        }
    }

    impl SpanExecutor for Gate {
        fn served_layers(&self) -> Option<LayerSpan> {
            Some(LayerSpan::new(10, 30))
        }

        fn forward(
            &self,
            meta: &FrameMeta,
            input: Activations,
        ) -> Result<Activations, ExecutorError> {
            lock(&self.positions).push(meta.position);
            let mut open = lock(&self.open);
            while !*open {
                open = self
                    .opened
                    .wait(open)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            drop(open);
            AddOnePerLayer.forward(meta, input)
        }
    }

    /// Serves `executor`'s activation plane on a loopback port; returns its URL.
    async fn serve(executor: Arc<dyn SpanExecutor>, client: &ForwardClient) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let router = ActivationPlane::new(executor, Limits::default(), client.clone()).router();
        tokio::spawn(async move { axum::serve(listener, router).await });
        url
    }

    /// Waits, at most 30 s, until `condition` holds.
    async fn until(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A two-token chunk whose values are all `value`.
    fn chunk(value: f32) -> Tensor {
        (Tensor::ones((1, 2, 4), DType::F32, &Device::Cpu).unwrap() * f64::from(value)).unwrap()
    }

    fn values(tensor: &Tensor) -> Vec<f32> {
        tensor.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// One holder of 10..30, never silent.
    struct OneHolder(PlannedHop);

    impl MeshRoutes for OneHolder {
        fn route(&self, _start: u32, _avoid: &[PeerId]) -> Result<Vec<PlannedHop>, Uncovered> {
            Ok(vec![self.0.clone()])
        }

        fn ban(&self, _peer: &PeerId, _cause: &str) {}

        fn first_silent(&self, _peers: &[PeerId]) -> Option<PeerId> {
            None
        }
    }

    /// Pipelined prefill: the stage hands each chunk on and returns at once, so all three are
    /// at the hop together; the last one's answer comes back once they land, and a decode step
    /// follows at the next position.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn prompt_chunks_travel_together_and_the_last_answer_comes_back() {
        let client = ForwardClient::new(Limits::default(), Duration::from_secs(60)).unwrap();
        let gate = Arc::new(Gate::default());
        let url = serve(Arc::clone(&gate) as _, &client).await;
        let (stage, _) = stage_over(Arc::new(OneHolder(hop("gated", url))), client);
        let stage = Arc::new(stage.with_prefill_in_flight(4));
        let session = SessionId::new_v4();

        let sending = Arc::clone(&stage);
        let started = tokio::task::spawn_blocking(move || {
            (0..3)
                .map(|k| {
                    sending
                        .start_chunk(session, 2 * k, chunk(k as f32))
                        .unwrap()
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap();
        assert!(
            started.iter().all(Option::is_none),
            "a chunk was waited for"
        );
        // All three are held at the hop at once: none was answered before the next was sent.
        until("three chunks at the hop", || gate.arrived() == 3).await;
        gate.open();
        let landing = Arc::clone(&stage);
        let last = tokio::task::spawn_blocking(move || landing.finish_chunks(session))
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(values(&last).iter().all(|v| *v == 22.0), "{last}");
        let mut positions = lock(&gate.positions).clone();
        positions.sort_unstable();
        assert_eq!(positions, [0, 2, 4]);

        let stepping = Arc::clone(&stage);
        let next = tokio::task::spawn_blocking(move || {
            let early = stepping.forward(session, 5, chunk(1.0));
            let step = stepping.forward(session, 6, chunk(1.0));
            (early, step)
        })
        .await
        .unwrap();
        assert!(next.0.is_err(), "a step at the wrong position was sent");
        assert!(values(&next.1.unwrap()).iter().all(|v| *v == 21.0));
    }

    /// A hop that stops while holding pipelined chunks: once every chunk has landed the
    /// generation fails over and the replay sends all of them, in order, to the other holder,
    /// whose answer to the last is the prefill's result.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hop_failing_under_pipelined_chunks_is_replaced_and_every_chunk_replayed() {
        let client = ForwardClient::new(Limits::default(), Duration::from_secs(60)).unwrap();
        let healthy = Arc::new(Gate::default());
        healthy.open();
        let healthy_url = serve(Arc::clone(&healthy) as _, &client).await;
        let stopped = Arc::new(Gate::default());
        let stopped_url = serve(Arc::clone(&stopped) as _, &client).await;
        let routes = two_holders(stopped_url, healthy_url);
        let (stage, failover) = stage_over(Arc::clone(&routes) as _, client);
        let stage = Arc::new(stage.with_prefill_in_flight(2));
        let session = SessionId::new_v4();

        // Two chunks are held at the stopped holder; the third waits for room, so the stage
        // blocks until the failover.
        let sending = Arc::clone(&stage);
        let prefill = tokio::task::spawn_blocking(move || {
            for k in 0..3 {
                sending.start_chunk(session, 2 * k, chunk(k as f32))?;
            }
            sending.finish_chunks(session)
        });
        until("two chunks at the stopped holder", || {
            stopped.arrived() == 2
        })
        .await;
        routes.silent.store(true, Ordering::Relaxed);
        let last = prefill.await.unwrap().unwrap().unwrap();
        assert!(values(&last).iter().all(|v| *v == 22.0), "{last}");
        assert_eq!(*lock(&healthy.positions), [0, 2, 4]);
        assert_eq!(failover.metrics.failovers(), 1);
        stopped.open();
    }

    /// Cutting the history back drops later frames and keeps the first rows of the frame
    /// that straddles the cut, so a failover replays exactly the positions the hops keep.
    #[test]
    fn a_rewind_cuts_the_recorded_history_at_the_position() {
        let mut state = route_state(
            vec![hop("a", "http://127.0.0.1:1".to_owned())],
            Avoid::default(),
        )
        .unwrap();
        for (first, tokens) in [(0.0f32, 3usize), (3.0, 1), (4.0, 4)] {
            let values: Vec<f32> = (0..tokens).map(|row| first + row as f32).collect();
            state
                .history
                .push(Tensor::from_vec(values, (1, tokens, 1), &Device::Cpu).unwrap());
            state.history_tokens += tokens;
        }
        cut_history(&mut state, 6).unwrap();
        let rows = |state: &RouteState| -> Vec<Vec<f32>> {
            state
                .history
                .iter()
                .map(|frame| frame.flatten_all().unwrap().to_vec1().unwrap())
                .collect()
        };
        assert_eq!(state.history_tokens, 6);
        assert_eq!(
            rows(&state),
            [vec![0.0, 1.0, 2.0], vec![3.0], vec![4.0, 5.0]]
        );
        cut_history(&mut state, 4).unwrap();
        assert_eq!(rows(&state), [vec![0.0, 1.0, 2.0], vec![3.0]]);
        cut_history(&mut state, 1).unwrap();
        assert_eq!((state.history_tokens, rows(&state)), (1, vec![vec![0.0]]));
    }
}
