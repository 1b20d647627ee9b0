//! A runnable tour of the activation plane, with stand-in layers instead of a model.
//!
//! `chain` starts three peers on loopback serving layers 0-10, 10-20 and 20-30, sends a 300-token
//! prefill (three 128-token chunks) and a few decode steps through them with source routing, checks
//! every answer and prints what crossed the wire. `serve` runs one such peer for `curl`
//! (see docs/wire-format.md).
//!
//! A stand-in layer adds 1 to every value, so the answer is predictable.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use half::bf16;
use meshnet_node::{ActivationPlane, ExecutorError, ForwardClient, SpanExecutor};
use meshnet_types::LayerSpan;
use meshnet_wire::{
    ActivationFrame, Activations, Encoding, FrameMeta, Hop, Limits, PREFILL_CHUNK_TOKENS, Route,
    Shape, split_prefill,
};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

#[derive(Parser)]
#[command(about = "Tour of the meshnet activation plane with stand-in layers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Three peers in one process; a prefill and decode steps through all of them.
    Chain {
        /// Prompt length in tokens.
        #[arg(long, default_value_t = 300)]
        tokens: usize,
        /// Hidden size (576 is SmolLM2-135M's).
        #[arg(long, default_value_t = 576)]
        hidden: usize,
    },
    /// One peer serving `POST /forward` until interrupted.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: SocketAddr,
        /// Layers served, as start-end.
        #[arg(long, default_value = "0-30")]
        layers: String,
    },
}

/// Stand-in layers: each adds 1 to every value (rounded to bfloat16 once per hop).
struct StandInLayers {
    serves: LayerSpan,
}

impl SpanExecutor for StandInLayers {
    fn served_layers(&self) -> Option<LayerSpan> {
        Some(self.serves)
    }

    fn forward(&self, meta: &FrameMeta, input: Activations) -> Result<Activations, ExecutorError> {
        let add = meta.layers.len() as f32;
        let (shape, values) = input.into_parts();
        let values = values
            .iter()
            .map(|v| bf16::from_f32(v.to_f32() + add))
            .collect();
        Activations::new(shape, values).map_err(|e| ExecutorError::Compute(e.to_string()))
    }
}

fn parse_layers(text: &str) -> anyhow::Result<LayerSpan> {
    let (a, b) = text
        .split_once('-')
        .ok_or_else(|| anyhow::anyhow!("--layers must look like 0-30, got {text:?}"))?;
    LayerSpan::non_empty(a.parse()?, b.parse()?)
        .ok_or_else(|| anyhow::anyhow!("--layers must have start < end, got {text:?}"))
}

async fn start_peer(listen: SocketAddr, serves: LayerSpan) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let plane = ActivationPlane::new(
        Arc::new(StandInLayers { serves }),
        Limits::default(),
        ForwardClient::new(Limits::default(), Duration::from_secs(30))?,
    );
    tokio::spawn(async move { axum::serve(listener, plane.router()).await });
    Ok(format!("http://{addr}"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    match Cli::parse().command {
        Command::Serve { listen, layers } => {
            let url = start_peer(listen, parse_layers(&layers)?).await?;
            println!("serving stand-in layers {layers} at {url}/forward (Ctrl-C to stop)");
            tokio::signal::ctrl_c().await?;
            Ok(())
        }
        Command::Chain { tokens, hidden } => chain(tokens, hidden).await,
    }
}

async fn chain(tokens: usize, hidden: usize) -> anyhow::Result<()> {
    let any_port: SocketAddr = "127.0.0.1:0".parse()?;
    let spans = [(0, 10), (10, 20), (20, 30)];
    let mut urls = Vec::new();
    for (a, b) in spans {
        let url = start_peer(any_port, LayerSpan::new(a, b)).await?;
        println!("peer serving layers {a:>2}-{b:<2} at {url}");
        urls.push(url);
    }
    let route = Route::new(
        spans[1..]
            .iter()
            .zip(&urls[1..])
            .map(|(&(a, b), url)| Hop::new(LayerSpan::new(a, b), url.clone()))
            .collect::<Result<_, _>>()?,
    )?;

    // A prompt's hidden states: random normal values, as after an embedding.
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let normal = Normal::new(0.0f32, 1.0)?;
    let shape = Shape::new(&[1, tokens, hidden])?;
    let values = (0..shape.elements())
        .map(|_| bf16::from_f32(normal.sample(&mut rng)))
        .collect();
    let prompt = Activations::new(shape, values)?;
    let session = uuid::Uuid::new_v4();
    let client = ForwardClient::new(Limits::default(), Duration::from_secs(30))?;

    println!(
        "\nsession {session}: prefill of {tokens} tokens x {hidden} in {PREFILL_CHUNK_TOKENS}-token chunks, zstd-1"
    );
    println!("| chunk | positions | raw bytes | zstd bytes | ratio | round trip |");
    println!("|---|---|---|---|---|---|");
    let mut next_position = 0u64;
    for chunk in split_prefill(&prompt, PREFILL_CHUNK_TOKENS)? {
        let n = chunk.activations.shape().dims()[1] as u64;
        let frame = ActivationFrame {
            meta: FrameMeta {
                session,
                chunk_index: chunk.index,
                chunk_total: chunk.total,
                position: chunk.token_offset as u64,
                layers: LayerSpan::new(0, 10),
                route: route.clone(),
                grant: None,
                fork_from: None,
                return_to: None,
                rewind: false,
            },
            activations: chunk.activations,
        };
        let expected = stand_in_reference(frame.activations.values(), &[10.0, 10.0, 10.0]);
        let raw_len = frame.activations.shape().byte_len();
        let zstd_len = frame.encode(Encoding::Zstd).body.len();
        let started = Instant::now();
        let answer = client
            .forward(&endpoint(&urls[0]), frame, Encoding::Zstd)
            .await?;
        let elapsed = started.elapsed();
        anyhow::ensure!(
            answer.activations.values() == expected.as_slice(),
            "chunk {} came back wrong",
            chunk.index
        );
        anyhow::ensure!(
            answer.meta.layers == LayerSpan::new(0, 30),
            "answer ran {}",
            answer.meta.layers
        );
        println!(
            "| {}/{} | {}..{} | {raw_len} | {zstd_len} | {:.2}x | {:.1} ms |",
            chunk.index + 1,
            chunk.total,
            chunk.token_offset,
            chunk.token_offset as u64 + n,
            raw_len as f64 / zstd_len as f64,
            elapsed.as_secs_f64() * 1e3,
        );
        next_position = chunk.token_offset as u64 + n;
    }

    let decode_steps = 8;
    let started = Instant::now();
    for step in 0..decode_steps {
        let one = Activations::new(
            Shape::new(&[1, 1, hidden])?,
            vec![bf16::from_f32(0.5); hidden],
        )?;
        let frame = ActivationFrame {
            meta: FrameMeta {
                session,
                chunk_index: 0,
                chunk_total: 1,
                position: next_position + step,
                layers: LayerSpan::new(0, 10),
                route: route.clone(),
                grant: None,
                fork_from: None,
                return_to: None,
                rewind: false,
            },
            activations: one,
        };
        let answer = client
            .forward(&endpoint(&urls[0]), frame, Encoding::Raw)
            .await?;
        anyhow::ensure!(
            answer.activations.values()[0] == bf16::from_f32(30.5),
            "decode step {step} came back wrong"
        );
    }
    println!(
        "\n{decode_steps} decode steps (1 token each, raw): {:.2} ms per step through 3 peers",
        started.elapsed().as_secs_f64() * 1e3 / decode_steps as f64
    );
    println!("every answer matched the stand-in layers' expected output");
    Ok(())
}

/// What three hops of stand-in layers produce, rounding to bfloat16 after each hop as the peers do.
fn stand_in_reference(values: &[bf16], hops: &[f32]) -> Vec<bf16> {
    values
        .iter()
        .map(|&v| {
            hops.iter()
                .fold(v, |acc, add| bf16::from_f32(acc.to_f32() + add))
        })
        .collect()
}

/// The endpoint a URL names.
fn endpoint(url: &str) -> meshnet_wire::Endpoint {
    url.parse().expect("an http:// URL")
}
