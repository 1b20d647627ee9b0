#!/usr/bin/env python3
"""Make the tool-use chat-template fixture: real templates rendered by jinja2 with tools.

What it makes
-------------
    crates/meshnet-model/tests/fixtures/templates/tools.json

Every `*.jinja` file of llama.cpp's `models/templates/` directory (fetched into a cache by
scripts/fetch-llama-references.sh) that renders the tools it is offered is rendered with
jinja2, set up exactly as
scripts/make_template_fixture.py sets it up (Hugging Face's `apply_chat_template`), for
conversations that use tools, with and without a generation prompt:

  - `tools` is a list of `{"type": "function", "function": {...}}` objects, as
    `apply_chat_template(tools=...)` passes them;
  - an assistant message that calls tools (OpenAI's `content: null`) has `content: ""` (Qwen
    3's template raises on `None`) and `tool_calls` of `{"id", "type": "function", "function":
    {"name", "arguments"}}` with the arguments a dict (`json.loads` of the text an OpenAI
    client sends back), as Hugging Face templates expect;
  - a tool's result is `{"role": "tool", "tool_call_id", "content"}`;
  - messages without calls have no `tool_calls` key at all.

The fixture keeps tools and arguments as the JSON *text* a client sends (object keys in a
deliberately unsorted order), so the Rust test hands the renderer the same text and the
rendering shows whether key order survives.

How to run it
-------------
As scripts/make_template_fixture.py (jinja2 3.1.6 in a virtual environment outside the
repository):

    bash scripts/fetch-llama-references.sh
    ~/.venvs/meshnet-templates/bin/python scripts/make_tool_template_fixture.py

Options: --templates DIR (default: the cache directory the fetch script uses), --output PATH.
"""

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path

import jinja2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_template_fixture import (  # noqa: E402
    BOS_TOKEN,
    EOS_TOKEN,
    FIXED_NOW,
    LLAMA_CPP_PYTHON_VERSION,
    default_templates_dir,
    environment,
)

WEATHER = (
    '{"type": "function", "function": {"name": "get_weather", "description": '
    '"The current weather in a city.", "parameters": {"type": "object", "properties": '
    '{"unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": '
    '"Temperature unit."}, "city": {"type": "string", "description": "The city, e.g. '
    'Paris."}}, "required": ["city"]}}}'
)
SEARCH = (
    '{"type": "function", "function": {"name": "search", "description": "Searches the web.", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string", '
    '"description": "What to look for."}, "limit": {"type": "integer", "description": '
    '"At most this many results."}}, "required": ["query"]}}}'
)


def call(call_id, name, arguments):
    return {"id": call_id, "name": name, "arguments": arguments}


# Messages as the fixture stores them: calls with their arguments as JSON text.
CONVERSATIONS = {
    "offer_tools": {
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ],
    },
    "offer_tools_no_system": {
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Weather in Rome, in fahrenheit?"}],
    },
    "call_and_result": {
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    call("call_a1", "get_weather", '{"unit": "celsius", "city": "Paris"}')
                ],
            },
            {"role": "tool", "tool_call_id": "call_a1", "content": '{"temperature": 18.5}'},
        ],
    },
    "two_calls_and_results": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Paris and in Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    call("call_b1", "get_weather", '{"city": "Paris"}'),
                    call("call_b2", "get_weather", '{"city": "Rome", "unit": "celsius"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "call_b1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_b2", "content": "25 C"},
            {"role": "assistant", "content": "Paris has 18 C and Rome 25 C."},
            {"role": "user", "content": "Thanks!"},
        ],
    },
    "history_without_tools": {
        "tools": None,
        "messages": [
            {"role": "user", "content": "Search for meshes."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("call_c1", "search", '{"query": "mesh", "limit": 3}')],
            },
            {"role": "tool", "tool_call_id": "call_c1", "content": "three results"},
        ],
    },
}


def hf_messages(messages):
    """The messages as apply_chat_template takes them: arguments as dicts, no null content."""
    rendered = []
    for message in copy.deepcopy(messages):
        if message.get("content") is None:
            message["content"] = ""
        if "tool_calls" in message:
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.loads(c["arguments"])},
                }
                for c in message["tool_calls"]
            ]
        rendered.append(message)
    return rendered


def render_case(template, conversation, add_generation_prompt):
    tools = conversation["tools"]
    try:
        text = template.render(
            messages=hf_messages(conversation["messages"]),
            tools=None if tools is None else [json.loads(t) for t in tools],
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=BOS_TOKEN,
            eos_token=EOS_TOKEN,
        )
        return {"text": text}
    except Exception as error:  # any failure is part of the expected behaviour
        return {"error": {"type": type(error).__name__, "message": str(error)}}


def template_entry(env, path):
    source = path.read_bytes()
    entry = {"file": path.name, "sha256": hashlib.sha256(source).hexdigest()}
    try:
        template = env.from_string(source.decode("utf-8"))
    except Exception as error:
        entry["compile_error"] = {"type": type(error).__name__, "message": str(error)}
        entry["cases"] = []
        return entry
    entry["cases"] = [
        {
            "conversation": name,
            "add_generation_prompt": add_generation_prompt,
            **render_case(template, conversation, add_generation_prompt),
        }
        for name, conversation in CONVERSATIONS.items()
        for add_generation_prompt in (False, True)
    ]
    return entry


def shows_tools(entry):
    """Whether the template renders the tools it is offered (only those are kept)."""
    return any(
        case["conversation"] == "offer_tools" and "get_weather" in case.get("text", "")
        for case in entry["cases"]
    )


def main():
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--templates", type=Path, default=default_templates_dir())
    parser.add_argument(
        "--output",
        type=Path,
        default=repo / "crates/meshnet-model/tests/fixtures/templates/tools.json",
    )
    args = parser.parse_args()
    paths = sorted(args.templates.glob("*.jinja"))
    if not paths:
        sys.exit(f"no *.jinja files in {args.templates}: run scripts/fetch-llama-references.sh")
    env = environment()
    fixture = {
        "source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist, vendor/llama.cpp/models/templates",
        "jinja2": jinja2.__version__,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "now": FIXED_NOW.isoformat(),
        "conversations": CONVERSATIONS,
        "templates": [
            entry for entry in (template_entry(env, path) for path in paths) if shows_tools(entry)
        ],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    failed = sum(1 for t in fixture["templates"] for c in t["cases"] if "error" in c)
    total = sum(len(t["cases"]) for t in fixture["templates"])
    print(
        f"{len(fixture['templates'])} of {len(paths)} templates render tools; {total} cases "
        f"({failed} raise) -> {args.output}"
    )


if __name__ == "__main__":
    main()
