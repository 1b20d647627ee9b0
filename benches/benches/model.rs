//! Tokens per second of the default model (SmolLM2-135M-Instruct) in one process: prefill and
//! decode, 1 and 2 threads, weights as shipped (Q4_1) and requantised to Q8_0 on load, our
//! spans beside candle-transformers' `quantized_llama::ModelWeights` in the same run; and the
//! resident memory of a peer holding layers 10..20 against the whole model.
//!
//! candle reads its thread count once per process, so every measurement runs in a child
//! process of this binary with `RAYON_NUM_THREADS` set. Prints a table. Run with
//! `cargo bench -p meshnet-benches --bench model`.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use meshnet_model::{
    BoundaryPolicy, GgufModel, LlamaSpan, ModelTokenizer, Route, SessionId, SpanSpec,
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
    let tensor_refs: Vec<(&str, &QTensor)> =
        tensors.iter().map(|(name, t)| (name.as_str(), t)).collect();
    // Written beside the target and renamed, so an interrupted run never leaves a partial file
    // that a later run would reuse.
    let partial = target.with_extension("partial");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&partial).unwrap());
    gguf_file::write(&mut out, &metadata, &tensor_refs).unwrap();
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
    let route = Route {
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

fn worker(args: &[String]) {
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

fn run_worker(threads: usize, kind: &str, quantization: &str) -> (f64, f64) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([WORKER, kind, quantization])
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "worker {kind} {quantization} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    let mut numbers = line.split_whitespace().map(|n| n.parse::<f64>().unwrap());
    (numbers.next().unwrap(), numbers.next().unwrap())
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

    println!(
        "SmolLM2-135M-Instruct, prefill {PREFILL_TOKENS} tokens in one chunk, decode \
         {DECODE_TOKENS} tokens (tokens/s; ratio = ours / candle-transformers)"
    );
    println!(
        "| weights | threads | prefill ours | prefill candle-transformers | ratio | decode ours | decode candle-transformers | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for quantization in ["as-shipped", "q8_0"] {
        for threads in [1, 2] {
            let (ours_prefill, ours_decode) = run_worker(threads, "ours", quantization);
            let (ref_prefill, ref_decode) = run_worker(threads, "reference", quantization);
            let label = if quantization == "q8_0" {
                "Q8_0 (requantised)"
            } else {
                "Q4_1 (as shipped)"
            };
            println!(
                "| {label} | {threads} | {ours_prefill:.1} | {ref_prefill:.1} | {:.2} | {ours_decode:.1} | {ref_decode:.1} | {:.2} |",
                ours_prefill / ref_prefill,
                ours_decode / ref_decode
            );
        }
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
