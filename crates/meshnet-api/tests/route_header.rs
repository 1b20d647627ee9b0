//! The `X-Meshnet-Route` extension header: which members serve a generation, on whole and
//! streamed answers.

#![allow(clippy::unwrap_used)]

mod support;

use meshnet_api::{EngineError, FinishReason, ROUTE_HEADER};
use serde_json::{Value, json};
use support::{End, MODEL, Script, ScriptedEngine, app, post, serve, sse_data};

/// The header value for `support::scripted_route`, as docs/openai-api.md spells it.
const SCRIPTED_ROUTE: &str = "12D3KooWEntry:0..12, 12D3KooWLast:12..24";

fn chat(stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": stream,
    })
}

fn completion(stream: bool) -> Value {
    json!({"model": MODEL, "prompt": "Hi", "stream": stream})
}

fn route_of(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(ROUTE_HEADER)
        .map(|value| value.to_str().unwrap())
}

/// POSTs `body` over TCP; returns the status, the route header and the body text.
async fn post_over_tcp(base: &str, path: &str, body: &Value) -> (u16, Option<String>, String) {
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let route = response
        .headers()
        .get("X-Meshnet-Route")
        .map(|value| value.to_str().unwrap().to_owned());
    (status, route, response.text().await.unwrap())
}

#[tokio::test]
async fn whole_chat_and_completion_answers_name_the_route() {
    let engine = ScriptedEngine::new(Script::hello());
    for (path, body) in [
        ("/v1/chat/completions", chat(false)),
        ("/v1/completions", completion(false)),
    ] {
        let answer = post(app(&engine), path, &body).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
        assert_eq!(route_of(&answer.headers), Some(SCRIPTED_ROUTE), "{path}");
    }
}

#[tokio::test]
async fn streamed_answers_name_the_route_in_their_headers() {
    let engine = ScriptedEngine::new(Script::hello());
    let base = serve(&engine).await;
    for (path, body) in [
        ("/v1/chat/completions", chat(true)),
        ("/v1/completions", completion(true)),
    ] {
        let (status, route, text) = post_over_tcp(&base, path, &body).await;
        assert_eq!(status, 200, "{path}: {text}");
        assert_eq!(route.as_deref(), Some(SCRIPTED_ROUTE), "{path}");
        assert_eq!(sse_data(&text).last().unwrap(), "[DONE]", "{path}: {text}");
    }
}

#[tokio::test]
async fn a_generation_that_fails_midway_still_names_its_route() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 3,
        deltas: vec!["Hel"],
        end: End::Fail(|| EngineError::Upstream("peer B went away".to_owned())),
    });
    let answer = post(app(&engine), "/v1/chat/completions", &chat(false)).await;
    assert_eq!(answer.status, 502, "{}", answer.body);
    assert_eq!(route_of(&answer.headers), Some(SCRIPTED_ROUTE));

    let base = serve(&engine).await;
    let (status, route, text) = post_over_tcp(&base, "/v1/chat/completions", &chat(true)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(route.as_deref(), Some(SCRIPTED_ROUTE));
    let last: Value = serde_json::from_str(sse_data(&text).last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{text}");
}

#[tokio::test]
async fn refused_requests_and_engines_naming_no_route_send_no_route_header() {
    // Refused by the API before the engine sees it.
    let engine = ScriptedEngine::new(Script::hello());
    let mut body = chat(false);
    body["max_tokens"] = json!(0);
    let answer = post(app(&engine), "/v1/chat/completions", &body).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert_eq!(route_of(&answer.headers), None);
    assert!(engine.requests().is_empty());

    // Refused by the engine: no route was chosen.
    let engine = ScriptedEngine::new(Script::Refuse(|| {
        EngineError::NotCovered("no ready peer serves layer 12".to_owned())
    }));
    let answer = post(app(&engine), "/v1/chat/completions", &chat(false)).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(route_of(&answer.headers), None);

    // Served by an engine that names no route.
    let engine = ScriptedEngine::with_route(
        Script::Generate {
            prompt_tokens: 2,
            deltas: vec!["ok"],
            end: End::Finish(FinishReason::Stop, 1),
        },
        Vec::new(),
    );
    let answer = post(app(&engine), "/v1/chat/completions", &chat(false)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(route_of(&answer.headers), None);
}
