//! Starting a member (either role) and the handle to a running one.
//!
//! [`start`] opens the model, binds the HTTP server, builds the role's parts (on the tracker:
//! the book of peers and the completion engine), joins the control plane and spawns the
//! control loop ([`crate::control`]) and the HTTP server ([`crate::http`]).

use std::net::SocketAddr;
use std::sync::Arc;

use libp2p::Multiaddr;
use meshnet_metrics::{LiveCollector, Metrics, Registry};
use meshnet_node::{DEFAULT_HOP_TIMEOUT, ForwardClient};
use meshnet_p2p::{P2pConfig, P2pHandle};
use meshnet_planner::PeerCapacity;
use meshnet_types::{PeerId, Quantization};
use meshnet_wire::Limits;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::PeerConfig;
use crate::control::ControlLoop;
use crate::error::PeerError;
use crate::member::{Lifecycle, Member, MeshView, Offer, Role, Settings};
use crate::mesh_model::MeshModel;
use crate::rejections::Rejections;
use crate::span_host::{LoadProgress, LoadedSpan, SpanHost};
use crate::status::{MemberGauges, StatusReport};
use crate::tracker_role::build_tracker_parts;

/// A member that has started.
pub struct RunningPeer {
    member: Arc<Member>,
    p2p: P2pHandle,
    http_addr: SocketAddr,
    stop: watch::Sender<bool>,
    failure: watch::Receiver<Option<String>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningPeer {
    /// This member's id.
    pub fn peer_id(&self) -> &PeerId {
        &self.member.peer_id
    }

    /// The model id the member serves.
    pub fn model_id(&self) -> &str {
        self.member.model.id()
    }

    /// The address the HTTP server is bound to.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The base URL of this member's HTTP server as seen from this machine.
    pub fn http_url(&self) -> &str {
        &self.member.local_url
    }

    /// The base URL other members reach this one at directly, if they can dial it.
    pub fn announced_http_url(&self) -> Option<&str> {
        self.member.http_url.as_deref()
    }

    /// The OpenAI-style base URL (tracker only).
    pub fn openai_base_url(&self) -> Option<String> {
        self.member
            .is_tracker()
            .then(|| format!("{}/v1", self.member.public_url()))
    }

    /// Waits until the member cannot go on (for example, the mesh it joined runs another
    /// model) and returns why.
    pub async fn failure(&mut self) -> String {
        match self.failure.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "the control loop stopped".to_owned(),
        }
    }

    /// What `GET /status` would answer now.
    pub fn status(&self) -> StatusReport {
        StatusReport::of(&self.member)
    }

    /// The progress of the span load running now, if any.
    pub fn progress_handle(&self) -> LoadProgress {
        self.member.host.progress()
    }

    /// The span serving new sessions here.
    pub fn current_span(&self) -> Option<Arc<LoadedSpan>> {
        self.member.host.current()
    }

    /// The libp2p addresses the member listens on.
    pub async fn p2p_addrs(&self) -> Result<Vec<Multiaddr>, PeerError> {
        Ok(self.p2p.listen_addrs().await?)
    }

    /// Leaves the mesh gracefully: announces that this member is leaving (the tracker routes
    /// no new session through it and re-covers its layers), then waits until its running
    /// sessions have ended and every layer it serves is served, ready, by another member, or
    /// until `timeout`. Call [`RunningPeer::shutdown`] afterwards.
    pub async fn leave(&self, timeout: std::time::Duration) -> LeaveOutcome {
        let started = tokio::time::Instant::now();
        self.member.start_leaving();
        let deadline = started + timeout;
        loop {
            let sessions = self.member.active_sessions();
            // The tracker hands its role over on its own (the members elect a successor).
            let covered = self.member.is_tracker() || self.member.covered_by_others();
            if sessions == 0 && covered {
                return LeaveOutcome::Clean {
                    waited: started.elapsed(),
                };
            }
            if tokio::time::Instant::now() >= deadline {
                return LeaveOutcome::TimedOut { sessions, covered };
            }
            tokio::time::sleep(LEAVE_POLL).await;
        }
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

/// How often a leaving member checks whether it may go.
const LEAVE_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// How long a member bound to all interfaces waits for a non-loopback listen address.
const INTERFACE_ADDRESS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The libp2p listen addresses, once one of them is on a non-loopback interface when
/// `wants_interface` (at most [`INTERFACE_ADDRESS_WAIT`]: a host with only a loopback
/// interface has no other).
async fn announceable_listen_addrs(p2p: &P2pHandle, wants_interface: bool) -> Vec<Multiaddr> {
    let deadline = tokio::time::Instant::now() + INTERFACE_ADDRESS_WAIT;
    loop {
        let addresses = p2p.listen_addrs().await.unwrap_or_default();
        let on_an_interface = addresses
            .iter()
            .filter_map(crate::http::listen_ip)
            .any(|ip| !ip.is_loopback() && !ip.is_unspecified());
        if !wants_interface || on_an_interface || tokio::time::Instant::now() >= deadline {
            return addresses;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// How a graceful leave ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaveOutcome {
    /// Every session ended and the member's layers are served by others.
    Clean {
        /// How long it took.
        waited: std::time::Duration,
    },
    /// The timeout came first.
    TimedOut {
        /// Sessions still running.
        sessions: usize,
        /// Whether others served this member's layers.
        covered: bool,
    },
}

/// Runs blocking work off the async workers.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, PeerError> + Send + 'static,
) -> Result<T, PeerError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| PeerError::Internal(e.to_string()))?
}

/// Opens the model, binds the HTTP server, joins the mesh and starts the control loop.
pub async fn start(config: PeerConfig) -> Result<RunningPeer, PeerError> {
    config.validate()?;
    let model = open_model(&config).await?;
    let quantizations = offered_formats(&config, &model)?;
    model.check_memory(&capacity(&config, &quantizations, PeerId::new("self")))?;
    let keypair = match &config.keypair {
        Some(keypair) => keypair.clone(),
        None => meshnet_p2p::load_or_create_identity(&config.data_dir)?,
    };
    let peer_id = meshnet_p2p::mesh_peer_id(&keypair.public().to_peer_id());
    let (listener, http_addr) = crate::http::bind(config.http_listen).await?;
    let grants = Arc::new(crate::grants::GrantSigner::new(keypair.clone()));
    let mut p2p_config = p2p_config(&config, keypair, model.id());
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    p2p_config.metrics = metrics.clone();
    let (p2p, events) = meshnet_p2p::spawn_registered(p2p_config, &mut registry).await?;
    let addresses = Addresses::find(&config, &p2p, http_addr).await;
    let host = SpanHost::new(Arc::clone(&model), config.kv_tokens, config.drain_timeout)
        .with_max_batch_tokens(config.max_batch_tokens);
    #[cfg(feature = "faulty-member")]
    let host = host.with_faulty_frames(config.faulty.clone());
    let host = Arc::new(host);
    let client = ForwardClient::new(Limits::default(), DEFAULT_HOP_TIMEOUT)
        .map_err(|e| PeerError::Internal(e.to_string()))?
        .with_metrics(metrics.clone())
        .with_streams(Arc::new(crate::p2p_plane::LibP2pStreams(p2p.clone())));
    let return_endpoint = config.direct_return.then(|| match &addresses.http_url {
        Some(url) => meshnet_wire::Endpoint::Http(url.clone()),
        None => meshnet_wire::Endpoint::peer(peer_id.clone()),
    });
    let settings = settings(&config, client.clone(), grants, return_endpoint);
    let (role, book) = if config.tracker {
        let own = capacity(&config, &quantizations, peer_id.clone());
        let tracker_url = addresses
            .http_url
            .clone()
            .unwrap_or_else(|| addresses.local_url.clone());
        let (parts, book) = build_tracker_parts(&host, own, &tracker_url, &settings).await?;
        (Role::Tracker(parts), Some(book))
    } else {
        (Role::Peer, None)
    };
    let (view, view_rx) = watch::channel(MeshView::at_start(
        config.tracker,
        &peer_id,
        config.announce_interval,
        addresses.p2p_addrs,
    ));
    let member = Arc::new(Member {
        view: view_rx,
        peer_id,
        lifecycle: Lifecycle::new(role),
        settings,
        model,
        host,
        http_url: addresses.http_url,
        local_url: addresses.local_url,
        offer: Offer {
            memory_bytes: config.memory_bytes,
            quantizations,
            kv_tokens: config.kv_tokens,
        },
        rejections: Rejections::default(),
        metrics,
        proxy: crate::http::proxy_client()?,
        p2p: p2p.clone(),
        rtt: Default::default(),
    });
    let routers = routers(&member, &config, client, registry, http_addr);
    let listening = Listening {
        listener,
        http_addr,
        p2p,
        events,
        view,
        book,
    };
    run(member, routers, listening, config.announce_interval)
}

/// The member's HTTP routers: everything it serves (with `/metrics` over `registry` and the
/// API behind `config`'s keys), and the activation plane alone, which libp2p streams reach.
fn routers(
    member: &Arc<Member>,
    config: &PeerConfig,
    client: ForwardClient,
    mut registry: Registry,
    http_addr: SocketAddr,
) -> (axum::Router, axum::Router) {
    LiveCollector::register(&mut registry, MemberGauges(Arc::clone(member)));
    let plane = crate::http::activation_plane(member, client.clone());
    let api_keys = api_key_guard(config, &member.metrics, http_addr);
    let router = crate::http::router(member, client, Arc::new(registry), api_keys);
    (router, plane)
}

/// The model `config` names: the one it holds already opened, or the file opened off the
/// async workers.
async fn open_model(config: &PeerConfig) -> Result<Arc<MeshModel>, PeerError> {
    Ok(match &config.model {
        Some(model) => Arc::clone(model),
        None => {
            let path = config.model_path.clone();
            Arc::new(blocking(move || MeshModel::open(&path)).await?)
        }
    })
}

/// The formats this member offers: those `config` asks for, each one the model can be held
/// in, or the model's shipped format.
fn offered_formats(config: &PeerConfig, model: &MeshModel) -> Result<Vec<Quantization>, PeerError> {
    if config.quantizations.is_empty() {
        return Ok(vec![model.shipped_format()]);
    }
    for format in &config.quantizations {
        model.check_format(*format)?;
    }
    Ok(config.quantizations.clone())
}

/// The control plane's settings for a member started with `config`, as `keypair`, in the
/// mesh of `model_id`.
fn p2p_config(
    config: &PeerConfig,
    keypair: libp2p::identity::Keypair,
    model_id: &str,
) -> P2pConfig {
    let p2p_role = if config.tracker {
        meshnet_p2p::Role::Tracker
    } else {
        meshnet_p2p::Role::Peer {
            pinned_tracker: config.pinned_tracker.clone(),
        }
    };
    let mut p2p_config = P2pConfig::new(keypair, model_id, p2p_role);
    p2p_config.listen = config.p2p_listen.clone();
    p2p_config.bootstrap = config.bootstrap.clone();
    p2p_config.transport = config.transport;
    p2p_config.upnp = config.upnp;
    p2p_config.assume_reachable = config.assume_reachable;
    p2p_config.external_addresses = config.advertise_p2p.clone();
    // The tracker and reachable members relay for the others; the others reserve slots.
    p2p_config.relay_server =
        (config.tracker || config.assume_reachable).then_some(config.relay_limits);
    p2p_config.reserve_relays = !config.assume_reachable;
    p2p_config.swarm_key = config.swarm_key.clone();
    // Followers accept a successor once they have missed two of the tracker's maps; the
    // successor claims after three (crate::election).
    p2p_config.takeover_silence = config.announce_interval * 2;
    p2p_config
}

/// Where a member is reached.
struct Addresses {
    /// Its libp2p addresses, as announced.
    p2p_addrs: Vec<String>,
    /// The HTTP URL others reach it at, if it is reachable.
    http_url: Option<String>,
    /// The HTTP URL on this machine.
    local_url: String,
}

impl Addresses {
    /// The addresses of a member started with `config`, its HTTP server bound at `http_addr`.
    async fn find(config: &PeerConfig, p2p: &P2pHandle, http_addr: SocketAddr) -> Self {
        // A reachable member bound to all interfaces names one of them in its HTTP URL: wait
        // for libp2p to report more than the loopback listener, which often comes first.
        let names_an_interface = config.advertise_http.is_none()
            && http_addr.ip().is_unspecified()
            && (config.assume_reachable || config.tracker);
        let listen_addrs = announceable_listen_addrs(p2p, names_an_interface).await;
        let announced = if config.advertise_p2p.is_empty() {
            &listen_addrs
        } else {
            &config.advertise_p2p
        };
        Addresses {
            p2p_addrs: announced.iter().map(ToString::to_string).collect(),
            http_url: crate::http::announced_url(
                config.advertise_http.clone(),
                http_addr,
                config.assume_reachable || config.tracker,
                &listen_addrs,
            ),
            local_url: crate::http::default_url(http_addr),
        }
    }
}

/// What the member's parts share of `config`, with its forwarding `client` and `grants`.
fn settings(
    config: &PeerConfig,
    client: ForwardClient,
    grants: Arc<crate::grants::GrantSigner>,
    return_endpoint: Option<meshnet_wire::Endpoint>,
) -> Settings {
    Settings {
        announce_interval: config.announce_interval,
        admission: crate::admission::AdmissionLimits {
            max_running: config.max_sessions,
            max_waiting: config.max_queued_sessions,
            max_wait: config.queue_timeout,
        },
        failover: config.failover.clone(),
        verify: config.verify.clone(),
        prefill_in_flight: config.prefill_in_flight,
        max_draft: config.max_draft,
        gate_drafts: config.gate_drafts,
        tracker_capable: config.tracker_capable && config.pinned_tracker.is_none(),
        client,
        grants,
        chat_template: config.chat_template.clone(),
        returns: meshnet_node::ReturnDesk::new(meshnet_node::DEFAULT_RETURN_CAPACITY),
        return_endpoint,
    }
}

/// The listeners of a member that is set up: its bound HTTP server and its control plane.
struct Listening {
    listener: TcpListener,
    http_addr: SocketAddr,
    p2p: P2pHandle,
    events: tokio::sync::mpsc::Receiver<meshnet_p2p::P2pEvent>,
    /// Where the control loop publishes the member's view of the mesh.
    view: watch::Sender<MeshView>,
    /// The tracker's book, for the control loop to own (on a member that starts as tracker).
    book: Option<crate::book_routes::OwnedBook>,
}

/// What `config` offers the planner, as `peer`.
fn capacity(config: &PeerConfig, quantizations: &[Quantization], peer: PeerId) -> PeerCapacity {
    PeerCapacity {
        peer,
        memory_bytes: config.memory_bytes,
        quantizations: quantizations.to_vec(),
        throughput: 1.0,
        kv_tokens: config.kv_tokens,
        is_tracker: config.tracker,
    }
}

/// The guard of the API's keys (`--api-keys`), counting into `metrics`; with none, a warning
/// when the API is open beyond this machine (the HTTP server bound to a non-loopback address).
fn api_key_guard(
    config: &PeerConfig,
    metrics: &Metrics,
    http_addr: SocketAddr,
) -> Option<Arc<meshnet_api::ApiKeyGuard>> {
    let Some(entries) = &config.api_keys else {
        if !http_addr.ip().is_loopback() {
            tracing::warn!(
                http = %http_addr,
                "the OpenAI-style API is open to anyone who can reach {http_addr}: no \
                 --api-keys was given"
            );
        }
        return None;
    };
    tracing::info!(
        keys = entries.len(),
        "the OpenAI-style API needs one of the --api-keys"
    );
    Some(Arc::new(meshnet_api::ApiKeyGuard::new(
        meshnet_apikeys::KeyBook::new(entries.clone()),
        Arc::new(meshnet_apikeys::SystemClock::new()),
        metrics.clone(),
    )))
}

/// Measures the member's round trips to the members it knows, a few each round (every
/// [`crate::latency::PROBE_INTERVAL`] or announcement interval, whichever is longer), until
/// `stop` turns true.
async fn probe_members(member: Arc<Member>, mut stop: watch::Receiver<bool>) {
    let mut cursor = 0;
    loop {
        let wait = crate::latency::PROBE_INTERVAL.max(member.view.borrow().announce_every);
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let known = member.probe_targets();
        let (targets, next) = crate::latency::round_targets(&known, cursor);
        cursor = next;
        crate::latency::probe_round(&member.settings.client, &targets, &member.rtt).await;
        let peers: Vec<PeerId> = known.into_iter().map(|(peer, _)| peer).collect();
        member.rtt.keep_only(&peers);
    }
}

/// Spawns the HTTP server and the control loop of a member that is set up.
fn run(
    member: Arc<Member>,
    (router, plane): (axum::Router, axum::Router),
    listening: Listening,
    announce_interval: std::time::Duration,
) -> Result<RunningPeer, PeerError> {
    let Listening {
        listener,
        http_addr,
        p2p,
        events,
        view,
        book,
    } = listening;
    let (stop, stop_rx) = watch::channel(false);
    let streams = crate::p2p_plane::serve_streams(Arc::clone(&member), plane, stop_rx.clone())?;
    let server = crate::http::serve(listener, router, stop_rx.clone());
    tracing::info!(
        peer = %member.peer_id,
        role = if member.is_tracker() { "tracker" } else { "peer" },
        model = %member.model.id(),
        http = ?member.http_url,
        p2p = ?member.view.borrow().listen_addrs,
        "peer started"
    );
    let (failed, failure) = watch::channel(None);
    let control = ControlLoop::new(
        Arc::clone(&member),
        view,
        book,
        p2p.clone(),
        announce_interval,
        failed,
    );
    let prober = tokio::spawn(probe_members(Arc::clone(&member), stop_rx.clone()));
    let control = tokio::spawn(control.run(events, stop_rx));
    Ok(RunningPeer {
        member,
        p2p,
        http_addr,
        stop,
        failure,
        tasks: vec![control, server, streams, prober],
    })
}
