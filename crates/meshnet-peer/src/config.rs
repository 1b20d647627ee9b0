//! How a peer is started.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use meshnet_p2p::TransportChoice;
use meshnet_types::{PeerId, Quantization};

use crate::error::PeerError;
use crate::mesh_model::MeshModel;
use crate::remote::FailoverPolicy;

/// The longest draft a verified step may carry (`--max-draft`): the drafts and the token
/// before them travel as one frame.
pub const MAX_DRAFT_LIMIT: usize = 32;

/// The shortest announcement interval a peer accepts.
pub const MIN_ANNOUNCE_INTERVAL: Duration = Duration::from_millis(50);

/// The longest timeout a peer accepts (a day).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// How a peer is started.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// The model: a Llama GGUF file or a Hugging Face GPT-2 directory; every member of a mesh
    /// runs the same one.
    pub model_path: PathBuf,
    /// The model at `model_path`, already opened: many members in one process (tests,
    /// benchmarks) share one instead of each reading and hashing the file.
    pub model: Option<Arc<MeshModel>>,
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
    /// The libp2p addresses others reach this member at, when they differ from where it
    /// listens (a port forward, a link emulator's relay): announced instead of the listen
    /// addresses.
    pub advertise_p2p: Vec<Multiaddr>,
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
    /// Generations the tracker runs at once; more wait in line.
    pub max_sessions: usize,
    /// The most rows (tokens over all sessions) one pass over a span's weights takes; 1 runs
    /// each session's chunk alone.
    pub max_batch_tokens: usize,
    /// Chunks of one prompt the tracker keeps travelling through the other peers at once
    /// (pipelined prefill); 1 sends the next only when the last is answered.
    pub prefill_in_flight: usize,
    /// Whether the last hop of the tracker's routes posts its output straight back to the
    /// tracker (ADR-0031) instead of back along the route.
    pub direct_return: bool,
    /// The most tokens the tracker drafts and verifies in one trip through a route
    /// (speculative decoding, ADR-0032); 0 turns it off.
    pub max_draft: usize,
    /// Whether the tracker sends only the drafts whose measured cost they are likely to repay
    /// (ADR-0035); `false` sends every draft the lookup finds, whatever the route costs.
    pub gate_drafts: bool,
    /// Requests the tracker keeps waiting for a generation slot; one more is answered 429.
    pub max_queued_sessions: usize,
    /// How long a request waits in line for a slot before it is answered 429.
    pub queue_timeout: Duration,
    /// Treat listen addresses as reachable (LANs, loopback testnets, public hosts).
    pub assume_reachable: bool,
    /// Ask the gateway for a UPnP port mapping.
    pub upnp: bool,
    /// The limits of the relay the tracker and reachable members run for the others.
    pub relay_limits: meshnet_p2p::RelayLimits,
    /// Accept coverage maps and directives only from this tracker.
    pub pinned_tracker: Option<PeerId>,
    /// How long a dropped span keeps serving its running sessions.
    pub drain_timeout: Duration,
    /// How the tracker's generations get past a failed hop.
    pub failover: FailoverPolicy,
    /// Which of the tracker's sessions are checked against a second holder of each hop, and
    /// how long a member caught returning wrong activations is banned (ADR-0026).
    pub verify: crate::verify::VerifyPolicy,
    /// Whether this member may take over the tracker role when the tracker goes silent
    /// (only if the tracker names it in its succession list).
    pub tracker_capable: bool,
    /// How long a leaving member waits for its sessions to finish and its layers to be
    /// covered by others before it goes anyway.
    pub leave_timeout: Duration,
    /// A Jinja chat template file the tracker renders prompts with instead of the model's
    /// own template.
    pub chat_template: Option<PathBuf>,
    /// Corrupts a fraction of this member's output frames (tests and benchmarks only).
    #[cfg(feature = "faulty-member")]
    pub faulty: Option<std::sync::Arc<crate::faulty::FaultyFrames>>,
    /// The swarm key of a private mesh (`None`: an open mesh): only members holding the same
    /// key can connect to this one over libp2p, and QUIC is off.
    pub swarm_key: Option<meshnet_p2p::SwarmKey>,
    /// The keys the OpenAI-style API accepts, with their limits (`--api-keys`); `None` leaves
    /// the API open to anyone who can reach the HTTP listener.
    pub api_keys: Option<Vec<meshnet_apikeys::KeyEntry>>,
}

impl PeerConfig {
    /// Defaults a user would expect for `model_path`: a peer (not tracker) on HTTP port 0 and
    /// TCP/QUIC port 0, 1 GiB of memory, announcements every 2 s, 2048 KV tokens per layer,
    /// 8 concurrent generations batched in passes of up to 256 rows.
    pub fn new(model_path: PathBuf, data_dir: PathBuf) -> Self {
        PeerConfig {
            model_path,
            model: None,
            tracker: false,
            http_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise_http: None,
            p2p_listen: Vec::new(),
            advertise_p2p: Vec::new(),
            bootstrap: Vec::new(),
            memory_bytes: 1 << 30,
            quantizations: Vec::new(),
            data_dir,
            keypair: None,
            transport: TransportChoice::Network,
            relay_limits: meshnet_p2p::RelayLimits::default(),
            announce_interval: Duration::from_secs(2),
            kv_tokens: 2048,
            max_sessions: 8,
            max_batch_tokens: crate::batcher::DEFAULT_MAX_BATCH_TOKENS,
            prefill_in_flight: crate::remote::DEFAULT_PREFILL_IN_FLIGHT,
            direct_return: true,
            max_draft: meshnet_model::DEFAULT_MAX_DRAFT,
            gate_drafts: true,
            max_queued_sessions: 32,
            queue_timeout: Duration::from_secs(60),
            assume_reachable: false,
            upnp: false,
            pinned_tracker: None,
            drain_timeout: Duration::from_secs(60),
            failover: FailoverPolicy::default(),
            verify: crate::verify::VerifyPolicy::default(),
            leave_timeout: Duration::from_secs(30),
            tracker_capable: true,
            chat_template: None,
            #[cfg(feature = "faulty-member")]
            faulty: None,
            swarm_key: None,
            api_keys: None,
        }
    }

    /// Refuses settings outside what they can mean, naming the setting and its command-line
    /// flag: a zero count, an announcement interval under [`MIN_ANNOUNCE_INTERVAL`], a timeout
    /// or announcement interval over [`MAX_TIMEOUT`], an unusable verification policy.
    /// [`crate::start`] calls it first.
    pub fn validate(&self) -> Result<(), PeerError> {
        let invalid = |setting: &'static str, flag: Option<&'static str>, reason: String| {
            Err(PeerError::InvalidSetting {
                setting,
                flag,
                reason,
            })
        };
        if self.announce_interval < MIN_ANNOUNCE_INTERVAL {
            let got = self.announce_interval;
            return invalid(
                "announce_interval",
                Some("announce-interval"),
                format!(
                    "must be at least {} s, got {} s",
                    MIN_ANNOUNCE_INTERVAL.as_secs_f64(),
                    got.as_secs_f64()
                ),
            );
        }
        for (setting, flag, count) in [
            ("max_sessions", "max-sessions", self.max_sessions),
            (
                "max_batch_tokens",
                "max-batch-tokens",
                self.max_batch_tokens,
            ),
            (
                "prefill_in_flight",
                "prefill-chunks-in-flight",
                self.prefill_in_flight,
            ),
            (
                "failover.attempts",
                "failover-attempts",
                self.failover.attempts as usize,
            ),
            ("kv_tokens", "kv-tokens", self.kv_tokens as usize),
        ] {
            if count == 0 {
                return invalid(setting, Some(flag), "must be at least 1".to_owned());
            }
        }
        if self.max_draft > MAX_DRAFT_LIMIT {
            return invalid(
                "max_draft",
                Some("max-draft"),
                format!("must be at most {MAX_DRAFT_LIMIT}, got {}", self.max_draft),
            );
        }
        for (setting, flag, timeout) in [
            (
                "failover.recover_timeout",
                Some("recover-timeout"),
                self.failover.recover_timeout,
            ),
            ("leave_timeout", Some("leave-timeout"), self.leave_timeout),
            ("queue_timeout", Some("queue-timeout"), self.queue_timeout),
            ("drain_timeout", None, self.drain_timeout),
            // Longer intervals overflow the expiry and takeover timeouts derived from it.
            (
                "announce_interval",
                Some("announce-interval"),
                self.announce_interval,
            ),
        ] {
            if timeout > MAX_TIMEOUT {
                let seconds = timeout.as_secs_f64();
                return invalid(
                    setting,
                    flag,
                    format!("must be at most a day (86400 s), got {seconds} s"),
                );
            }
        }
        if let Err(reason) = self.verify.validate() {
            return invalid("verify", Some("verify-sample"), reason);
        }
        self.validate_addresses()
    }

    /// Refuses addresses to announce that others could not use.
    fn validate_addresses(&self) -> Result<(), PeerError> {
        if !self.advertise_p2p.is_empty() && !self.assume_reachable {
            return Err(PeerError::InvalidSetting {
                setting: "advertise_p2p",
                flag: Some("advertise-p2p"),
                reason: "names where others reach this member: it needs --reachable".to_owned(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> PeerConfig {
        PeerConfig::new("model.gguf".into(), "data".into())
    }

    fn refusal(config: &PeerConfig) -> String {
        config.validate().unwrap_err().to_string()
    }

    #[test]
    fn the_defaults_are_valid() {
        config().validate().unwrap();
    }

    #[test]
    fn a_setting_outside_what_it_can_mean_is_refused_by_name_and_flag() {
        let mut zero_sessions = config();
        zero_sessions.max_sessions = 0;
        assert_eq!(
            refusal(&zero_sessions),
            "max_sessions (--max-sessions) must be at least 1"
        );
        let mut zero_chunks = config();
        zero_chunks.prefill_in_flight = 0;
        assert_eq!(
            refusal(&zero_chunks),
            "prefill_in_flight (--prefill-chunks-in-flight) must be at least 1"
        );
        let mut fast = config();
        fast.announce_interval = Duration::from_millis(49);
        assert_eq!(
            refusal(&fast),
            "announce_interval (--announce-interval) must be at least 0.05 s, got 0.049 s"
        );
        let mut long_drain = config();
        long_drain.drain_timeout = MAX_TIMEOUT + Duration::from_secs(1);
        assert_eq!(
            refusal(&long_drain),
            "drain_timeout must be at most a day (86400 s), got 86401 s"
        );
        let mut slow = config();
        slow.announce_interval = MAX_TIMEOUT * 2;
        assert_eq!(
            refusal(&slow),
            "announce_interval (--announce-interval) must be at most a day (86400 s), got 172800 s"
        );
        let mut unreachable = config();
        unreachable.advertise_p2p = vec!["/ip4/192.0.2.1/tcp/4001".parse().unwrap()];
        assert_eq!(
            refusal(&unreachable),
            "advertise_p2p (--advertise-p2p) names where others reach this member: it needs --reachable"
        );
        let mut sample = config();
        sample.verify.sample_rate = 2.0;
        assert_eq!(
            refusal(&sample),
            "verify (--verify-sample) the verification sample rate must be between 0 and 1, not 2"
        );
    }

    #[test]
    fn the_bounds_themselves_are_valid() {
        let mut edge = config();
        edge.announce_interval = MIN_ANNOUNCE_INTERVAL;
        edge.queue_timeout = MAX_TIMEOUT;
        edge.max_sessions = 1;
        edge.validate().unwrap();
    }
}
