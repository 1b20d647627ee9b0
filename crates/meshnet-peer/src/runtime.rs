//! A running peer: the control plane, the span slot, the HTTP server, and the control loop
//! that ties them together.
//!
//! Every peer announces itself on gossip every `announce_interval` and applies the directives
//! the tracker addresses to it (loading off the async workers, announcing `loading` then
//! `ready`). The tracker also gathers announcements, forgets peers silent for three intervals,
//! runs the planner after every change (debounced) and on every interval, publishes the
//! coverage map and the directives, loads its own entry span, and answers the OpenAI-style
//! API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt;
use axum::{Json, Router};
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use meshnet_api::openai_router;
use meshnet_node::{ActivationPlane, DEFAULT_HOP_TIMEOUT, ForwardClient, SpanExecutor};
use meshnet_p2p::{
    CoverageMessage, DirectiveMessage, P2pConfig, P2pEvent, P2pHandle, PeerAnnouncement, Role,
    SpanState, SpanStatus, TrackerRecord, TransportChoice,
};
use meshnet_planner::{PeerCapacity, PeerId as PlannerPeerId, Quantization};
use meshnet_wire::{Limits, WIRE_VERSION};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::engine::{MeshEngine, TextSide};
use crate::error::PeerError;
use crate::mesh_model::MeshModel;
use crate::shard::{LoadedShard, ShardHost, ShardTarget};
use crate::status::{CoverageReport, ModelReport, PeerReport, SpanReport, StatusReport};
use crate::tracker::{TrackerBook, route_boundaries};

/// How a peer is started.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// The GGUF model file; every member of a mesh runs the same file.
    pub model_path: PathBuf,
    /// Take the tracker role.
    pub tracker: bool,
    /// Where the HTTP server (activation plane, status, and on the tracker the OpenAI API)
    /// listens; port 0 picks a free port.
    pub http_listen: SocketAddr,
    /// The base URL other peers use to reach this one; by default `http://` and the bound
    /// address (127.0.0.1 when bound to all interfaces).
    pub advertise_http: Option<String>,
    /// libp2p listen addresses.
    pub p2p_listen: Vec<Multiaddr>,
    /// libp2p addresses of any members of the mesh.
    pub bootstrap: Vec<Multiaddr>,
    /// Memory given to the mesh, in bytes (weights plus KV cache).
    pub memory_bytes: u64,
    /// Formats this peer may hold layers in; empty means the model's shipped format.
    pub quantizations: Vec<Quantization>,
    /// Where the peer keeps its identity key.
    pub data_dir: PathBuf,
    /// An identity to use instead of the one in `data_dir` (tests).
    pub keypair: Option<Keypair>,
    /// libp2p transports.
    pub transport: TransportChoice,
    /// How often the peer announces itself; it is forgotten after three silent intervals.
    pub announce_interval: Duration,
    /// KV-cache tokens reserved per held layer.
    pub kv_tokens: u64,
    /// Generations the tracker runs at once before answering 429.
    pub max_sessions: usize,
    /// Treat listen addresses as reachable (LANs, loopback testnets, public hosts).
    pub assume_reachable: bool,
    /// Ask the gateway for a UPnP port mapping.
    pub upnp: bool,
    /// Accept coverage maps and directives only from this tracker.
    pub pinned_tracker: Option<PeerId>,
    /// How long a dropped span keeps serving its running sessions.
    pub drain_timeout: Duration,
}

impl PeerConfig {
    /// Defaults a user would expect for `model_path`: a peer (not tracker) on HTTP port 0 and
    /// TCP/QUIC port 0, 1 GiB of memory, announcements every 2 s, 2048 KV tokens per layer,
    /// 4 concurrent generations.
    pub fn new(model_path: PathBuf, data_dir: PathBuf) -> Self {
        PeerConfig {
            model_path,
            tracker: false,
            http_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_http: None,
            p2p_listen: Vec::new(),
            bootstrap: Vec::new(),
            memory_bytes: 1 << 30,
            quantizations: Vec::new(),
            data_dir,
            keypair: None,
            transport: TransportChoice::Network,
            announce_interval: Duration::from_secs(2),
            kv_tokens: 2048,
            max_sessions: 4,
            assume_reachable: false,
            upnp: false,
            pinned_tracker: None,
            drain_timeout: Duration::from_secs(60),
        }
    }
}

/// State shared by the HTTP handlers and the control loop.
struct Shared {
    peer_id: String,
    tracker_role: bool,
    model: Arc<MeshModel>,
    host: Arc<ShardHost>,
    http_url: String,
    memory_bytes: u64,
    quantizations: Vec<Quantization>,
    kv_tokens: u64,
    throughput: Mutex<f64>,
    book: Option<Arc<Mutex<TrackerBook>>>,
    engine: Option<Arc<MeshEngine>>,
    coverage: Mutex<Option<CoverageMessage>>,
    tracker: Mutex<Option<String>>,
    p2p_addrs: Mutex<Vec<String>>,
    rejected: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// The span to announce: the one loading, else the current one.
    fn span_status(&self) -> Option<SpanStatus> {
        if let Some(target) = self.host.loading() {
            return Some(SpanStatus {
                layers: target.layers,
                quantization: target.quantization,
                state: SpanState::Loading,
            });
        }
        self.host.current().map(|shard| SpanStatus {
            layers: shard.target.layers,
            quantization: shard.target.quantization,
            state: SpanState::Ready,
        })
    }

    fn active_sessions(&self) -> usize {
        let generations = self.engine.as_ref().map_or(0, |e| e.active_sessions());
        generations.max(self.host.active_sessions())
    }

    fn announcement(&self) -> PeerAnnouncement {
        PeerAnnouncement {
            peer: self.peer_id.clone(),
            model_id: self.model.id().to_owned(),
            software_version: env!("CARGO_PKG_VERSION").to_owned(),
            wire_version: WIRE_VERSION,
            http_endpoints: vec![self.http_url.clone()],
            memory_bytes: self.memory_bytes,
            quantizations: self.quantizations.clone(),
            throughput: *lock(&self.throughput),
            kv_tokens: self.kv_tokens,
            span: self.span_status(),
            free_kv_tokens: self.host.free_kv_tokens(),
            active_sessions: u32::try_from(self.active_sessions()).unwrap_or(u32::MAX),
            is_tracker: self.tracker_role,
            sent_at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// The hops after the entry span, when the mesh covers the model.
    fn route_boundaries(&self) -> Option<Vec<u32>> {
        let book = self.book.as_ref()?;
        let entry = self.host.current().filter(|s| s.target.entry)?;
        let start = entry.target.layers.end;
        let hops = lock(book).route(start).ok()?;
        Some(route_boundaries(start, &hops))
    }

    fn status(&self) -> StatusReport {
        let loading = self.host.loading().map(|target| SpanReport {
            layers: [target.layers.start, target.layers.end],
            quantization: target.quantization,
            state: SpanState::Loading,
        });
        let span = self.host.current().map(|shard| SpanReport {
            layers: [shard.target.layers.start, shard.target.layers.end],
            quantization: shard.target.quantization,
            state: SpanState::Ready,
        });
        let peers = self.book.as_ref().map(|book| {
            let now = Instant::now();
            lock(book)
                .peers()
                .values()
                .map(|known| {
                    let a = &known.announcement;
                    PeerReport {
                        peer: a.peer.clone(),
                        http: a.http_endpoints.first().cloned(),
                        span: a.span.as_ref().map(SpanReport::from),
                        memory_bytes: a.memory_bytes,
                        quantizations: a.quantizations.clone(),
                        throughput: a.throughput,
                        active_sessions: a.active_sessions,
                        free_kv_tokens: a.free_kv_tokens,
                        last_seen_ms: now.duration_since(known.last_seen).as_millis() as u64,
                    }
                })
                .collect()
        });
        StatusReport {
            peer: self.peer_id.clone(),
            role: if self.tracker_role { "tracker" } else { "peer" },
            version: env!("CARGO_PKG_VERSION"),
            model: ModelReport {
                id: self.model.id().to_owned(),
                layers: self.model.num_layers(),
            },
            http: self.http_url.clone(),
            p2p: lock(&self.p2p_addrs).clone(),
            span,
            loading,
            active_sessions: self.active_sessions(),
            free_kv_tokens: self.host.free_kv_tokens(),
            tracker: lock(&self.tracker).clone(),
            rejected_messages: self.rejected.load(Ordering::Relaxed),
            coverage: lock(&self.coverage)
                .as_ref()
                .map(CoverageReport::from_message),
            peers,
            openai_base_url: self.tracker_role.then(|| format!("{}/v1", self.http_url)),
            route_boundaries: self.route_boundaries(),
        }
    }

    /// Whether this peer does its job now: the tracker when the mesh covers the model, a
    /// peer when it serves a ready span.
    fn health(&self) -> Result<&'static str, String> {
        if self.tracker_role {
            match self.route_boundaries() {
                Some(_) => Ok("the mesh covers the model"),
                None => Err("the mesh does not cover the model yet".to_owned()),
            }
        } else if self.host.current().is_some() {
            Ok("serving a span")
        } else {
            Err("no span assigned yet".to_owned())
        }
    }
}

/// A peer that has started.
pub struct RunningPeer {
    shared: Arc<Shared>,
    p2p: P2pHandle,
    http_addr: SocketAddr,
    stop: watch::Sender<bool>,
    failure: watch::Receiver<Option<String>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningPeer {
    /// This peer's id.
    pub fn peer_id(&self) -> &str {
        &self.shared.peer_id
    }

    /// The model id the peer serves.
    pub fn model_id(&self) -> &str {
        self.shared.model.id()
    }

    /// The address the HTTP server is bound to.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The base URL other peers reach this one at.
    pub fn http_url(&self) -> &str {
        &self.shared.http_url
    }

    /// The OpenAI-style base URL (tracker only).
    pub fn openai_base_url(&self) -> Option<String> {
        self.shared
            .tracker_role
            .then(|| format!("{}/v1", self.shared.http_url))
    }

    /// Waits until the peer cannot go on (for example, the mesh it joined runs another
    /// model) and returns why.
    pub async fn failure(&mut self) -> String {
        match self.failure.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "the control loop stopped".to_owned(),
        }
    }

    /// What `GET /status` would answer now.
    pub fn status(&self) -> StatusReport {
        self.shared.status()
    }

    /// The progress of the span load running now, if any.
    pub fn progress_handle(&self) -> crate::shard::LoadProgress {
        self.shared.host.progress()
    }

    /// The span serving new sessions here.
    pub fn current_span(&self) -> Option<Arc<LoadedShard>> {
        self.shared.host.current()
    }

    /// The libp2p addresses the peer listens on.
    pub async fn p2p_addrs(&self) -> Result<Vec<Multiaddr>, PeerError> {
        Ok(self.p2p.listen_addrs().await?)
    }

    /// Stops the control loop, the control plane and the HTTP server, and waits for them.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        self.p2p.shutdown().await;
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Opens the model, binds the HTTP server, joins the mesh and starts the control loop.
pub async fn start(config: PeerConfig) -> Result<RunningPeer, PeerError> {
    let path = config.model_path.clone();
    let model = tokio::task::spawn_blocking(move || MeshModel::open(&path))
        .await
        .map_err(|e| PeerError::Internal(e.to_string()))??;
    let model = Arc::new(model);
    let quantizations = if config.quantizations.is_empty() {
        vec![model.shipped_format()]
    } else {
        for format in &config.quantizations {
            model.load_format(*format)?;
        }
        config.quantizations.clone()
    };
    check_memory(&model, &config, &quantizations)?;
    let keypair = match &config.keypair {
        Some(keypair) => keypair.clone(),
        None => meshnet_p2p::load_or_create_identity(&config.data_dir)?,
    };
    let peer_id = keypair.public().to_peer_id();

    let listener = tokio::net::TcpListener::bind(config.http_listen)
        .await
        .map_err(|source| PeerError::Io {
            what: format!("binding the HTTP server to {}", config.http_listen),
            source,
        })?;
    let http_addr = listener.local_addr().map_err(|source| PeerError::Io {
        what: "reading the HTTP server's address".to_owned(),
        source,
    })?;
    let http_url = config.advertise_http.clone().unwrap_or_else(|| {
        let host = if http_addr.ip().is_unspecified() {
            "127.0.0.1".to_owned()
        } else {
            http_addr.ip().to_string()
        };
        format!("http://{host}:{}", http_addr.port())
    });

    let host = Arc::new(ShardHost::new(
        Arc::clone(&model),
        config.kv_tokens,
        config.drain_timeout,
    ));
    let client = ForwardClient::new(Limits::default(), DEFAULT_HOP_TIMEOUT)
        .map_err(|e| PeerError::Internal(e.to_string()))?;

    let (book, engine) = if config.tracker {
        let capacity = PeerCapacity {
            peer: PlannerPeerId::new(peer_id.to_string()),
            memory_bytes: config.memory_bytes,
            quantizations: quantizations.clone(),
            throughput: 1.0,
            kv_tokens: config.kv_tokens,
            is_tracker: true,
        };
        let book = Arc::new(Mutex::new(TrackerBook::new(
            model.id().to_owned(),
            model.shape().clone(),
            peer_id.to_string(),
            capacity,
            http_url.clone(),
            config.announce_interval * 3,
        )?));
        let gguf = Arc::clone(model.gguf());
        let text = tokio::task::spawn_blocking(move || TextSide::from_gguf(&gguf))
            .await
            .map_err(|e| PeerError::Internal(e.to_string()))??;
        let routes_book = Arc::clone(&book);
        let engine = Arc::new(MeshEngine::new(
            model.id().to_owned(),
            text,
            Arc::clone(&host),
            Arc::new(move |start, _end| lock(&routes_book).route(start)),
            client.clone(),
            config.max_sessions,
        ));
        (Some(book), Some(engine))
    } else {
        (None, None)
    };

    let role = if config.tracker {
        Role::Tracker
    } else {
        Role::Peer {
            pinned_tracker: config.pinned_tracker,
        }
    };
    let mut p2p_config = P2pConfig::new(keypair, model.id(), role);
    p2p_config.listen = config.p2p_listen.clone();
    p2p_config.bootstrap = config.bootstrap.clone();
    p2p_config.transport = config.transport;
    p2p_config.upnp = config.upnp;
    p2p_config.assume_reachable = config.assume_reachable;
    let (p2p, events) = meshnet_p2p::spawn(p2p_config).await?;

    let shared = Arc::new(Shared {
        peer_id: peer_id.to_string(),
        tracker_role: config.tracker,
        model: Arc::clone(&model),
        host: Arc::clone(&host),
        http_url,
        memory_bytes: config.memory_bytes,
        quantizations,
        kv_tokens: config.kv_tokens,
        throughput: Mutex::new(1.0),
        book,
        engine: engine.clone(),
        coverage: Mutex::new(None),
        tracker: Mutex::new(config.tracker.then(|| peer_id.to_string())),
        p2p_addrs: Mutex::new(Vec::new()),
        rejected: AtomicU64::new(0),
    });
    if let Ok(addrs) = p2p.listen_addrs().await {
        *lock(&shared.p2p_addrs) = addrs.iter().map(ToString::to_string).collect();
    }

    let executor: Arc<dyn SpanExecutor> = host;
    let mut router = ActivationPlane::new(executor, Limits::default(), client)
        .router()
        .merge(
            Router::new()
                .route("/status", get(status_handler))
                .route("/health", get(health_handler))
                .with_state(Arc::clone(&shared)),
        );
    if let Some(engine) = engine {
        router = openai_router(engine).merge(router);
    }

    let (stop, stop_rx) = watch::channel(false);
    let mut server_stop = stop_rx.clone();
    let server = tokio::spawn(async move {
        let shutdown = async move {
            let _ = server_stop.wait_for(|stopped| *stopped).await;
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
    });
    tracing::info!(
        peer = %shared.peer_id,
        role = if config.tracker { "tracker" } else { "peer" },
        model = %model.id(),
        http = %shared.http_url,
        p2p = ?lock(&shared.p2p_addrs),
        "peer started"
    );
    let (failed, failure) = watch::channel(None);
    let control = ControlLoop {
        failed,
        shared: Arc::clone(&shared),
        p2p: p2p.clone(),
        announce_interval: config.announce_interval,
        loader: Loader::default(),
        last_directive: None,
        covered: false,
        record_epoch: None,
    };
    let control = tokio::spawn(control.run(events, stop_rx));
    Ok(RunningPeer {
        shared,
        p2p,
        http_addr,
        stop,
        failure,
        tasks: vec![control, server],
    })
}

/// Refuses a memory budget that cannot hold a single layer (plus, on the tracker, the
/// embedding and head), naming the sizes involved.
fn check_memory(
    model: &MeshModel,
    config: &PeerConfig,
    quantizations: &[Quantization],
) -> Result<(), PeerError> {
    let capacity = PeerCapacity {
        peer: PlannerPeerId::new("self"),
        memory_bytes: config.memory_bytes,
        quantizations: quantizations.to_vec(),
        throughput: 1.0,
        kv_tokens: config.kv_tokens,
        is_tracker: config.tracker,
    };
    let shape = model.shape();
    let fits = quantizations
        .iter()
        .any(|q| capacity.max_layers(shape, *q).unwrap_or(0) > 0);
    if fits {
        return Ok(());
    }
    let cheapest = quantizations
        .iter()
        .filter_map(|q| shape.layer_cost(*q, config.kv_tokens))
        .min()
        .unwrap_or(0);
    let extra = if config.tracker {
        format!(
            " plus {} bytes for the embedding and head the tracker holds",
            shape.tracker_extra_bytes()
        )
    } else {
        String::new()
    };
    Err(PeerError::Config(format!(
        "--memory {} bytes holds no layer of {}: one layer with its KV reserve ({} tokens) takes \
         {cheapest} bytes{extra}",
        config.memory_bytes,
        model.id(),
        config.kv_tokens
    )))
}

async fn status_handler(State(shared): State<Arc<Shared>>) -> Json<StatusReport> {
    Json(shared.status())
}

async fn health_handler(State(shared): State<Arc<Shared>>) -> Response {
    match shared.health() {
        Ok(detail) => Json(serde_json::json!({"status": "ok", "detail": detail})).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "unavailable", "detail": reason})),
        )
            .into_response(),
    }
}

/// One span load at a time; the latest request waits its turn.
#[derive(Default)]
struct Loader {
    busy: bool,
    queued: Option<Option<ShardTarget>>,
}

/// What a finished load reports back to the control loop.
struct LoadDone {
    target: ShardTarget,
    outcome: Result<f64, PeerError>,
}

struct ControlLoop {
    /// Set when the peer cannot go on.
    failed: watch::Sender<Option<String>>,
    shared: Arc<Shared>,
    p2p: P2pHandle,
    announce_interval: Duration,
    loader: Loader,
    /// The tracker and sequence of the last directive applied.
    last_directive: Option<(PeerId, u64)>,
    covered: bool,
    record_epoch: Option<u64>,
}

/// How long the tracker waits after a change before planning, to batch announcements.
const REPLAN_DEBOUNCE: Duration = Duration::from_millis(150);

impl ControlLoop {
    async fn run(mut self, mut events: mpsc::Receiver<P2pEvent>, mut stop: watch::Receiver<bool>) {
        let (load_tx, mut load_rx) = mpsc::channel::<LoadDone>(4);
        let mut announce = tokio::time::interval(self.announce_interval);
        announce.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut replan_at = self.shared.tracker_role.then(tokio::time::Instant::now);
        loop {
            let replan = async {
                match replan_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.changed() => break,
                event = events.recv() => match event {
                    Some(event) => {
                        if self.handle_event(event, &load_tx) && replan_at.is_none() {
                            replan_at = Some(tokio::time::Instant::now() + REPLAN_DEBOUNCE);
                        }
                    }
                    None => break,
                },
                _ = announce.tick() => {
                    self.announce().await;
                    if let Some(book) = &self.shared.book {
                        lock(book).expire(Instant::now());
                        replan_at.get_or_insert_with(tokio::time::Instant::now);
                    }
                }
                Some(done) = load_rx.recv() => {
                    let loaded = self.finish_load(done, &load_tx);
                    self.announce().await;
                    if self.shared.tracker_role {
                        // After a failed load of its own span, the tracker waits an interval
                        // before trying again.
                        let delay = if loaded { Duration::ZERO } else { self.announce_interval };
                        replan_at = Some(tokio::time::Instant::now() + delay);
                    }
                }
                _ = replan => {
                    replan_at = None;
                    self.plan_round(&load_tx).await;
                }
            }
        }
        tracing::debug!(peer = %self.shared.peer_id, "control loop stopped");
    }

    /// Handles one control-plane event; returns whether the tracker should replan.
    fn handle_event(&mut self, event: P2pEvent, load_tx: &mpsc::Sender<LoadDone>) -> bool {
        match event {
            P2pEvent::Announcement { announcement, .. } => {
                if let Some(book) = &self.shared.book {
                    return lock(book).observe(announcement, Instant::now());
                }
            }
            P2pEvent::Coverage { coverage, .. } => {
                if !self.shared.tracker_role {
                    *lock(&self.shared.coverage) = Some(coverage);
                }
            }
            P2pEvent::Directive { from, directive } => {
                self.apply_directive(from, directive, load_tx)
            }
            P2pEvent::TrackerDiscovered(record) => {
                tracing::info!(tracker = %record.peer, http = %record.http_endpoint, "tracker found");
                *lock(&self.shared.tracker) = Some(record.peer);
            }
            P2pEvent::Rejected {
                from,
                topic,
                reason,
            } => {
                self.shared.rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%from, %topic, %reason, "gossip message rejected");
            }
            P2pEvent::ListeningOn(address) => {
                let address = address.to_string();
                let mut addrs = lock(&self.shared.p2p_addrs);
                if !addrs.contains(&address) {
                    addrs.push(address);
                }
            }
            P2pEvent::PeerConnected(peer) => tracing::debug!(%peer, "connected"),
            P2pEvent::PeerDisconnected(peer) => tracing::debug!(%peer, "disconnected"),
            P2pEvent::Reachability { public } => tracing::info!(public, "reachability"),
            P2pEvent::ModelMismatch {
                peer,
                model,
                decisive,
            } => {
                self.shared.rejected.fetch_add(1, Ordering::Relaxed);
                let ours = self.shared.model.id();
                if !self.shared.tracker_role && decisive {
                    let reason = format!(
                        "the mesh this peer joined runs model {model} (peer {peer}), but this \
                         peer runs {ours}: start it with the same model file as the tracker"
                    );
                    tracing::error!("{reason}");
                    let _ = self.failed.send(Some(reason));
                } else {
                    tracing::warn!(%peer, their_model = %model, our_model = %ours, "refused a peer that runs another model");
                }
            }
        }
        false
    }

    fn apply_directive(
        &mut self,
        from: PeerId,
        directive: DirectiveMessage,
        load_tx: &mpsc::Sender<LoadDone>,
    ) {
        if let Some((tracker, sequence)) = &self.last_directive
            && *tracker == from
            && directive.sequence <= *sequence
        {
            tracing::debug!(sequence = directive.sequence, "stale directive ignored");
            return;
        }
        self.last_directive = Some((from, directive.sequence));
        tracing::info!(
            epoch = directive.epoch,
            sequence = directive.sequence,
            directives = ?directive.directives,
            "directive received"
        );
        let target = directive.span_after.map(|span| ShardTarget {
            layers: span.layers,
            quantization: span.quantization,
            entry: false,
        });
        self.request_span(target, load_tx);
    }

    /// Moves this peer towards holding `target` (nothing when `None`).
    fn request_span(&mut self, target: Option<ShardTarget>, load_tx: &mpsc::Sender<LoadDone>) {
        if self.loader.busy {
            self.loader.queued = Some(target);
            return;
        }
        let Some(target) = target else {
            self.shared.host.unload();
            return;
        };
        if self
            .shared
            .host
            .current()
            .is_some_and(|shard| shard.target == target)
        {
            return;
        }
        self.loader.busy = true;
        let host = Arc::clone(&self.shared.host);
        let hidden = self.shared.model.description().hidden;
        let load_tx = load_tx.clone();
        tokio::spawn(async move {
            let outcome = tokio::task::spawn_blocking(move || {
                let shard = host.load(target)?;
                Ok(measure_throughput(&shard, hidden))
            })
            .await
            .unwrap_or_else(|e| Err(PeerError::Internal(e.to_string())));
            let _ = load_tx.send(LoadDone { target, outcome }).await;
        });
    }

    /// Records a finished load and starts the queued one; returns whether the load worked.
    fn finish_load(&mut self, done: LoadDone, load_tx: &mpsc::Sender<LoadDone>) -> bool {
        self.loader.busy = false;
        let loaded = done.outcome.is_ok();
        match done.outcome {
            Ok(throughput) => {
                *lock(&self.shared.throughput) = throughput;
            }
            Err(error) => {
                tracing::error!(
                    layers = %format_args!("{}..{}", done.target.layers.start, done.target.layers.end),
                    %error,
                    "loading a span failed"
                );
            }
        }
        if let Some(book) = &self.shared.book {
            lock(book).set_own_span(self.shared.span_status());
        }
        if let Some(next) = self.loader.queued.take() {
            self.request_span(next, load_tx);
        }
        loaded
    }

    async fn announce(&self) {
        let announcement = self.shared.announcement();
        if let Err(error) = self.p2p.publish_announcement(announcement).await {
            tracing::warn!(%error, "announcing failed");
        }
    }

    /// The tracker's planning round: plan, publish, load its own span if it changed.
    async fn plan_round(&mut self, load_tx: &mpsc::Sender<LoadDone>) {
        let Some(book) = self.shared.book.clone() else {
            return;
        };
        let outcome = {
            let mut book = lock(&book);
            book.set_own_span(self.shared.span_status());
            book.plan(Instant::now())
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                tracing::error!(%error, "planning failed");
                return;
            }
        };
        if let Some(target) = outcome.own_target {
            self.request_span(
                Some(ShardTarget {
                    layers: target.layers,
                    quantization: target.quantization,
                    entry: true,
                }),
                load_tx,
            );
        }
        let epoch = outcome.coverage.epoch;
        *lock(&self.shared.coverage) = Some(outcome.coverage.clone());
        if let Err(error) = self.p2p.publish_coverage(outcome.coverage).await {
            tracing::warn!(%error, "publishing the coverage map failed");
        }
        for directive in outcome.directives {
            tracing::info!(
                target = %directive.target,
                epoch = directive.epoch,
                sequence = directive.sequence,
                span_after = ?directive.span_after.as_ref().map(|s| (s.layers.start, s.layers.end)),
                "directive published"
            );
            if let Err(error) = self.p2p.publish_directive(directive).await {
                tracing::warn!(%error, "publishing a directive failed");
            }
        }
        if self.record_epoch != Some(epoch) {
            self.record_epoch = Some(epoch);
            let record = TrackerRecord {
                peer: self.shared.peer_id.clone(),
                addresses: lock(&self.shared.p2p_addrs).clone(),
                http_endpoint: self.shared.http_url.clone(),
                epoch,
                model_id: self.shared.model.id().to_owned(),
            };
            if let Err(error) = self.p2p.set_tracker_record(record).await {
                tracing::warn!(%error, "storing the tracker record failed");
            }
        }
        let covered = self.shared.route_boundaries().is_some();
        if covered && !self.covered {
            tracing::info!(
                "the mesh covers the model; OpenAI base URL: {}/v1",
                self.shared.http_url
            );
        } else if !covered && self.covered {
            tracing::warn!("the mesh no longer covers the model");
        }
        self.covered = covered;
    }
}

/// Tokens per second through a freshly loaded span, from one 16-token chunk on a scratch
/// session.
fn measure_throughput(shard: &LoadedShard, hidden_size: usize) -> f64 {
    let tokens = 16;
    let layers = shard.span.layer_range();
    let Ok(input) = candle_core::Tensor::zeros(
        (1, tokens, hidden_size),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    ) else {
        return 1.0;
    };
    let session = uuid::Uuid::new_v4();
    let started = Instant::now();
    let ran = shard.span.forward_range(session, 0, &input, layers);
    let elapsed = started.elapsed().as_secs_f64();
    shard.span.kv_store().end_session(session);
    match ran {
        Ok(_) if elapsed > 0.0 => tokens as f64 / elapsed,
        _ => 1.0,
    }
}
