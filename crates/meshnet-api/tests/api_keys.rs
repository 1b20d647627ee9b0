//! `--api-keys` through the router: 401 without a key or with a wrong one, 200 with a right
//! one, 429 with the exact `Retry-After` once a key's requests or tokens per minute are spent,
//! and the per-key counters of `/metrics`, all on a clock the test moves.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use meshnet_api::{ApiKeyGuard, require_api_keys};
use meshnet_apikeys::{KeyBook, ManualClock, parse_key_file};
use meshnet_metrics::{Metrics, Registry};
use serde_json::{Value, json};
use support::{MODEL, Script, ScriptedEngine, app, assert_error, sse_data};
use tower::ServiceExt;

/// alice may make 2 requests a minute; bob may use 20 tokens a minute.
const KEYS: &str = "# test keys\nsk-alice id=alice rpm=2\nsk-bob id=bob tpm=20\n";

struct Mesh {
    router: Router,
    clock: Arc<ManualClock>,
    registry: Registry,
}

fn mesh() -> Mesh {
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let clock = Arc::new(ManualClock::at(Duration::from_secs(100)));
    let book = KeyBook::new(parse_key_file(KEYS).unwrap());
    let guard = Arc::new(ApiKeyGuard::new(book, clock.clone(), metrics));
    let engine = ScriptedEngine::new(Script::hello());
    Mesh {
        router: require_api_keys(app(&engine), guard),
        clock,
        registry,
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap()
    }

    fn retry_after(&self) -> Option<&str> {
        self.headers
            .get("retry-after")
            .map(|value| value.to_str().unwrap())
    }
}

async fn chat(mesh: &Mesh, key: Option<&str>, extra: Value) -> Answer {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]});
    for (field, value) in extra.as_object().unwrap() {
        body[field] = value.clone();
    }
    let mut request =
        Request::post("/v1/chat/completions").header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let request = request.body(Body::from(body.to_string())).unwrap();
    let response = mesh.router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        text: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

fn at(mesh: &Mesh, millis: u64) {
    mesh.clock.set(Duration::from_millis(millis));
}

fn series(mesh: &Mesh, name: &str) -> Option<f64> {
    let text = meshnet_metrics::encode(&mesh.registry);
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn a_request_needs_a_known_key() {
    let mesh = mesh();
    let missing = chat(&mesh, None, json!({})).await;
    assert_eq!(missing.status, 401);
    assert_error(
        &missing.json(),
        "invalid_request_error",
        None,
        Some("invalid_api_key"),
    );
    assert!(
        missing.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("didn't provide")
    );

    let wrong = chat(&mesh, Some("sk-mallory"), json!({})).await;
    assert_eq!(wrong.status, 401);
    assert_error(
        &wrong.json(),
        "invalid_request_error",
        None,
        Some("invalid_api_key"),
    );
    assert!(!wrong.text.contains("sk-mallory"), "{}", wrong.text);

    let right = chat(&mesh, Some("sk-alice"), json!({})).await;
    assert_eq!(right.status, 200, "{}", right.text);
    assert_eq!(
        right.json()["choices"][0]["message"]["content"],
        "Hello, wörld"
    );

    // Paths no route serves still answer 404, key or not.
    let request = Request::get("/v2/nothing").body(Body::empty()).unwrap();
    let unknown = mesh.router.clone().oneshot(request).await.unwrap();
    assert_eq!(unknown.status(), 404);

    assert_eq!(
        series(&mesh, "meshnet_api_unauthorized_total{reason=\"missing\"}"),
        Some(1.0)
    );
    assert_eq!(
        series(&mesh, "meshnet_api_unauthorized_total{reason=\"invalid\"}"),
        Some(1.0)
    );
    assert_eq!(
        series(&mesh, "meshnet_api_key_requests_total{key=\"alice\"}"),
        Some(1.0)
    );
}

#[tokio::test]
async fn requests_per_minute_answer_429_with_the_seconds_left() {
    let mesh = mesh();
    at(&mesh, 100_000);
    assert_eq!(chat(&mesh, Some("sk-alice"), json!({})).await.status, 200);
    at(&mesh, 110_500);
    assert_eq!(chat(&mesh, Some("sk-alice"), json!({})).await.status, 200);
    // The first request leaves the window at 160 s: from 120.25 s, 39.75 s, so 40.
    at(&mesh, 120_250);
    let limited = chat(&mesh, Some("sk-alice"), json!({})).await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.retry_after(), Some("40"));
    assert_error(
        &limited.json(),
        "rate_limit_error",
        None,
        Some("rate_limit_exceeded"),
    );
    assert_eq!(
        limited.json()["error"]["message"],
        "Rate limit reached for API key alice on requests per minute (rpm): limit 2, used 2, \
         requested 1. Please try again in 40s."
    );
    at(&mesh, 159_999);
    assert_eq!(
        chat(&mesh, Some("sk-alice"), json!({})).await.retry_after(),
        Some("1")
    );
    // Another key has a window of its own.
    assert_eq!(chat(&mesh, Some("sk-bob"), json!({})).await.status, 200);
    at(&mesh, 160_000);
    let streamed = chat(&mesh, Some("sk-alice"), json!({"stream": true})).await;
    assert_eq!(streamed.status, 200);
    assert_eq!(
        sse_data(&streamed.text).last().map(String::as_str),
        Some("[DONE]")
    );

    for (name, value) in [
        ("meshnet_api_key_requests_total{key=\"alice\"}", 3.0),
        (
            "meshnet_api_key_rate_limited_total{key=\"alice\",limit=\"rpm\"}",
            2.0,
        ),
        (
            "meshnet_api_key_tokens_total{key=\"alice\",kind=\"prompt\"}",
            15.0,
        ),
        (
            "meshnet_api_key_tokens_total{key=\"alice\",kind=\"completion\"}",
            9.0,
        ),
        ("meshnet_api_key_requests_total{key=\"bob\"}", 1.0),
    ] {
        assert_eq!(series(&mesh, name), Some(value), "{name}");
    }
}

#[tokio::test]
async fn tokens_per_minute_count_usage_and_refuse_a_reservation_early() {
    let mesh = mesh();
    // Each answer uses 5 prompt and 3 completion tokens; max_tokens 10 is reserved first.
    at(&mesh, 170_000);
    assert_eq!(
        chat(&mesh, Some("sk-bob"), json!({"max_tokens": 10}))
            .await
            .status,
        200
    );
    at(&mesh, 175_000);
    assert_eq!(
        chat(&mesh, Some("sk-bob"), json!({"max_tokens": 10}))
            .await
            .status,
        200
    );
    // 16 used: 10 more would pass 20. 6 must leave: the 8 of 170 s, at 230 s.
    at(&mesh, 180_000);
    let limited = chat(&mesh, Some("sk-bob"), json!({"max_tokens": 10})).await;
    assert_eq!(limited.status, 429, "{}", limited.text);
    assert_eq!(limited.retry_after(), Some("50"));
    assert_eq!(
        limited.json()["error"]["message"],
        "Rate limit reached for API key bob on tokens per minute (tpm): limit 20, used 16, \
         requested 10. Please try again in 50s."
    );
    // 4 tokens still fit.
    assert_eq!(
        chat(&mesh, Some("sk-bob"), json!({"max_tokens": 4}))
            .await
            .status,
        200
    );
    // More than the whole limit can never run: a 400 naming max_tokens, at once.
    let too_large = chat(&mesh, Some("sk-bob"), json!({"max_tokens": 7, "n": 3})).await;
    assert_eq!(too_large.status, 400);
    assert_error(
        &too_large.json(),
        "invalid_request_error",
        Some("max_tokens"),
        None,
    );
    // 24 counted now (usage may pass the reservation). At 231 s the 8 of 170 s are gone;
    // 5 more would make 21: the 8 of 175 s must leave too, at 235 s.
    at(&mesh, 231_000);
    let spent = chat(&mesh, Some("sk-bob"), json!({"max_tokens": 5})).await;
    assert_eq!(spent.retry_after(), Some("4"));
    at(&mesh, 235_000);
    assert_eq!(
        chat(&mesh, Some("sk-bob"), json!({"max_tokens": 5}))
            .await
            .status,
        200
    );

    for (name, value) in [
        ("meshnet_api_key_requests_total{key=\"bob\"}", 4.0),
        (
            "meshnet_api_key_tokens_total{key=\"bob\",kind=\"prompt\"}",
            20.0,
        ),
        (
            "meshnet_api_key_tokens_total{key=\"bob\",kind=\"completion\"}",
            12.0,
        ),
        (
            "meshnet_api_key_rate_limited_total{key=\"bob\",limit=\"tpm\"}",
            2.0,
        ),
    ] {
        assert_eq!(series(&mesh, name), Some(value), "{name}");
    }
}
