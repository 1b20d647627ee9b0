//! `meshnet-peer` (run): the command line's flags turned into a [`PeerConfig`].

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::bail;
use libp2p::Multiaddr;
use meshnet_p2p::TransportChoice;
use meshnet_peer::PeerConfig;
use meshnet_peer::remote::FailoverPolicy;

use crate::RunArgs;

impl TryFrom<RunArgs> for PeerConfig {
    type Error = anyhow::Error;

    /// Reads the files the flags name (model, chat template, API keys, swarm key) and checks
    /// every number, naming the flag of the first that is wrong.
    fn try_from(args: RunArgs) -> anyhow::Result<PeerConfig> {
        let model_path = crate::model_path_or_default(args.model.clone())?;
        if let Some(path) = &args.chat_template {
            crate::check_chat_template(path)?;
        }
        let swarm_key = match &args.swarm_key {
            Some(path) => Some(meshnet_p2p::load_swarm_key(path)?),
            None => None,
        };
        let data_dir = args
            .data_dir
            .clone()
            .unwrap_or_else(|| crate::default_data_dir(args.tracker));
        let mut config = PeerConfig::new(model_path, data_dir);
        config.api_keys = args
            .api_keys
            .as_deref()
            .map(crate::load_api_keys)
            .transpose()?;
        config.verify = verify_policy(&args)?;
        config.p2p_listen = p2p_listen(&args, swarm_key.is_some())?;
        config.swarm_key = swarm_key;
        set_network(&mut config, &args)?;
        set_serving(&mut config, &args)?;
        #[cfg(feature = "faulty-member")]
        {
            config.faulty = args.faults.frames()?;
        }
        config.chat_template = args.chat_template;
        config.validate()?;
        Ok(config)
    }
}

/// The flags of how the member is reached and whom it follows.
fn set_network(config: &mut PeerConfig, args: &RunArgs) -> anyhow::Result<()> {
    config.tracker = args.tracker;
    config.http_listen = args
        .http
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], if args.tracker { 8080 } else { 0 })));
    config.advertise_http = args.advertise_http.clone();
    config.advertise_p2p = args.advertise_p2p.clone();
    config.relay_limits = meshnet_p2p::RelayLimits {
        max_circuits: args.relay_max_circuits,
        max_circuits_per_peer: args.relay_circuits_per_peer,
        circuit_duration: hours(args.relay_circuit_hours, "--relay-circuit-hours")?,
        ..meshnet_p2p::RelayLimits::default()
    };
    config.bootstrap = args.bootstrap.clone();
    config.transport = TransportChoice::Network;
    config.announce_interval = seconds(args.announce_interval, "--announce-interval")?;
    config.assume_reachable = args.reachable;
    config.upnp = args.upnp;
    config.pinned_tracker = args.tracker_id.clone();
    config.tracker_capable = args.tracker_capable;
    Ok(())
}

/// The flags of what the member holds and how many sessions it serves.
fn set_serving(config: &mut PeerConfig, args: &RunArgs) -> anyhow::Result<()> {
    config.memory_bytes = args.memory;
    config.quantizations = args.quantization.clone();
    config.kv_tokens = args.kv_tokens;
    config.max_sessions = args.max_sessions;
    config.max_batch_tokens = args.max_batch_tokens;
    config.prefill_in_flight = args.prefill_chunks_in_flight;
    config.direct_return = !args.no_direct_return;
    config.max_draft = if args.no_speculation {
        0
    } else {
        args.max_draft
    };
    config.max_queued_sessions = args.max_queued_sessions;
    config.queue_timeout = seconds(args.queue_timeout, "--queue-timeout")?;
    config.failover = FailoverPolicy {
        attempts: args.failover_attempts,
        recover_timeout: seconds(args.recover_timeout, "--recover-timeout")?,
    };
    config.leave_timeout = seconds(args.leave_timeout, "--leave-timeout")?;
    Ok(())
}

/// `value` seconds as a duration; a negative or non-finite number is refused naming `flag`
/// (the range of each setting is checked by [`PeerConfig::validate`]).
fn seconds(value: f64, flag: &str) -> anyhow::Result<Duration> {
    if !(value.is_finite() && value >= 0.0) {
        bail!("{flag} must be a number of seconds, at least 0, got {value}");
    }
    Ok(Duration::try_from_secs_f64(value)?)
}

/// The verification policy the flags ask for (`--verify-sample`, `--probation-sessions`,
/// `--ban-hours`).
fn verify_policy(args: &RunArgs) -> anyhow::Result<meshnet_peer::verify::VerifyPolicy> {
    let policy = meshnet_peer::verify::VerifyPolicy {
        sample_rate: args.verify_sample,
        probation_sessions: args.probation_sessions,
        ban_duration: hours(args.ban_hours, "--ban-hours")?,
    };
    policy
        .validate()
        .map_err(|reason| anyhow::anyhow!("--verify-sample: {reason}"))?;
    Ok(policy)
}

/// `value` hours as a duration: more than zero and at most a year.
fn hours(value: f64, flag: &str) -> anyhow::Result<Duration> {
    if !(value > 0.0 && value <= 24.0 * 365.0) {
        anyhow::bail!("{flag} must be more than 0 and at most 8760 (a year), got {value}");
    }
    Ok(Duration::from_secs_f64(value * 3600.0))
}

/// The libp2p listen addresses: those given, or TCP and (in an open mesh) QUIC on all
/// interfaces. A private mesh refuses a QUIC address outright: it cannot carry the key.
fn p2p_listen(args: &RunArgs, private: bool) -> anyhow::Result<Vec<Multiaddr>> {
    if private && let Some(quic) = args.p2p.iter().find(|a| meshnet_p2p::is_quic(a)) {
        bail!(
            "--p2p {quic}: QUIC cannot carry a swarm key, so a private mesh (--swarm-key) \
             listens on TCP only"
        );
    }
    if !args.p2p.is_empty() {
        return Ok(args.p2p.clone());
    }
    let port = if args.tracker { 4001 } else { 0 };
    let mut p2p = vec![format!("/ip4/0.0.0.0/tcp/{port}").parse()?];
    if !private {
        p2p.push(format!("/ip4/0.0.0.0/udp/{port}/quic-v1").parse()?);
    }
    Ok(p2p)
}
