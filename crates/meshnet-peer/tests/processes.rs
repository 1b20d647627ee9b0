#![allow(clippy::unwrap_used)]
//! The binary as users run it: a tracker and two peers as separate processes on loopback
//! converge, answer chats exactly as `meshnet-peer generate --chat --boundaries` does, free
//! sessions on every hop when a client goes away, refuse a peer with another model, and
//! answer in the JSON a `response_format` asks for.

mod common;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_meshnet-peer");

/// A child process killed when dropped, with its log kept for failure messages.
struct Process {
    child: Child,
    log: PathBuf,
    /// The ready line the child prints on standard output once it is up.
    ready: std::sync::mpsc::Receiver<Value>,
    ready_line: std::cell::OnceCell<Value>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Process {
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Waits for the child's ready line: the addresses it bound (port 0 lets the system choose
    /// them, so parallel tests never race for a port).
    fn wait_ready(&self) -> &Value {
        self.ready_line
            .get_or_init(|| match self.ready.recv_timeout(common::DEADLINE) {
                Ok(line) => line,
                Err(error) => panic!(
                    "{} printed no ready line ({error}):\n{}",
                    self.log.display(),
                    self.log_tail()
                ),
            })
    }

    /// The port the child's HTTP server is bound to, from its ready line.
    fn http_port(&self) -> u16 {
        let ready = self.wait_ready();
        let bound: std::net::SocketAddr = ready["http_bound"].as_str().unwrap().parse().unwrap();
        bound.port()
    }
}

/// Listen addresses that let the system pick both ports.
const ANY_HTTP_PORT: &str = "127.0.0.1:0";
const ANY_P2P_PORT: &str = "/ip4/127.0.0.1/tcp/0";

fn spawn(name: &str, dir: &Path, args: &[String]) -> Process {
    let log = dir.join(format!("{name}.log"));
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "info,libp2p=warn")
        .stdout(Stdio::piped())
        .stderr(File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (sender, ready) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if let Ok(value) = serde_json::from_str::<Value>(&line)
                && value["event"] == "ready"
            {
                let _ = sender.send(value);
            }
        }
    });
    Process {
        child,
        log,
        ready,
        ready_line: std::cell::OnceCell::new(),
    }
}

/// The `--memory` that holds exactly `layers` layers of `model` with the default 2048 KV
/// tokens, as `meshnet-peer model-info --layers` prints it.
fn memory(model: &Path, layers: u64, tracker: bool) -> String {
    let mut command = Command::new(BIN);
    command
        .args(["model-info", "--model"])
        .arg(model)
        .args(["--layers", &layers.to_string()]);
    if tracker {
        command.arg("--tracker");
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let info: Value = serde_json::from_slice(&output.stdout).unwrap();
    info["memory_for_layers"].as_u64().unwrap().to_string()
}

fn peer_args(model: &Path, data: PathBuf, memory: String) -> Vec<String> {
    vec![
        "--model".into(),
        model.display().to_string(),
        "--http".into(),
        ANY_HTTP_PORT.into(),
        "--p2p".into(),
        ANY_P2P_PORT.into(),
        "--memory".into(),
        memory,
        "--data-dir".into(),
        data.display().to_string(),
        "--reachable".into(),
        "--announce-interval".into(),
        "0.3".into(),
    ]
}

/// A tracker and its peers as processes on loopback.
struct Mesh {
    dir: PathBuf,
    tracker_http: u16,
    /// The tracker's libp2p address, the one every other process bootstraps from.
    tracker_p2p: String,
    processes: Vec<Process>,
    http: reqwest::Client,
}

impl Mesh {
    /// A tracker and two peers of the default model, each able to hold 10 of the 30 layers.
    async fn start() -> Mesh {
        Mesh::start_with(&common::model_path(), &[10, 10, 10]).await
    }

    /// A tracker able to hold `layers[0]` layers of `model` and a peer for each further entry.
    async fn start_with(model: &Path, layers: &[u64]) -> Mesh {
        let dir = std::env::temp_dir().join(format!("meshnet-processes-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut args = peer_args(model, dir.join("tracker"), memory(model, layers[0], true));
        args.push("--tracker".into());
        let tracker = spawn("tracker", &dir, &args);
        let tracker_http = tracker.http_port();
        let tracker_p2p = tracker.wait_ready()["p2p"][0].as_str().unwrap().to_owned();
        let mut processes = vec![tracker];
        for (index, &share) in layers[1..].iter().enumerate() {
            let mut args = peer_args(
                model,
                dir.join(format!("peer{index}")),
                memory(model, share, false),
            );
            args.push("--bootstrap".into());
            args.push(tracker_p2p.clone());
            processes.push(spawn(&format!("peer{index}"), &dir, &args));
        }
        let mesh = Mesh {
            dir,
            tracker_http,
            tracker_p2p,
            processes,
            http: reqwest::Client::new(),
        };
        mesh.wait("the mesh to cover the model", |status| {
            status["coverage"]["complete"] == json!(true) && status["route_boundaries"].is_array()
        })
        .await;
        mesh
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.tracker_http)
    }

    async fn status(&self) -> Value {
        match self.http.get(self.url("/status")).send().await {
            Ok(response) => response.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        }
    }

    fn logs(&self) -> String {
        self.processes
            .iter()
            .map(|p| format!("--- {}\n{}", p.log.display(), p.log_tail()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    async fn wait(&self, what: &str, mut condition: impl FnMut(&Value) -> bool) -> Value {
        let started = Instant::now();
        loop {
            let status = self.status().await;
            if condition(&status) {
                return status;
            }
            assert!(
                started.elapsed() < common::DEADLINE,
                "timed out waiting for {what}; status: {status:#}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn chat(&self, body: Value) -> (u16, Value) {
        self.post("/v1/chat/completions", body).await
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = self
            .http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap())
    }

    async fn model_id(&self) -> String {
        let models: Value = self
            .http
            .get(self.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        models["data"][0]["id"].as_str().unwrap().to_owned()
    }

    /// Every process's `/status`, tracker first.
    async fn all_statuses(&self, peers: &[String]) -> Vec<Value> {
        let mut statuses = vec![self.status().await];
        for http in peers {
            let status = match self.http.get(format!("{http}/status")).send().await {
                Ok(response) => response.json().await.unwrap_or(Value::Null),
                Err(_) => Value::Null,
            };
            statuses.push(status);
        }
        statuses
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.processes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What `meshnet-peer generate --chat` prints for `prompt`, split at `boundaries`.
fn reference_answer(prompt: &str, boundaries: &[u64], max_tokens: usize) -> String {
    common::reference_generation(&["--chat", "--prompt", prompt], boundaries, max_tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_process_mesh_answers_exactly_like_one_process_with_the_same_boundaries() {
    let mesh = Mesh::start().await;
    let status = mesh.status().await;
    assert_eq!(status["peers"].as_array().unwrap().len(), 2, "{status:#}");
    let boundaries: Vec<u64> = status["route_boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    assert_eq!(boundaries.len(), 2, "a 3-way split: {boundaries:?}");
    let model = mesh.model_id().await;

    let long_prompt = format!(
        "Summarise the following notes in one sentence. {}",
        "The mesh splits one model across many machines; each peer holds a contiguous span of \
         layers, and activations travel from peer to peer as bfloat16 frames. "
            .repeat(12)
    );
    let prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three uses of a paperclip.",
        long_prompt.as_str(),
    ];
    for prompt in prompts {
        let max_tokens = 48;
        let (code, answer) = mesh
            .chat(json!({
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": max_tokens,
            }))
            .await;
        assert_eq!(code, 200, "{answer:#}");
        let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
        let expected = reference_answer(prompt, &boundaries, max_tokens);
        assert_eq!(text, expected, "prompt {prompt:?}");
        assert!(!text.is_empty());
        if prompt == long_prompt {
            let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(
                prompt_tokens > 300,
                "the long prompt spans 3+ prefill chunks ({prompt_tokens} tokens)"
            );
        }
    }

    // The terminal commands against the same mesh. `status` shows the three members in
    // route order, all ready, and complete coverage.
    let output = terminal(&["status", "--url", &mesh.url("")], "").await;
    assert!(output.status.success(), "{output:?}");
    let table = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(table.contains("coverage complete"), "{table}");
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with('…')).collect();
    assert_eq!(rows.len(), 3, "{table}");
    let spans: Vec<&str> = rows
        .iter()
        .map(|row| row.split_whitespace().nth(1).unwrap())
        .collect();
    let expected_spans = [
        format!("0..{}", boundaries[0]),
        format!("{}..{}", boundaries[0], boundaries[1]),
        format!("{}..30", boundaries[1]),
    ];
    assert_eq!(spans, expected_spans, "{table}");
    assert!(rows.iter().all(|row| row.contains(" ready ")), "{table}");

    // `chat` through a peer (which passes /v1 on to the tracker) streams the greedy answer;
    // `/reset` forgets the first exchange, so the same question gets the same answer again.
    let peer_http = status["peers"][0]["http"].as_str().unwrap();
    let question = "What is the capital of France?";
    let output = terminal(
        &[
            "chat",
            "--url",
            peer_http,
            "--temperature",
            "0",
            "--max-tokens",
            "48",
        ],
        &format!("{question}\n/reset\n{question}\n/quit\nnot asked\n"),
    )
    .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let expected = reference_answer(question, &boundaries, 48);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        format!("{expected}\n{expected}\n")
    );
    assert_eq!(
        stderr.matches("tokens/s, first token after").count(),
        2,
        "{stderr}"
    );
}

/// Runs `meshnet-peer ARGS` with `input` on its standard input and waits for it.
async fn terminal(args: &[&str], input: &str) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let input = input.to_owned();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = Command::new(BIN)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_frees_the_session_on_every_hop_and_bad_requests_get_4xx() {
    let mesh = Mesh::start().await;
    let status = mesh.status().await;
    let peers: Vec<String> = status["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["http"].as_str().unwrap().to_owned())
        .collect();
    let model = mesh.model_id().await;

    let mut stream = mesh
        .http
        .post(mesh.url("/v1/chat/completions"))
        .json(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
            "temperature": 0.7,
            "seed": 7,
            "max_tokens": 2000,
            "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status().as_u16(), 200);
    let mut received = String::new();
    while !received.contains("\"content\":\"") || received.matches("data:").count() < 3 {
        let chunk = stream.chunk().await.unwrap().expect("the stream goes on");
        received.push_str(&String::from_utf8_lossy(&chunk));
    }
    // While the stream runs, every hop holds the session.
    let started = Instant::now();
    loop {
        let statuses = mesh.all_statuses(&peers).await;
        if statuses[1..]
            .iter()
            .all(|s| s["active_sessions"].as_u64() == Some(1))
        {
            break;
        }
        assert!(started.elapsed() < common::DEADLINE, "{statuses:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(stream);
    let left = Instant::now();
    loop {
        let statuses = mesh.all_statuses(&peers).await;
        if statuses
            .iter()
            .all(|s| s["active_sessions"].as_u64() == Some(0))
        {
            break;
        }
        assert!(
            left.elapsed() < common::DEADLINE,
            "sessions not freed: {statuses:#?}\n{}",
            mesh.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "sessions freed on every hop {:?} after the client left",
        left.elapsed()
    );

    let context = 8192;
    let (code, body) = mesh
        .chat(json!({
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": context,
        }))
        .await;
    assert_eq!(code, 400, "{body:#}");
    assert_eq!(body["error"]["param"], "max_tokens");
    let (code, body) = mesh
        .chat(json!({"model": "another-model", "messages": [{"role": "user", "content": "Hi"}]}))
        .await;
    assert_eq!(code, 404, "{body:#}");
    let (code, body) = mesh.chat(json!({"model": model, "messages": []})).await;
    assert_eq!(code, 400, "{body:#}");
    let response = mesh
        .http
        .post(mesh.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_another_model_is_refused_with_a_message_naming_both() {
    let mesh = Mesh::start().await;
    // The same weights with one byte appended: another file, so another model id.
    let other = mesh.dir.join("other-model.gguf");
    let mut bytes = std::fs::read(common::model_path()).unwrap();
    bytes.push(0);
    std::fs::write(&other, bytes).unwrap();
    let mut args = peer_args(&other, mesh.dir.join("stranger"), memory(&other, 10, false));
    args.push("--bootstrap".into());
    args.push(mesh.tracker_p2p.clone());
    let mut stranger = spawn("stranger", &mesh.dir, &args);
    let started = Instant::now();
    let exit = loop {
        if let Some(exit) = stranger.child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            started.elapsed() < common::DEADLINE,
            "the stranger was not refused:\n{}",
            stranger.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!exit.success());
    let log = std::fs::read_to_string(&stranger.log).unwrap();
    let tracker_model = mesh.model_id().await;
    assert!(
        log.contains("runs model") && log.contains(&tracker_model),
        "the refusal names the mesh's model:\n{log}"
    );
    assert!(log.contains("other-model-"), "and its own:\n{log}");
    // The mesh is unaffected.
    let status = mesh.status().await;
    assert_eq!(status["peers"].as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_process_gpt2_mesh_completes_exactly_like_one_process() {
    let dir = common::gpt2_dir_with_tokenizer("gpt2-mesh");
    let mesh = Mesh::start_with(&dir, &[2, 2]).await;
    let status = mesh.status().await;
    assert_eq!(status["peers"].as_array().unwrap().len(), 1, "{status:#}");
    assert_eq!(status["route_boundaries"], json!([2]), "{status:#}");
    let model = mesh.model_id().await;
    let prompt = "hello mesh";
    let max_tokens = 16;
    let (code, answer) = mesh
        .post(
            "/v1/completions",
            json!({"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}),
        )
        .await;
    assert_eq!(code, 200, "{answer:#}\n{}", mesh.logs());
    let text = answer["choices"][0]["text"].as_str().unwrap();
    let dir_arg = dir.display().to_string();
    let expected = common::reference_generation(
        &[
            "--model",
            &dir_arg,
            "--prompt",
            prompt,
            "--temperature",
            "0",
        ],
        &[2],
        max_tokens,
    );
    assert!(!expected.is_empty(), "the reference continues the prompt");
    assert_eq!(text, expected);

    let (code, body) = mesh
        .chat(json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        .await;
    assert_eq!(code, 400, "{body:#}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("no chat format"), "{message}");
    drop(mesh);
    std::fs::remove_dir_all(&dir).unwrap();
}

impl Mesh {
    /// The text of the one choice of a request to `path` (chat or completions) that must
    /// succeed.
    async fn text_of(&self, path: &str, body: Value) -> String {
        let (code, answer) = self.post(path, body.clone()).await;
        assert_eq!(code, 200, "{body}: {answer:#}\n{}", self.logs());
        let choice = &answer["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap();
        text.to_owned()
    }
}

/// `body` with the fields of `extra` set.
fn merged(mut body: Value, extra: Value) -> Value {
    for (field, value) in extra.as_object().unwrap() {
        body[field] = value.clone();
    }
    body
}

/// How often `token` is among the ids of `text`.
fn occurrences(tokenizer: &meshnet_model::ModelTokenizer, text: &str, token: u32) -> usize {
    tokenizer
        .encode(text)
        .unwrap()
        .iter()
        .filter(|&&id| id == token)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_penalties_top_k_and_min_p_change_the_text_through_a_three_process_mesh() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    let tokenizer = meshnet_model::ModelTokenizer::from_gguf_file(common::model_path()).unwrap();
    let chat = json!({
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 12,
    });
    let path = "/v1/chat/completions";

    // Banning the greedy answer's first token changes the first token.
    let greedy = mesh.text_of(path, chat.clone()).await;
    let first = tokenizer.encode(&greedy).unwrap()[0];
    let banned = json!({"logit_bias": {first.to_string(): -100}});
    let other = mesh.text_of(path, merged(chat.clone(), banned)).await;
    println!("greedy {greedy:?}; without token {first}: {other:?}");
    assert_ne!(tokenizer.encode(&other).unwrap()[0], first, "{other:?}");

    // +100 on one token makes every generated token that token, greedy or sampled.
    let favoured = tokenizer.encode(" banana").unwrap()[0];
    let max_tokens = 6;
    let expected = tokenizer.decode(&vec![favoured; max_tokens]).unwrap();
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 1, "seed": 3}),
    ] {
        let body = merged(
            chat.clone(),
            merged(
                sampling,
                json!({"max_tokens": max_tokens, "logit_bias": {favoured.to_string(): 100}}),
            ),
        );
        assert_eq!(mesh.text_of(path, body).await, expected);
    }

    // Counting continues "1, 1, 1, ..." (" ", "1" and "," each a token); a frequency
    // penalty makes "1" stop repeating, the sooner the larger it is.
    let ones = json!({
        "model": model,
        "prompt": "1, 1, 1, 1, 1, 1, 1, 1,",
        "temperature": 0,
        "max_tokens": 24,
    });
    let digit_one = tokenizer.token_id("1").unwrap();
    let mut counts = Vec::new();
    for penalty in [0, 1, 2] {
        let body = merged(ones.clone(), json!({"frequency_penalty": penalty}));
        let text = mesh.text_of("/v1/completions", body).await;
        println!("frequency penalty {penalty}: {text:?}");
        counts.push(occurrences(&tokenizer, &text, digit_one));
    }
    assert_eq!(counts[0], 8, "{counts:?}");
    assert!(counts[1] < counts[0] && counts[2] < counts[1], "{counts:?}");

    // "Hello Hello ..." is continued by "\n" twice; a presence penalty leaves the first
    // (nothing was generated yet) and stops the second.
    let hello = json!({
        "model": model,
        "prompt": "Hello Hello Hello Hello Hello Hello",
        "temperature": 0,
        "max_tokens": 2,
    });
    let plain = mesh.text_of("/v1/completions", hello.clone()).await;
    assert_eq!(plain, "\n\n");
    let body = merged(hello, json!({"presence_penalty": 2}));
    let penalised = mesh.text_of("/v1/completions", body).await;
    assert!(
        penalised.starts_with('\n') && !penalised.starts_with("\n\n"),
        "{penalised:?}"
    );

    // top_k 1 and min_p 1 leave only the most likely token: a hot, seeded sample is greedy.
    let hot = merged(chat.clone(), json!({"temperature": 2, "seed": 11}));
    let sampled = mesh.text_of(path, hot.clone()).await;
    assert_ne!(sampled, greedy, "temperature 2 is not greedy by chance");
    for only_the_best in [json!({"top_k": 1}), json!({"min_p": 1})] {
        let text = mesh.text_of(path, merged(hot.clone(), only_the_best)).await;
        assert_eq!(text, greedy);
    }

    // Token ids are checked against the model's vocabulary.
    let vocab = tokenizer.vocab_size();
    let last = json!({"max_tokens": 1, "logit_bias": {(vocab - 1).to_string(): 5}});
    mesh.text_of(path, merged(chat.clone(), last)).await;
    let past = json!({"logit_bias": {vocab.to_string(): 5}});
    let (code, body) = mesh.chat(merged(chat.clone(), past)).await;
    assert_eq!(code, 400, "{body:#}");
    assert_eq!(body["error"]["param"], "logit_bias");
}

/// Posts `body` to `url`; the status and the JSON answer.
async fn post_json(http: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let response = http.post(url).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_id_prompts_tokenize_and_detokenize_through_a_three_process_mesh() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    let tokenizer = meshnet_model::ModelTokenizer::from_gguf_file(common::model_path()).unwrap();
    let status = mesh.status().await;
    // A member that is not the tracker passes the requests on to it.
    let peer_http = status["peers"][0]["http"].as_str().unwrap().to_owned();

    // Control tokens written in the text are read as their ids, and written out again.
    let text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>";
    let ids = tokenizer.encode(text).unwrap();
    assert_eq!(ids[0], tokenizer.token_id("<|im_start|>").unwrap());
    for base in [mesh.url(""), peer_http] {
        let body = json!({"content": text});
        let (code, answer) = post_json(&mesh.http, &format!("{base}/tokenize"), &body).await;
        assert_eq!(code, 200, "{base}: {answer:#}");
        assert_eq!(answer, json!({"tokens": ids}), "{base}");
        let body = json!({"tokens": ids});
        let (code, answer) = post_json(&mesh.http, &format!("{base}/detokenize"), &body).await;
        assert_eq!(code, 200, "{base}: {answer:#}");
        assert_eq!(answer, json!({"content": text}), "{base}");
        let body = json!({"tokens": [tokenizer.vocab_size()]});
        let (code, answer) = post_json(&mesh.http, &format!("{base}/detokenize"), &body).await;
        assert_eq!(code, 400, "{base}: {answer:#}");
        assert_eq!(answer["error"]["param"], "tokens");
    }

    // A prompt of token ids is continued exactly as its text is.
    let prompt = "The capital of France is";
    let (_, tokenized) = mesh
        .post("/tokenize", json!({"content": prompt, "add_special": true}))
        .await;
    let ids = tokenized["tokens"].clone();
    let completion = |prompt: Value| json!({"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 12});
    let (code, from_text) = mesh
        .post("/v1/completions", completion(json!(prompt)))
        .await;
    assert_eq!(code, 200, "{from_text:#}");
    for form in [ids.clone(), json!([ids])] {
        let (code, from_ids) = mesh.post("/v1/completions", completion(form)).await;
        assert_eq!(code, 200, "{from_ids:#}");
        assert_eq!(
            from_ids["choices"][0]["text"],
            from_text["choices"][0]["text"]
        );
        assert_eq!(from_ids["usage"], from_text["usage"]);
        assert_eq!(
            from_ids["usage"]["prompt_tokens"],
            ids.as_array().unwrap().len()
        );
    }
    println!("{prompt:?} {ids} → {}", from_text["choices"][0]["text"]);

    for bad in [
        json!([1, tokenizer.vocab_size()]),
        json!([-1]),
        json!([]),
        json!(["one", 2]),
        json!(vec!["one"; 9]),
    ] {
        let (code, answer) = mesh.post("/v1/completions", completion(bad.clone())).await;
        assert_eq!(code, 400, "{bad}: {answer:#}");
        assert_eq!(answer["error"]["param"], "prompt", "{bad}");
    }
}

/// The `data:` payloads of a streamed answer to `body`, as JSON, up to `[DONE]`.
async fn stream_chunks(mesh: &Mesh, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = mesh
        .http
        .post(mesh.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await.unwrap();
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .take_while(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

/// The bytes of every entry of a `logprobs.content` list, joined.
fn logprob_bytes(content: &[Value]) -> Vec<u8> {
    content
        .iter()
        .flat_map(|entry| entry["bytes"].as_array().unwrap().clone())
        .map(|byte| u8::try_from(byte.as_u64().unwrap()).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_through_a_three_process_mesh_are_the_raw_distribution_streamed_or_not() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    let body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": true,
        "top_logprobs": 3,
    });
    let (code, answer) = mesh.chat(body.clone()).await;
    assert_eq!(code, 200, "{answer:#}");
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
    let content = answer["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(logprob_bytes(&content), text.as_bytes());
    assert_eq!(content.len() as u64, answer["usage"]["completion_tokens"]);
    for entry in &content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            values.windows(2).all(|w| w[0] >= w[1]) && values[0] <= 0.0,
            "{entry}"
        );
        // Greedy: the chosen token is the most likely one.
        assert_eq!(entry["token"], top[0]["token"], "{entry}");
        assert_eq!(entry["logprob"], top[0]["logprob"], "{entry}");
    }

    // Streamed: the chunks carry the same entries, each with the text it completes.
    let chunks = stream_chunks(&mesh, &body).await;
    let mut streamed = Vec::new();
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        if let Some(entries) = choice["logprobs"]["content"].as_array() {
            let delta = choice["delta"]["content"].as_str().unwrap_or_default();
            assert_eq!(logprob_bytes(entries), delta.as_bytes(), "{chunk}");
            streamed.extend(entries.iter().cloned());
        }
    }
    assert_eq!(streamed, content);

    // The values are those of the raw logits: banning the greedy first token leaves it the
    // most likely in top_logprobs, and the token taken is the runner-up.
    let tokenizer = meshnet_model::ModelTokenizer::from_gguf_file(common::model_path()).unwrap();
    let first = tokenizer.encode(text).unwrap()[0];
    let mut banned = body.clone();
    banned["logit_bias"] = json!({first.to_string(): -100});
    let (code, other) = mesh.chat(banned).await;
    assert_eq!(code, 200, "{other:#}");
    let entry = &other["choices"][0]["logprobs"]["content"][0];
    assert_eq!(entry["top_logprobs"][0], content[0]["top_logprobs"][0]);
    assert_eq!(entry["top_logprobs"][1]["token"], entry["token"]);
    // ... and temperature does not change them.
    let mut hot = body.clone();
    hot["temperature"] = json!(1.5);
    hot["seed"] = json!(5);
    let (code, sampled) = mesh.chat(hot).await;
    assert_eq!(code, 200, "{sampled:#}");
    let entry = &sampled["choices"][0]["logprobs"]["content"][0];
    assert_eq!(entry["top_logprobs"], content[0]["top_logprobs"]);

    for (path, extra, param) in [
        (
            "/v1/chat/completions",
            json!({"top_logprobs": 21}),
            "top_logprobs",
        ),
        ("/v1/completions", json!({"logprobs": 21}), "logprobs"),
    ] {
        let mut request = json!({"model": model, "prompt": "Hi", "messages": body["messages"]});
        for (field, value) in extra.as_object().unwrap() {
            request[field] = value.clone();
        }
        request["logprobs"] = request.get("logprobs").cloned().unwrap_or(json!(true));
        let (code, answer) = mesh.post(path, request).await;
        assert_eq!(code, 400, "{answer:#}");
        assert_eq!(answer["error"]["param"], param);
    }
}

/// How many chunk and decode frames each peer's span has answered so far.
async fn frames_answered(mesh: &Mesh, peers: &[String]) -> Vec<u64> {
    let statuses = mesh.all_statuses(peers).await;
    statuses[1..]
        .iter()
        .map(|status| status["batching"]["requests"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill_and_each_equals_its_own_single_request() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    let tokenizer = meshnet_model::ModelTokenizer::from_gguf_file(common::model_path()).unwrap();
    let peers: Vec<String> = mesh.status().await["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["http"].as_str().unwrap().to_owned())
        .collect();
    // No end of text: every choice runs to max_tokens, so the frames can be counted.
    let eos = tokenizer.eos_token().unwrap();
    let max_tokens = 6;
    let body = json!({
        "model": model,
        "prompt": "Once upon a time, in a small village by the sea,",
        "temperature": 1.0,
        "seed": 21,
        "max_tokens": max_tokens,
        "logit_bias": {eos.to_string(): -100},
    });

    let before = frames_answered(&mesh, &peers).await;
    let (code, answer) = mesh
        .post("/v1/completions", merged(body.clone(), json!({"n": 3})))
        .await;
    assert_eq!(code, 200, "{answer:#}\n{}", mesh.logs());
    let after = frames_answered(&mesh, &peers).await;
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    assert_eq!(answer["usage"]["completion_tokens"], 3 * max_tokens);
    // One prompt frame for all three, then each choice's decode steps (its last token is
    // not fed back).
    let expected_frames = 1 + 3 * (max_tokens as u64 - 1);
    for (peer, (b, a)) in before.iter().zip(&after).enumerate() {
        assert_eq!(
            a - b,
            expected_frames,
            "peer {peer}: {before:?} → {after:?}"
        );
    }

    // Choice i is exactly the single-choice answer with seed 21 + i.
    let mut texts = Vec::new();
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(choice["finish_reason"], "length");
        let alone = merged(body.clone(), json!({"seed": 21 + index}));
        let expected = mesh.text_of("/v1/completions", alone).await;
        assert_eq!(choice["text"], expected, "choice {index}");
        texts.push(expected);
    }
    println!("three choices: {texts:?}");
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");

    // Streamed chat choices put together per index equal the whole answer's choices.
    let chat = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Name a fruit."}],
        "temperature": 0.8,
        "seed": 4,
        "max_tokens": 8,
        "n": 2,
    });
    let (code, whole) = mesh.chat(chat.clone()).await;
    assert_eq!(code, 200, "{whole:#}");
    let mut streamed = [String::new(), String::new()];
    for chunk in stream_chunks(&mesh, &chat).await {
        for choice in chunk["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap() as usize;
            streamed[index].push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        }
    }
    for (index, text) in streamed.iter().enumerate() {
        assert_eq!(
            whole["choices"][index]["message"]["content"], *text,
            "choice {index}"
        );
    }

    // Every session, the shared prompt's too, is freed on every hop.
    let started = Instant::now();
    loop {
        let statuses = mesh.all_statuses(&peers).await;
        if statuses[1..]
            .iter()
            .all(|s| s["active_sessions"].as_u64() == Some(0))
        {
            break;
        }
        assert!(started.elapsed() < common::DEADLINE, "{statuses:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Choices that could never fit the entry's KV cache together are refused up front.
    let huge = merged(body.clone(), json!({"n": 8, "max_tokens": 7000}));
    let (code, refused) = mesh.post("/v1/completions", huge).await;
    assert_eq!(code, 400, "{refused:#}");
    assert_eq!(refused["error"]["param"], "n");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV cache at the entry"),
        "{refused:#}"
    );

    // max_completion_tokens bounds a chat's every choice, over max_tokens.
    let end_of_turn = tokenizer.token_id("<|im_end|>").unwrap();
    let no_end = json!({eos.to_string(): -100, end_of_turn.to_string(): -100});
    let bounded = merged(
        chat,
        json!({"max_completion_tokens": 3, "max_tokens": 50, "logit_bias": no_end}),
    );
    let (code, answer) = mesh.chat(bounded).await;
    assert_eq!(code, 200, "{answer:#}");
    assert_eq!(answer["usage"]["completion_tokens"], 6);
    for choice in answer["choices"].as_array().unwrap() {
        assert_eq!(choice["finish_reason"], "length", "{choice}");
    }
    let (code, refused) = mesh
        .post("/v1/completions", merged(body, json!({"n": 9})))
        .await;
    assert_eq!(code, 400, "{refused:#}");
    assert_eq!(refused["error"]["param"], "n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo_the_prompt_with_its_logprobs_through_a_three_process_mesh() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    let prompt = "The capital of France is";
    let plain = json!({
        "model": model, "prompt": prompt, "temperature": 0, "max_tokens": 4, "logprobs": 2,
    });
    let (code, answer) = mesh.post("/v1/completions", plain.clone()).await;
    assert_eq!(code, 200, "{answer:#}");
    let generated = answer["choices"][0].clone();
    let completion = generated["text"].as_str().unwrap().to_owned();
    let generated_tokens = generated["logprobs"]["tokens"].as_array().unwrap().len();
    assert_eq!(
        generated_tokens as u64,
        answer["usage"]["completion_tokens"]
    );
    assert_eq!(generated["logprobs"]["text_offset"][0], 0);

    let (code, echoed) = mesh
        .post(
            "/v1/completions",
            merged(plain.clone(), json!({"echo": true})),
        )
        .await;
    assert_eq!(code, 200, "{echoed:#}");
    let choice = &echoed["choices"][0];
    assert_eq!(choice["text"], format!("{prompt}{completion}"));
    let logprobs = &choice["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let prompt_tokens = echoed["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(tokens.len(), prompt_tokens + generated_tokens);
    assert_eq!(tokens.concat(), choice["text"].as_str().unwrap());
    let mut offset = 0;
    for (index, token) in tokens.iter().enumerate() {
        assert_eq!(logprobs["text_offset"][index], offset, "{logprobs:#}");
        offset += token.len();
    }
    assert!(logprobs["token_logprobs"][0].is_null() && logprobs["top_logprobs"][0].is_null());
    for index in 1..tokens.len() {
        let value = logprobs["token_logprobs"][index].as_f64().unwrap();
        let top = logprobs["top_logprobs"][index].as_object().unwrap();
        assert!(
            value <= 0.0 && (2..=3).contains(&top.len()),
            "{index}: {top:?}"
        );
        assert_eq!(top[tokens[index]].as_f64().unwrap(), value, "{index}");
    }
    // The generated tokens' entries are those of the plain request.
    for field in ["tokens", "token_logprobs", "top_logprobs"] {
        let echoed_part = &logprobs[field].as_array().unwrap()[prompt_tokens..];
        assert_eq!(
            echoed_part,
            generated["logprobs"][field].as_array().unwrap(),
            "{field}"
        );
    }

    // A prompt token is scored from the positions before it: with the first generated token
    // appended to the prompt (as ids), its entry is the one it had when it was generated.
    let (_, tokenized) = mesh.post("/tokenize", json!({"content": prompt})).await;
    let mut ids: Vec<Value> = tokenized["tokens"].as_array().unwrap().clone();
    let first_generated = generated["logprobs"]["tokens"][0].as_str().unwrap();
    let (_, next) = mesh
        .post("/tokenize", json!({"content": first_generated}))
        .await;
    ids.push(next["tokens"][0].clone());
    let scored = json!({"model": model, "prompt": ids, "echo": true, "logprobs": 2, "max_tokens": 1, "temperature": 0});
    let (code, scored) = mesh.post("/v1/completions", scored).await;
    assert_eq!(code, 200, "{scored:#}");
    let last = ids.len() - 1;
    let entry = &scored["choices"][0]["logprobs"];
    assert_eq!(entry["tokens"][last], first_generated);
    let as_prompt = entry["token_logprobs"][last].as_f64().unwrap();
    let as_generated = generated["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    println!("{first_generated:?}: {as_prompt} scored in the prompt, {as_generated} generated");
    assert!(
        (as_prompt - as_generated).abs() < 1e-2,
        "{as_prompt} vs {as_generated}"
    );

    // Streamed: the echo comes first, the offsets run on across chunks.
    let mut body = merged(plain, json!({"echo": true, "stream": true}));
    body["n"] = json!(2);
    let response = mesh
        .http
        .post(mesh.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let text = response.text().await.unwrap();
    let mut streamed = [String::new(), String::new()];
    let mut offsets: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    for data in text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .take_while(|d| *d != "[DONE]")
    {
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        streamed[index].push_str(choice["text"].as_str().unwrap());
        if let Some(list) = choice["logprobs"]["text_offset"].as_array() {
            offsets[index].extend(list.iter().map(|o| o.as_u64().unwrap()));
        }
    }
    for index in 0..2 {
        assert_eq!(streamed[index], choice["text"].as_str().unwrap(), "{text}");
        assert_eq!(
            offsets[index],
            logprobs["text_offset"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_u64().unwrap())
                .collect::<Vec<_>>()
        );
    }
}

/// A schema of the structured-output test and a check, by hand, that a value matches it.
struct SchemaCase {
    name: &'static str,
    prompt: &'static str,
    schema: Value,
    matches: fn(&Value) -> bool,
}

/// Whether `value` is a string of `min..=max` characters.
fn string_of(value: &Value, min: usize, max: usize) -> bool {
    value
        .as_str()
        .is_some_and(|text| (min..=max).contains(&text.chars().count()))
}

/// Whether `value` is an object with exactly the keys `keys`.
fn object_with(value: &Value, keys: &[&str]) -> bool {
    value.as_object().is_some_and(|object| {
        object.len() == keys.len() && keys.iter().all(|key| object.contains_key(*key))
    })
}

fn schema_cases() -> Vec<SchemaCase> {
    let closed = |properties: Value| {
        let required: Vec<&String> = properties.as_object().unwrap().keys().collect();
        json!({
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": false,
        })
    };
    vec![
        SchemaCase {
            name: "person",
            prompt: "Describe a fictional person as JSON with a name and an age.",
            schema: closed(json!({
                "name": {"type": "string", "minLength": 1, "maxLength": 16},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            })),
            matches: |v| {
                object_with(v, &["name", "age"])
                    && string_of(&v["name"], 1, 16)
                    && v["age"]
                        .as_i64()
                        .is_some_and(|age| (0..=120).contains(&age))
            },
        },
        SchemaCase {
            name: "fruits",
            prompt: "List some fruits as a JSON object with an array of names.",
            schema: closed(json!({
                "fruits": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 1,
                    "maxItems": 3,
                },
            })),
            matches: |v| {
                object_with(v, &["fruits"])
                    && v["fruits"].as_array().is_some_and(|fruits| {
                        (1..=3).contains(&fruits.len())
                            && fruits.iter().all(|fruit| string_of(fruit, 0, 12))
                    })
            },
        },
        SchemaCase {
            name: "verdict",
            prompt: "Is the sky blue? Answer in JSON with your confidence.",
            schema: closed(json!({
                "answer": {"enum": ["yes", "no"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            })),
            matches: |v| {
                object_with(v, &["answer", "confidence"])
                    && (v["answer"] == "yes" || v["answer"] == "no")
                    && v["confidence"]
                        .as_f64()
                        .is_some_and(|c| (0.0..=1.0).contains(&c))
            },
        },
        SchemaCase {
            name: "flight",
            prompt: "Make up a flight code like ABC-12 and give it as JSON.",
            schema: closed(json!({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}})),
            matches: |v| {
                object_with(v, &["code"])
                    && v["code"].as_str().is_some_and(|code| {
                        let bytes = code.as_bytes();
                        bytes.len() == 6
                            && bytes[..3].iter().all(u8::is_ascii_uppercase)
                            && bytes[3] == b'-'
                            && bytes[4..].iter().all(u8::is_ascii_digit)
                    })
            },
        },
    ]
}

/// The text and finish reason of the one choice of a request that must succeed.
async fn answer_of(mesh: &Mesh, path: &str, body: &Value) -> (String, String) {
    let (code, answer) = mesh.post(path, body.clone()).await;
    assert_eq!(code, 200, "{body}: {answer:#}\n{}", mesh.logs());
    let choice = &answer["choices"][0];
    let text = choice["message"]["content"]
        .as_str()
        .or_else(|| choice["text"].as_str())
        .unwrap();
    let finish = choice["finish_reason"].as_str().unwrap();
    (text.to_owned(), finish.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_through_a_three_process_mesh_parses_and_matches_every_schema() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    for case in schema_cases() {
        let format = json!({
            "type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": true},
        });
        for sampling in [
            json!({"temperature": 0}),
            json!({"temperature": 0.8, "seed": 7}),
        ] {
            let chat = json!({
                "model": model,
                "messages": [{"role": "user", "content": case.prompt}],
                "max_tokens": 96,
                "response_format": format,
            });
            let completion = json!({
                "model": model,
                "prompt": format!("{}\nJSON:", case.prompt),
                "max_tokens": 96,
                "response_format": format,
            });
            for (path, body) in [
                ("/v1/chat/completions", chat),
                ("/v1/completions", completion),
            ] {
                let body = merged(body, sampling.clone());
                let (text, finish) = answer_of(&mesh, path, &body).await;
                println!("{} {path} {sampling}: {text}", case.name);
                assert_eq!(finish, "stop", "{}: {text:?}", case.name);
                let value: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{}: {text:?} is not JSON: {e}", case.name));
                assert!(
                    (case.matches)(&value),
                    "{}: {text} does not match",
                    case.name
                );
            }
        }
    }

    // Any object, streamed: the pieces make one object, and the stream finishes with stop.
    let object = json!({
        "model": model,
        "messages": [{"role": "user", "content": "Give the name and age of a person as JSON."}],
        "temperature": 0,
        "max_tokens": 96,
        "response_format": {"type": "json_object"},
    });
    let chunks = stream_chunks(&mesh, &object).await;
    let text: String = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    let finish = chunks
        .iter()
        .rev()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("stop"), "{chunks:?}");
    let value: Value = serde_json::from_str(&text).unwrap();
    assert!(value.is_object(), "{text}");

    // A token budget too small for the JSON ends with length: the text is the beginning of
    // the whole greedy answer, cut off.
    let case = &schema_cases()[0];
    let short = json!({
        "model": model,
        "messages": [{"role": "user", "content": case.prompt}],
        "temperature": 0,
        "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": case.schema}},
    });
    let (text, finish) = answer_of(&mesh, "/v1/chat/completions", &short).await;
    assert_eq!(finish, "length", "{text:?}");
    let whole = merged(short.clone(), json!({"max_tokens": 96}));
    let (whole, finish) = answer_of(&mesh, "/v1/chat/completions", &whole).await;
    assert_eq!(finish, "stop", "{whole:?}");
    assert!(
        whole.starts_with(&text) && whole.len() > text.len(),
        "{text:?} / {whole:?}"
    );
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text:?}");

    // A schema the engine cannot compile, and a malformed format, are refused naming the field.
    for (format, param, word) in [
        (
            json!({"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": true}}}),
            "response_format",
            "uniqueItems",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "u"}}),
            "response_format.json_schema.schema",
            "schema",
        ),
    ] {
        let body = merged(short.clone(), json!({"response_format": format}));
        let (code, answer) = mesh.chat(body).await;
        assert_eq!(code, 400, "{answer:#}");
        assert_eq!(answer["error"]["param"], param, "{answer:#}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(word), "{message}");
    }
}

/// The functions the tool tests offer: arguments from small enums and ranges, so even the
/// tiny default model's calls are short.
fn offered_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city over the next days.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}
            }, "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The time in a time zone.",
            "parameters": {"type": "object", "properties": {
                "zone": {"type": "string", "enum": ["UTC", "CET"]}
            }, "required": ["zone"], "additionalProperties": false}}}
    ])
}

/// Checks a call against [`offered_tools`]' schemas by hand; returns its name.
fn checked_call(call: &Value) -> String {
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    assert_eq!(call["type"], "function", "{call}");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let arguments = arguments.as_object().unwrap();
    let name = call["function"]["name"].as_str().unwrap();
    match name {
        "get_weather" => {
            assert!(["Paris", "Rome", "Tokyo"].contains(&arguments["city"].as_str().unwrap()));
            if let Some(days) = arguments.get("days") {
                assert!((1..=7).contains(&days.as_i64().unwrap()), "{call}");
            }
            assert!(
                arguments.keys().all(|k| k == "city" || k == "days"),
                "{call}"
            );
        }
        "get_time" => {
            assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap()));
            assert_eq!(arguments.len(), 1, "{call}");
        }
        other => panic!("{other} was not offered"),
    }
    name.to_owned()
}

/// The default model's template as the tracker uses it (without its default system prompt),
/// with its tokenizer.
fn local_chat_side() -> meshnet_model::TextSide {
    let model = meshnet_model::Model::open(&common::model_path()).unwrap();
    let mut text = meshnet_model::TextSide::of(&model, None).unwrap();
    text.template = text
        .template
        .take()
        .map(meshnet_model::ChatTemplate::without_default_system);
    text
}

/// `messages` (OpenAI's shape) as the model crate's chat messages.
fn chat_messages(messages: &Value) -> Vec<meshnet_model::ChatMessage> {
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| meshnet_model::ChatMessage {
            tool_calls: m["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|call| meshnet_model::ToolCall {
                    id: call["id"].as_str().unwrap().to_owned(),
                    name: call["function"]["name"].as_str().unwrap().to_owned(),
                    arguments: call["function"]["arguments"].as_str().unwrap().to_owned(),
                })
                .collect(),
            tool_call_id: m["tool_call_id"].as_str().map(str::to_owned),
            ..meshnet_model::ChatMessage::new(
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_through_a_three_process_mesh_required_named_none_streamed_and_answered() {
    let mesh = Mesh::start().await;
    let model = mesh.model_id().await;
    let boundaries: Vec<u64> = mesh.status().await["route_boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    let question = "What is the weather in Paris?";
    let messages = json!([{"role": "user", "content": question}]);
    let base = json!({
        "model": model, "messages": messages, "tools": offered_tools(),
        "temperature": 0, "max_tokens": 64, "parallel_tool_calls": false,
    });
    let local = local_chat_side();
    let template = local.template.as_ref().unwrap();
    // SmolLM2's template renders no tools: the generic format describes them.
    assert_eq!(template.tool_format(), meshnet_model::ToolFormat::Generic);
    let definitions: Vec<meshnet_model::ToolDefinition> = offered_tools()
        .as_array()
        .unwrap()
        .iter()
        .map(|tool| meshnet_model::ToolDefinition::from_json(&tool.to_string()).unwrap())
        .collect();

    // `required`: one call of an offered function, its arguments valid, and no text; the
    // prompt is the conversation with the tools, rendered as this process renders it.
    let (code, answer) = mesh
        .chat(merged(base.clone(), json!({"tool_choice": "required"})))
        .await;
    assert_eq!(code, 200, "{answer:#}");
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{answer:#}");
    assert_eq!(choice["message"]["content"], Value::Null, "{answer:#}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{answer:#}");
    checked_call(&calls[0]);
    let required_call = calls[0].clone();
    let rendered = template
        .render_chat(&chat_messages(&messages), &definitions, true)
        .unwrap();
    let prompt_tokens = local.tokenizer.encode_prompt(&rendered).unwrap().len();
    assert_eq!(answer["usage"]["prompt_tokens"], json!(prompt_tokens));

    // A named function: a call of that one.
    let named = merged(
        base.clone(),
        json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    );
    let (code, answer) = mesh.chat(named.clone()).await;
    assert_eq!(code, 200, "{answer:#}");
    let calls = answer["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap();
    assert_eq!(calls.len(), 1, "{answer:#}");
    assert_eq!(checked_call(&calls[0]), "get_time");
    let named_arguments = calls[0]["function"]["arguments"].clone();

    // Streamed: the call comes as delta.tool_calls, its id, type and name first, then the
    // same arguments in pieces; no text.
    let chunks = stream_chunks(&mesh, &named).await;
    let mut pieces = Vec::new();
    for chunk in &chunks {
        let delta = &chunk["choices"][0]["delta"];
        if let Some(content) = delta["content"].as_str() {
            assert_eq!(content, "", "{chunk}");
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            assert_eq!(calls.len(), 1);
            pieces.push(calls[0].clone());
        }
    }
    assert!(pieces.len() >= 2, "{chunks:#?}");
    assert_eq!(pieces[0]["index"], 0);
    assert!(pieces[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(pieces[0]["type"], "function");
    assert_eq!(pieces[0]["function"]["name"], "get_time");
    assert_eq!(pieces[0]["function"]["arguments"], "");
    let mut streamed = String::new();
    for piece in &pieces[1..] {
        assert_eq!(piece["index"], 0);
        assert!(piece.get("id").is_none() && piece["function"].get("name").is_none());
        streamed.push_str(piece["function"]["arguments"].as_str().unwrap());
    }
    assert_eq!(json!(streamed), named_arguments);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");

    // `none`: the tools are not shown; the answer is the one without them.
    let (code, answer) = mesh
        .chat(merged(base.clone(), json!({"tool_choice": "none"})))
        .await;
    assert_eq!(code, 200, "{answer:#}");
    let message = &answer["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none(), "{answer:#}");
    assert_eq!(
        message["content"].as_str().unwrap(),
        reference_answer(question, &boundaries, 64)
    );

    // The call's result continues the conversation: the answer is what generating from the
    // conversation rendered here gives, read for calls the same way.
    let id = required_call["id"].as_str().unwrap();
    let conversation = json!([
        {"role": "user", "content": question},
        {"role": "assistant", "content": null, "tool_calls": [required_call]},
        {"role": "tool", "tool_call_id": id, "content": "{\"temperature\": 18, \"sky\": \"clear\"}"}
    ]);
    let (code, answer) = mesh
        .chat(merged(
            base.clone(),
            json!({"messages": conversation, "max_tokens": 48}),
        ))
        .await;
    assert_eq!(code, 200, "{answer:#}");
    let rendered = template
        .render_chat(&chat_messages(&conversation), &definitions, true)
        .unwrap();
    assert!(
        rendered.contains("<tool_response>\n{\"temperature\": 18"),
        "{rendered}"
    );
    let raw = common::reference_generation(&["--prompt", &rendered], &boundaries, 48);
    let expected = meshnet_model::parse_answer(meshnet_model::ToolFormat::Generic, &raw, false);
    let message = &answer["choices"][0]["message"];
    assert_eq!(
        message["content"].as_str().unwrap_or_default(),
        expected.content
    );
    let calls: Vec<(String, String)> = message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|call| {
            let function = &call["function"];
            (
                function["name"].as_str().unwrap().to_owned(),
                function["arguments"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected_calls: Vec<(String, String)> = expected
        .calls
        .into_iter()
        .map(|call| (call.name, call.arguments))
        .collect();
    assert_eq!(calls, expected_calls, "raw answer {raw:?}");

    // A parameters schema the grammar engine cannot compile is a 400 naming it.
    let mut bad = offered_tools();
    bad[1]["function"]["parameters"] = json!({"type": "string", "pattern": "(("});
    let (code, answer) = mesh
        .chat(merged(
            base,
            json!({"tools": bad, "tool_choice": "required"}),
        ))
        .await;
    assert_eq!(code, 400, "{answer:#}");
    assert_eq!(answer["error"]["param"], "tools[1].function.parameters");
}
