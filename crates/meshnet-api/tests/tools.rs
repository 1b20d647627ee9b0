//! Tool calls through the router: the request's tools reach the engine, and the engine's
//! calls reach the client in OpenAI's shape, whole and streamed.

#![allow(clippy::unwrap_used)]

mod support;

use meshnet_api::{EngineEvent, FinishReason, ToolChoice};
use serde_json::{Value, json};
use support::{End, MODEL, Script, ScriptedEngine, app, post, serve, sse_data};

/// Text, then two calls, the first's arguments in two pieces.
fn calls() -> Vec<EngineEvent> {
    vec![
        EngineEvent::Delta("Checking.".into()),
        EngineEvent::ToolCallStart {
            index: 0,
            id: "call_a".into(),
            name: "get_weather".into(),
        },
        EngineEvent::ToolCallArguments {
            index: 0,
            text: "{\"city\": ".into(),
        },
        EngineEvent::ToolCallArguments {
            index: 0,
            text: "\"Paris\"}".into(),
        },
        EngineEvent::ToolCallStart {
            index: 1,
            id: "call_b".into(),
            name: "get_time".into(),
        },
        EngineEvent::ToolCallArguments {
            index: 1,
            text: "{}".into(),
        },
    ]
}

fn engine() -> std::sync::Arc<ScriptedEngine> {
    ScriptedEngine::new(Script::Events {
        prompt_tokens: 9,
        events: calls,
        end: End::Finish(FinishReason::ToolCalls, 12),
    })
}

fn body() -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_time"}}
        ],
        "tool_choice": "required"
    })
}

#[tokio::test]
async fn calls_come_back_in_the_message_with_finish_reason_tool_calls() {
    let engine = engine();
    let answer = post(app(&engine), "/v1/chat/completions", &body()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        answer.body["choices"][0],
        json!({
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"id": "call_a", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "call_b", "type": "function",
                     "function": {"name": "get_time", "arguments": "{}"}}
                ]
            },
            "finish_reason": "tool_calls",
            "logprobs": null
        })
    );
    let request = &engine.requests()[0];
    let tools = request.tools.as_ref().unwrap();
    assert_eq!(tools.choice, ToolChoice::Required);
    assert!(tools.parallel);
    let names: Vec<&str> = tools.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    // The tool's text as sent (serde_json writes the test's keys sorted).
    assert_eq!(tools.tools[1].json, body()["tools"][1].to_string());

    // With tool_choice "none" the engine is offered no tools.
    let mut none = body();
    none["tool_choice"] = json!("none");
    let answer = post(app(&engine), "/v1/chat/completions", &none).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(engine.requests()[1].tools, None);
}

#[tokio::test]
async fn streamed_calls_are_tool_call_deltas_with_their_index() {
    let engine = engine();
    let base = serve(&engine).await;
    let mut streamed = body();
    streamed["stream"] = json!(true);
    let text = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let data = sse_data(&text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let deltas: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0].clone())
        .map(|choice| json!([choice["delta"], choice["finish_reason"]]))
        .collect();
    let arguments = |index: usize, text: &str| json!([{"tool_calls": [{"index": index, "function": {"arguments": text}}]}, null]);
    let start = |index: usize, id: &str, name: &str| {
        json!([{"tool_calls": [{"index": index, "id": id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}, null])
    };
    assert_eq!(
        deltas,
        [
            json!([{"role": "assistant", "content": ""}, null]),
            json!([{"content": "Checking."}, null]),
            start(0, "call_a", "get_weather"),
            arguments(0, "{\"city\": "),
            arguments(0, "\"Paris\"}"),
            start(1, "call_b", "get_time"),
            arguments(1, "{}"),
            json!([{}, "tool_calls"]),
        ]
    );
}
