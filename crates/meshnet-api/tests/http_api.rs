//! Whole (non-streamed) answers, validation and error mapping, exercised through the router.

#![allow(clippy::unwrap_used)]

mod support;

use std::time::{SystemTime, UNIX_EPOCH};

use meshnet_api::{ChatTurn, EngineError, FinishReason, PromptInput};
use meshnet_types::SamplingConfig;
use serde_json::{Value, json};
use support::{BOS, End, MODEL, Script, ScriptedEngine, VOCAB_SIZE, app, assert_error, call, post};

fn chat_body() -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
}

fn with(mut body: Value, field: &str, value: Value) -> Value {
    body[field] = value;
    body
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
async fn lists_and_retrieves_the_model() {
    let engine = ScriptedEngine::new(Script::hello());
    let list = call(app(&engine), "GET", "/v1/models", None).await;
    assert_eq!(list.status, 200);
    let model = json!({"id": MODEL, "object": "model", "created": 1_700_000_000,
                       "owned_by": "meshnet", "context_length": 1024, "family": "llama",
                       "quantization": "q4_1", "tensor_types": {"F32": 61, "Q4_1": 211}});
    assert_eq!(
        list.body,
        json!({"object": "list", "data": [model.clone()]})
    );

    let one = call(app(&engine), "GET", "/v1/models/test-model", None).await;
    assert_eq!(one.status, 200);
    assert_eq!(one.body, model);

    let missing = call(app(&engine), "GET", "/v1/models/org/other-model", None).await;
    assert_eq!(missing.status, 404);
    assert_error(
        &missing.body,
        "invalid_request_error",
        Some("model"),
        Some("model_not_found"),
    );
    assert!(
        missing.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("org/other-model")
    );
}

#[tokio::test]
async fn chat_answer_has_the_openai_shape() {
    let engine = ScriptedEngine::new(Script::hello());
    let before = unix_now();
    let body = json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
        ],
        "max_tokens": 16,
        "temperature": 0,
        "top_p": 0.9,
        "seed": 42,
        "stop": "\n\n",
        "n": 1,
        "user": "someone",
        "presence_penalty": 0.1,
        "frequency_penalty": -0.5,
        "logit_bias": {"999": -100},
        "top_k": 3,
        "min_p": 0.25
    });
    let answer = post(app(&engine), "/v1/chat/completions", &body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.headers["content-type"], "application/json");

    let id = answer.body["id"].as_str().unwrap().to_owned();
    let uuid = id.strip_prefix("chatcmpl-").unwrap();
    assert_eq!(uuid.len(), 32);
    assert!(uuid.chars().all(|c| c.is_ascii_hexdigit()));
    let created = answer.body["created"].as_u64().unwrap();
    assert!((before..=unix_now()).contains(&created));
    assert_eq!(
        answer.body,
        json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": MODEL,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": "Hello, wörld"},
                "finish_reason": "stop",
                "logprobs": null
            }],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        })
    );

    let requests = engine.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert_eq!(request.request_id, id);
    assert_eq!(
        request.prompt,
        PromptInput::Chat(vec![
            ChatTurn::new("system", "Be nice."),
            ChatTurn::new("user", "Hi"),
        ])
    );
    assert_eq!(request.max_tokens, Some(16));
    assert_eq!(request.stop, vec!["\n\n".to_owned()]);
    let sampling = SamplingConfig {
        temperature: 0.0,
        top_p: Some(0.9),
        seed: 42,
        presence_penalty: 0.1,
        frequency_penalty: -0.5,
        logit_bias: vec![(999, -100.0)],
        top_k: Some(3),
        min_p: Some(0.25),
    };
    assert_eq!(request.sampling, sampling);
}

#[tokio::test]
async fn completion_answer_has_the_openai_shape() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 2,
        deltas: vec![" upon", " a time"],
        end: End::Finish(FinishReason::Length, 3),
    });
    let body = json!({"model": MODEL, "prompt": ["Once"], "max_tokens": 3, "echo": false});
    let answer = post(app(&engine), "/v1/completions", &body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let id = answer.body["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("cmpl-"));
    assert_eq!(
        answer.body,
        json!({
            "id": id,
            "object": "text_completion",
            "created": answer.body["created"],
            "model": MODEL,
            "choices": [{"index": 0, "text": " upon a time", "finish_reason": "length", "logprobs": null}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        })
    );
    let request = &engine.requests()[0];
    assert_eq!(request.request_id, id);
    assert_eq!(request.prompt, PromptInput::Text("Once".into()));
    assert_eq!(request.max_tokens, Some(3));
    let sampling = SamplingConfig {
        temperature: 1.0,
        seed: request.sampling.seed,
        ..SamplingConfig::greedy()
    };
    assert_eq!(request.sampling, sampling);
}

#[tokio::test]
async fn n_choices_come_whole_in_index_order_with_their_tokens_added_up() {
    let engine = ScriptedEngine::new(Script::hello());
    let body = json!({"model": MODEL, "prompt": "Hi", "n": 2, "seed": 5});
    let answer = post(app(&engine), "/v1/completions", &body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        answer.body["choices"],
        json!([
            {"index": 0, "text": "Hello, wörld", "finish_reason": "stop", "logprobs": null},
            {"index": 1, "text": "Hello#1, #1wörld#1", "finish_reason": "stop", "logprobs": null}
        ])
    );
    assert_eq!(
        answer.body["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11})
    );
    let request = &engine.requests()[0];
    assert_eq!((request.n, request.sampling.seed), (2, 5));
}

#[tokio::test]
async fn completions_echo_the_prompt_with_legacy_logprobs() {
    let engine = ScriptedEngine::new(Script::hello());
    let body = json!({"model": MODEL, "prompt": "Once", "echo": true, "logprobs": 1});
    let answer = post(app(&engine), "/v1/completions", &body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let choice = &answer.body["choices"][0];
    assert_eq!(choice["text"], "OnceHello, wörld");
    // The scripted entries: "ce" and each delta at -1.5 with "x" at -0.25 beside it, and a
    // last token without text.
    let scored = json!({"x": -0.25, "ce": -1.5});
    assert_eq!(
        choice["logprobs"],
        json!({
            "tokens": ["On", "ce", "Hello", ", ", "wörld", ""],
            "token_logprobs": [null, -1.5, -1.5, -1.5, -1.5, -1.5],
            "top_logprobs": [null, scored,
                             {"x": -0.25, "Hello": -1.5}, {"x": -0.25, ", ": -1.5},
                             {"x": -0.25, "wörld": -1.5}, {"x": -0.25, "": -1.5}],
            "text_offset": [0, 2, 4, 9, 11, 17]
        })
    );
    let request = &engine.requests()[0];
    assert_eq!((request.echo, request.logprobs), (true, Some(1)));

    // Echo alone: the text only.
    let body = json!({"model": MODEL, "prompt": "Once", "echo": true});
    let answer = post(app(&engine), "/v1/completions", &body).await;
    assert_eq!(answer.body["choices"][0]["text"], "OnceHello, wörld");
    assert_eq!(answer.body["choices"][0]["logprobs"], Value::Null);
}

#[tokio::test]
async fn a_completion_prompt_may_be_token_ids() {
    let engine = ScriptedEngine::new(Script::hello());
    for prompt in [json!([1, 2, 999]), json!([[1, 2, 999]])] {
        let body = json!({"model": MODEL, "prompt": prompt});
        let answer = post(app(&engine), "/v1/completions", &body).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let requests = engine.requests();
    for request in &requests {
        assert_eq!(request.prompt, PromptInput::Tokens(vec![1, 2, 999]));
    }
}

#[tokio::test]
async fn several_prompts_each_get_n_choices_in_prompt_order() {
    let engine = ScriptedEngine::new(Script::hello());
    let two = json!({"model": MODEL, "prompt": ["one", [7, 8]], "n": 2});
    let answer = post(app(&engine), "/v1/completions", &two).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let texts: Vec<&str> = answer.body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(index, choice)| {
            assert_eq!(choice["index"], index);
            choice["text"].as_str().unwrap()
        })
        .collect();
    let other = "Hello#1, #1wörld#1";
    assert_eq!(texts, ["Hello, wörld", other, "Hello, wörld", other]);
    assert_eq!(
        answer.body["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22})
    );
    let prompts: Vec<PromptInput> = engine.requests().iter().map(|r| r.prompt.clone()).collect();
    assert_eq!(
        prompts,
        [
            PromptInput::Text("one".into()),
            PromptInput::Tokens(vec![7, 8])
        ]
    );

    let nine = json!({"model": MODEL, "prompt": vec!["x"; 9]});
    let answer = post(app(&engine), "/v1/completions", &nine).await;
    assert_eq!(answer.status, 400);
    assert_error(&answer.body, "invalid_request_error", Some("prompt"), None);
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(message.contains("9 prompts"), "{message}");
}

#[tokio::test]
async fn tokenize_and_detokenize_use_the_engine_tokenizer() {
    let engine = ScriptedEngine::new(Script::hello());
    let answer = post(app(&engine), "/tokenize", &json!({"content": "hé"})).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body, json!({"tokens": [104, 195, 169]}));
    let body = json!({"content": "hi", "add_special": true});
    let answer = post(app(&engine), "/tokenize", &body).await;
    assert_eq!(answer.body, json!({"tokens": [BOS, 104, 105]}));

    let body = json!({"tokens": [BOS, 104, 195, 169]});
    let answer = post(app(&engine), "/detokenize", &body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body, json!({"content": "<s>hé"}));
    let answer = post(app(&engine), "/detokenize", &json!({"tokens": []})).await;
    assert_eq!(answer.body, json!({"content": ""}));

    for (path, body, param) in [
        ("/tokenize", json!({}), "content"),
        ("/tokenize", json!({"content": ["a"]}), "content"),
        (
            "/tokenize",
            json!({"content": "a", "add_special": 1}),
            "add_special",
        ),
        ("/detokenize", json!({"tokens": [VOCAB_SIZE]}), "tokens"),
        ("/detokenize", json!({"tokens": [1, -2]}), "tokens"),
        ("/detokenize", json!({"content": "a"}), "tokens"),
    ] {
        let answer = post(app(&engine), path, &body).await;
        assert_eq!(answer.status, 400, "{path} {body}: {}", answer.body);
        assert_error(&answer.body, "invalid_request_error", Some(param), None);
    }
    let answer = call(app(&engine), "GET", "/tokenize", None).await;
    assert_eq!(answer.status, 405);
    assert!(engine.requests().is_empty(), "no generation was started");
}

#[tokio::test]
async fn max_completion_tokens_wins_over_max_tokens() {
    let engine = ScriptedEngine::new(Script::hello());
    let body = with(
        with(chat_body(), "max_tokens", json!(100)),
        "max_completion_tokens",
        json!(7),
    );
    let answer = post(app(&engine), "/v1/chat/completions", &body).await;
    assert_eq!(answer.status, 200);
    assert_eq!(engine.requests()[0].max_tokens, Some(7));
}

#[tokio::test]
async fn invalid_requests_are_400_naming_the_field() {
    let cases: Vec<(&str, String, Option<&str>)> = vec![
        ("/v1/chat/completions", "{\"model\": ".into(), None),
        ("/v1/chat/completions", "[1, 2]".into(), None),
        ("/v1/chat/completions", String::new(), None),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}]}).to_string(),
            Some("model"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL}).to_string(),
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "messages", json!([])).to_string(),
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "messages", json!({"role": "user"})).to_string(),
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            with(
                chat_body(),
                "messages",
                json!([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]),
            )
            .to_string(),
            Some("messages[1].role"),
        ),
        (
            "/v1/chat/completions",
            with(
                chat_body(),
                "messages",
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            )
            .to_string(),
            Some("messages[0].content[0].type"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "max_tokens", json!(0)).to_string(),
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "max_completion_tokens", json!(0)).to_string(),
            Some("max_completion_tokens"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "temperature", json!(3)).to_string(),
            Some("temperature"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "top_p", json!(0)).to_string(),
            Some("top_p"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "n", json!(9)).to_string(),
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "frequency_penalty", json!(-3)).to_string(),
            Some("frequency_penalty"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}).to_string(),
            Some("presence_penalty"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "logit_bias", json!({"1000": 1})).to_string(),
            Some("logit_bias"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "logit_bias": {"5": -101}}).to_string(),
            Some("logit_bias"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "top_k", json!(0)).to_string(),
            Some("top_k"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "min_p": 2}).to_string(),
            Some("min_p"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "stop", json!(["a", "b", "c", "d", "e"])).to_string(),
            Some("stop"),
        ),
        (
            "/v1/chat/completions",
            with(chat_body(), "stream", json!("yes")).to_string(),
            Some("stream"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL}).to_string(),
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": [1, 2, 1000]}).to_string(),
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "echo": "yes"}).to_string(),
            Some("echo"),
        ),
    ];
    let engine = ScriptedEngine::new(Script::hello());
    for (path, body, param) in cases {
        let answer = call(app(&engine), "POST", path, Some(&body)).await;
        assert_eq!(answer.status, 400, "{path} {body}: {}", answer.body);
        assert_error(&answer.body, "invalid_request_error", param, None);
    }
    assert!(
        engine.requests().is_empty(),
        "invalid requests reached the engine"
    );
}

#[tokio::test]
async fn unknown_model_is_404() {
    let engine = ScriptedEngine::new(Script::hello());
    let body = with(chat_body(), "model", json!("gpt-4o"));
    let answer = post(app(&engine), "/v1/chat/completions", &body).await;
    assert_eq!(answer.status, 404);
    assert_error(
        &answer.body,
        "invalid_request_error",
        Some("model"),
        Some("model_not_found"),
    );
    assert!(engine.requests().is_empty());
}

/// What an engine refusal must turn into.
struct Expected {
    status: u16,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
    retry_after: Option<&'static str>,
}

#[tokio::test]
async fn engine_refusals_map_to_statuses() {
    let cases: [(fn() -> EngineError, Expected); 5] = [
        (
            || EngineError::InvalidRequest {
                param: Some("max_tokens".into()),
                message: "prompt (1000 tokens) plus max_tokens (100) exceeds the context".into(),
            },
            Expected {
                status: 400,
                kind: "invalid_request_error",
                param: Some("max_tokens"),
                code: None,
                retry_after: None,
            },
        ),
        (
            || EngineError::Busy {
                reason: "4 generations are running and 32 are waiting".into(),
                retry_after_seconds: 3,
            },
            Expected {
                status: 429,
                kind: "rate_limit_error",
                param: None,
                code: Some("rate_limit_exceeded"),
                retry_after: Some("3"),
            },
        ),
        (
            || EngineError::NotCovered("no peer holds layers 6..12".into()),
            Expected {
                status: 503,
                kind: "server_error",
                param: None,
                code: Some("model_not_covered"),
                retry_after: Some("10"),
            },
        ),
        (
            || EngineError::Upstream("peer 12D3 dropped the session".into()),
            Expected {
                status: 502,
                kind: "server_error",
                param: None,
                code: Some("upstream_error"),
                retry_after: None,
            },
        ),
        (
            || EngineError::Internal("oops".into()),
            Expected {
                status: 500,
                kind: "server_error",
                param: None,
                code: Some("internal_error"),
                retry_after: None,
            },
        ),
    ];
    for (error, expected) in cases {
        let engine = ScriptedEngine::new(Script::Refuse(error));
        for (path, body) in [
            ("/v1/chat/completions", chat_body()),
            ("/v1/completions", json!({"model": MODEL, "prompt": "x"})),
        ] {
            let answer = post(app(&engine), path, &body).await;
            assert_eq!(answer.status, expected.status, "{path}: {}", answer.body);
            assert_error(&answer.body, expected.kind, expected.param, expected.code);
            assert_eq!(
                answer
                    .headers
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap()),
                expected.retry_after
            );
        }
        // Errors found before any generation starts are plain HTTP errors even when streaming.
        let streamed = post(
            app(&engine),
            "/v1/chat/completions",
            &with(chat_body(), "stream", json!(true)),
        )
        .await;
        assert_eq!(streamed.status, expected.status);
        assert_eq!(streamed.headers["content-type"], "application/json");
    }
}

#[tokio::test]
async fn failure_during_generation_is_the_mapped_status() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["partial"],
        end: End::Fail(|| EngineError::Upstream("peer went away".into())),
    });
    let answer = post(app(&engine), "/v1/chat/completions", &chat_body()).await;
    assert_eq!(answer.status, 502);
    assert_error(&answer.body, "server_error", None, Some("upstream_error"));
    assert!(
        answer.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("peer went away")
    );
}

#[tokio::test]
async fn wrong_method_and_unknown_path_are_json_errors() {
    let engine = ScriptedEngine::new(Script::hello());
    let get = call(app(&engine), "GET", "/v1/chat/completions", None).await;
    assert_eq!(get.status, 405);
    assert_error(
        &get.body,
        "invalid_request_error",
        None,
        Some("method_not_allowed"),
    );

    let delete = call(app(&engine), "DELETE", "/v1/models", None).await;
    assert_eq!(delete.status, 405);

    let unknown = call(app(&engine), "POST", "/v1/embeddings", Some("{}")).await;
    assert_eq!(unknown.status, 404);
    assert_error(
        &unknown.body,
        "invalid_request_error",
        None,
        Some("unknown_url"),
    );
    assert!(
        unknown.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("POST /v1/embeddings")
    );
}

#[tokio::test]
async fn oversized_body_is_413_json() {
    let engine = ScriptedEngine::new(Script::hello());
    let huge = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "x".repeat(meshnet_api::MAX_BODY_BYTES)}]
    });
    let answer = post(app(&engine), "/v1/chat/completions", &huge).await;
    assert_eq!(answer.status, 413);
    assert_error(
        &answer.body,
        "invalid_request_error",
        None,
        Some("request_too_large"),
    );
}
