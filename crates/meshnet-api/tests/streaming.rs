//! Server-sent event streams and cancellation, over real TCP connections.

#![allow(clippy::unwrap_used)]

mod support;

use futures::StreamExt;
use meshnet_api::{EngineError, FinishReason};
use serde_json::{Value, json};
use support::{
    DEADLINE, End, MODEL, Script, ScriptedEngine, assert_error, scripted_logprob, serve, sse_data,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// POSTs `body` and returns the status, content type and whole body text.
async fn post_text(base: &str, path: &str, body: &Value) -> (u16, String, String) {
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    (status, content_type, response.text().await.unwrap())
}

fn parse_json(data: &[String]) -> Vec<Value> {
    data.iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn streaming_chat(include_usage: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": true,
        "stream_options": {"include_usage": include_usage}
    })
}

#[tokio::test]
async fn chat_stream_with_usage() {
    let engine = ScriptedEngine::new(Script::hello());
    let base = serve(&engine).await;
    let (status, content_type, text) =
        post_text(&base, "/v1/chat/completions", &streaming_chat(true)).await;
    assert_eq!(status, 200);
    assert_eq!(content_type, "text/event-stream");

    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]", "{text}");
    let chunks = parse_json(&data[..data.len() - 1]);
    // role, 3 deltas, finish, usage
    assert_eq!(chunks.len(), 6, "{text}");

    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert_eq!(engine.requests()[0].request_id, id);
    for chunk in &chunks {
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], MODEL);
        assert_eq!(chunk["created"], chunks[0]["created"]);
    }

    assert_eq!(
        chunks[0]["choices"],
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}])
    );
    assert_eq!(chunks[0]["usage"], Value::Null);

    let content: String = chunks[1..4]
        .iter()
        .map(|c| {
            assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
            assert!(c["choices"][0]["delta"].get("role").is_none());
            c["choices"][0]["delta"]["content"].as_str().unwrap()
        })
        .collect();
    assert_eq!(content, "Hello, wörld");

    assert_eq!(
        chunks[4]["choices"],
        json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}])
    );
    assert_eq!(chunks[4]["usage"], Value::Null);

    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(
        chunks[5]["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})
    );
}

#[tokio::test]
async fn logprobs_ride_with_the_text_they_complete_streamed_or_whole() {
    let engine = ScriptedEngine::new(Script::hello());
    let base = serve(&engine).await;
    let mut body = streaming_chat(false);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(1);
    let (status, _, text) = post_text(&base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let data = sse_data(&text);
    let chunks = parse_json(&data[..data.len() - 1]);
    // role, 3 deltas, finish
    assert_eq!(chunks.len(), 5, "{text}");
    let logprobs_of = |texts: &[&str]| {
        let content: Vec<_> = texts.iter().map(|t| scripted_logprob(t)).collect();
        json!({"content": content, "refusal": null})
    };
    assert_eq!(chunks[0]["choices"][0]["logprobs"], Value::Null);
    for (chunk, delta) in chunks[1..4].iter().zip(["Hello", ", ", "wörld"]) {
        assert_eq!(chunk["choices"][0]["delta"]["content"], delta);
        assert_eq!(chunk["choices"][0]["logprobs"], logprobs_of(&[delta]));
    }
    // The entry of a token without text comes with the finish.
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[4]["choices"][0]["logprobs"], logprobs_of(&[""]));
    assert_eq!(engine.requests()[0].logprobs, Some(1));

    body["stream"] = json!(false);
    let (status, _, text) = post_text(&base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let whole: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        whole["choices"][0]["logprobs"],
        logprobs_of(&["Hello", ", ", "wörld", ""])
    );
}

#[tokio::test]
async fn chat_stream_without_usage() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 1,
        deltas: vec!["a", "", "b"],
        end: End::Finish(FinishReason::Length, 2),
    });
    let base = serve(&engine).await;
    let mut body = streaming_chat(false);
    body.as_object_mut().unwrap().remove("stream_options");
    let (status, _, text) = post_text(&base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks = parse_json(&data[..data.len() - 1]);
    // role, "a", "b" (the empty delta is skipped), finish
    assert_eq!(chunks.len(), 4, "{text}");
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "a");
    assert_eq!(chunks[2]["choices"][0]["delta"]["content"], "b");
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn completion_stream() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 2,
        deltas: vec![" upon", " a time"],
        end: End::Finish(FinishReason::Length, 3),
    });
    let base = serve(&engine).await;
    let body = json!({"model": MODEL, "prompt": "Once", "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, content_type, text) = post_text(&base, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(content_type, "text/event-stream");
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks = parse_json(&data[..data.len() - 1]);
    // 2 deltas, finish, usage; no role chunk
    assert_eq!(chunks.len(), 4, "{text}");
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion");
        assert!(chunk["id"].as_str().unwrap().starts_with("cmpl-"));
    }
    assert_eq!(
        chunks[0]["choices"],
        json!([{"index": 0, "text": " upon", "logprobs": null, "finish_reason": null}])
    );
    assert_eq!(chunks[1]["choices"][0]["text"], " a time");
    assert_eq!(
        chunks[2]["choices"],
        json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}])
    );
    assert_eq!(
        chunks[3]["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5})
    );
}

#[tokio::test]
async fn failure_mid_stream_is_an_error_event_without_done() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["par", "tial"],
        end: End::Fail(|| EngineError::Upstream("peer 7 lost its connection".into())),
    });
    let base = serve(&engine).await;
    let (status, _, text) = post_text(&base, "/v1/chat/completions", &streaming_chat(true)).await;
    assert_eq!(status, 200);
    let data = sse_data(&text);
    assert!(!data.iter().any(|d| d == "[DONE]"), "{text}");
    let events = parse_json(&data);
    assert_eq!(events.len(), 4, "{text}");
    assert_eq!(events[1]["choices"][0]["delta"]["content"], "par");
    assert_eq!(events[2]["choices"][0]["delta"]["content"], "tial");
    let error = &events[3];
    assert_error(error, "server_error", None, Some("upstream_error"));
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("peer 7 lost its connection")
    );
}

#[tokio::test]
async fn engine_vanishing_mid_stream_is_an_internal_error_event() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["x"],
        end: End::Vanish,
    });
    let base = serve(&engine).await;
    let body = json!({"model": MODEL, "prompt": "p", "stream": true});
    let (status, _, text) = post_text(&base, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    let events = parse_json(&sse_data(&text));
    assert_eq!(events.len(), 2, "{text}");
    assert_error(&events[1], "server_error", None, Some("internal_error"));
}

#[tokio::test]
async fn raw_tcp_client_disconnecting_mid_stream_cancels_the_generation() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["Hello"],
        end: End::HoldOpen,
    });
    let base = serve(&engine).await;
    let addr = base.strip_prefix("http://").unwrap();
    let body = streaming_chat(false).to_string();
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();

    let mut received = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&received).contains("\"content\":\"Hello\"") {
            let n = socket.read(&mut buf).await.unwrap();
            assert!(n > 0, "connection closed early");
            received.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .unwrap();
    let head = String::from_utf8_lossy(&received);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");

    // The stream is live and holds the generation open until the client leaves.
    assert_eq!(engine.closed_count(), 0);
    drop(socket);
    assert!(
        engine.wait_closed(1).await,
        "the engine's sender did not see the receiver dropped"
    );
}

#[tokio::test]
async fn http_client_dropping_the_response_cancels_the_generation() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["Hello"],
        end: End::HoldOpen,
    });
    let base = serve(&engine).await;
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "p", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut seen = String::new();
    tokio::time::timeout(DEADLINE, async {
        while !seen.contains("Hello") {
            let chunk = body.next().await.unwrap().unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .unwrap();
    assert_eq!(engine.closed_count(), 0);
    drop(body);
    assert!(
        engine.wait_closed(1).await,
        "the engine's sender did not see the receiver dropped"
    );
}

#[tokio::test]
async fn client_leaving_a_whole_answer_cancels_the_generation() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["Hello"],
        end: End::HoldOpen,
    });
    let base = serve(&engine).await;
    let request = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}))
        .send();
    let client = tokio::spawn(request);
    assert!(engine.wait_started(1).await, "the generation never started");
    assert_eq!(engine.closed_count(), 0);
    client.abort();
    assert!(
        engine.wait_closed(1).await,
        "the engine's sender did not see the receiver dropped"
    );
}

/// Every choice of `n` streams under its own index: the texts put back together per index
/// are each choice's whole text, each index finishes once, and the usage adds up every
/// choice's tokens.
#[tokio::test]
async fn n_choices_stream_under_their_own_indexes() {
    let engine = ScriptedEngine::new(Script::hello());
    let base = serve(&engine).await;
    let mut body = streaming_chat(true);
    body["n"] = json!(3);
    let (status, _, text) = post_text(&base, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]", "{text}");
    let chunks = parse_json(&data[..data.len() - 1]);
    let mut texts = vec![String::new(); 3];
    let mut roles = vec![0; 3];
    let mut finishes = vec![0; 3];
    for chunk in &chunks[..chunks.len() - 1] {
        let choices = chunk["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 1, "{chunk}");
        let index = choices[0]["index"].as_u64().unwrap() as usize;
        let delta = &choices[0]["delta"];
        if delta["role"] == "assistant" {
            roles[index] += 1;
        }
        texts[index].push_str(delta["content"].as_str().unwrap_or(""));
        if !choices[0]["finish_reason"].is_null() {
            finishes[index] += 1;
        }
    }
    assert_eq!(roles, [1, 1, 1]);
    assert_eq!(finishes, [1, 1, 1]);
    assert_eq!(
        texts,
        ["Hello, wörld", "Hello#1, #1wörld#1", "Hello#2, #2wörld#2"]
    );
    assert_eq!(
        chunks.last().unwrap()["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14})
    );
    assert_eq!(engine.requests()[0].n, 3);
}

/// A choice that fails ends the whole stream with the error, and the other choices are
/// cancelled.
#[tokio::test]
async fn one_failing_choice_fails_the_stream_of_all() {
    let engine = ScriptedEngine::new(Script::Generate {
        prompt_tokens: 5,
        deltas: vec!["a"],
        end: End::Fail(|| EngineError::Upstream("peer 9 went away".into())),
    });
    let base = serve(&engine).await;
    let body = json!({"model": MODEL, "prompt": "p", "stream": true, "n": 2});
    let (status, _, text) = post_text(&base, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    let events = parse_json(&sse_data(&text));
    assert!(!text.contains("[DONE]"), "{text}");
    assert_error(
        events.last().unwrap(),
        "server_error",
        None,
        Some("upstream_error"),
    );
}
