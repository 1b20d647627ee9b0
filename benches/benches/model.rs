//! Tokens per second and memory of models in one process, ours beside llama.cpp in the same
//! run. Five tables, each of which can be asked for alone
//! (`cargo bench -p meshnet-benches --bench model -- formats long`):
//!
//! - `kernels`: the default model (SmolLM2-135M-Instruct), prefill and decode, 1 and 2
//!   threads, weights as shipped (Q4_1) and requantised to Q8_0 on load. Our spans run on
//!   `meshnet-kernels` (the default), and again on candle's own quantized matmul
//!   (`MESHNET_KERNEL=candle`), beside candle-transformers' `quantized_llama::ModelWeights` and,
//!   when `benches/anchors/llamacpp.sh` has built it, llama.cpp's `llama-bench` on the same file.
//! - `layer`: one synthetic Llama-7B-shaped layer (hidden 4096, intermediate 11008, random
//!   weights written as GGUF by this bench) in Q4_1 and Q8_0: a 128-token prefill chunk and a
//!   decode step through our span, with our kernels and with candle's matmul.
//! - `memory`: the resident memory of a peer holding layers 10..20 against the whole model.
//! - `formats`: every GGUF format of the default model that `benches/anchors/quantized_files.sh`
//!   makes (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0) beside the shipped Q4_1, and Gemma 3 270M Q4_K_M:
//!   prefill and decode tokens/s at 1 and 2 threads against `llama-bench -p 128 -n 64`, with
//!   the resident memory of the whole-model span against the file's size. A file that is
//!   absent is named with the command that makes it; one our model crate cannot load or run
//!   is reported "not loadable" with the error, and the bench goes on.
//! - `long`: the default model with 1,900 tokens of context: a 1,900-token prefill against
//!   `llama-bench -p 1900`, and decoding after it against `llama-bench -d 1900 -n 64`.
//!
//! Thread counts are read once per process, so every measurement runs in a child process of
//! this binary with `RAYON_NUM_THREADS` set. Prints tables. Run with
//! `cargo bench -p meshnet-benches --bench model`.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use meshnet_benches::{QUANTIZED_TYPES, median, rate, ratio};
use meshnet_kernels::KERNEL_VARIABLE;
use meshnet_model::{
    BoundaryPolicy, GgufModel, LayerRoute, LlamaSpan, ModelTokenizer, SessionId, SpanSpec, Stage,
};
use meshnet_types::{LayerSpan, Quantization};
use meshnet_wire::PREFILL_CHUNK_TOKENS;

const PREFILL_TOKENS: usize = 128;
const DECODE_TOKENS: usize = 32;
const WORKER: &str = "--model-bench-worker";

fn model_path() -> PathBuf {
    let path = meshnet_model::default_model_path();
    assert!(
        path.is_file(),
        "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
        path.display()
    );
    path
}

/// The Q8_0 copy of the default model that candle-transformers loads for its Q8_0 row.
fn requantised_path() -> PathBuf {
    std::env::temp_dir().join("meshnet-bench-SmolLM2-135M-Instruct.Q8_0.gguf")
}

fn write_requantised(source: &Path, target: &Path) {
    let mut file = std::fs::File::open(source).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .iter()
        .map(|name| {
            let tensor = content.tensor(&mut file, name, &Device::Cpu).unwrap();
            let dims = tensor.shape().dims().to_vec();
            let quantize =
                dims.len() == 2 && dims[1].is_multiple_of(32) && tensor.dtype() != GgmlDType::Q8_0;
            let tensor = if quantize {
                let dense = tensor.dequantize(&Device::Cpu).unwrap();
                QTensor::quantize(&dense, GgmlDType::Q8_0).unwrap()
            } else {
                tensor
            };
            ((*name).clone(), tensor)
        })
        .collect();
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    write_gguf(target, &metadata, &tensors);
}

/// Writes a GGUF file beside `target` and renames it, so an interrupted run never leaves a
/// partial file that a later run would reuse.
fn write_gguf(
    target: &Path,
    metadata: &[(&str, &gguf_file::Value)],
    tensors: &[(String, QTensor)],
) {
    let tensor_refs: Vec<(&str, &QTensor)> =
        tensors.iter().map(|(name, t)| (name.as_str(), t)).collect();
    let partial = target.with_extension("partial");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&partial).unwrap());
    gguf_file::write(&mut out, metadata, &tensor_refs).unwrap();
    std::io::Write::flush(&mut out).unwrap();
    drop(out);
    std::fs::rename(&partial, target).unwrap();
}

fn prompt_tokens(model: &GgufModel) -> Vec<u32> {
    let tokenizer = ModelTokenizer::from_gguf(model).unwrap();
    let text =
        "Peer-to-peer networks share the work of running a model across machines. ".repeat(20);
    let mut ids = tokenizer.encode(&text).unwrap();
    ids.truncate(PREFILL_TOKENS);
    assert_eq!(ids.len(), PREFILL_TOKENS);
    ids
}

/// Prefill and decode tokens per second of our whole-model span.
fn measure_ours(quantization: Option<Quantization>) -> (f64, f64) {
    let model = GgufModel::open(model_path()).unwrap();
    let prompt = prompt_tokens(&model);
    let spec = SpanSpec {
        quantization,
        ..SpanSpec::whole(model.description())
    };
    let span = LlamaSpan::load(&model, &spec).unwrap();
    let route = LayerRoute {
        embedder: &span,
        stages: vec![&span],
        head: &span,
        boundary: BoundaryPolicy::F32,
    };
    // Warm-up.
    let warm = SessionId::new_v4();
    route.forward(warm, 0, &prompt[..8]).unwrap();
    route.end_session(warm);

    let session = SessionId::new_v4();
    let start = Instant::now();
    let mut logits = route.forward(session, 0, &prompt).unwrap();
    let prefill = PREFILL_TOKENS as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    for step in 0..DECODE_TOKENS {
        let token = meshnet_model::argmax(&logits);
        logits = route
            .forward(session, PREFILL_TOKENS + step, &[token])
            .unwrap();
    }
    let decode = DECODE_TOKENS as f64 / start.elapsed().as_secs_f64();
    (prefill, decode)
}

/// The same with candle-transformers' whole-model implementation.
fn measure_reference(path: &Path) -> (f64, f64) {
    let model = GgufModel::open(model_path()).unwrap();
    let prompt = prompt_tokens(&model);
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut weights = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let warm = Tensor::new(&prompt[..8], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    weights.forward(&warm, 0).unwrap();
    weights.clear_kv_cache();

    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let start = Instant::now();
    let mut logits = weights.forward(&input, 0).unwrap();
    let prefill = PREFILL_TOKENS as f64 / start.elapsed().as_secs_f64();
    let start = Instant::now();
    for step in 0..DECODE_TOKENS {
        let values = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        let token = meshnet_model::argmax(&values);
        let input = Tensor::new(&[token], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        logits = weights.forward(&input, PREFILL_TOKENS + step).unwrap();
    }
    let decode = DECODE_TOKENS as f64 / start.elapsed().as_secs_f64();
    (prefill, decode)
}

/// Resident memory after loading a span, and the growth over the process before loading.
fn measure_memory(which: &str, quantization: Option<Quantization>) -> (u64, u64) {
    let model = GgufModel::open(model_path()).unwrap();
    if which == "reference-memory" {
        let path = match quantization {
            Some(Quantization::Q8_0) => requantised_path(),
            _ => model_path(),
        };
        let before = meshnet_benches::resident_bytes();
        let mut file = std::fs::File::open(path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let weights = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let after = meshnet_benches::resident_bytes();
        drop(weights);
        return (after, after.saturating_sub(before));
    }
    let before = meshnet_benches::resident_bytes();
    let spec = SpanSpec {
        quantization,
        ..match which {
            "whole" => SpanSpec::whole(model.description()),
            _ => SpanSpec::layers(LayerSpan::new(10, 20)),
        }
    };
    let span = LlamaSpan::load(&model, &spec).unwrap();
    let after = meshnet_benches::resident_bytes();
    drop(span);
    (after, after.saturating_sub(before))
}

/// The synthetic layer's shape: one Llama-7B block.
const LAYER_HIDDEN: usize = 4096;
const LAYER_INTERMEDIATE: usize = 11008;
const LAYER_HEADS: usize = 32;
const LAYER_VOCAB: usize = 32;
const LAYER_DECODE_STEPS: usize = 8;

fn synthetic_layer_path(dtype: GgmlDType) -> PathBuf {
    std::env::temp_dir().join(format!("meshnet-bench-llama7b-layer.{dtype:?}.gguf"))
}

/// Writes a one-layer Llama-7B-shaped model with random weights in `dtype` (norms f32).
fn write_synthetic_layer(dtype: GgmlDType, target: &Path) {
    use gguf_file::Value;
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ dtype as u64;
    let mut random = |len: usize, scale: f32| -> Vec<f32> {
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    };
    let mut matrix = |rows: usize, cols: usize| {
        let values =
            Tensor::from_vec(random(rows * cols, 0.04), (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&values, dtype).unwrap()
    };
    let h = LAYER_HIDDEN;
    let i = LAYER_INTERMEDIATE;
    let mut tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), matrix(LAYER_VOCAB, h)),
        ("blk.0.attn_q.weight".into(), matrix(h, h)),
        ("blk.0.attn_k.weight".into(), matrix(h, h)),
        ("blk.0.attn_v.weight".into(), matrix(h, h)),
        ("blk.0.attn_output.weight".into(), matrix(h, h)),
        ("blk.0.ffn_gate.weight".into(), matrix(i, h)),
        ("blk.0.ffn_up.weight".into(), matrix(i, h)),
        ("blk.0.ffn_down.weight".into(), matrix(h, i)),
    ];
    for name in [
        "blk.0.attn_norm.weight",
        "blk.0.ffn_norm.weight",
        "output_norm.weight",
    ] {
        let ones = Tensor::ones(h, candle_core::DType::F32, &Device::Cpu).unwrap();
        tensors.push((
            name.into(),
            QTensor::quantize(&ones, GgmlDType::F32).unwrap(),
        ));
    }
    let tokens = Value::Array(
        (0..LAYER_VOCAB)
            .map(|t| Value::String(format!("t{t}")))
            .collect(),
    );
    let metadata = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(1)),
        ("llama.embedding_length", Value::U32(h as u32)),
        ("llama.feed_forward_length", Value::U32(i as u32)),
        ("llama.attention.head_count", Value::U32(LAYER_HEADS as u32)),
        (
            "llama.attention.head_count_kv",
            Value::U32(LAYER_HEADS as u32),
        ),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(4096)),
        ("tokenizer.ggml.tokens", tokens),
    ];
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    write_gguf(target, &metadata, &tensors);
}

/// Milliseconds for a 128-token prefill chunk and for one decode step (the mean of a few,
/// after the chunk) through the synthetic layer.
fn measure_layer(path: &Path) -> (f64, f64) {
    let model = GgufModel::open(path).unwrap();
    let span = LlamaSpan::load(&model, &SpanSpec::layers(LayerSpan::new(0, 1))).unwrap();
    let hidden =
        |tokens: usize| Tensor::randn(0f32, 1.0, (1, tokens, LAYER_HIDDEN), &Device::Cpu).unwrap();
    // Warm-up.
    let warm = SessionId::new_v4();
    span.forward_layers(warm, 0, &hidden(8)).unwrap();
    span.end_session(warm);

    let session = SessionId::new_v4();
    let chunk = hidden(PREFILL_TOKENS);
    let start = Instant::now();
    span.forward_layers(session, 0, &chunk).unwrap();
    let prefill = start.elapsed().as_secs_f64() * 1e3;
    let step = hidden(1);
    let start = Instant::now();
    for offset in 0..LAYER_DECODE_STEPS {
        span.forward_layers(session, PREFILL_TOKENS + offset, &step)
            .unwrap();
    }
    let decode = start.elapsed().as_secs_f64() * 1e3 / LAYER_DECODE_STEPS as f64;
    (prefill, decode)
}

/// What `llama-bench` printed (its JSON rows) and the most it had resident.
struct LlamaBench {
    rows: Vec<serde_json::Value>,
    peak_resident: u64,
}

impl LlamaBench {
    /// Tokens/s of the test of `prompt` tokens then `generated` tokens after `depth` tokens
    /// already in the cache: the median of its repetitions, the fastest when it ran the test
    /// in several settings (`-fa 0,1`).
    fn rate(&self, prompt: usize, generated: usize, depth: usize) -> Option<f64> {
        self.rows
            .iter()
            .filter(|row| {
                row["n_prompt"] == prompt
                    && row["n_gen"] == generated
                    && row["n_depth"].as_u64().unwrap_or(0) == depth as u64
            })
            .filter_map(row_rate)
            .reduce(f64::max)
    }
}

/// One `llama-bench` row's tokens/s: the median of its samples, else its average.
fn row_rate(row: &serde_json::Value) -> Option<f64> {
    let samples: Vec<f64> = row["samples_ts"]
        .as_array()
        .map(|samples| {
            samples
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect()
        })
        .unwrap_or_default();
    if samples.is_empty() {
        row["avg_ts"].as_f64()
    } else {
        Some(median(&samples))
    }
}

/// Runs llama.cpp's `llama-bench` on `path` with `threads` threads and `args`; `None` when
/// `benches/anchors/llamacpp.sh` has not built it.
fn llama_bench(path: &Path, threads: usize, args: &[String]) -> Option<Result<LlamaBench, String>> {
    let binary = meshnet_benches::llamacpp_binary("llama-bench")?;
    let mut command = Command::new(binary);
    command
        .arg("-m")
        .arg(path)
        .args(["-t", &threads.to_string(), "-o", "json"])
        .args(args);
    Some(
        meshnet_benches::run_watched(&mut command).and_then(|finished| {
            let rows = serde_json::from_str(&finished.stdout)
                .map_err(|error| format!("llama-bench printed no JSON list: {error}"))?;
            Ok(LlamaBench {
                rows,
                peak_resident: finished.peak_resident,
            })
        }),
    )
}

/// `llama-bench` arguments from numbers and flags.
fn bench_args(args: &[&dyn std::fmt::Display]) -> Vec<String> {
    args.iter().map(ToString::to_string).collect()
}

/// Prefill and decode tokens/s of llama.cpp's `llama-bench` on `path` with `threads`, when
/// `benches/anchors/llamacpp.sh` has built it.
fn measure_llamacpp(path: &Path, threads: usize) -> Option<(f64, f64)> {
    let args = bench_args(&[&"-p", &PREFILL_TOKENS, &"-n", &DECODE_TOKENS, &"-r", &3]);
    let bench = llama_bench(path, threads, &args)?.unwrap_or_else(|error| {
        panic!("llama-bench failed: {error}");
    });
    Some((
        bench.rate(PREFILL_TOKENS, 0, 0)?,
        bench.rate(0, DECODE_TOKENS, 0)?,
    ))
}

/// Tokens generated one at a time in the table of formats, as `llama-bench -n` counts them.
const FILE_DECODE_TOKENS: usize = 64;

/// Tokens already in the cache in the long-context table, and the length of its prefill.
const LONG_CONTEXT: usize = 1900;

/// Times each measurement of the long-context table is taken (the median is printed).
const LONG_REPS: usize = 2;

/// How many times each measurement of the table of formats is taken (the median is printed):
/// `MESHNET_BENCH_REPS`, default 3.
fn file_reps() -> usize {
    std::env::var("MESHNET_BENCH_REPS")
        .ok()
        .and_then(|reps| reps.parse().ok())
        .filter(|&reps| reps > 0)
        .unwrap_or(3)
}

/// The first `count` tokens of a long repeated text in `model`'s tokenizer.
fn text_tokens(model: &GgufModel, count: usize) -> meshnet_model::Result<Vec<u32>> {
    let tokenizer = ModelTokenizer::from_gguf(model)?;
    let sentence = "Peer-to-peer networks share the work of running a model across machines. ";
    let mut text = sentence.repeat(count / 8 + 1);
    let mut ids = tokenizer.encode(&text)?;
    while ids.len() < count {
        text.push_str(&sentence.repeat(count / 8 + 1));
        ids = tokenizer.encode(&text)?;
    }
    ids.truncate(count);
    Ok(ids)
}

/// A route through one whole-model span.
fn whole_route(span: &LlamaSpan) -> LayerRoute<'_> {
    LayerRoute {
        embedder: span,
        stages: vec![span],
        head: span,
        boundary: BoundaryPolicy::F32,
    }
}

/// Tokens/s of `steps` greedy decode steps of `session`, the first feeding `token` at
/// `position`.
fn decode_rate(
    route: &LayerRoute<'_>,
    session: SessionId,
    position: usize,
    mut token: u32,
    steps: usize,
) -> meshnet_model::Result<f64> {
    let start = Instant::now();
    for step in 0..steps {
        let logits = route.forward(session, position + step, &[token])?;
        token = meshnet_model::argmax(&logits);
    }
    Ok(steps as f64 / start.elapsed().as_secs_f64())
}

/// One file of the table of formats, in this process: the resident growth from loading the
/// whole model as one span, the median prefill (one `PREFILL_TOKENS` chunk at position 0) and
/// decode (`FILE_DECODE_TOKENS` steps from position 0, as `llama-bench -n` runs them) tokens/s
/// over `reps` fresh sessions each, and the process's peak resident memory.
fn measure_file(path: &Path, reps: usize) -> meshnet_model::Result<[f64; 4]> {
    let model = GgufModel::open(path)?;
    let prompt = text_tokens(&model, PREFILL_TOKENS)?;
    let before = meshnet_benches::resident_bytes();
    let span = LlamaSpan::load(&model, &SpanSpec::whole(model.description()))?;
    let growth = meshnet_benches::resident_bytes().saturating_sub(before);
    let route = whole_route(&span);
    let warm = SessionId::new_v4();
    route.forward(warm, 0, &prompt[..8])?;
    route.end_session(warm);

    let mut prefill = Vec::with_capacity(reps);
    let mut decode = Vec::with_capacity(reps);
    for _ in 0..reps {
        let session = SessionId::new_v4();
        let start = Instant::now();
        route.forward(session, 0, &prompt)?;
        prefill.push(PREFILL_TOKENS as f64 / start.elapsed().as_secs_f64());
        route.end_session(session);

        let session = SessionId::new_v4();
        decode.push(decode_rate(
            &route,
            session,
            0,
            prompt[0],
            FILE_DECODE_TOKENS,
        )?);
        route.end_session(session);
    }
    Ok([
        growth as f64,
        median(&prefill),
        median(&decode),
        meshnet_benches::peak_resident_bytes() as f64,
    ])
}

/// The long-context row, in this process: the median over `LONG_REPS` fresh sessions of the
/// tokens/s of a `LONG_CONTEXT`-token prefill in the wire's chunks, and of
/// `FILE_DECODE_TOKENS` decode steps after it.
fn measure_long(path: &Path) -> meshnet_model::Result<[f64; 2]> {
    let model = GgufModel::open(path)?;
    let prompt = text_tokens(&model, LONG_CONTEXT)?;
    let span = LlamaSpan::load(&model, &SpanSpec::whole(model.description()))?;
    let route = whole_route(&span);
    let warm = SessionId::new_v4();
    route.forward(warm, 0, &prompt[..8])?;
    route.end_session(warm);

    let mut prefill = Vec::with_capacity(LONG_REPS);
    let mut decode = Vec::with_capacity(LONG_REPS);
    for _ in 0..LONG_REPS {
        let session = SessionId::new_v4();
        let start = Instant::now();
        let hidden = route.prefill(session, &prompt, PREFILL_CHUNK_TOKENS)?;
        let logits = route.head.logits(&hidden)?;
        prefill.push(LONG_CONTEXT as f64 / start.elapsed().as_secs_f64());
        let token = meshnet_model::argmax(&logits);
        decode.push(decode_rate(
            &route,
            session,
            LONG_CONTEXT,
            token,
            FILE_DECODE_TOKENS,
        )?);
        route.end_session(session);
    }
    Ok([median(&prefill), median(&decode)])
}

/// Prints a worker's numbers, or its error on standard error with a failing exit status.
fn report<const N: usize>(measured: meshnet_model::Result<[f64; N]>) {
    match measured {
        Ok(numbers) => {
            let words: Vec<String> = numbers.iter().map(f64::to_string).collect();
            println!("{}", words.join(" "));
        }
        Err(error) => {
            eprintln!("error: {error}");
            std::process::exit(1);
        }
    }
}

fn worker(args: &[String]) {
    match args[1].as_str() {
        "layer" => {
            let (prefill, decode) = measure_layer(Path::new(&args[2]));
            println!("{prefill} {decode}");
            return;
        }
        "file" => {
            let reps = args[3].parse().unwrap();
            report(measure_file(Path::new(&args[2]), reps));
            return;
        }
        "long" => {
            report(measure_long(Path::new(&args[2])));
            return;
        }
        _ => {}
    }
    let quantization = match args[2].as_str() {
        "q8_0" => Some(Quantization::Q8_0),
        _ => None,
    };
    match args[1].as_str() {
        "ours" => {
            let (prefill, decode) = measure_ours(quantization);
            println!("{prefill} {decode}");
        }
        "reference" => {
            let path = match quantization {
                Some(Quantization::Q8_0) => requantised_path(),
                _ => model_path(),
            };
            let (prefill, decode) = measure_reference(&path);
            println!("{prefill} {decode}");
        }
        which => {
            let (resident, growth) = measure_memory(which, quantization);
            println!("{resident} {growth}");
        }
    }
}

/// Runs a measurement in a child process with `threads` threads and `MESHNET_KERNEL=kernel`
/// (the default kernel when `None`); returns the two numbers it prints.
fn run_worker_with(threads: usize, kernel: Option<&str>, args: &[&str]) -> (f64, f64) {
    let mut command = meshnet_benches::worker_command(WORKER, threads).unwrap();
    command.args(args).env_remove(KERNEL_VARIABLE);
    if let Some(kernel) = kernel {
        command.env(KERNEL_VARIABLE, kernel);
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "worker {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    let mut numbers = line.split_whitespace().map(|n| n.parse::<f64>().unwrap());
    (numbers.next().unwrap(), numbers.next().unwrap())
}

fn run_worker(threads: usize, kind: &str, quantization: &str) -> (f64, f64) {
    run_worker_with(threads, None, &[kind, quantization])
}

/// Runs a measurement of the table of formats or the long-context table in a child process
/// with `threads` threads and the default kernel; its numbers, or why it failed (a model the
/// crate cannot load yet fails here without stopping the bench).
fn try_worker(threads: usize, args: &[&str]) -> Result<Vec<f64>, String> {
    let mut command =
        meshnet_benches::worker_command(WORKER, threads).map_err(|error| error.to_string())?;
    command.args(args).env_remove(KERNEL_VARIABLE);
    let finished = meshnet_benches::run_watched(&mut command)?;
    meshnet_benches::last_line_numbers(&finished.stdout)
}

/// A model file of the table of formats, and how to make it when it is absent.
struct BenchFile {
    label: String,
    path: PathBuf,
    make: &'static str,
}

/// The default model as shipped, its requantised copies and Gemma 3 270M.
fn bench_files() -> Vec<BenchFile> {
    let models = meshnet_model::models_dir();
    let mut files = vec![BenchFile {
        label: "SmolLM2 Q4_1".into(),
        path: meshnet_model::default_model_path(),
        make: "bash scripts/fetch-model.sh",
    }];
    for format in QUANTIZED_TYPES {
        files.push(BenchFile {
            label: format!("SmolLM2 {format}"),
            path: meshnet_benches::quantized_file(&models, format),
            make: "bash benches/anchors/quantized_files.sh",
        });
    }
    let gemma = meshnet_model::known_model("gemma3-270m").map_or_else(
        || models.join("gemma-3-270m-q4_k_m.gguf"),
        |known| known.path(),
    );
    files.push(BenchFile {
        label: "Gemma3-270M Q4_K_M".into(),
        path: gemma,
        make: "bash scripts/fetch-model.sh gemma3-270m",
    });
    files
}

/// The formats of a file's matrices, each with its share of their weights, largest first
/// ("Q5_0 58%, Q4_K 33%, Q6_K 9%").
fn format_mix(path: &Path) -> String {
    let content = std::fs::File::open(path)
        .map_err(candle_core::Error::from)
        .and_then(|mut file| gguf_file::Content::read(&mut file));
    let content = match content {
        Ok(content) => content,
        Err(error) => return format!("header not readable by candle: {error}"),
    };
    let mut weights: Vec<(String, usize)> = Vec::new();
    for info in content.tensor_infos.values() {
        if info.shape.dims().len() < 2 {
            continue;
        }
        let name = format!("{:?}", info.ggml_dtype);
        // candle spells the k-quants `Q4K`; GGUF spells them `Q4_K`.
        let name = match name.strip_suffix('K') {
            Some(stem) if stem.len() == 2 => format!("{stem}_K"),
            _ => name,
        };
        match weights.iter_mut().find(|(known, _)| *known == name) {
            Some((_, count)) => *count += info.shape.elem_count(),
            None => weights.push((name, info.shape.elem_count())),
        }
    }
    let total: usize = weights.iter().map(|(_, count)| count).sum();
    weights.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    weights
        .iter()
        .map(|(name, count)| format!("{name} {:.0}%", 100.0 * *count as f64 / total.max(1) as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The table of formats: every file of [`bench_files`] that is on disk, at 1 and 2 threads.
fn files_table() {
    let reps = file_reps();
    println!(
        "Every format, ours beside llama.cpp in the same run: prefill {PREFILL_TOKENS} tokens \
         in one chunk, decode {FILE_DECODE_TOKENS} tokens from an empty cache, tokens/s, median \
         of {reps} (MESHNET_BENCH_REPS) against llama-bench -p {PREFILL_TOKENS} -n \
         {FILE_DECODE_TOKENS} -r {reps}, median of its samples; ratio: ours / llama.cpp. span: \
         resident growth from loading the whole model as one span, against the file's size; \
         peak: the most each process had resident."
    );
    println!(
        "| file | threads | prefill ours | llama.cpp | ratio | decode ours | llama.cpp | ratio | span MiB | span / file | peak MiB ours | llama.cpp |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut notes = Vec::new();
    for file in bench_files() {
        let Ok(metadata) = std::fs::metadata(&file.path) else {
            notes.push(format!(
                "{}: absent ({}); make it with `{}`",
                file.label,
                file.path.display(),
                file.make
            ));
            continue;
        };
        let file_bytes = metadata.len();
        notes.push(format!(
            "{}: {:.1} MiB, matrices in {}",
            file.label,
            meshnet_benches::mib(file_bytes),
            format_mix(&file.path)
        ));
        let path_arg = file.path.to_string_lossy().into_owned();
        let reps_arg = reps.to_string();
        let mut unloadable: Option<String> = None;
        for threads in [1, 2] {
            let ours = match &unloadable {
                Some(_) => None,
                None => match try_worker(threads, &["file", &path_arg, &reps_arg]) {
                    Ok(numbers) if numbers.len() == 4 => Some(numbers),
                    Ok(numbers) => {
                        unloadable = Some(format!("the worker printed {numbers:?}"));
                        None
                    }
                    Err(error) => {
                        unloadable = Some(error);
                        None
                    }
                },
            };
            let args = bench_args(&[
                &"-p",
                &PREFILL_TOKENS,
                &"-n",
                &FILE_DECODE_TOKENS,
                &"-r",
                &reps,
            ]);
            let anchor = match llama_bench(&file.path, threads, &args) {
                Some(Ok(bench)) => Some(bench),
                Some(Err(error)) => {
                    notes.push(format!(
                        "{} at -t {threads}: llama-bench failed: {error}",
                        file.label
                    ));
                    None
                }
                None => None,
            };
            let ours_value = |index: usize| ours.as_ref().map(|numbers| numbers[index]);
            let ours_rate = |index: usize| match &ours {
                Some(numbers) => format!("{:.1}", numbers[index]),
                None => "not loadable".into(),
            };
            let anchor_prefill = anchor
                .as_ref()
                .and_then(|bench| bench.rate(PREFILL_TOKENS, 0, 0));
            let anchor_decode = anchor
                .as_ref()
                .and_then(|bench| bench.rate(0, FILE_DECODE_TOKENS, 0));
            let mib = |value: Option<f64>| {
                value.map_or_else(
                    || "-".into(),
                    |bytes| format!("{:.1}", meshnet_benches::mib(bytes as u64)),
                )
            };
            let span_share = ours_value(0).map_or_else(
                || "-".into(),
                |growth| format!("{:.2}", growth / file_bytes as f64),
            );
            println!(
                "| {} | {threads} | {} | {} | {} | {} | {} | {} | {} | {span_share} | {} | {} |",
                file.label,
                ours_rate(1),
                rate(anchor_prefill),
                ratio(ours_value(1), anchor_prefill),
                ours_rate(2),
                rate(anchor_decode),
                ratio(ours_value(2), anchor_decode),
                mib(ours_value(0)),
                mib(ours_value(3)),
                mib(anchor.as_ref().map(|bench| bench.peak_resident as f64)),
            );
        }
        if let Some(error) = unloadable {
            notes.push(format!("{}: not loadable: {error}", file.label));
        }
    }
    if meshnet_benches::llamacpp_binary("llama-bench").is_none() {
        notes.push(
            "llama.cpp: llama-bench is not built; build it with `bash benches/anchors/llamacpp.sh`"
                .into(),
        );
    }
    for note in notes {
        println!("- {note}");
    }
}

/// The long-context rows: the default model with `LONG_CONTEXT` tokens of context.
fn long_table() {
    let path = model_path();
    println!(
        "Long context, SmolLM2-135M-Instruct Q4_1, tokens/s, median of {LONG_REPS}: a \
         {LONG_CONTEXT}-token prefill (ours in the wire's {PREFILL_CHUNK_TOKENS}-token chunks, \
         as peers run it; llama-bench -p {LONG_CONTEXT} in its own 512-token micro-batches), \
         and {FILE_DECODE_TOKENS} decode steps with {LONG_CONTEXT} tokens in the cache \
         (llama-bench -d {LONG_CONTEXT} -n {FILE_DECODE_TOKENS}); llama.cpp: the faster of \
         flash attention off and on (-fa 0,1); ratio: ours / llama.cpp"
    );
    println!(
        "| threads | prefill {LONG_CONTEXT} ours | llama.cpp | ratio | decode @{LONG_CONTEXT} ours | llama.cpp | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    let path_arg = path.to_string_lossy().into_owned();
    let mut notes = Vec::new();
    for threads in [1, 2] {
        let ours = match try_worker(threads, &["long", &path_arg]) {
            Ok(numbers) if numbers.len() == 2 => Some(numbers),
            Ok(numbers) => {
                notes.push(format!("the worker printed {numbers:?}"));
                None
            }
            Err(error) => {
                notes.push(format!("ours at -t {threads} failed: {error}"));
                None
            }
        };
        let mut anchor = |args: Vec<String>| match llama_bench(&path, threads, &args) {
            Some(Ok(bench)) => Some(bench),
            Some(Err(error)) => {
                notes.push(format!("llama-bench at -t {threads} failed: {error}"));
                None
            }
            None => None,
        };
        let anchor_prefill = anchor(bench_args(&[
            &"-p",
            &LONG_CONTEXT,
            &"-n",
            &0,
            &"-r",
            &LONG_REPS,
            &"-fa",
            &"0,1",
        ]))
        .and_then(|bench| bench.rate(LONG_CONTEXT, 0, 0));
        let anchor_decode = anchor(bench_args(&[
            &"-p",
            &0,
            &"-n",
            &FILE_DECODE_TOKENS,
            &"-d",
            &LONG_CONTEXT,
            &"-r",
            &LONG_REPS,
            &"-fa",
            &"0,1",
        ]))
        .and_then(|bench| bench.rate(0, FILE_DECODE_TOKENS, LONG_CONTEXT));
        let ours_value = |index: usize| ours.as_ref().map(|numbers| numbers[index]);
        println!(
            "| {threads} | {} | {} | {} | {} | {} | {} |",
            rate(ours_value(0)),
            rate(anchor_prefill),
            ratio(ours_value(0), anchor_prefill),
            rate(ours_value(1)),
            rate(anchor_decode),
            ratio(ours_value(1), anchor_decode),
        );
    }
    if meshnet_benches::llamacpp_binary("llama-bench").is_none() {
        notes.push(
            "llama.cpp: llama-bench is not built; build it with `bash benches/anchors/llamacpp.sh`"
                .into(),
        );
    }
    for note in notes {
        println!("- {note}");
    }
}

/// The first table: the default model as shipped and requantised to Q8_0 on our kernels, on
/// candle's matmul, in candle-transformers and in llama.cpp.
fn kernels_table(cores: usize) {
    let path = model_path();
    let requantised = requantised_path();
    if !requantised.is_file() {
        write_requantised(&path, &requantised);
    }
    println!(
        "SmolLM2-135M-Instruct, prefill {PREFILL_TOKENS} tokens in one chunk, decode \
         {DECODE_TOKENS} tokens, tokens/s ({cores} cores). ours: our spans on meshnet-kernels; \
         ours/candle: our spans on candle's quantized matmul; c-t: candle-transformers; \
         llama.cpp: llama-bench on the same file (absent until benches/anchors/llamacpp.sh \
         has built it); ratio: ours / llama.cpp"
    );
    println!(
        "| weights | threads | prefill ours | ours/candle | c-t | llama.cpp | ratio | decode ours | ours/candle | c-t | llama.cpp | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for quantization in ["as-shipped", "q8_0"] {
        for threads in [1, 2] {
            let (ours_prefill, ours_decode) = run_worker(threads, "ours", quantization);
            let (candle_prefill, candle_decode) =
                run_worker_with(threads, Some("candle"), &["ours", quantization]);
            let (ref_prefill, ref_decode) = run_worker(threads, "reference", quantization);
            let file = if quantization == "q8_0" {
                &requantised
            } else {
                &path
            };
            let anchor = measure_llamacpp(file, threads);
            let label = if quantization == "q8_0" {
                "Q8_0 (requantised)"
            } else {
                "Q4_1 (as shipped)"
            };
            let anchor_prefill = anchor.map(|(prefill, _)| prefill);
            let anchor_decode = anchor.map(|(_, decode)| decode);
            println!(
                "| {label} | {threads} | {ours_prefill:.1} | {candle_prefill:.1} | {ref_prefill:.1} | {} | {} | {ours_decode:.1} | {candle_decode:.1} | {ref_decode:.1} | {} | {} |",
                rate(anchor_prefill),
                ratio(Some(ours_prefill), anchor_prefill),
                rate(anchor_decode),
                ratio(Some(ours_decode), anchor_decode),
            );
        }
    }
}

/// The synthetic Llama-7B-shaped layer, ours against candle's matmul.
fn layer_table(cores: usize) {
    println!(
        "One synthetic Llama-7B-shaped layer (hidden {LAYER_HIDDEN}, intermediate \
         {LAYER_INTERMEDIATE}, {LAYER_HEADS} heads, random weights), {cores} threads, \
         milliseconds: a {PREFILL_TOKENS}-token prefill chunk, then one decode step (mean of \
         {LAYER_DECODE_STEPS}); ratio: candle / ours (above 1: ours is faster)"
    );
    println!(
        "| weights | prefill ours | prefill candle | ratio | decode ours | decode candle | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let layer = synthetic_layer_path(dtype);
        if !layer.is_file() {
            write_synthetic_layer(dtype, &layer);
        }
        let layer_arg = layer.to_string_lossy().into_owned();
        let (ours_prefill, ours_decode) = run_worker_with(cores, None, &["layer", &layer_arg]);
        let (candle_prefill, candle_decode) =
            run_worker_with(cores, Some("candle"), &["layer", &layer_arg]);
        println!(
            "| {dtype:?} | {ours_prefill:.1} | {candle_prefill:.1} | {:.2} | {ours_decode:.2} | {candle_decode:.2} | {:.2} |",
            candle_prefill / ours_prefill,
            candle_decode / ours_decode
        );
    }
}

/// Resident memory of spans of the default model, as shipped and requantised to Q8_0.
fn memory_table() {
    let requantised = requantised_path();
    if !requantised.is_file() {
        write_requantised(&model_path(), &requantised);
    }
    println!("Resident memory after loading (process total, and growth from loading the span)");
    println!("| weights | span | resident MiB | growth MiB |");
    println!("|---|---|---|---|");
    let mib = |bytes: f64| bytes / (1024.0 * 1024.0);
    for quantization in ["as-shipped", "q8_0"] {
        for which in ["whole", "layers-10-20", "reference-memory"] {
            let (resident, growth) = run_worker(1, which, quantization);
            let label = match which {
                "reference-memory" => "whole, candle-transformers",
                other => other,
            };
            println!(
                "| {quantization} | {label} | {:.1} | {:.1} |",
                mib(resident),
                mib(growth)
            );
        }
    }
}

/// The tables, in the order they print; naming some after `--` prints only those.
const TABLES: [&str; 5] = ["kernels", "layer", "memory", "formats", "long"];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(WORKER) {
        worker(&args);
        return;
    }
    // `cargo test --benches` runs this with `--bench` absent; keep that quick.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let asked: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|arg| !arg.starts_with('-'))
        .collect();
    if let Some(unknown) = asked.iter().find(|name| !TABLES.contains(name)) {
        eprintln!(
            "unknown table {unknown:?}; the tables are {}",
            TABLES.join(", ")
        );
        std::process::exit(2);
    }
    let wanted = |table: &str| asked.is_empty() || asked.contains(&table);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut first = true;
    let mut gap = || {
        if !std::mem::take(&mut first) {
            println!();
        }
    };
    if wanted("kernels") {
        gap();
        kernels_table(cores);
    }
    if wanted("layer") {
        gap();
        layer_table(cores);
    }
    if wanted("memory") {
        gap();
        memory_table();
    }
    if wanted("formats") {
        gap();
        files_table();
    }
    if wanted("long") {
        gap();
        long_table();
    }
}
