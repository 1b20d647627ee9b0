//! Compression ratio and speed of activation payloads: plain zstd-1 against a byte-plane
//! shuffle (all high bytes, then all low bytes) before zstd-1.
//!
//! Besides synthetic data, real hidden states of the default model (SmolLM2-135M-Instruct,
//! after layer 15 of 30, 128 tokens) when `scripts/fetch-model.sh` has put it on disk.
//!
//! Prints a table. Run with `cargo bench -p meshnet-benches --bench wire_compression`.

#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Instant;

use half::bf16;
use meshnet_wire::bf16_to_le_bytes;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

const SHAPES: [[usize; 3]; 3] = [[1, 128, 576], [1, 128, 4096], [1, 128, 16384]];
const REPEATS: usize = 15;

/// Values from a standard normal distribution.
fn normal(n: usize, seed: u64) -> Vec<bf16> {
    let mut rng = StdRng::seed_from_u64(seed);
    let dist = Normal::new(0.0f32, 1.0).unwrap();
    (0..n)
        .map(|_| bf16::from_f32(dist.sample(&mut rng)))
        .collect()
}

/// Normal values with a few channels of large outliers, as the residual stream of a transformer
/// has after its middle layers (|x| in the tens to thousands on a handful of channels).
fn with_outliers(n: usize, hidden: usize, seed: u64) -> Vec<bf16> {
    let mut values = normal(n, seed);
    for (i, v) in values.iter_mut().enumerate() {
        let channel = i % hidden;
        if channel % 97 == 3 {
            *v = bf16::from_f32(v.to_f32() * 300.0);
        } else {
            *v = bf16::from_f32(v.to_f32() * 4.0);
        }
    }
    values
}

/// Real residual-stream activations: the default model's hidden states after layer
/// `LAYERS_RUN` for a 128-token prompt, as the bf16 a peer would send. `None` without the model.
fn real_activations() -> Option<Vec<bf16>> {
    use meshnet_model::{GgufModel, LlamaSpan, ModelTokenizer, SessionId, SpanSpec, TokenEmbedder};
    const LAYERS_RUN: usize = 15;
    let path = meshnet_model::default_model_path();
    if !path.is_file() {
        return None;
    }
    let model = GgufModel::open(&path).unwrap();
    let tokenizer = ModelTokenizer::from_gguf(&model).unwrap();
    let text = "Peer-to-peer networks share the work of running a language model across many \
                volunteer machines, each holding a few layers. "
        .repeat(12);
    let mut ids = tokenizer.encode(&text).unwrap();
    ids.truncate(128);
    let span = LlamaSpan::load(
        &model,
        &SpanSpec {
            embedding: true,
            ..SpanSpec::layers(meshnet_types::LayerSpan::new(0, LAYERS_RUN as u32))
        },
    )
    .unwrap();
    let hidden = span.embed(&ids).unwrap();
    let hidden = span
        .forward_layers(SessionId::new_v4(), 0, &hidden)
        .unwrap();
    let activations = meshnet_wire::Activations::from_tensor(&hidden).unwrap();
    Some(activations.values().to_vec())
}

/// Little-endian bytes regrouped as every high byte, then every low byte.
fn shuffle(le: &[u8]) -> Vec<u8> {
    let n = le.len() / 2;
    let mut out = vec![0u8; le.len()];
    let (high, low) = out.split_at_mut(n);
    for (i, pair) in le.chunks_exact(2).enumerate() {
        low[i] = pair[0];
        high[i] = pair[1];
    }
    out
}

fn unshuffle(planes: &[u8]) -> Vec<u8> {
    let n = planes.len() / 2;
    let (high, low) = planes.split_at(n);
    let mut out = vec![0u8; planes.len()];
    for (i, pair) in out.chunks_exact_mut(2).enumerate() {
        pair[0] = low[i];
        pair[1] = high[i];
    }
    out
}

/// Median seconds of `REPEATS` runs of `f`.
fn median_secs(mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..REPEATS)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[REPEATS / 2]
}

struct Row {
    ratio: f64,
    encode_gbps: f64,
    decode_gbps: f64,
}

fn measure(le: &[u8], shuffled: bool) -> Row {
    let gb = le.len() as f64 / 1e9;
    let compressed = if shuffled {
        zstd::bulk::compress(&shuffle(le), 1).unwrap()
    } else {
        zstd::bulk::compress(le, 1).unwrap()
    };
    let encode = median_secs(|| {
        let input = if shuffled { shuffle(le) } else { le.to_vec() };
        std::hint::black_box(zstd::bulk::compress(&input, 1).unwrap());
    });
    let decode = median_secs(|| {
        let out = zstd::bulk::decompress(&compressed, le.len()).unwrap();
        let out = if shuffled { unshuffle(&out) } else { out };
        std::hint::black_box(out);
    });
    let check = zstd::bulk::decompress(&compressed, le.len()).unwrap();
    assert_eq!(if shuffled { unshuffle(&check) } else { check }, le);
    Row {
        ratio: le.len() as f64 / compressed.len() as f64,
        encode_gbps: gb / encode,
        decode_gbps: gb / decode,
    }
}

/// Measures plain and shuffled zstd-1 on `values` and prints one table row.
fn print_row(name: &str, shape: &str, values: &[bf16]) {
    let le = bf16_to_le_bytes(values);
    let plain = measure(&le, false);
    let planes = measure(&le, true);
    println!(
        "| {name} | {shape} | {:.3} | {:.3} | {:+.1}% | {:.2} / {:.2} | {:.2} / {:.2} |",
        plain.ratio,
        planes.ratio,
        (planes.ratio / plain.ratio - 1.0) * 100.0,
        plain.encode_gbps,
        plain.decode_gbps,
        planes.encode_gbps,
        planes.decode_gbps,
    );
}

fn main() {
    // `cargo test --benches` runs this with `--bench` absent; keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    println!(
        "| data | shape | zstd-1 ratio | shuffle+zstd-1 ratio | gain | zstd-1 enc/dec GB/s | shuffle+zstd-1 enc/dec GB/s |"
    );
    println!("|---|---|---|---|---|---|---|");
    for dims in SHAPES {
        let n: usize = dims.iter().product();
        let datasets = [
            ("normal(0,1)", normal(n, 1)),
            ("normal + outlier channels", with_outliers(n, dims[2], 2)),
        ];
        for (name, values) in datasets {
            print_row(
                name,
                &format!("{}x{}x{}", dims[0], dims[1], dims[2]),
                &values,
            );
        }
    }
    match real_activations() {
        Some(values) => {
            print_row(
                "SmolLM2-135M hidden states after layer 15",
                &format!("1x{}x576", values.len() / 576),
                &values,
            );
        }
        None => {
            println!("(real activations skipped: run scripts/fetch-model.sh for the default model)")
        }
    }
}
