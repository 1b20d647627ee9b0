//! The `meshnet-peer` binary as a user runs it.

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
