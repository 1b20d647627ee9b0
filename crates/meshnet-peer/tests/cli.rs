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
    let text = TextSide::of(&model, None).unwrap();
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

    // A template file gives the model a chat format: one that renders the prompt as it is
    // continues it exactly as without --chat.
    let template = dir.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    .unwrap();
    let templated = run(&["--chat", "--chat-template", template.to_str().unwrap()]);
    assert_eq!(templated, whole);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_chat_template_file_is_named_with_its_problem() {
    let dir = std::env::temp_dir().join(format!("meshnet-cli-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{% for %}").unwrap();
    let missing = dir.join("missing.jinja");
    let data = dir.join("data");
    for (file, problem) in [(&broken, "syntax error"), (&missing, "cannot read it")] {
        let generate = peer()
            .args(["generate", "--chat", "--prompt", "hi", "--chat-template"])
            .arg(file)
            .output()
            .unwrap();
        let run = peer()
            .args(["--http", "127.0.0.1:0", "--p2p", "/ip4/127.0.0.1/tcp/0"])
            .arg("--data-dir")
            .arg(&data)
            .arg("--chat-template")
            .arg(file)
            .output()
            .unwrap();
        for output in [generate, run] {
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(!output.status.success(), "{stderr}");
            assert!(stderr.contains(&file.display().to_string()), "{stderr}");
            assert!(stderr.contains(problem), "{stderr}");
            assert!(!stderr.contains("panicked"), "{stderr}");
        }
    }
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
    let cases: [(&[&str], &str); 13] = [
        (
            &["--verify-sample", "1.5"],
            "sample rate must be between 0 and 1, not 1.5",
        ),
        (
            &["--verify-sample", "NaN"],
            "sample rate must be between 0 and 1, not NaN",
        ),
        (&["--ban-hours", "0"], "--ban-hours must be more than 0"),
        (&["--tracker", "--memory", "1KiB"], "holds no layer"),
        (&["--memory", "1MiB"], "holds no layer"),
        (&["--memory", "lots"], "not a byte count"),
        (&["--quantization", "q9"], "unknown quantization"),
        (&["--model", "/nonexistent/model.gguf"], "does not exist"),
        (&["--announce-interval", "0"], "at least 0.05"),
        (
            &["--max-sessions", "0"],
            "--max-sessions) must be at least 1",
        ),
        (&["--kv-tokens", "0"], "--kv-tokens) must be at least 1"),
        (
            &["--queue-timeout", "90000"],
            "--queue-timeout) must be at most a day",
        ),
        (
            &["--leave-timeout=-1"],
            "--leave-timeout must be a number of seconds, at least 0",
        ),
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

#[test]
fn fetch_model_refuses_an_unknown_name_listing_the_known_ones() {
    let output = peer()
        .args(["fetch-model", "llama-9000"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("unknown model llama-9000 (known: smollm2-135m, gemma3-270m)"),
        "{stderr}"
    );
}

/// A fresh models directory and an empty directory to use as `PATH` (so no python3 is found
/// and nothing can be downloaded).
fn fetch_dirs(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let base = std::env::temp_dir().join(format!("meshnet-{name}-{}", uuid::Uuid::new_v4()));
    let models = base.join("models");
    let empty_path = base.join("bin");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::create_dir_all(&empty_path).unwrap();
    (models, empty_path)
}

#[test]
fn fetch_model_keeps_a_present_file_with_the_pinned_hash() {
    let model = meshnet_model::default_model_path();
    assert!(model.is_file(), "the default model is missing");
    let (models, empty_path) = fetch_dirs("fetch-keep");
    let target = models.join(model.file_name().unwrap());
    std::os::unix::fs::symlink(&model, &target).unwrap();
    let output = peer()
        .arg("fetch-model")
        .env("MESHNET_MODELS", &models)
        .env("PATH", &empty_path)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr: {stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout.lines().last(), Some(target.to_str().unwrap()));
    std::fs::remove_dir_all(models.parent().unwrap()).unwrap();
}

#[test]
fn fetch_model_refuses_a_present_file_with_another_hash() {
    let model = meshnet_model::default_model_path();
    let (models, empty_path) = fetch_dirs("fetch-refuse");
    let target = models.join(model.file_name().unwrap());
    std::fs::write(&target, b"not a model").unwrap();
    // sha256 of "not a model".
    let wrong = "708811ccb1510c6d6c6e6379ef09be39bdbb0e7edcf44fefcca21c6228ee6d89";
    let output = peer()
        .arg("fetch-model")
        .env("MESHNET_MODELS", &models)
        .env("PATH", &empty_path)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The wrong file is not accepted: the binary tries to fetch the model again, which cannot
    // work without python3.
    assert!(!output.status.success(), "accepted a wrong file: {stderr}");
    assert!(stderr.contains("fetching it again"), "{stderr}");
    assert!(stderr.contains(wrong), "{stderr}");
    assert!(
        stderr.contains("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
        "{stderr}"
    );
    assert!(stderr.contains("python3"), "{stderr}");
    std::fs::remove_dir_all(models.parent().unwrap()).unwrap();
}

/// A one-shot HTTP server on 127.0.0.1 answering every request with `status` and `body`;
/// returns its base URL.
fn answering(status: &'static str, body: &'static str) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let answer = format!(
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes());
        }
    });
    url
}

#[test]
fn health_exits_zero_only_on_a_200_and_names_what_failed() {
    let healthy = answering("200 OK", "the mesh covers the model");
    let output = peer()
        .args(["health", &format!("{healthy}/health")])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "the mesh covers the model"
    );

    for timeout in ["1e30", "0", "NaN"] {
        let output = peer()
            .args(["health", &format!("{healthy}/health"), "--timeout", timeout])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "--timeout {timeout}: {stderr}"
        );
        assert!(stderr.contains("--timeout must be"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }

    let unhealthy = answering("503 Service Unavailable", "no span assigned yet");
    let output = peer()
        .args(["health", &format!("{unhealthy}/health")])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("answered 503"));

    // A port that refuses connections; a URL that is none; a scheme that is not HTTP.
    let (_held, closed) = common::refusing_endpoint();
    let closed = format!("{closed}/health");
    for (url, named) in [
        (closed.as_str(), "GET http://127.0.0.1"),
        ("not a url", "is not a URL"),
        ("ftp://127.0.0.1/health", "not an http:// URL"),
    ] {
        let output = peer().args(["health", url]).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{url}: {stderr}");
        assert!(stderr.contains(named), "{url}: {stderr}");
        assert!(!stderr.contains("panicked"), "{url}: {stderr}");
    }
}

#[test]
fn status_and_chat_name_a_bad_member_url_or_an_unreachable_member() {
    let (_held, closed) = common::refusing_endpoint();
    let refusing = answering(
        "503 Service Unavailable",
        r#"{"error":{"message":"the mesh does not cover the model yet"}}"#,
    );
    let cases: [(&[&str], &str); 7] = [
        (
            &["status", "--url", "ftp://127.0.0.1"],
            "not an http:// URL",
        ),
        (&["status", "--url", "http://"], "is not a URL"),
        (&["status", "--url", &closed], "cannot reach a member"),
        (&["chat", "--url", &closed], "cannot reach a member"),
        (
            &["chat", "--url", &refusing],
            "the mesh does not cover the model yet",
        ),
        (&["chat", "--temperature", "NaN"], "--temperature must be"),
        (&["chat", "--max-tokens", "0"], "--max-tokens must be"),
    ];
    for (args, named) in cases {
        let output = peer().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// Runs `meshnet-peer tokenize` on the default model with `input` on standard input.
fn tokenize(flags: &[&str], input: &str) -> std::process::Output {
    use std::io::Write;
    let model = meshnet_model::default_model_path();
    let mut child = peer()
        .arg("tokenize")
        .arg("--model")
        .arg(&model)
        .args(flags)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn tokenize_prints_one_array_per_json_line_and_names_a_bad_line() {
    // SmolLM2: "<|im_start|>" is the control token 1; BOS is 1 too, but not added by default.
    let input = "\"<|im_start|>Hi\"\n\"12\"\n";
    let plain = tokenize(&[], input);
    assert!(plain.status.success(), "{plain:?}");
    let plain = String::from_utf8(plain.stdout).unwrap();
    let lines: Vec<Vec<u32>> = plain
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{plain}");
    assert!(!lines[0].contains(&1), "{plain}");
    assert_eq!(lines[1].len(), 2, "digits one by one: {plain}");

    let parsed = tokenize(&["--parse-special"], input);
    let parsed = String::from_utf8(parsed.stdout).unwrap();
    let first: Vec<u32> = serde_json::from_str(parsed.lines().next().unwrap()).unwrap();
    assert_eq!(first[0], 1, "{parsed}");
    assert_eq!(first.len(), 2, "{parsed}");

    let bad = tokenize(&[], "\"ok\"\nnot json\n");
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("line 2 is not a JSON string"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn fetch_model_keeps_a_present_gemma_file_only_with_its_notices() {
    let gemma = meshnet_model::known_model("gemma3-270m").unwrap();
    let model = gemma.path();
    let notices = gemma.notices_dir().unwrap();
    assert!(
        model.is_file() && notices.is_dir(),
        "the Gemma model is missing at {}: run `bash scripts/fetch-model.sh gemma3-270m`",
        model.display()
    );
    let (models, empty_path) = fetch_dirs("fetch-gemma");
    let target = models.join(gemma.file);
    std::os::unix::fs::symlink(&model, &target).unwrap();
    let fetch = || {
        peer()
            .args(["fetch-model", "gemma3-270m"])
            .env("MESHNET_MODELS", &models)
            .env("PATH", &empty_path)
            .output()
            .expect("runs")
    };
    // Without its notices the file is fetched again (which cannot work without python3).
    let output = fetch();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "accepted a model without notices: {stderr}"
    );
    assert!(stderr.contains("python3"), "{stderr}");

    let notices_copy = models.join(notices.file_name().unwrap());
    std::os::unix::fs::symlink(&notices, &notices_copy).unwrap();
    let output = fetch();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stderr: {stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout.lines().last(), Some(target.to_str().unwrap()));
    std::fs::remove_dir_all(models.parent().unwrap()).unwrap();
}

/// `model-info` on the Gemma 3 file names its family, tokenizer, template source, format and
/// tensor types, and sizes each of its layers from the file.
#[test]
fn model_info_describes_a_gemma_file() {
    let gemma = meshnet_model::known_model("gemma3-270m").unwrap();
    let model = gemma.path();
    assert!(
        model.is_file(),
        "the Gemma model is missing at {}: run `bash scripts/fetch-model.sh gemma3-270m`",
        model.display()
    );
    let output = peer()
        .arg("model-info")
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let info: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(info["architecture"], "gemma3");
    assert_eq!(info["tokenizer"], "llama/default");
    assert_eq!(info["chat_template"], "built-in gemma format");
    assert_eq!(info["shipped_format"], "q4_k_m");
    assert_eq!(info["tensor_types"]["Q4_K"], 27);
    assert_eq!(info["tensor_types"]["Q6_K"], 9);
    let layers = info["bytes_per_layer_as_shipped"].as_array().unwrap();
    assert_eq!(layers.len(), 18);
    assert_eq!(
        info["layer_bytes"]["q4_k_m"],
        layers.iter().map(|b| b.as_u64().unwrap()).max().unwrap()
    );
}

#[test]
fn swarm_key_new_writes_a_private_key_file_and_never_overwrites_one() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("meshnet-swarm-key-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("swarm.key");
    let out = path.to_str().unwrap();
    let output = peer()
        .args(["swarm-key", "new", "--out", out])
        .output()
        .expect("runs");
    assert!(output.status.success(), "{output:?}");
    let written = std::fs::read(&path).unwrap();
    let key = meshnet_p2p::SwarmKey::parse(&written).unwrap();
    let text = String::from_utf8(written).unwrap();
    assert!(
        text.starts_with("/key/swarm/psk/1.0.0/\n/base16/\n"),
        "{text}"
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(&meshnet_p2p::swarm_key_fingerprint(&key)),
        "{stdout}"
    );

    let again = peer()
        .args(["swarm-key", "new", "--out", out])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{out} already exists; a swarm key file is never overwritten"
        )),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_bad_swarm_key_file_or_a_private_quic_address_is_named_and_no_panic() {
    let dir = std::env::temp_dir().join(format!("meshnet-bad-key-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.key");
    std::fs::write(&bad, "/key/swarm/psk/1.0.0/\n/base16/\nabcdx\n").unwrap();
    let good = dir.join("good.key");
    let made = peer()
        .args(["swarm-key", "new", "--out", good.to_str().unwrap()])
        .output()
        .expect("runs");
    assert!(made.status.success(), "{made:?}");
    let data = dir.join("data");
    let common = [
        "--http",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
    ];
    let bad_message = format!(
        "swarm key file {} is not usable: its key line has a character that is not a \
         hexadecimal digit at position 4",
        bad.display()
    );
    let missing = dir.join("absent.key");
    let missing_message = format!("swarm key file {}: No such file", missing.display());
    let cases: [(Vec<&str>, &str); 3] = [
        (
            vec![
                "--swarm-key",
                bad.to_str().unwrap(),
                "--p2p",
                "/ip4/127.0.0.1/tcp/0",
            ],
            &bad_message,
        ),
        (
            vec!["--swarm-key", missing.to_str().unwrap()],
            &missing_message,
        ),
        (
            vec![
                "--swarm-key",
                good.to_str().unwrap(),
                "--p2p",
                "/ip4/127.0.0.1/udp/0/quic-v1",
            ],
            "QUIC cannot carry a swarm key",
        ),
    ];
    for (args, expected) in cases {
        let output = peer().args(common).args(&args).output().expect("runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_malformed_api_keys_file_stops_the_member_naming_the_file_line_and_problem() {
    let dir = std::env::temp_dir().join(format!("meshnet-cli-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys.txt");
    std::fs::write(&keys, "# keys\nsk-one id=one\nsk-two rpm=0\n").unwrap();
    let data = dir.join("data");
    let run = |keys: &std::path::Path| {
        peer()
            .args([
                "--http",
                "127.0.0.1:0",
                "--p2p",
                "/ip4/127.0.0.1/tcp/0",
                "--data-dir",
            ])
            .arg(&data)
            .arg("--api-keys")
            .arg(keys)
            .output()
            .expect("runs")
    };
    let output = run(&keys);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert_eq!(
        stderr.trim(),
        format!(
            "error: --api-keys {}: line 3: rpm=0: a limit is a whole number from 1 to {}",
            keys.display(),
            u64::MAX
        )
    );
    let output = run(&dir.join("absent.txt"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains(&format!(
            "reading --api-keys {}",
            dir.join("absent.txt").display()
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn api_key_hash_prints_the_form_a_key_file_may_hold() {
    use std::io::Write;
    let hash = |input: &str| {
        let mut child = peer()
            .args(["api-key", "hash"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let output = hash("test\n");
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n"
    );
    let output = hash("\n");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("no key on standard input"));
}
