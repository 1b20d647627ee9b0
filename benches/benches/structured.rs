//! What structured output costs on the default model's tokenizer (SmolLM2, 49,152 tokens):
//! building the token environment (once per model: time and resident memory), compiling a
//! schema (once per request), and the mask the generation loop asks for before each token plus
//! the commit after it (per token), over the tokens of real answers. Prints tables. Run with
//! `cargo bench -p meshnet-benches --bench structured` (or with `--profile dev`, which builds
//! the grammar engine optimised too and reuses the test build).

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use meshnet_grammar::{JsonConstraint, JsonFormat, TokenEnvironment};
use meshnet_model::{ModelTokenizer, TokenConstraint, TokenMask};
use serde_json::{Value, json};

/// Runs of each timing; the tables show the median.
const RUNS: usize = 7;

/// Passes over each answer's tokens for the per-token cost.
const PASSES: usize = 30;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// This process's resident memory in bytes (`VmRSS` of `/proc/self/status`).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Schemas and an answer valid under each, as a model would write it.
fn answers() -> Vec<(&'static str, JsonFormat, &'static str)> {
    let name = json!({"type": "string", "maxLength": 16});
    let person = json!({
        "type": "object",
        "properties": {"name": name, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    let company = json!({
        "type": "object",
        "properties": {
            "company": {
                "type": "object",
                "properties": {"name": name, "ceo": person},
                "required": ["name", "ceo"],
                "additionalProperties": false,
            },
            "employees": {"type": "integer", "minimum": 1, "maximum": 100000},
            "tags": {"type": "array", "items": {"enum": ["tech", "retail", "energy"]}, "maxItems": 3},
        },
        "required": ["company", "employees", "tags"],
        "additionalProperties": false,
    });
    vec![
        (
            "person",
            JsonFormat::Schema(person),
            r#"{"name": "John Smith", "age": 45}"#,
        ),
        (
            "company",
            JsonFormat::Schema(company),
            r#"{"company": {"name": "Acme Rockets", "ceo": {"name": "Ada Lovelace", "age": 36}}, "employees": 1200, "tags": ["tech", "energy"]}"#,
        ),
        (
            "json_object",
            JsonFormat::AnyObject,
            r#"{"animal": "cat", "legs": 4, "sounds": ["meow", "purr"], "facts": {"sleeps": "16 hours a day", "domestic": true}}"#,
        ),
    ]
}

/// The tokens a model could take to write `text` under `constraint`: at each step the allowed
/// token that covers the most of the text still to write.
fn walk(
    tokenizer: &ModelTokenizer,
    mut constraint: JsonConstraint,
    text: &str,
    vocab: usize,
) -> Vec<u32> {
    let mut rest = text.as_bytes();
    let mut tokens = Vec::new();
    let mut mask = TokenMask::default();
    while !rest.is_empty() {
        constraint.allowed_tokens(&mut mask).unwrap();
        let (token, length) = (0..vocab as u32)
            .filter(|&id| mask.allows(id))
            .filter_map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap();
                (!bytes.is_empty() && rest.starts_with(&bytes)).then_some((id, bytes.len()))
            })
            .max_by_key(|&(_, length)| length)
            .unwrap_or_else(|| {
                panic!(
                    "no allowed token writes {:?}",
                    String::from_utf8_lossy(rest)
                )
            });
        constraint.commit(token).unwrap();
        tokens.push(token);
        rest = &rest[length..];
    }
    assert!(
        constraint.is_complete(),
        "{text} did not complete its format"
    );
    tokens
}

/// The times of one pass over an answer's tokens.
struct Pass {
    /// In all the masks.
    masking: Duration,
    /// In all the commits.
    committing: Duration,
    /// In the slowest mask.
    worst_mask: Duration,
}

/// One pass over `tokens`: the mask before each and the commit after it.
fn pass(compiled: &JsonConstraint, tokens: &[u32]) -> Pass {
    let mut constraint = compiled.clone();
    let mut mask = TokenMask::default();
    let mut timed = Pass {
        masking: Duration::ZERO,
        committing: Duration::ZERO,
        worst_mask: Duration::ZERO,
    };
    for &token in tokens {
        let started = Instant::now();
        constraint.allowed_tokens(&mut mask).unwrap();
        let masked = Instant::now();
        constraint.commit(token).unwrap();
        timed.masking += masked - started;
        timed.worst_mask = timed.worst_mask.max(masked - started);
        timed.committing += masked.elapsed();
    }
    timed
}

fn main() {
    let path = meshnet_model::default_model_path();
    assert!(
        path.is_file(),
        "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
        path.display()
    );
    let tokenizer = ModelTokenizer::from_gguf_file(&path).unwrap();
    let mut ends = tokenizer.end_of_generation().to_vec();
    ends.extend(tokenizer.end_of_turn());
    let vocab = tokenizer.vocab_size();

    let before = resident_bytes();
    let started = Instant::now();
    let environment = TokenEnvironment::new(&tokenizer, &ends).unwrap();
    let first = started.elapsed();
    let grown = resident_bytes().saturating_sub(before);
    let builds: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let started = Instant::now();
            drop(TokenEnvironment::new(&tokenizer, &ends).unwrap());
            started.elapsed()
        })
        .collect();
    println!("token environment of {} ({vocab} tokens)", path.display());
    println!(
        "  build: first {:.0} ms, median of {RUNS} more {:.0} ms; resident memory +{:.1} MiB; \
         canonical forcing: {}",
        first.as_secs_f64() * 1e3,
        median(builds).as_secs_f64() * 1e3,
        grown as f64 / (1 << 20) as f64,
        environment.forces_canonical_tokens()
    );

    println!();
    println!("per request: compile, then one pass over the answer's tokens as a request makes");
    println!("it (cold: the compiled grammar's lexer caches start empty), median of {RUNS};");
    println!("warm: {PASSES} more passes over one compiled grammar, median");
    println!(
        "{:12} {:>6} {:>10} {:>15} {:>15} {:>15} {:>15}",
        "format",
        "tokens",
        "compile ms",
        "cold mask µs/t",
        "cold worst µs",
        "warm mask µs/t",
        "commit µs/t"
    );
    for (name, format, text) in answers() {
        let tokens = walk(
            &tokenizer,
            environment.compile(&format).unwrap(),
            text,
            vocab,
        );
        let value: Value = serde_json::from_str(text).unwrap();
        assert!(value.is_object());
        let per_token = |d: Duration| d.as_secs_f64() * 1e6 / tokens.len() as f64;
        let mut compiles = Vec::new();
        let mut cold = Vec::new();
        let mut worst = Vec::new();
        for _ in 0..RUNS {
            let started = Instant::now();
            let compiled = environment.compile(&format).unwrap();
            compiles.push(started.elapsed());
            let timed = pass(&compiled, &tokens);
            cold.push(timed.masking);
            worst.push(timed.worst_mask);
        }
        let compiled = environment.compile(&format).unwrap();
        let warm: Vec<Pass> = (0..PASSES).map(|_| pass(&compiled, &tokens)).collect();
        println!(
            "{name:12} {:>6} {:>10.2} {:>15.1} {:>15.0} {:>15.1} {:>15.1}",
            tokens.len(),
            median(compiles).as_secs_f64() * 1e3,
            per_token(median(cold)),
            median(worst).as_secs_f64() * 1e6,
            per_token(median(warm.iter().map(|p| p.masking).collect())),
            per_token(median(warm.iter().map(|p| p.committing).collect())),
        );
    }
}
