//! The binary's terminal commands that talk to a running member over HTTP:
//! `meshnet-peer status` (the coverage map and peers as a table) and `meshnet-peer chat` (a
//! streaming chat with a history). The text they print comes from [`meshnet_peer::console`].

use std::io::{BufRead, IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use meshnet_peer::console::{SseDecoder, StreamEvent, member_base_url, status_table};
use meshnet_peer::status::StatusReport;
use serde_json::{Value, json};

/// The member the commands talk to when `--url` is not given: `testnet/local.sh`'s tracker.
pub const DEFAULT_MEMBER_URL: &str = "http://127.0.0.1:8080";

/// How long connecting to a member may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a member may stay silent in a streamed answer (the first token of a long prompt
/// on a slow mesh included).
const READ_TIMEOUT: Duration = Duration::from_secs(300);

/// The most bytes of a non-streamed answer (`/status`, `/v1/models`, an error) kept.
const BODY_LIMIT: usize = 16 << 20;

/// What `chat` is asked.
#[derive(clap::Args)]
pub struct ChatArgs {
    /// Any member of the mesh (the tracker, or a peer that passes the API on to it).
    #[arg(long, default_value = DEFAULT_MEMBER_URL)]
    pub url: String,
    /// The most tokens of one answer.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// Sampling temperature (0: always the likeliest token).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f64,
    /// A system message that opens the conversation.
    #[arg(long)]
    pub system: Option<String>,
}

/// What `status` is asked.
#[derive(clap::Args)]
pub struct StatusArgs {
    /// Any member of the mesh.
    #[arg(long, default_value = DEFAULT_MEMBER_URL)]
    pub url: String,
    /// Print the raw `/status` JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn http_client() -> anyhow::Result<reqwest::Client> {
    http_client_builder()
        .build()
        .context("building the HTTP client")
}

fn http_client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
}

/// The environment variable `chat` takes an API key from (for a member with `--api-keys`).
const API_KEY_VARIABLE: &str = "MESHNET_API_KEY";

/// A client that sends `Authorization: Bearer $MESHNET_API_KEY` when that is set.
fn api_client() -> anyhow::Result<reqwest::Client> {
    let key = std::env::var(API_KEY_VARIABLE).unwrap_or_default();
    let key = key.trim();
    if key.is_empty() {
        return http_client();
    }
    let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
        .map_err(|_| anyhow::anyhow!("{API_KEY_VARIABLE} holds characters a header cannot"))?;
    value.set_sensitive(true);
    let headers = reqwest::header::HeaderMap::from_iter([(reqwest::header::AUTHORIZATION, value)]);
    http_client_builder()
        .default_headers(headers)
        .build()
        .context("building the HTTP client")
}

/// Reads at most [`BODY_LIMIT`] bytes of an answer.
async fn bounded_body(mut response: reqwest::Response, url: &str) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .with_context(|| format!("reading the answer of {url}"))?
    {
        if body.len() + chunk.len() > BODY_LIMIT {
            bail!("{url} sent more than {BODY_LIMIT} bytes");
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The reason in an error answer: the OpenAI-style `error.message`, the member's `reason`, or
/// the body itself.
fn error_reason(body: &[u8]) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    parsed
        .as_ref()
        .and_then(|value| {
            value
                .pointer("/error/message")
                .or_else(|| value.get("reason"))
                .or_else(|| value.get("error"))
        })
        .map(|reason| {
            reason
                .as_str()
                .map_or_else(|| reason.to_string(), str::to_owned)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned())
}

/// GETs a document from a member; a non-200 answer is an error naming its reason.
async fn get_body(client: &reqwest::Client, url: &str) -> anyhow::Result<Vec<u8>> {
    let response = client
        .get(url)
        .send()
        .await
        .with_context(|| format!("cannot reach a member at {url}"))?;
    let status = response.status();
    let body = bounded_body(response, url).await?;
    if !status.is_success() {
        bail!("{url} answered {status}: {}", error_reason(&body));
    }
    Ok(body)
}

/// GETs a JSON document from a member; a non-200 answer is an error naming its reason.
async fn get_json(client: &reqwest::Client, url: &str) -> anyhow::Result<Value> {
    let body = get_body(client, url).await?;
    serde_json::from_slice(&body).with_context(|| format!("{url} did not answer JSON"))
}

/// The status report in a `/status` answer from `url`; a body that is not one is an error
/// naming `url` and what does not parse.
fn parse_status(body: &[u8], url: &str) -> anyhow::Result<StatusReport> {
    serde_json::from_slice(body)
        .map_err(|error| anyhow::anyhow!("{url} did not answer a status report: {error}"))
}

/// `status`: the member's `/status` as a table (or as JSON with `--json`).
pub fn status(args: &StatusArgs) -> anyhow::Result<()> {
    let base = member_base_url(&args.url).map_err(anyhow::Error::msg)?;
    let url = format!("{base}/status");
    if args.json {
        let status = runtime()?.block_on(async { get_json(&http_client()?, &url).await })?;
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        let body = runtime()?.block_on(async { get_body(&http_client()?, &url).await })?;
        print!("{}", status_table(&parse_status(&body, &url)?));
    }
    Ok(())
}

/// What one streamed answer took.
struct AnswerStats {
    text: String,
    completion_tokens: Option<u64>,
    first_token: Option<Duration>,
    total: Duration,
}

/// `chat`: reads lines from standard input, sends each with the conversation so far, and
/// prints the answer as it streams, then its token count, tokens per second and time to the
/// first token. `/reset` forgets the conversation, `/quit` (or end of input) leaves.
pub fn chat(args: &ChatArgs) -> anyhow::Result<()> {
    if !(args.temperature.is_finite() && (0.0..=2.0).contains(&args.temperature)) {
        bail!(
            "--temperature must be between 0 and 2, got {}",
            args.temperature
        );
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let base = member_base_url(&args.url).map_err(anyhow::Error::msg)?;
    let runtime = runtime()?;
    let client = api_client()?;
    let models_url = format!("{base}/v1/models");
    let models = runtime.block_on(get_json(&client, &models_url))?;
    let model = models
        .pointer("/data/0/id")
        .and_then(Value::as_str)
        .with_context(|| format!("{models_url} lists no model"))?
        .to_owned();

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!(
            "chatting with {model} at {base} (/reset forgets the conversation, /quit leaves)"
        );
    }
    let opening: Vec<Value> = args
        .system
        .iter()
        .map(|system| json!({"role": "system", "content": system}))
        .collect();
    let mut history = opening.clone();
    let mut stdin = std::io::stdin().lock();
    while let Some(prompt) = next_prompt(&mut stdin, interactive)? {
        match prompt.as_str() {
            "/quit" | "/exit" => break,
            "/reset" => {
                history.clone_from(&opening);
                eprintln!("(conversation forgotten)");
                continue;
            }
            _ => {}
        }
        history.push(json!({"role": "user", "content": prompt}));
        let request = json!({
            "model": model,
            "messages": history,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match runtime.block_on(stream_answer(&client, &base, &request)) {
            Ok(stats) => {
                println!();
                eprintln!("{}", describe(&stats));
                history.push(json!({"role": "assistant", "content": stats.text}));
            }
            Err(error) => {
                // The question stays unanswered: it leaves the history, the chat goes on.
                history.pop();
                println!();
                eprintln!("error: {error:#}");
                if !interactive {
                    return Err(error);
                }
            }
        }
    }
    Ok(())
}

/// The next non-empty line of `input`, trimmed (`None` at its end), after a `you>` prompt
/// when a person types.
fn next_prompt(input: &mut impl BufRead, interactive: bool) -> anyhow::Result<Option<String>> {
    let mut line = String::new();
    loop {
        if interactive {
            eprint!("you> ");
            std::io::stderr().flush().ok();
        }
        line.clear();
        if input
            .read_line(&mut line)
            .context("reading standard input")?
            == 0
        {
            return Ok(None);
        }
        let prompt = line.trim();
        if !prompt.is_empty() {
            return Ok(Some(prompt.to_owned()));
        }
    }
}

/// `[12 tokens, 35.1 tokens/s, first token after 180 ms]`.
fn describe(stats: &AnswerStats) -> String {
    let tokens = stats
        .completion_tokens
        .map_or_else(|| "? tokens".to_owned(), |n| format!("{n} tokens"));
    let rate = match stats.completion_tokens {
        Some(n) if stats.total > Duration::ZERO => {
            format!(", {:.1} tokens/s", n as f64 / stats.total.as_secs_f64())
        }
        _ => String::new(),
    };
    let first = stats.first_token.map_or_else(String::new, |first| {
        format!(", first token after {} ms", first.as_millis())
    });
    format!("[{tokens}{rate}{first}]")
}

/// Sends one streamed chat request and prints the answer's text as it arrives.
async fn stream_answer(
    client: &reqwest::Client,
    base: &str,
    request: &Value,
) -> anyhow::Result<AnswerStats> {
    let url = format!("{base}/v1/chat/completions");
    let started = Instant::now();
    let mut response = client
        .post(&url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(serde_json::to_vec(request)?)
        .send()
        .await
        .with_context(|| format!("cannot reach a member at {url}"))?;
    let status = response.status();
    if !status.is_success() {
        let body = bounded_body(response, &url).await?;
        bail!("the member answered {status}: {}", error_reason(&body));
    }
    let mut decoder = SseDecoder::default();
    let mut stats = AnswerStats {
        text: String::new(),
        completion_tokens: None,
        first_token: None,
        total: Duration::ZERO,
    };
    let mut stdout = std::io::stdout();
    let mut done = false;
    while !done
        && let Some(chunk) = response
            .chunk()
            .await
            .with_context(|| format!("reading the answer of {url}"))?
    {
        for event in decoder.push(&chunk).map_err(anyhow::Error::msg)? {
            match event {
                StreamEvent::Delta(text) => {
                    stats.first_token.get_or_insert_with(|| started.elapsed());
                    print!("{text}");
                    stdout.flush().ok();
                    stats.text.push_str(&text);
                }
                StreamEvent::Usage {
                    completion_tokens, ..
                } => stats.completion_tokens = Some(completion_tokens),
                StreamEvent::Error(message) => bail!("the mesh failed mid-answer: {message}"),
                StreamEvent::Done => done = true,
            }
        }
    }
    if !done {
        bail!("the stream from {url} ended before its end marker");
    }
    stats.total = started.elapsed();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_reasons_are_found_in_either_shape() {
        assert_eq!(
            error_reason(br#"{"error":{"message":"model not found","type":"x"}}"#),
            "model not found"
        );
        assert_eq!(error_reason(br#"{"reason":"no route"}"#), "no route");
        assert_eq!(error_reason(b"plain text\n"), "plain text");
    }

    #[test]
    fn a_body_that_is_not_a_status_report_names_the_url_and_the_field() {
        let url = "http://127.0.0.1:8080/status";
        let error = parse_status(br#"{"peer": "p", "role": "tracker"}"#, url).unwrap_err();
        let message = error.to_string();
        assert!(message.starts_with(url), "{message}");
        assert!(message.contains("missing field"), "{message}");
        let error = parse_status(b"<html>", url).unwrap_err();
        assert!(error.to_string().contains("did not answer a status report"));
    }

    #[test]
    fn stats_read_as_a_line() {
        let stats = AnswerStats {
            text: String::new(),
            completion_tokens: Some(10),
            first_token: Some(Duration::from_millis(150)),
            total: Duration::from_secs(2),
        };
        assert_eq!(
            describe(&stats),
            "[10 tokens, 5.0 tokens/s, first token after 150 ms]"
        );
    }
}
