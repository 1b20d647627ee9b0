#!/usr/bin/env python3
"""Make the chat-template fixture: real templates rendered by Python's jinja2.

What it makes
-------------
    crates/meshnet-model/tests/fixtures/templates/expected.json

Every `*.jinja` file of llama.cpp's `models/templates/` directory (real chat
templates of Llama 3.x, Qwen 2.5 / 3, Gemma, Phi-3.5, Mistral, DeepSeek, ...,
fetched into a cache by scripts/fetch-llama-references.sh) is rendered with
jinja2 for a fixed set of conversations, with and without a generation
prompt. The environment is set up the way Hugging Face's
`apply_chat_template` sets it up:

  - an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
    loop-controls extension, and a `{% generation %}` block tag that renders
    its body unchanged (it only marks assistant text there);
  - `tojson` replaced by json.dumps with ensure_ascii=False and its indent,
    separators and sort_keys arguments;
  - globals `raise_exception(msg)` (raises a TemplateError with msg) and
    `strftime_now(fmt)`;
  - the render variables `messages`, `tools=None`, `documents=None`,
    `add_generation_prompt`, `bos_token`, `eos_token`.

One deliberate difference: `strftime_now` formats a fixed moment (FIXED_NOW
below) instead of the current time, so the fixture does not change by the day;
the Rust test gives its renderer the same moment.

The JSON holds, for each template, its file name and SHA-256, and one case per
(conversation, add_generation_prompt): the expected text, or the error jinja2
raised (its type and message).

How to run it
-------------
From the repository root, with the references in the cache and jinja2 in a
virtual environment outside the repository:

    bash scripts/fetch-llama-references.sh
    python3 -m venv ~/.venvs/meshnet-templates
    ~/.venvs/meshnet-templates/bin/pip install jinja2==3.1.6
    ~/.venvs/meshnet-templates/bin/python scripts/make_template_fixture.py

Options: --templates DIR (default: the cache directory the fetch script uses),
--output PATH.
"""

import argparse
import hashlib
import json
import os
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# The moment strftime_now formats (the Rust test uses the same one).
FIXED_NOW = datetime(2025, 1, 2, 3, 4, 5)

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! Who are you?"},
    ],
    "user_only": [
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "several_turns": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": 'Say "café" & <b>bold</b>, then stop.'},
    ],
    "several_turns_no_system": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And times three?  "},
    ],
}


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def strftime_now(fmt):
    return FIXED_NOW.strftime(fmt)


def environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_case(template, messages, add_generation_prompt):
    try:
        text = template.render(
            messages=messages,
            tools=None,
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
            **render_case(template, messages, add_generation_prompt),
        }
        for name, messages in CONVERSATIONS.items()
        for add_generation_prompt in (False, True)
    ]
    return entry


def default_templates_dir():
    cache = os.environ.get("MESHNET_REFERENCES") or str(
        Path.home() / ".cache" / "meshnet" / "references"
    )
    return Path(cache) / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "models" / "templates"


def main():
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--templates", type=Path, default=default_templates_dir())
    parser.add_argument(
        "--output",
        type=Path,
        default=repo / "crates/meshnet-model/tests/fixtures/templates/expected.json",
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
        "templates": [template_entry(env, path) for path in paths],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    failed = sum(1 for t in fixture["templates"] for c in t["cases"] if "error" in c)
    total = sum(len(t["cases"]) for t in fixture["templates"])
    print(f"{len(paths)} templates, {total} cases ({failed} raise) -> {args.output}")


if __name__ == "__main__":
    main()
