//! The `meshnet-peer` binary as a user runs it.

#![allow(clippy::unwrap_used)]

mod common;

use common::gpt2_dir_with_tokenizer;

use std::process::Command;

fn peer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_meshnet-peer"))
}

#[test]
fn answers_the_capital_of_france() {
    let model = meshnet_model::default_model_path();
    assert!(
        model.is_file(),
        "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
        model.display()
    );
    let output = peer()
        .args([
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--quantization",
            "q8_0",
        ])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr: {stderr}");
    println!("answer: {stdout}");
    assert!(stdout.contains("Paris"), "answer: {stdout:?}");
}

#[test]
fn bad_input_gives_a_clear_message_and_no_panic() {
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "generate",
                "--model",
                "/nonexistent/model.gguf",
                "--prompt",
                "x",
            ],
            "does not exist",
        ),
        (
            &["generate", "--prompt", "x", "--boundaries", "20,10"],
            "boundary",
        ),
        (
            &["generate", "--prompt", "x", "--boundaries", "ten"],
            "invalid value",
        ),
        (
            &["generate", "--prompt", "x", "--quantization", "q4_k"],
            "unknown quantization",
        ),
    ];
    for (args, expected) in cases {
        let output = peer().args(args).output().expect("runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// Greedy text of the model at `dir` split at `boundaries` (bf16 casts between spans, f32 when
/// whole), generated in this process with the library's own route.
fn in_process(
    dir: &std::path::Path,
    boundaries: &[usize],
    prompt: &str,
    max_tokens: usize,
) -> String {
    use meshnet_model::{
        BoundaryPolicy, GenerationRequest, Model, SplitModel, StopConditions, TextSide,
    };

    let model = Model::open(dir).unwrap();
    let text = TextSide::of(&model).unwrap();
    let specs = meshnet_model::split_specs(
        model.description().layers,
        boundaries,
        None,
        meshnet_model::DEFAULT_KV_BUDGET_BYTES,
    )
    .unwrap();
    let spans = specs
        .iter()
        .map(|spec| model.load_span(spec, &mut |_, _| {}).unwrap())
        .collect();
    let split = SplitModel::from_spans(spans);
    let policy = if boundaries.is_empty() {
        BoundaryPolicy::F32
    } else {
        BoundaryPolicy::Bf16
    };
    let route = split.route(policy).unwrap();
    let request = GenerationRequest {
        stop: StopConditions {
            tokens: text.stop_tokens.clone(),
            strings: Vec::new(),
        },
        ..GenerationRequest::greedy(text.tokenizer.encode(prompt).unwrap(), max_tokens)
    };
    meshnet_model::generate(&route, &request, Some(&text.tokenizer))
        .unwrap()
        .text
        .unwrap()
}

#[test]
fn generates_from_a_gpt2_directory_whole_and_split() {
    let dir = gpt2_dir_with_tokenizer("gpt2");
    let run = |extra: &[&str]| {
        let output = peer()
            .args(["generate", "--model"])
            .arg(&dir)
            .args([
                "--prompt",
                "hello mesh",
                "--max-tokens",
                "12",
                "--temperature",
                "0",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    };
    let whole = run(&[]);
    assert!(!whole.trim().is_empty(), "no continuation");
    assert_eq!(
        whole,
        format!("{}\n", in_process(&dir, &[], "hello mesh", 12))
    );
    // A random model's continuation is noise, but it is the same noise as the library's own
    // route split at the same boundary with the same bf16 cast.
    let split = run(&["--boundaries", "2"]);
    assert!(
        !split.trim().is_empty(),
        "no continuation from the split model"
    );
    assert_eq!(
        split,
        format!("{}\n", in_process(&dir, &[2], "hello mesh", 12))
    );
    let bad = peer()
        .args(["generate", "--prompt", "hi", "--boundaries", "4", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("boundary 4"));

    let chat = peer()
        .args(["generate", "--chat", "--prompt", "hi", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!chat.status.success());
    assert!(String::from_utf8_lossy(&chat.stderr).contains("no chat template"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_gpt2_directory_without_a_tokenizer_is_named() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../meshnet-model/tests/fixtures/gpt2-tiny");
    let output = peer()
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&fixture)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("has no tokenizer.json"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_run_settings_give_a_clear_message_and_no_panic() {
    let data = std::env::temp_dir().join(format!("meshnet-cli-run-{}", std::process::id()));
    let data = data.to_str().unwrap();
    let common = [
        "--http",
        "127.0.0.1:0",
        "--p2p",
        "/ip4/127.0.0.1/tcp/0",
        "--data-dir",
        data,
    ];
    let cases: [(&[&str], &str); 6] = [
        (&["--tracker", "--memory", "1KiB"], "holds no layer"),
        (&["--memory", "1MiB"], "holds no layer"),
        (&["--memory", "lots"], "not a byte count"),
        (&["--quantization", "q9"], "unknown quantization"),
        (&["--model", "/nonexistent/model.gguf"], "does not exist"),
        (&["--announce-interval", "0"], "at least 0.05"),
    ];
    for (args, expected) in cases {
        let output = peer().args(common).args(args).output().expect("runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(data);
}
