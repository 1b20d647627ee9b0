//! Time to first token and decode tokens/s through the OpenAI API: one process holding the
//! whole model against a mesh of three processes on loopback (`testnet/local.sh up 3`), same
//! model, same prompts, same HTTP/SSE path; the only difference is the hops between peers.
//!
//! Each setup answers one warm-up request per prompt, then `MESHNET_BENCH_RUNS` (default 5)
//! streamed requests per prompt at temperature 0. TTFT is the time from sending the request to
//! the first SSE chunk with non-empty content; the decode rate is (completion tokens - 1)
//! divided by the time from the first to the last content chunk, with the completion tokens
//! taken from the final usage chunk. Prints a markdown table of medians (min-max) and the
//! ratio mesh/single.
//!
//! Then a burst: `MESHNET_BENCH_BURST` (default 8) greedy chats of `BURST_MAX_TOKENS` tokens
//! sent to the mesh at once, with default flags, against the same chats one after another:
//! how many were served and how many refused (429), the aggregate tokens/s of each, the
//! longest wait for a first token, and whether every text equals the one-at-a-time text.
//!
//! Last, pipelined prefill: two more 3-process meshes, one with the default
//! `--prefill-chunks-in-flight` and one with `--prefill-chunks-in-flight 1` (each chunk answered
//! before the next is computed), answer a prompt of `PIPELINE_PREFILL_CHUNKS` chunks (about
//! 1,024 tokens) in turn, `MESHNET_BENCH_RUNS` times each; the table gives the time to the
//! first token of each.
//!
//! Needs a release `meshnet-peer` (or `MESHNET_BIN`) and the default model
//! (`scripts/fetch-model.sh`). Run with
//! `cargo build --release -p meshnet-peer && cargo bench -p meshnet-benches --bench mesh_latency`.

#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const SHORT_PROMPT: &str = "Explain in a few sentences why the sky is blue.";
const MAX_TOKENS: u32 = 64;
/// Enough for the first content chunk of the long prompt; its decode is not measured.
const LONG_MAX_TOKENS: u32 = 8;
/// The long prompt must span this many 128-token prefill chunks.
const LONG_PREFILL_CHUNKS: u64 = 4;
const PREFILL_CHUNK_TOKENS: u64 = 128;
const MESH_PROCESSES: u32 = 3;
/// The prompt of the pipelined-prefill comparison spans this many prefill chunks.
const PIPELINE_PREFILL_CHUNKS: u64 = 8;
/// Notes in that prompt (each about 110 tokens).
const PIPELINE_NOTES: usize = 9;
/// Tokens each chat of the burst generates.
const BURST_MAX_TOKENS: u32 = 48;
const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `MESHNET_BIN`, else the release binary in the workspace's target directory.
fn peer_binary() -> PathBuf {
    let path = match std::env::var_os("MESHNET_BIN") {
        Some(bin) => PathBuf::from(bin),
        None => std::env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| workspace_root().join("target"), PathBuf::from)
            .join("release")
            .join("meshnet-peer"),
    };
    if !path.is_file() {
        eprintln!(
            "mesh_latency: meshnet-peer binary not found at {}\n\
             build it first with `cargo build --release -p meshnet-peer`, \
             or point MESHNET_BIN at one",
            path.display()
        );
        std::process::exit(1);
    }
    path
}

fn runs() -> usize {
    match std::env::var("MESHNET_BENCH_RUNS") {
        Ok(value) => match value.trim().parse::<usize>() {
            Ok(n) if n >= 1 => n,
            _ => panic!("MESHNET_BENCH_RUNS must be an integer >= 1, got {value:?}"),
        },
        Err(_) => 5,
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A paragraph repeated until the chat prompt spans `LONG_PREFILL_CHUNKS` prefill chunks; the
/// run checks the token count the server reports.
fn long_prompt() -> String {
    prompt_of_notes(4)
}

/// `notes` numbered copies of a paragraph and a question about them.
fn prompt_of_notes(notes: usize) -> String {
    let paragraph = "Sunlight looks white but is a mixture of every visible colour. When it \
        enters the atmosphere it meets nitrogen and oxygen molecules that are much smaller than \
        its wavelengths, and they scatter short wavelengths far more strongly than long ones. \
        Blue and violet light is therefore redirected across the whole sky, while red and \
        yellow light mostly travels straight on. Our eyes are less sensitive to violet, and \
        some of it is absorbed high up, so the scattered light we see overhead looks blue. ";
    let mut prompt = String::from("Read the following notes carefully.\n\n");
    for i in 1..=notes {
        write!(prompt, "Note {i}: {paragraph}\n\n").unwrap();
    }
    prompt.push_str("Summarise the notes above in one sentence.");
    prompt
}

/// What one streamed request measured.
struct Sample {
    ttft: Duration,
    /// Time from the first to the last content chunk.
    decode: Duration,
    prompt_tokens: u64,
    completion_tokens: u64,
    text: String,
}

impl Sample {
    fn decode_tokens_per_s(&self) -> Option<f64> {
        let secs = self.decode.as_secs_f64();
        (self.completion_tokens > 1 && secs > 0.0)
            .then(|| (self.completion_tokens - 1) as f64 / secs)
    }
}

#[derive(Clone)]
struct Api {
    client: reqwest::Client,
    /// The tracker's root URL, without `/v1`.
    root: String,
    model: String,
}

impl Api {
    async fn connect(root: &str) -> Self {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .unwrap();
        let models = get_json(&client, &format!("{root}/v1/models")).await;
        let model = models["data"][0]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no model id in GET /v1/models: {models}"))
            .to_owned();
        Self {
            client,
            root: root.to_owned(),
            model,
        }
    }

    /// One streamed chat completion, timed from just before the request is sent.
    async fn stream(&self, prompt: &str, max_tokens: u32) -> Sample {
        self.try_stream(prompt, max_tokens)
            .await
            .unwrap_or_else(|(status, text)| panic!("the tracker answered {status}: {text}"))
    }

    /// [`Api::stream`], or the status and body of a refusal.
    async fn try_stream(&self, prompt: &str, max_tokens: u32) -> Result<Sample, (u16, String)> {
        let body = json!({
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let url = format!("{}/v1/chat/completions", self.root);
        let start = Instant::now();
        let mut response = self
            .client
            .post(&url)
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err((status.as_u16(), text));
        }

        let mut buffer: Vec<u8> = Vec::new();
        let mut first: Option<Instant> = None;
        let mut last: Option<Instant> = None;
        let mut usage: Option<Value> = None;
        let mut text = String::new();
        let mut done = false;
        while let Some(bytes) = response
            .chunk()
            .await
            .unwrap_or_else(|e| panic!("reading the stream from {url}: {e}"))
        {
            let now = Instant::now();
            buffer.extend_from_slice(&bytes);
            while let Some(end) = find(&buffer, b"\n\n") {
                let event: Vec<u8> = buffer.drain(..end + 2).collect();
                let event = std::str::from_utf8(&event).expect("SSE event is not UTF-8");
                for line in event.lines() {
                    let Some(data) = line.strip_prefix("data:") else {
                        continue;
                    };
                    let data = data.trim();
                    if data == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let chunk: Value = serde_json::from_str(data)
                        .unwrap_or_else(|e| panic!("bad SSE data {data:?}: {e}"));
                    if let Some(error) = chunk.get("error") {
                        panic!("the stream failed: {error}");
                    }
                    if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                        usage = Some(u.clone());
                    }
                    let content = chunk["choices"][0]["delta"]["content"]
                        .as_str()
                        .unwrap_or("");
                    if !content.is_empty() {
                        first.get_or_insert(now);
                        last = Some(now);
                        text.push_str(content);
                    }
                }
            }
        }
        assert!(done, "the stream from {url} ended without [DONE]");
        let usage = usage.expect("no usage chunk in the stream");
        let first = first.expect("the stream carried no content");
        Ok(Sample {
            ttft: first - start,
            decode: last.unwrap() - first,
            prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
            completion_tokens: usage["completion_tokens"].as_u64().unwrap(),
            text,
        })
    }

    async fn status(&self) -> Value {
        get_json(&self.client, &format!("{}/status", self.root)).await
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    let response = client
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "GET {url} answered {status}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("GET {url}: not JSON ({e}): {text}"))
}

/// Everything one setup measured.
struct Measured {
    short: Vec<Sample>,
    long: Vec<Sample>,
    route_boundaries: Value,
}

async fn measure(root: &str, runs: usize, label: &str) -> Measured {
    let api = Api::connect(root).await;
    let long = long_prompt();
    // Warm-up: the first request of a process pays for lazy allocations and cold caches.
    api.stream(SHORT_PROMPT, MAX_TOKENS).await;
    let warm = api.stream(&long, LONG_MAX_TOKENS).await;
    let min_long = (LONG_PREFILL_CHUNKS - 1) * PREFILL_CHUNK_TOKENS + 1;
    let max_long = LONG_PREFILL_CHUNKS * PREFILL_CHUNK_TOKENS;
    assert!(
        (min_long..=max_long).contains(&warm.prompt_tokens),
        "the long prompt is {} tokens, not {min_long}..={max_long} ({LONG_PREFILL_CHUNKS} \
         prefill chunks): adjust long_prompt()",
        warm.prompt_tokens
    );
    let route_boundaries = api.status().await["route_boundaries"].clone();

    let mut measured = Measured {
        short: Vec::new(),
        long: Vec::new(),
        route_boundaries,
    };
    for run in 1..=runs {
        let short = api.stream(SHORT_PROMPT, MAX_TOKENS).await;
        let long = api.stream(&long, LONG_MAX_TOKENS).await;
        eprintln!(
            "mesh_latency: {label} run {run}/{runs}: TTFT {:.1} ms, decode {:.1} tokens/s \
             ({} tokens), long-prompt TTFT {:.1} ms",
            ms(short.ttft),
            short.decode_tokens_per_s().unwrap_or(f64::NAN),
            short.completion_tokens,
            ms(long.ttft),
        );
        measured.short.push(short);
        measured.long.push(long);
    }
    let after = api.status().await["route_boundaries"].clone();
    if after != measured.route_boundaries {
        eprintln!(
            "mesh_latency: warning: {label}'s route changed during the runs: {} -> {after}",
            measured.route_boundaries
        );
    }
    measured
}

/// Time to first token of the long pipelined prompt, chunks travelling together and one at a
/// time, measured in turn so that both see the same machine.
struct Pipelining {
    prompt_tokens: u64,
    pipelined: Vec<Sample>,
    one_at_a_time: Vec<Sample>,
}

async fn pipelining(pipelined_root: &str, one_at_a_time_root: &str, runs: usize) -> Pipelining {
    let pipelined_api = Api::connect(pipelined_root).await;
    let one_at_a_time_api = Api::connect(one_at_a_time_root).await;
    let prompt = prompt_of_notes(PIPELINE_NOTES);
    let warm = pipelined_api.stream(&prompt, LONG_MAX_TOKENS).await;
    one_at_a_time_api.stream(&prompt, LONG_MAX_TOKENS).await;
    let min = (PIPELINE_PREFILL_CHUNKS - 1) * PREFILL_CHUNK_TOKENS + 1;
    let max = PIPELINE_PREFILL_CHUNKS * PREFILL_CHUNK_TOKENS;
    assert!(
        (min..=max).contains(&warm.prompt_tokens),
        "the pipelined prompt is {} tokens, not {min}..={max}: adjust PIPELINE_NOTES",
        warm.prompt_tokens
    );
    let mut measured = Pipelining {
        prompt_tokens: warm.prompt_tokens,
        pipelined: Vec::new(),
        one_at_a_time: Vec::new(),
    };
    for run in 1..=runs {
        let pipelined = pipelined_api.stream(&prompt, LONG_MAX_TOKENS).await;
        let one_at_a_time = one_at_a_time_api.stream(&prompt, LONG_MAX_TOKENS).await;
        eprintln!(
            "mesh_latency: pipelined prefill run {run}/{runs}: TTFT {:.1} ms pipelined, {:.1} ms \
             one chunk at a time",
            ms(pipelined.ttft),
            ms(one_at_a_time.ttft)
        );
        measured.pipelined.push(pipelined);
        measured.one_at_a_time.push(one_at_a_time);
    }
    measured
}

impl Pipelining {
    fn print(&self) {
        let ttft = |samples: &[Sample]| samples.iter().map(|s| ms(s.ttft)).collect::<Vec<_>>();
        let same = self
            .pipelined
            .iter()
            .chain(&self.one_at_a_time)
            .all(|s| s.text == self.pipelined[0].text);
        println!();
        println!(
            "## Pipelined prefill: a {}-token prompt through {MESH_PROCESSES}-process meshes",
            self.prompt_tokens
        );
        println!();
        println!(
            "| metric | one chunk at a time (--prefill-chunks-in-flight 1) | pipelined \
             (default) | pipelined/one at a time |"
        );
        println!("|---|---|---|---|");
        println!(
            "{}",
            row(
                "TTFT (ms)",
                ttft(&self.one_at_a_time),
                ttft(&self.pipelined),
                1
            )
        );
        println!();
        println!(
            "- greedy output identical in both: {}",
            if same { "yes" } else { "no" }
        );
    }
}

/// `MESHNET_BENCH_BURST`: chats sent at once (default 8).
fn burst_size() -> usize {
    match std::env::var("MESHNET_BENCH_BURST") {
        Ok(value) => match value.trim().parse::<usize>() {
            Ok(n) if n >= 1 => n,
            _ => panic!("MESHNET_BENCH_BURST must be an integer >= 1, got {value:?}"),
        },
        Err(_) => 8,
    }
}

/// A burst of chats sent at once, against the same chats one after another.
struct Burst {
    sent: usize,
    served: usize,
    /// Refusals by status, with the first body.
    refused: Vec<(u16, String)>,
    in_turn_wall: Duration,
    in_turn_tokens: u64,
    at_once_wall: Duration,
    at_once_tokens: u64,
    longest_ttft: Duration,
    same_text: bool,
}

async fn burst(root: &str, size: usize) -> Burst {
    let api = Api::connect(root).await;
    let started = Instant::now();
    let mut in_turn = Vec::new();
    for _ in 0..size {
        in_turn.push(api.stream(SHORT_PROMPT, BURST_MAX_TOKENS).await);
    }
    let in_turn_wall = started.elapsed();
    let started = Instant::now();
    let mut chats = tokio::task::JoinSet::new();
    for _ in 0..size {
        let api = api.clone();
        chats.spawn(async move { api.try_stream(SHORT_PROMPT, BURST_MAX_TOKENS).await });
    }
    let mut served = Vec::new();
    let mut refused = Vec::new();
    while let Some(outcome) = chats.join_next().await {
        match outcome.unwrap() {
            Ok(sample) => served.push(sample),
            Err(refusal) => refused.push(refusal),
        }
    }
    let at_once_wall = started.elapsed();
    Burst {
        sent: size,
        served: served.len(),
        same_text: served.iter().all(|s| s.text == in_turn[0].text)
            && in_turn.iter().all(|s| s.text == in_turn[0].text),
        refused,
        in_turn_wall,
        in_turn_tokens: in_turn.iter().map(|s| s.completion_tokens).sum(),
        at_once_wall,
        at_once_tokens: served.iter().map(|s| s.completion_tokens).sum(),
        longest_ttft: served.iter().map(|s| s.ttft).max().unwrap_or_default(),
    }
}

impl Burst {
    fn print(&self, setup: &str) {
        let rate = |tokens: u64, wall: Duration| tokens as f64 / wall.as_secs_f64();
        let at_once = rate(self.at_once_tokens, self.at_once_wall);
        let in_turn = rate(self.in_turn_tokens, self.in_turn_wall);
        println!();
        println!(
            "## A burst of {} greedy {BURST_MAX_TOKENS}-token chats at once, {setup} (default \
             flags)",
            self.sent
        );
        println!();
        println!("| measure | value |");
        println!("|---|---|");
        println!("| served / sent | {} / {} |", self.served, self.sent);
        let first_refusal = self
            .refused
            .first()
            .map_or(String::new(), |(status, body)| {
                format!(" (first: {status} {body})")
            });
        println!("| refused | {}{first_refusal} |", self.refused.len());
        println!(
            "| aggregate tokens/s, at once | {at_once:.1} ({} tokens in {:.2} s) |",
            self.at_once_tokens,
            self.at_once_wall.as_secs_f64()
        );
        println!(
            "| aggregate tokens/s, one after another | {in_turn:.1} ({} tokens in {:.2} s) |",
            self.in_turn_tokens,
            self.in_turn_wall.as_secs_f64()
        );
        println!("| at once / one after another | {:.2} |", at_once / in_turn);
        println!(
            "| longest time to first token, at once (ms) | {:.0} |",
            ms(self.longest_ttft)
        );
        println!(
            "| every text equal to the one-at-a-time text | {} |",
            if self.same_text { "yes" } else { "no" }
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// --- processes ---------------------------------------------------------------------------------

fn wait_healthy(root: &str, child: &mut Child, log: &Path) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let url = format!("{root}/health");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the single tracker exited ({status}) before it was healthy; log:\n{}",
                tail(log)
            );
        }
        let ok = runtime.block_on(async {
            client
                .get(&url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        });
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the single tracker was not healthy within {STARTUP_TIMEOUT:?}; log:\n{}",
            tail(log)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A tracker holding the whole model in one process; stopped on drop.
struct SingleTracker {
    child: Child,
    root: String,
}

impl SingleTracker {
    fn start(bin: &Path, dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let http = free_port();
        let mut p2p = free_port();
        while p2p == http {
            p2p = free_port();
        }
        let log_path = dir.join("tracker.log");
        let log = File::create(&log_path).unwrap();
        let child = Command::new(bin)
            .args(["--tracker", "--http"])
            .arg(format!("127.0.0.1:{http}"))
            .arg("--p2p")
            .arg(format!("/ip4/127.0.0.1/tcp/{p2p}"))
            .args(["--memory", "1GiB", "--reachable", "--data-dir"])
            .arg(dir.join("data"))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
        let mut tracker = Self {
            child,
            root: format!("http://127.0.0.1:{http}"),
        };
        let root = tracker.root.clone();
        wait_healthy(&root, &mut tracker.child, &log_path);
        tracker
    }
}

impl Drop for SingleTracker {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        // SIGTERM first for a clean shutdown, SIGKILL if it lingers.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `testnet/local.sh` mesh; `local.sh down` on drop, also when the bench panics.
struct Testnet {
    script: PathBuf,
    bin: PathBuf,
    dir: PathBuf,
    root: String,
}

impl Testnet {
    fn command(script: &Path, bin: &Path, dir: &Path) -> Command {
        let mut command = Command::new("bash");
        command
            .arg(script)
            .env("MESHNET_BIN", bin)
            .env("MESHNET_TESTNET_DIR", dir)
            .env(
                "MESHNET_TESTNET_TIMEOUT",
                STARTUP_TIMEOUT.as_secs().to_string(),
            )
            .stdin(Stdio::null());
        command
    }

    fn up(bin: &Path, dir: &Path, processes: u32) -> Self {
        Self::up_with(bin, dir, processes, &[])
    }

    /// Like [`Testnet::up`], passing `args` to every `meshnet-peer`.
    fn up_with(bin: &Path, dir: &Path, processes: u32, args: &[&str]) -> Self {
        let script = workspace_root().join("testnet").join("local.sh");
        // The guard exists before `up` so that a half-started mesh is stopped too.
        let mut testnet = Self {
            script,
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            root: String::new(),
        };
        let output = Self::command(&testnet.script, bin, dir)
            .args(["up", &processes.to_string()])
            .args(if args.is_empty() {
                &[][..]
            } else {
                &["--"][..]
            })
            .args(args)
            .env("MESHNET_HTTP_PORT", free_port().to_string())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            panic!(
                "testnet/local.sh up {processes} failed ({}):\n{stdout}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let base = stdout.lines().last().unwrap_or("").trim();
        testnet.root = base
            .strip_suffix("/v1")
            .unwrap_or_else(|| panic!("local.sh up printed no base URL last: {stdout}"))
            .to_owned();
        for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
            if line.trim() != base && !line.starts_with("stop it with") {
                eprintln!("mesh_latency: {line}");
            }
        }
        testnet
    }
}

impl Drop for Testnet {
    fn drop(&mut self) {
        let result = Self::command(&self.script, &self.bin, &self.dir)
            .arg("down")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !matches!(result, Ok(s) if s.success()) {
            eprintln!(
                "mesh_latency: `testnet/local.sh down` failed ({result:?}); stop the mesh with \
                 MESHNET_TESTNET_DIR={} testnet/local.sh down",
                self.dir.display()
            );
        }
    }
}

/// The run directory, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

// --- the table ---------------------------------------------------------------------------------

/// Median, min and max.
fn stats(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    (median, values[0], values[n - 1])
}

fn row(metric: &str, single: Vec<f64>, mesh: Vec<f64>, decimals: usize) -> String {
    let (s, s_min, s_max) = stats(single);
    let (m, m_min, m_max) = stats(mesh);
    format!(
        "| {metric} | {s:.decimals$} ({s_min:.decimals$}-{s_max:.decimals$}) \
         | {m:.decimals$} ({m_min:.decimals$}-{m_max:.decimals$}) | {:.2}x |",
        m / s
    )
}

fn main() {
    // `cargo bench` passes `--bench`; this bench takes no filter.
    let bin = peer_binary();
    let runs = runs();
    let dir = TempDir(
        std::env::temp_dir().join(format!("meshnet-bench-mesh-latency-{}", std::process::id())),
    );
    std::fs::create_dir_all(&dir.0).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());

    eprintln!("mesh_latency: starting a single tracker holding the whole model");
    let started = Instant::now();
    let single = SingleTracker::start(&bin, &dir.0.join("single"));
    eprintln!(
        "mesh_latency: single tracker healthy after {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let single_measured = runtime.block_on(measure(&single.root, runs, "single"));
    let single_burst = runtime.block_on(burst(&single.root, burst_size()));
    drop(single);

    eprintln!("mesh_latency: starting a {MESH_PROCESSES}-process mesh with testnet/local.sh");
    let started = Instant::now();
    let mesh = Testnet::up(&bin, &dir.0.join("mesh"), MESH_PROCESSES);
    eprintln!(
        "mesh_latency: mesh covers the model after {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let mesh_measured = runtime.block_on(measure(&mesh.root, runs, "mesh"));
    let burst_measured = runtime.block_on(burst(&mesh.root, burst_size()));
    drop(mesh);

    eprintln!(
        "mesh_latency: starting two {MESH_PROCESSES}-process meshes, pipelined and one chunk at \
         a time"
    );
    let pipelined = Testnet::up(&bin, &dir.0.join("pipelined"), MESH_PROCESSES);
    let one_at_a_time = Testnet::up_with(
        &bin,
        &dir.0.join("one-at-a-time"),
        MESH_PROCESSES,
        &["--prefill-chunks-in-flight", "1"],
    );
    let pipelining_measured =
        runtime.block_on(pipelining(&pipelined.root, &one_at_a_time.root, runs));
    drop(pipelined);
    drop(one_at_a_time);

    let short_prompt_tokens = single_measured.short[0].prompt_tokens;
    let long_prompt_tokens = single_measured.long[0].prompt_tokens;
    let completion: Vec<u64> = single_measured
        .short
        .iter()
        .chain(&mesh_measured.short)
        .map(|s| s.completion_tokens)
        .collect();
    let same_text = single_measured.short[0].text == mesh_measured.short[0].text;

    println!();
    println!(
        "## meshnet: single process vs {MESH_PROCESSES}-process mesh on loopback \
         ({runs} runs, median (min-max))"
    );
    println!();
    println!("- binary: {}", bin.display());
    println!("- cores: {cores}");
    println!(
        "- single route boundaries: {}; mesh route boundaries: {}",
        single_measured.route_boundaries, mesh_measured.route_boundaries
    );
    println!(
        "- short prompt: {short_prompt_tokens} tokens, max_tokens {MAX_TOKENS}, completion \
         tokens per run {}..={}; long prompt: {long_prompt_tokens} tokens ({LONG_PREFILL_CHUNKS} \
         prefill chunks), max_tokens {LONG_MAX_TOKENS}; temperature 0, stream=true",
        completion.iter().min().unwrap(),
        completion.iter().max().unwrap()
    );
    println!(
        "- greedy output of the short prompt identical in both setups: {}",
        if same_text { "yes" } else { "no" }
    );
    println!();
    println!("| metric | single | mesh | mesh/single |");
    println!("|---|---|---|---|");
    let ttft = |m: &Measured, long: bool| -> Vec<f64> {
        let samples = if long { &m.long } else { &m.short };
        samples.iter().map(|s| ms(s.ttft)).collect()
    };
    let rate = |m: &Measured| -> Vec<f64> {
        m.short
            .iter()
            .map(|s| s.decode_tokens_per_s().unwrap_or(f64::NAN))
            .collect()
    };
    println!(
        "{}",
        row(
            &format!("TTFT, {short_prompt_tokens}-token prompt (ms)"),
            ttft(&single_measured, false),
            ttft(&mesh_measured, false),
            1
        )
    );
    println!(
        "{}",
        row(
            "decode (tokens/s)",
            rate(&single_measured),
            rate(&mesh_measured),
            1
        )
    );
    println!(
        "{}",
        row(
            &format!("TTFT, {long_prompt_tokens}-token prompt (ms)"),
            ttft(&single_measured, true),
            ttft(&mesh_measured, true),
            1
        )
    );
    single_burst.print("single process");
    burst_measured.print(&format!("through the {MESH_PROCESSES}-process mesh"));
    pipelining_measured.print();
}
