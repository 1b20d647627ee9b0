//! Every Prometheus metric family a meshnet member exports, defined once.
//!
//! [`Metrics`] holds the families that are counted where things happen (tokens generated,
//! latencies, wire bytes, directives, gossip verdicts, failovers): it is cheap to clone, and each
//! crate that counts something takes a clone and calls the `record_*`/`count_*` method for it.
//! [`Metrics::register`] puts the families in a [`Registry`]; a [`Metrics::detached`] handle
//! counts into families no registry sees (tools and tests that export nothing).
//!
//! What is a state rather than an event (active sessions, KV bytes, load progress) is read at
//! scrape time from a [`LiveSource`] through [`LiveCollector`], so a scrape only reads.
//!
//! Names carry their units (`_seconds`, `_bytes`, `_ratio`); counters end in `_total`.
//! The crate has no runtime and does no I/O; [`encode`] writes the text format.

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
pub use prometheus_client::registry::Registry;

/// How an activation frame travels to the next hop.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum HopPath {
    /// An HTTP request on a TCP connection of its own to the hop's announced endpoint.
    DirectHttp,
    /// An HTTP request on a libp2p stream over a direct connection.
    DirectP2p,
    /// An HTTP request on a libp2p stream through a relay.
    Relayed,
}

impl HopPath {
    /// The label value (and the name `/status` uses): `direct-http`, `direct-p2p`, `relayed`.
    pub fn as_str(self) -> &'static str {
        match self {
            HopPath::DirectHttp => "direct-http",
            HopPath::DirectP2p => "direct-p2p",
            HopPath::Relayed => "relayed",
        }
    }
}

/// Whether bytes left this member or arrived at it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Direction {
    /// Written by this member.
    Sent,
    /// Read by this member.
    Received,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HopLabels {
    hop: String,
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WireLabels {
    direction: &'static str,
    form: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TopicLabels {
    topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectionLabels {
    topic: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyLabels {
    key: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyTokenLabels {
    key: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyLimitLabels {
    key: String,
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Latency buckets from 0.5 ms to about 33 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 17))
}

/// A family registered so that a scrape lists it (its `# HELP` and `# TYPE`) even before it
/// has a sample: a registry leaves out labelled families that have none, and a dashboard or a
/// check cannot tell a family not yet counted from one this member does not export.
#[derive(Debug)]
struct AlwaysListed<M> {
    name: &'static str,
    help: &'static str,
    metric: M,
}

impl<M: EncodeMetric + std::fmt::Debug + Send + Sync + 'static> Collector for AlwaysListed<M> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let metric =
            encoder.encode_descriptor(self.name, self.help, None, self.metric.metric_type())?;
        self.metric.encode(metric)
    }
}

/// Registers `metric` in `registry` as an [`AlwaysListed`] family.
fn list_always<M: EncodeMetric + std::fmt::Debug + Send + Sync + 'static>(
    registry: &mut Registry,
    name: &'static str,
    help: &'static str,
    metric: M,
) {
    registry.register_collector(Box::new(AlwaysListed { name, help, metric }));
}

/// The families counted where things happen. Clones share the same families.
#[derive(Clone, Debug)]
pub struct Metrics {
    tokens_generated: Counter,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    forward_request: HistogramFamily<HopLabels>,
    forward_compute: Histogram,
    wire_bytes: Family<WireLabels, Counter>,
    directives_issued: Counter,
    directives_applied: Counter,
    gossip_accepted: Family<TopicLabels, Counter>,
    gossip_rejected: Family<RejectionLabels, Counter>,
    connections_refused: Family<ReasonLabels, Counter>,
    failovers: Counter,
    direct_returns: Counter,
    drafted_tokens: Counter,
    accepted_drafts: Counter,
    draft_length: prometheus_client::metrics::gauge::Gauge,
    checked_sessions: Counter,
    convictions: Counter,
    api_key_requests: Family<KeyLabels, Counter>,
    api_key_tokens: Family<KeyTokenLabels, Counter>,
    api_key_rate_limited: Family<KeyLimitLabels, Counter>,
    api_unauthorized: Family<ReasonLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::detached()
    }
}

impl Metrics {
    /// Families that no registry exports (for tools and tests).
    pub fn detached() -> Self {
        Metrics {
            tokens_generated: Counter::default(),
            time_to_first_token: latency_histogram(),
            inter_token_latency: latency_histogram(),
            forward_request: Family::new_with_constructor(latency_histogram),
            forward_compute: latency_histogram(),
            wire_bytes: Family::default(),
            directives_issued: Counter::default(),
            directives_applied: Counter::default(),
            gossip_accepted: Family::default(),
            gossip_rejected: Family::default(),
            connections_refused: Family::default(),
            failovers: Counter::default(),
            direct_returns: Counter::default(),
            drafted_tokens: Counter::default(),
            accepted_drafts: Counter::default(),
            draft_length: Default::default(),
            checked_sessions: Counter::default(),
            convictions: Counter::default(),
            api_key_requests: Family::default(),
            api_key_tokens: Family::default(),
            api_key_rate_limited: Family::default(),
            api_unauthorized: Family::default(),
        }
    }

    /// New families, registered in `registry` under the `meshnet_` prefix.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Metrics::detached();
        let meshnet = registry.sub_registry_with_prefix("meshnet");
        metrics.register_generation(meshnet);
        metrics.register_mesh(meshnet);
        metrics.register_api_keys(meshnet);
        metrics
    }

    /// The families of generations and of the activation plane.
    fn register_generation(&self, meshnet: &mut Registry) {
        meshnet.register(
            "tokens_generated",
            "Tokens generated by generations this member ran as the entry",
            self.tokens_generated.clone(),
        );
        meshnet.register(
            "time_to_first_token_seconds",
            "Time from a generation's admission to its first generated token",
            self.time_to_first_token.clone(),
        );
        meshnet.register(
            "inter_token_latency_seconds",
            "Time between two consecutive tokens of one generation",
            self.inter_token_latency.clone(),
        );
        list_always(
            meshnet,
            "forward_request_seconds",
            "Round trip of one POST /forward this member sent, by next hop and path (the hop's \
             compute and every later hop included)",
            self.forward_request.clone(),
        );
        meshnet.register(
            "forward_compute_seconds",
            "Time this member spent running its own layers for one /forward frame",
            self.forward_compute.clone(),
        );
        list_always(
            meshnet,
            "wire_bytes",
            "Activation bytes this member sent and received: raw bf16 and as encoded on the wire",
            self.wire_bytes.clone(),
        );
    }

    /// The families of the control plane: directives, gossip, connections, failovers.
    fn register_mesh(&self, meshnet: &mut Registry) {
        meshnet.register(
            "directives_issued",
            "LOAD_SHARD/DROP_SHARD directives this member published as the tracker",
            self.directives_issued.clone(),
        );
        meshnet.register(
            "directives_applied",
            "Directives from the tracker this member applied",
            self.directives_applied.clone(),
        );
        list_always(
            meshnet,
            "gossip_accepted",
            "Gossip messages that passed validation, by topic kind",
            self.gossip_accepted.clone(),
        );
        list_always(
            meshnet,
            "gossip_rejected",
            "Gossip messages and peers refused, by topic kind and reason",
            self.gossip_rejected.clone(),
        );
        list_always(
            meshnet,
            "p2p_connections_refused",
            "Incoming libp2p connections this member refused before any libp2p protocol ran, by \
             reason (swarm_key: the other side holds no swarm key or another one)",
            self.connections_refused.clone(),
        );
        meshnet.register(
            "failovers",
            "Generations that got past a failed hop on a new route",
            self.failovers.clone(),
        );
        meshnet.register(
            "direct_returns",
            "Route outputs the last hop posted straight to this entry (POST /return) instead of \
             back along the route",
            self.direct_returns.clone(),
        );
        meshnet.register(
            "drafted_tokens",
            "Tokens the entry drafted (prompt lookup) and sent through its routes to be verified \
             (speculative decoding)",
            self.drafted_tokens.clone(),
        );
        meshnet.register(
            "accepted_drafts",
            "Drafted tokens the sampler accepted: tokens that cost no trip of their own",
            self.accepted_drafts.clone(),
        );
        meshnet.register(
            "draft_length",
            "How many tokens the last generation would have drafted next (k; 0 while drafting \
             is paused or off)",
            self.draft_length.clone(),
        );
        meshnet.register(
            "checked_sessions",
            "Generations whose every hop with a second holder was checked against it, ended \
             without a disagreement",
            self.checked_sessions.clone(),
        );
        meshnet.register(
            "convictions",
            "Members caught returning wrong activations (an arbiter contradicted them) and banned",
            self.convictions.clone(),
        );
    }

    /// The families of the API's keys and quotas.
    fn register_api_keys(&self, meshnet: &mut Registry) {
        list_always(
            meshnet,
            "api_key_requests",
            "OpenAI-style API requests admitted, by API key id (--api-keys)",
            self.api_key_requests.clone(),
        );
        list_always(
            meshnet,
            "api_key_tokens",
            "Tokens of admitted API requests by API key id and kind (prompt, completion), as in \
             the answers' usage",
            self.api_key_tokens.clone(),
        );
        list_always(
            meshnet,
            "api_key_rate_limited",
            "API requests answered 429 for their key's limit, by API key id and limit (rpm, tpm)",
            self.api_key_rate_limited.clone(),
        );
        list_always(
            meshnet,
            "api_unauthorized",
            "API requests answered 401, by reason (missing, invalid)",
            self.api_unauthorized.clone(),
        );
    }

    /// Counts one token generated (`first` for a generation's first, taking `since` as the time
    /// since it was admitted; else the time since its previous token).
    pub fn record_token(&self, first: bool, since: Duration) {
        self.tokens_generated.inc();
        let histogram = if first {
            &self.time_to_first_token
        } else {
            &self.inter_token_latency
        };
        histogram.observe(since.as_secs_f64());
    }

    /// Records one `/forward` round trip to `hop` over `path`.
    pub fn record_forward_request(&self, hop: &str, path: HopPath, elapsed: Duration) {
        self.forward_request
            .get_or_create(&HopLabels {
                hop: hop.to_owned(),
                path: path.as_str(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Records the time this member's own layers took for one frame.
    pub fn record_forward_compute(&self, elapsed: Duration) {
        self.forward_compute.observe(elapsed.as_secs_f64());
    }

    /// Counts one activation frame: `raw` bf16 bytes, `encoded` bytes on the wire.
    pub fn count_wire_bytes(&self, direction: Direction, raw: usize, encoded: usize) {
        let direction = match direction {
            Direction::Sent => "sent",
            Direction::Received => "received",
        };
        for (form, bytes) in [("raw", raw), ("encoded", encoded)] {
            self.wire_bytes
                .get_or_create(&WireLabels { direction, form })
                .inc_by(bytes as u64);
        }
    }

    /// Counts `count` directives published.
    pub fn count_directives_issued(&self, count: usize) {
        self.directives_issued.inc_by(count as u64);
    }

    /// Counts `count` directives applied.
    pub fn count_directives_applied(&self, count: usize) {
        self.directives_applied.inc_by(count as u64);
    }

    /// Counts a gossip message accepted on `topic` (the topic's kind, not its full name).
    pub fn count_gossip_accepted(&self, topic: &str) {
        self.gossip_accepted
            .get_or_create(&TopicLabels {
                topic: topic.to_owned(),
            })
            .inc();
    }

    /// Counts a gossip message (or peer) refused on `topic` for `reason`, a stable code.
    pub fn count_gossip_rejected(&self, topic: &str, reason: &'static str) {
        self.gossip_rejected
            .get_or_create(&RejectionLabels {
                topic: topic.to_owned(),
                reason,
            })
            .inc();
    }

    /// Counts an incoming libp2p connection refused for `reason`, a stable code.
    pub fn count_connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Incoming libp2p connections refused so far for `reason`.
    pub fn connections_refused(&self, reason: &'static str) -> u64 {
        self.connections_refused
            .get_or_create(&ReasonLabels { reason })
            .get()
    }

    /// Counts a failover.
    pub fn count_failover(&self) {
        self.failovers.inc();
    }

    /// Counts a route output posted straight to this entry.
    pub fn count_direct_return(&self) {
        self.direct_returns.inc();
    }

    /// Counts what one generation's speculative decoding did: tokens `drafted`, of them
    /// `accepted`, and the draft length it ended with.
    pub fn count_speculation(&self, drafted: usize, accepted: usize, draft_length: usize) {
        self.drafted_tokens.inc_by(drafted as u64);
        self.accepted_drafts.inc_by(accepted as u64);
        self.draft_length.set(draft_length as i64);
    }

    /// Tokens drafted and accepted so far: `(drafted, accepted)`.
    pub fn speculation(&self) -> (u64, u64) {
        (self.drafted_tokens.get(), self.accepted_drafts.get())
    }

    /// Counts a checked generation that ended without a disagreement.
    pub fn count_checked_session(&self) {
        self.checked_sessions.inc();
    }

    /// Counts a member convicted of returning wrong activations.
    pub fn count_conviction(&self) {
        self.convictions.inc();
    }

    /// Counts an API request admitted with the key `key` (its id, never the key).
    pub fn count_api_key_request(&self, key: &str) {
        self.api_key_requests
            .get_or_create(&KeyLabels {
                key: key.to_owned(),
            })
            .inc();
    }

    /// Counts the usage of an API request made with the key `key`.
    pub fn count_api_key_tokens(&self, key: &str, prompt: u64, completion: u64) {
        for (kind, tokens) in [("prompt", prompt), ("completion", completion)] {
            self.api_key_tokens
                .get_or_create(&KeyTokenLabels {
                    key: key.to_owned(),
                    kind,
                })
                .inc_by(tokens);
        }
    }

    /// Counts an API request refused for its key's `limit` (`rpm` or `tpm`).
    pub fn count_api_key_rate_limited(&self, key: &str, limit: &'static str) {
        self.api_key_rate_limited
            .get_or_create(&KeyLimitLabels {
                key: key.to_owned(),
                limit,
            })
            .inc();
    }

    /// Counts an API request refused for its key, `reason` `missing` or `invalid`.
    pub fn count_api_unauthorized(&self, reason: &'static str) {
        self.api_unauthorized
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Tokens generated so far.
    pub fn tokens_generated(&self) -> u64 {
        self.tokens_generated.get()
    }

    /// Failovers so far.
    pub fn failovers(&self) -> u64 {
        self.failovers.get()
    }

    /// Route outputs posted straight to this entry so far.
    pub fn direct_returns(&self) -> u64 {
        self.direct_returns.get()
    }

    /// Checked generations that ended without a disagreement so far.
    pub fn checked_sessions(&self) -> u64 {
        self.checked_sessions.get()
    }

    /// Convictions so far.
    pub fn convictions(&self) -> u64 {
        self.convictions.get()
    }
}

/// A member's state as a scrape reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LiveSample {
    /// Sessions running here: generations on the entry, KV sessions on any span.
    pub active_sessions: u64,
    /// Requests waiting for a generation slot (the tracker's line; 0 elsewhere).
    pub queued_sessions: u64,
    /// KV cache bytes held by sessions.
    pub kv_used_bytes: u64,
    /// KV cache bytes the current span can still give out.
    pub kv_free_bytes: u64,
    /// Progress of the span being loaded, 0 to 1 (1 when nothing is loading).
    pub load_progress: f64,
    /// Layers this member serves now.
    pub served_layers: u64,
}

/// Where [`LiveCollector`] reads the state from at each scrape.
pub trait LiveSource: Send + Sync + 'static {
    /// The state now. It must only read.
    fn sample(&self) -> LiveSample;
}

/// Exports a [`LiveSource`]'s state as gauges, read at each scrape.
pub struct LiveCollector<S> {
    source: S,
}

impl<S> std::fmt::Debug for LiveCollector<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LiveCollector")
    }
}

impl<S: LiveSource> LiveCollector<S> {
    /// Registers a collector of `source`'s state in `registry` (under `meshnet_`).
    pub fn register(registry: &mut Registry, source: S) {
        registry
            .sub_registry_with_prefix("meshnet")
            .register_collector(Box::new(LiveCollector { source }));
    }
}

impl<S: LiveSource> Collector for LiveCollector<S> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = self.source.sample();
        let gauges: [(&str, &str, f64); 6] = [
            (
                "active_sessions",
                "Sessions running here now",
                sample.active_sessions as f64,
            ),
            (
                "queued_sessions",
                "Requests waiting for a generation slot now",
                sample.queued_sessions as f64,
            ),
            (
                "kv_cache_used_bytes",
                "KV cache bytes held by sessions",
                sample.kv_used_bytes as f64,
            ),
            (
                "kv_cache_free_bytes",
                "KV cache bytes the current span can still give out",
                sample.kv_free_bytes as f64,
            ),
            (
                "load_progress_ratio",
                "Progress of the span being loaded (1 when nothing is loading)",
                sample.load_progress,
            ),
            (
                "served_layers",
                "Layers this member serves now",
                sample.served_layers as f64,
            ),
        ];
        for (name, help, value) in gauges {
            let metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(value).encode(metric)?;
        }
        Ok(())
    }
}

/// The text exposition of everything in `registry`.
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(LiveSample);

    impl LiveSource for Fixed {
        fn sample(&self) -> LiveSample {
            self.0
        }
    }

    fn value_of(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn registered_families_show_what_was_counted() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.record_token(true, Duration::from_millis(80));
        metrics.record_token(false, Duration::from_millis(20));
        metrics.record_forward_request(
            "http://10.0.0.2:8080",
            HopPath::DirectHttp,
            Duration::from_millis(3),
        );
        metrics.count_wire_bytes(Direction::Sent, 1152, 900);
        metrics.count_gossip_rejected("announce", "wrong_model");
        metrics.count_connection_refused("swarm_key");
        metrics.count_directives_issued(2);
        metrics.count_api_key_request("alice");
        metrics.count_api_key_tokens("alice", 12, 30);
        metrics.count_api_key_rate_limited("alice", "tpm");
        metrics.count_api_unauthorized("missing");
        let text = encode(&registry);
        for (series, value) in [
            ("meshnet_api_key_requests_total{key=\"alice\"}", 1.0),
            (
                "meshnet_api_key_tokens_total{key=\"alice\",kind=\"prompt\"}",
                12.0,
            ),
            (
                "meshnet_api_key_tokens_total{key=\"alice\",kind=\"completion\"}",
                30.0,
            ),
            (
                "meshnet_api_key_rate_limited_total{key=\"alice\",limit=\"tpm\"}",
                1.0,
            ),
            ("meshnet_api_unauthorized_total{reason=\"missing\"}", 1.0),
        ] {
            assert_eq!(value_of(&text, series), Some(value), "{series}");
        }
        assert_eq!(value_of(&text, "meshnet_tokens_generated_total"), Some(2.0));
        assert_eq!(
            value_of(&text, "meshnet_time_to_first_token_seconds_count"),
            Some(1.0)
        );
        assert_eq!(
            value_of(&text, "meshnet_inter_token_latency_seconds_sum"),
            Some(0.02)
        );
        assert_eq!(
            value_of(
                &text,
                "meshnet_forward_request_seconds_count{hop=\"http://10.0.0.2:8080\",path=\"direct-http\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            value_of(
                &text,
                "meshnet_wire_bytes_total{direction=\"sent\",form=\"encoded\"}"
            ),
            Some(900.0)
        );
        assert_eq!(
            value_of(
                &text,
                "meshnet_gossip_rejected_total{topic=\"announce\",reason=\"wrong_model\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            value_of(
                &text,
                "meshnet_p2p_connections_refused_total{reason=\"swarm_key\"}"
            ),
            Some(1.0)
        );
        assert_eq!(metrics.connections_refused("swarm_key"), 1);
        assert_eq!(
            value_of(&text, "meshnet_directives_issued_total"),
            Some(2.0)
        );
        assert_eq!(value_of(&text, "meshnet_failovers_total"), Some(0.0));
        assert_eq!(value_of(&text, "meshnet_checked_sessions_total"), Some(0.0));
        assert_eq!(value_of(&text, "meshnet_convictions_total"), Some(0.0));
    }

    #[test]
    fn labelled_families_are_listed_before_their_first_sample() {
        let mut registry = Registry::default();
        Metrics::register(&mut registry);
        let text = encode(&registry);
        for (family, kind) in [
            ("meshnet_forward_request_seconds", "histogram"),
            ("meshnet_wire_bytes", "counter"),
            ("meshnet_gossip_accepted", "counter"),
            ("meshnet_gossip_rejected", "counter"),
            ("meshnet_p2p_connections_refused", "counter"),
            ("meshnet_api_key_requests", "counter"),
            ("meshnet_api_key_tokens", "counter"),
            ("meshnet_api_key_rate_limited", "counter"),
            ("meshnet_api_unauthorized", "counter"),
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} {kind}\n")),
                "{family} in\n{text}"
            );
            assert!(
                !text.lines().any(|line| line.starts_with(family)),
                "{family} has no sample yet"
            );
        }
    }

    #[test]
    fn a_detached_handle_counts_but_exports_nothing() {
        let registry = Registry::default();
        let metrics = Metrics::detached();
        metrics.record_token(true, Duration::from_millis(1));
        assert_eq!(metrics.tokens_generated(), 1);
        assert!(!encode(&registry).contains("meshnet_tokens_generated"));
    }

    #[test]
    fn live_gauges_are_read_at_each_scrape() {
        let mut registry = Registry::default();
        LiveCollector::register(
            &mut registry,
            Fixed(LiveSample {
                active_sessions: 3,
                queued_sessions: 2,
                kv_used_bytes: 4096,
                kv_free_bytes: 1 << 20,
                load_progress: 0.5,
                served_layers: 10,
            }),
        );
        let text = encode(&registry);
        assert_eq!(value_of(&text, "meshnet_active_sessions"), Some(3.0));
        assert_eq!(value_of(&text, "meshnet_queued_sessions"), Some(2.0));
        assert_eq!(value_of(&text, "meshnet_kv_cache_used_bytes"), Some(4096.0));
        assert_eq!(
            value_of(&text, "meshnet_kv_cache_free_bytes"),
            Some(1048576.0)
        );
        assert_eq!(value_of(&text, "meshnet_load_progress_ratio"), Some(0.5));
        assert_eq!(value_of(&text, "meshnet_served_layers"), Some(10.0));
        assert!(text.contains("# TYPE meshnet_active_sessions gauge"));
    }
}
