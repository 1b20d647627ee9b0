//! `meshnet-linkem`: TCP relays that emulate a wide-area link (delay, jitter, a bandwidth cap)
//! between testbed members, and a self-test of the emulation.

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgGroup, Args, Parser, Subcommand, value_parser};
use meshnet_linkem::{LinkShape, Relay, SelftestReport, selftest};

/// The largest delay or jitter accepted, in milliseconds (a minute).
const MAX_DELAY_MS: u64 = 60_000;
/// The largest rate accepted, in kbit/s (100 Gbit/s).
const MAX_RATE_KBIT: u64 = 100_000_000;
/// The largest bucket accepted, in KiB (1 GiB).
const MAX_BURST_KB: u64 = 1 << 20;
/// How far the self-test's figures may be from the setting.
const SELFTEST_TOLERANCE: f64 = 0.10;
/// How many round trips the self-test takes the median of.
const SELFTEST_PINGS: usize = 20;
/// How long the self-test's bulk transfer lasts at the rate.
const SELFTEST_BULK: Duration = Duration::from_secs(2);

#[derive(Parser)]
#[command(name = "meshnet-linkem", version, about)]
/// A userspace link emulator: TCP relays that add delay, jitter and a bandwidth cap.
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Relay TCP connections from each listening address to its target through an emulated
    /// link (each direction shaped alike; a link's connections share its bandwidth).
    Relay(RelayArgs),
    /// Run an echo server and a relay in-process on 127.0.0.1 and measure the round-trip time
    /// (median of 20 small messages) and the throughput of a 2-second bulk transfer; exit 1 if
    /// either is more than 10% off the setting.
    Selftest(SelftestArgs),
}

#[derive(Args)]
#[command(group(ArgGroup::new("links").required(true).multiple(true).args(["listen", "link"])))]
struct RelayArgs {
    /// The address to listen on (with --to).
    #[arg(long, requires = "to")]
    listen: Option<SocketAddr>,
    /// The address to relay to (with --listen).
    #[arg(long, requires = "listen")]
    to: Option<SocketAddr>,
    /// A further link as LISTEN=TARGET (repeatable); each link shapes its own traffic.
    #[arg(long, value_name = "LISTEN=TARGET", value_parser = parse_link)]
    link: Vec<LinkArg>,
    /// The one-way delay in milliseconds.
    #[arg(long, default_value_t = 0, value_parser = value_parser!(u64).range(0..=MAX_DELAY_MS))]
    delay_ms: u64,
    /// Extra delay per chunk, drawn uniformly in [0, J] milliseconds (a stream is never
    /// reordered, so jitter only ever holds bytes back).
    #[arg(long, default_value_t = 0, value_parser = value_parser!(u64).range(0..=MAX_DELAY_MS))]
    jitter_ms: u64,
    /// The bandwidth of each direction in kbit/s (1000 bit/s); unlimited when absent.
    #[arg(long, value_parser = value_parser!(u64).range(1..=MAX_RATE_KBIT))]
    rate_kbit: Option<u64>,
    /// The token bucket in KiB: what passes at once after the link was idle (default: 10 ms of
    /// the rate, between 512 B and 16 KiB).
    #[arg(long, requires = "rate_kbit", value_parser = value_parser!(u64).range(0..=MAX_BURST_KB))]
    burst_kb: Option<u64>,
}

#[derive(Args)]
struct SelftestArgs {
    /// The one-way delay in milliseconds.
    #[arg(long, default_value_t = 50, value_parser = value_parser!(u64).range(10..=MAX_DELAY_MS))]
    delay_ms: u64,
    /// The bandwidth in kbit/s.
    #[arg(long, default_value_t = 10_000, value_parser = value_parser!(u64).range(100..=1_000_000))]
    rate_kbit: u64,
}

/// One `--link LISTEN=TARGET`.
#[derive(Clone, Copy, Debug)]
struct LinkArg {
    listen: SocketAddr,
    target: SocketAddr,
}

fn parse_link(text: &str) -> Result<LinkArg, String> {
    let (listen, target) = text
        .split_once('=')
        .ok_or_else(|| "expected LISTEN=TARGET, e.g. 127.0.0.1:9001=127.0.0.1:8080".to_string())?;
    let parse = |addr: &str| {
        addr.parse::<SocketAddr>()
            .map_err(|e| format!("{addr:?} is not an IP:PORT address: {e}"))
    };
    Ok(LinkArg {
        listen: parse(listen)?,
        target: parse(target)?,
    })
}

/// Bytes per second from kbit/s.
fn bytes_per_second(kbit: u64) -> Option<NonZeroU64> {
    NonZeroU64::new(kbit.saturating_mul(125))
}

impl RelayArgs {
    fn shape(&self) -> LinkShape {
        let rate = self.rate_kbit.and_then(bytes_per_second);
        LinkShape {
            delay: Duration::from_millis(self.delay_ms),
            jitter: Duration::from_millis(self.jitter_ms),
            rate,
            burst: self
                .burst_kb
                .map_or_else(|| LinkShape::default_burst(rate), |kb| kb * 1024),
        }
    }

    fn links(&self) -> Vec<LinkArg> {
        let single = self.listen.zip(self.to);
        let single = single.map(|(listen, target)| LinkArg { listen, target });
        single
            .into_iter()
            .chain(self.link.iter().copied())
            .collect()
    }
}

fn describe(shape: &LinkShape) -> String {
    let rate = shape.rate.map_or("unlimited".to_string(), |r| {
        format!("{} kbit/s, burst {} B", r.get() / 125, shape.burst)
    });
    format!(
        "delay {} ms, jitter {} ms, rate {rate}",
        shape.delay.as_millis(),
        shape.jitter.as_millis()
    )
}

async fn relay(args: RelayArgs) -> anyhow::Result<ExitCode> {
    let shape = args.shape();
    let mut serving = tokio::task::JoinSet::new();
    for link in args.links() {
        let relay = Relay::bind(link.listen, link.target, shape)
            .await
            .with_context(|| format!("starting the link {}={}", link.listen, link.target))?;
        let addr = relay.local_addr()?;
        println!(
            "relaying {addr} -> {} ({})",
            relay.target(),
            describe(&shape)
        );
        serving.spawn(relay.serve(|e| eprintln!("meshnet-linkem: {e}")));
    }
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    serving.abort_all();
    Ok(ExitCode::SUCCESS)
}

fn print_report(report: &SelftestReport, delay_ms: u64) {
    println!(
        "rtt: measured {:.1} ms, setting {:.1} ms (2 x {delay_ms} ms delay), off {:.1}%",
        report.rtt.as_secs_f64() * 1e3,
        report.expected_rtt.as_secs_f64() * 1e3,
        report.rtt_error() * 100.0
    );
    println!(
        "throughput: measured {:.0} kbit/s, setting {:.0} kbit/s, off {:.1}%",
        report.throughput / 125.0,
        report.expected_throughput / 125.0,
        report.throughput_error() * 100.0
    );
}

async fn run_selftest(args: SelftestArgs) -> anyhow::Result<ExitCode> {
    let rate = bytes_per_second(args.rate_kbit);
    let shape = LinkShape {
        delay: Duration::from_millis(args.delay_ms),
        jitter: Duration::ZERO,
        rate,
        burst: LinkShape::default_burst(rate),
    };
    println!("selftest: {}", describe(&shape));
    let report = selftest::run(shape, SELFTEST_PINGS, SELFTEST_BULK).await?;
    print_report(&report, args.delay_ms);
    if report.within(SELFTEST_TOLERANCE) {
        println!("selftest ok: both within 10% of the setting");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("selftest FAILED: a figure is more than 10% off the setting");
        Ok(ExitCode::FAILURE)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Command::Relay(args) => relay(args).await,
        Command::Selftest(args) => run_selftest(args).await,
    };
    outcome.unwrap_or_else(|error| {
        eprintln!("meshnet-linkem: {error:#}");
        ExitCode::FAILURE
    })
}
