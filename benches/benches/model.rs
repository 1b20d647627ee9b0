//! Tokens per second of the default model (SmolLM2-135M-Instruct) in one process: prefill and
//! decode, 1 and 2 threads, weights as shipped (Q4_1) and requantised to Q8_0 on load. Our
//! spans run on `meshnet-kernels` (the default), and again on candle's own quantized matmul
//! (`MESHNET_KERNEL=candle`), beside candle-transformers' `quantized_llama::ModelWeights` and,
//! when `benches/anchors/llamacpp.sh` has built it, llama.cpp's `llama-bench` on the same file,
//! all in the same run. Then one synthetic Llama-7B-shaped layer (hidden 4096, intermediate
//! 11008, random weights written as GGUF by this bench) in Q4_1 and Q8_0: a 128-token prefill
//! chunk and a decode step through our span, with our kernels and with candle's matmul. Last,
//! the resident memory of a peer holding layers 10..20 against the whole model.
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
use meshnet_kernels::KERNEL_VARIABLE;
use meshnet_model::{
    BoundaryPolicy, GgufModel, LayerRoute, LlamaSpan, ModelTokenizer, SessionId, SpanSpec, Stage,
};
use meshnet_types::{LayerSpan, Quantization};

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

/// Resident set size of this process in bytes.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// Resident memory after loading a span, and the growth over the process before loading.
fn measure_memory(which: &str, quantization: Option<Quantization>) -> (u64, u64) {
    let model = GgufModel::open(model_path()).unwrap();
    if which == "reference-memory" {
        let path = match quantization {
            Some(Quantization::Q8_0) => requantised_path(),
            _ => model_path(),
        };
        let before = resident_bytes();
        let mut file = std::fs::File::open(path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let weights = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        let after = resident_bytes();
        drop(weights);
        return (after, after.saturating_sub(before));
    }
    let before = resident_bytes();
    let spec = SpanSpec {
        quantization,
        ..match which {
            "whole" => SpanSpec::whole(model.description()),
            _ => SpanSpec::layers(LayerSpan::new(10, 20)),
        }
    };
    let span = LlamaSpan::load(&model, &spec).unwrap();
    let after = resident_bytes();
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

/// Prefill and decode tokens/s of llama.cpp's `llama-bench` on `path` with `threads`, when
/// `benches/anchors/llamacpp.sh` has built it.
fn measure_llamacpp(path: &Path, threads: usize) -> Option<(f64, f64)> {
    let anchors = std::env::var_os("MESHNET_ANCHORS").map_or_else(
        || meshnet_model::models_dir().join("anchors"),
        PathBuf::from,
    );
    let binary = anchors.join("llama.cpp/build/bin/llama-bench");
    if !binary.is_file() {
        return None;
    }
    let output = Command::new(&binary)
        .arg("-m")
        .arg(path)
        .args(["-t", &threads.to_string()])
        .args([
            "-p",
            &PREFILL_TOKENS.to_string(),
            "-n",
            &DECODE_TOKENS.to_string(),
        ])
        .args(["-r", "3", "-o", "json"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let results: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let rate = |prompt: usize, generated: usize| {
        results
            .as_array()
            .unwrap()
            .iter()
            .find(|run| run["n_prompt"] == prompt && run["n_gen"] == generated)
            .and_then(|run| run["avg_ts"].as_f64())
            .unwrap()
    };
    Some((rate(PREFILL_TOKENS, 0), rate(0, DECODE_TOKENS)))
}

fn worker(args: &[String]) {
    if args[1] == "layer" {
        let (prefill, decode) = measure_layer(Path::new(&args[2]));
        println!("{prefill} {decode}");
        return;
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
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .arg(WORKER)
        .args(args)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", threads.to_string())
        .env_remove(KERNEL_VARIABLE);
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
    let path = model_path();
    let requantised = requantised_path();
    if !requantised.is_file() {
        write_requantised(&path, &requantised);
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
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
            let (anchor_prefill, anchor_decode, prefill_ratio, decode_ratio) = match anchor {
                Some((prefill, decode)) => (
                    format!("{prefill:.1}"),
                    format!("{decode:.1}"),
                    format!("{:.2}", ours_prefill / prefill),
                    format!("{:.2}", ours_decode / decode),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            println!(
                "| {label} | {threads} | {ours_prefill:.1} | {candle_prefill:.1} | {ref_prefill:.1} | {anchor_prefill} | {prefill_ratio} | {ours_decode:.1} | {candle_decode:.1} | {ref_decode:.1} | {anchor_decode} | {decode_ratio} |"
            );
        }
    }

    println!();
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

    println!();
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
