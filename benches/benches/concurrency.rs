//! Aggregate tokens/s of 1, 2, 4 and 8 concurrent greedy chats in one process, each the ratio
//! to one chat, beside llama.cpp's `llama-batched-bench` on the same file and threads in the
//! same run.
//!
//! Ours: the whole model as one span behind the peer's own compute thread
//! (`meshnet_peer::span_host::LoadedSpan`, which batches the sessions' chunks and LM-head
//! requests as a tracker does, with the default `--max-batch-tokens`), and one thread per chat
//! running the generation loop (`meshnet_model::generate`: 128-token prompt in the wire's
//! chunks, then 64 greedy tokens). What the HTTP front end adds on top is measured by
//! `mesh_latency`'s burst. The anchor: `llama-batched-bench -npp 128 -ntg 64 -npl 1,2,4,8`
//! (each sequence its own 128-token prompt, prefilled together, then decoded in lockstep).
//!
//! Both sides count generated tokens over wall time, prompts included: N × 64 / (time for N
//! chats); llama-batched-bench's `T s` is that time. Also checks that every chat's tokens equal
//! those of the same prompt run alone (batching must not change them).
//!
//! `cargo bench -p meshnet-benches --bench concurrency`; another file with
//! `MESHNET_BENCH_MODEL=path`; `MESHNET_BENCH_REPS` (default 3) runs of each count, median.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use meshnet_benches::{median, rate, ratio};
use meshnet_model::{
    BoundaryPolicy, GenerationRequest, LayerRoute, Model, ModelTokenizer, SpanSpec, generate,
};
use meshnet_peer::batcher::DEFAULT_MAX_BATCH_TOKENS;
use meshnet_peer::span_host::{LoadedSpan, SpanTarget};
use meshnet_types::Quantization;

const PROMPT_TOKENS: usize = 128;
const GENERATED_TOKENS: usize = 64;
const CHATS: [usize; 4] = [1, 2, 4, 8];
const WORKER: &str = "--concurrency-bench-worker";

fn model_path() -> PathBuf {
    std::env::var_os("MESHNET_BENCH_MODEL")
        .filter(|path| !path.is_empty())
        .map_or_else(meshnet_model::default_model_path, PathBuf::from)
}

fn reps() -> usize {
    std::env::var("MESHNET_BENCH_REPS")
        .ok()
        .and_then(|reps| reps.parse().ok())
        .filter(|&reps| reps > 0)
        .unwrap_or(3)
}

/// The first `PROMPT_TOKENS` tokens of a repeated text in the model's tokenizer.
fn prompt(model: &Model) -> Vec<u32> {
    let Model::Llama(gguf) = model else {
        panic!("the concurrency bench takes GGUF models");
    };
    let tokenizer = ModelTokenizer::from_gguf(gguf).unwrap();
    let text = "Several people ask the same small model different questions at once. ".repeat(40);
    let mut ids = tokenizer.encode(&text).unwrap();
    assert!(ids.len() >= PROMPT_TOKENS, "the text is too short");
    ids.truncate(PROMPT_TOKENS);
    ids
}

/// In the worker: for each count of chats, the median wall time of `reps` runs of that many
/// chats at once, and whether every chat's tokens equalled those of the prompt alone (1 or 0).
fn measure(path: &Path, reps: usize) -> Vec<f64> {
    let model = Model::open(path).unwrap();
    let description = model.description().clone();
    let span = model
        .load_span(&SpanSpec::whole(&description), &mut |_, _| {})
        .unwrap();
    let target = SpanTarget {
        layers: span.layers(),
        quantization: description
            .shipped_quantization
            .unwrap_or(Quantization::Q8_0),
        entry: true,
    };
    let loaded = LoadedSpan::new(target, span, DEFAULT_MAX_BATCH_TOKENS).unwrap();
    let prompt = prompt(&model);
    let chat = |max_tokens: usize| {
        let route = LayerRoute {
            embedder: &loaded,
            stages: vec![&loaded],
            head: &loaded,
            boundary: BoundaryPolicy::F32,
        };
        generate(
            &route,
            &GenerationRequest::greedy(prompt.clone(), max_tokens),
            None,
        )
        .unwrap()
        .tokens
    };
    chat(4);
    let alone = chat(GENERATED_TOKENS);
    assert_eq!(alone.len(), GENERATED_TOKENS);

    let mut numbers = Vec::new();
    for chats in CHATS {
        let mut walls = Vec::with_capacity(reps);
        let mut equal = true;
        for _ in 0..reps {
            let start = Instant::now();
            let answers: Vec<Vec<u32>> = std::thread::scope(|scope| {
                let running: Vec<_> = (0..chats)
                    .map(|_| scope.spawn(|| chat(GENERATED_TOKENS)))
                    .collect();
                running
                    .into_iter()
                    .map(|handle| handle.join().unwrap())
                    .collect()
            });
            walls.push(start.elapsed().as_secs_f64());
            equal &= answers.iter().all(|answer| *answer == alone);
        }
        numbers.push(median(&walls));
        numbers.push(if equal { 1.0 } else { 0.0 });
    }
    numbers
}

/// llama-batched-bench's wall time per count of sequences (`T s`: prefill and decode), `None`
/// when `benches/anchors/llamacpp.sh` has not built it.
fn llamacpp(path: &Path, threads: usize) -> Option<Result<Vec<(usize, f64)>, String>> {
    let binary = meshnet_benches::llamacpp_binary("llama-batched-bench")?;
    let counts: Vec<String> = CHATS.iter().map(ToString::to_string).collect();
    let context = CHATS.iter().max().unwrap() * (PROMPT_TOKENS + GENERATED_TOKENS);
    let mut command = Command::new(binary);
    command
        .arg("-m")
        .arg(path)
        .args(["-c", &context.to_string()])
        .args(["-npp", &PROMPT_TOKENS.to_string()])
        .args(["-ntg", &GENERATED_TOKENS.to_string()])
        .args(["-npl", &counts.join(",")])
        .args(["-t", &threads.to_string(), "-tb", &threads.to_string()])
        .args(["--output-format", "jsonl"]);
    Some(
        meshnet_benches::run_watched(&mut command).and_then(|finished| {
            let rows: Vec<(usize, f64)> = finished
                .stdout
                .lines()
                .filter(|line| line.trim_start().starts_with('{'))
                .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
                .filter_map(|row| Some((row["pl"].as_u64()? as usize, row["t"].as_f64()?)))
                .collect();
            if rows.is_empty() {
                Err("llama-batched-bench printed no JSON lines".into())
            } else {
                Ok(rows)
            }
        }),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(WORKER) {
        let numbers = measure(Path::new(&args[1]), args[2].parse().unwrap());
        let words: Vec<String> = numbers.iter().map(f64::to_string).collect();
        println!("{}", words.join(" "));
        return;
    }
    // `cargo test --benches` runs this with `--bench` absent; keep that quick.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let path = model_path();
    assert!(
        path.is_file(),
        "{} is missing: run `bash scripts/fetch-model.sh`",
        path.display()
    );
    let reps = reps();
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    println!(
        "{name}: N greedy chats at once in one process, each a {PROMPT_TOKENS}-token prompt and \
         {GENERATED_TOKENS} generated tokens; tokens/s: N × {GENERATED_TOKENS} / wall time \
         (prompts included), ours the median of {reps} (MESHNET_BENCH_REPS); llama.cpp: \
         llama-batched-bench -npp {PROMPT_TOKENS} -ntg {GENERATED_TOKENS} -npl 1,2,4,8, one run; \
         × 1: against one chat; same: every chat's tokens equal the prompt's alone"
    );
    println!(
        "| threads | chats | ours tok/s | ours × 1 | llama.cpp tok/s | llama.cpp × 1 | ours / llama.cpp | same |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let path_arg = path.to_string_lossy().into_owned();
    let mut notes = Vec::new();
    for threads in [1, 2] {
        let ours = meshnet_benches::worker_command(WORKER, threads)
            .map_err(|error| error.to_string())
            .and_then(|mut command| {
                command.args([path_arg.as_str(), &reps.to_string()]);
                meshnet_benches::run_watched(&mut command)
            })
            .and_then(|finished| meshnet_benches::last_line_numbers(&finished.stdout));
        let ours = match ours {
            Ok(numbers) if numbers.len() == 2 * CHATS.len() => Some(numbers),
            Ok(numbers) => {
                notes.push(format!("ours at -t {threads} printed {numbers:?}"));
                None
            }
            Err(error) => {
                notes.push(format!("ours at -t {threads} failed: {error}"));
                None
            }
        };
        let anchor = match llamacpp(&path, threads) {
            Some(Ok(rows)) => rows,
            Some(Err(error)) => {
                notes.push(format!(
                    "llama-batched-bench at -t {threads} failed: {error}"
                ));
                Vec::new()
            }
            None => Vec::new(),
        };
        let ours_rate = |index: usize| {
            ours.as_ref()
                .map(|numbers| (CHATS[index] * GENERATED_TOKENS) as f64 / numbers[2 * index])
        };
        let anchor_rate = |chats: usize| {
            anchor
                .iter()
                .find(|(count, _)| *count == chats)
                .map(|(_, wall)| (chats * GENERATED_TOKENS) as f64 / wall)
        };
        for (index, chats) in CHATS.into_iter().enumerate() {
            let same = match &ours {
                Some(numbers) if numbers[2 * index + 1] == 1.0 => "yes",
                Some(_) => "NO",
                None => "-",
            };
            println!(
                "| {threads} | {chats} | {} | {} | {} | {} | {} | {same} |",
                rate(ours_rate(index)),
                ratio(ours_rate(index), ours_rate(0)),
                rate(anchor_rate(chats)),
                ratio(anchor_rate(chats), anchor_rate(1)),
                ratio(ours_rate(index), anchor_rate(chats)),
            );
        }
    }
    if meshnet_benches::llamacpp_binary("llama-batched-bench").is_none() {
        notes.push(
            "llama-batched-bench is not built; build it with \
             `bash benches/anchors/llamacpp.sh llama-batched-bench`"
                .into(),
        );
    }
    for note in notes {
        println!("- {note}");
    }
}
