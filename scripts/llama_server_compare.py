#!/usr/bin/env python3
"""Compares the JSON structure of meshnet's OpenAI-style API with llama.cpp's llama-server.

Usage:
    python3 scripts/llama_server_compare.py http://127.0.0.1:8080 [--llama-server URL]
        [--llama-server-bin PATH] [--model-file GGUF] [--timeout SECONDS]

The first argument is a running meshnet member's base URL (with or without `/v1`). Without
`--llama-server`, the script starts llama-server itself on a free port of 127.0.0.1 with the
model file (default ~/.cache/meshnet/SmolLM2-135M-Instruct.Q4_1.gguf, which should be the file
the mesh serves) and stops it when done, whatever happens. The binary comes from
`bash benches/anchors/llamacpp.sh llama-server` (default path under ~/.cache/meshnet/anchors).

It sends the same requests to both servers with plain urllib: chat whole and streamed, with
logprobs, stop, seed, sampling, penalties, logit_bias, token limits and n=2; completions from a
string, token ids, several prompts, with echo and legacy logprobs; /tokenize, /detokenize,
/v1/models; and requests that must fail. For each pair of answers it compares the structure
field by field (keys, value types, list lengths that must match, the values of `object`,
`finish_reason`, `role`, `index` and the error fields, HTTP status, SSE framing) and prints
one line per structural difference, grouped per request, then a summary. Values that
legitimately differ (ids, timestamps, model names, generated text, numbers) are not compared;
for greedy (temperature 0) requests it says whether the texts are equal, for information.

Not part of CI. Exits 0 once the report is printed, differences or not; non-zero only when it
could not run (a server unreachable, llama-server missing or not starting).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

OURS = "meshnet"
THEIRS = "llama-server"
MODEL = "$MODEL"  # replaced by each server's own model id
DEFAULT_MODEL_FILE = Path.home() / ".cache/meshnet/SmolLM2-135M-Instruct.Q4_1.gguf"
ANCHORS = Path(os.environ.get("MESHNET_ANCHORS", Path.home() / ".cache/meshnet/anchors"))
DEFAULT_BINARY = ANCHORS / "llama.cpp/build/bin/llama-server"

# With a system message of its own, so that neither server adds the template's default one
# (llama-server renders it, meshnet leaves it out); one case goes without, to show that.
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTION = {"role": "user", "content": "Name three colours of the rainbow."}
MESSAGES = [SYSTEM, QUESTION]
PROMPT = "The capital of France is"
MAX_TOKENS = 12

# Keys whose values are compared (the others only by type).
VALUE_KEYS = {"object", "finish_reason", "role", "index", "type", "param", "code"}
# Objects whose keys are data (token texts), compared as maps: only their values' types.
MAP_PATHS = ("choices[].logprobs.top_logprobs[]",)
# Lists whose length follows the generated text: compared only when the texts are equal.
TEXT_LENGTH_SUFFIXES = (
    "logprobs.content",
    "logprobs.tokens",
    "logprobs.token_logprobs",
    "logprobs.text_offset",
    "logprobs.top_logprobs",
    ".bytes",
)


class CannotRun(Exception):
    """The comparison cannot run at all (a server is missing or unreachable)."""


@dataclass
class Case:
    """One request sent to both servers."""

    name: str
    path: str
    body: object = None  # a dict with MODEL placeholders, or bytes sent as they are
    method: str = "POST"
    greedy: bool = False  # temperature 0: the texts should match


@dataclass
class Answer:
    """What one server answered to a case."""

    status: int | None = None
    content_type: str = ""
    body: object = None  # the parsed JSON of a whole answer
    raw: str = ""
    events: list | None = None  # a stream's parsed `data:` chunks, in order
    framing: dict = field(default_factory=dict)
    failure: str | None = None  # transport failure (no HTTP answer)


@dataclass
class Findings:
    """What the comparison of one pair of answers found."""

    texts_equal: bool
    differences: list = field(default_factory=list)  # structural, counted
    notes: list = field(default_factory=list)  # information, not counted


@dataclass
class Server:
    """A server under comparison: its name, root URL and model id."""

    name: str
    root: str
    model: str = ""


# ---------------------------------------------------------------------------------------------
# HTTP


def root_url(url):
    """The server root of a base URL given with or without `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def fill_model(value, model):
    """The request body with every MODEL placeholder replaced by the server's model id."""
    if isinstance(value, dict):
        return {k: fill_model(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_model(v, model) for v in value]
    return model if value == MODEL else value


def send(server, case, timeout):
    """Sends a case to a server and reads the whole answer (a stream to its end)."""
    data = None
    if case.body is not None:
        body = fill_model(case.body, server.model)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.root + case.path, data=data, method=case.method)
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", "Bearer meshnet")
    answer = Answer()
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        response = error
    except (urllib.error.URLError, OSError) as error:
        answer.failure = f"no answer: {error}"
        return answer
    with response:
        answer.status = response.status
        answer.content_type = (response.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            answer.raw = response.read().decode("utf-8", errors="replace")
        except OSError as error:
            answer.failure = f"answer cut off: {error}"
            return answer
    if answer.content_type == "text/event-stream":
        read_stream(answer)
    else:
        try:
            answer.body = json.loads(answer.raw)
        except ValueError:
            answer.body = None
    return answer


def get_json(server, path, timeout):
    """GET a JSON document, or raise CannotRun naming the server."""
    try:
        with urllib.request.urlopen(server.root + path, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise CannotRun(f"{server.name} at {server.root}: GET {path} failed: {error}") from error


# ---------------------------------------------------------------------------------------------
# SSE framing


def read_stream(answer):
    """Parses a text/event-stream answer into chunks and notes how it is framed."""
    lines = answer.raw.split("\n")
    chunks, other_lines, bad_data, done, unseparated = [], [], [], 0, 0
    for number, line in enumerate(lines):
        line = line.rstrip("\r")
        if line.startswith("data:"):
            payload = line[len("data:") :].strip()
            following = lines[number + 1].rstrip("\r") if number + 1 < len(lines) else ""
            if following != "":
                unseparated += 1
            if payload == "[DONE]":
                done += 1
                continue
            try:
                chunks.append(json.loads(payload))
            except ValueError:
                bad_data.append(payload[:60])
            if done:
                bad_data.append("a chunk after [DONE]")
        elif line and not line.startswith(":"):
            other_lines.append(line[:60])
    answer.events = chunks
    last = lines_before_end(lines)
    answer.framing = {
        "`data:` lines that are not JSON": bad_data[:1] or "none",
        "lines other than `data:`, comments and blank lines": other_lines[:2] or "none",
        "`data:` lines not followed by a blank line": unseparated,
        "`data: [DONE]` lines": done,
        "the stream ends with `data: [DONE]`": "yes" if last == "data: [DONE]" else "no",
        "usage": usage_framing(chunks),
        "error chunks": sum(1 for c in chunks if isinstance(c, dict) and "error" in c),
    }


def lines_before_end(lines):
    """The last non-blank line of a stream."""
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def usage_framing(chunks):
    """Where a stream reports usage: its own chunk with no choices, or alongside choices."""
    places = []
    for chunk in chunks:
        if isinstance(chunk, dict) and chunk.get("usage"):
            with_choices = bool(chunk.get("choices"))
            places.append("a chunk with choices" if with_choices else "a chunk without choices")
    if not places:
        return "no usage"
    return f"{len(places)} × in {places[-1]}" if len(set(places)) == 1 else ", ".join(places)


def chunk_kind(chunk):
    """A stream chunk's role in the stream: role, content, finish, usage, error (joined by +)."""
    if not isinstance(chunk, dict):
        return "not an object"
    if "error" in chunk:
        return "error"
    choices = chunk.get("choices") or []
    tags = []
    for choice in choices[:1]:
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if delta.get("role"):
            tags.append("role")
        if delta.get("content") or choice.get("text"):
            tags.append("content")
        if choice.get("finish_reason") is not None:
            tags.append("finish")
        if not tags:
            tags.append("empty")
    if chunk.get("usage"):
        tags.append("usage")
    return "+".join(tags) or "empty"


def kind_sequence(chunks):
    """The kinds of a stream's chunks per choice index, repeats folded (`content…`)."""
    per_index = {}
    for chunk in chunks:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        key = choices[0].get("index") if choices else None
        per_index.setdefault(key, []).append(chunk_kind(chunk))
    folded = {}
    for key, kinds in per_index.items():
        out = []
        for kind in kinds:
            if out and out[-1].rstrip("…") == kind:
                out[-1] = kind + "…"
            else:
                out.append(kind)
        folded[key] = ", ".join(out)
    return folded


# ---------------------------------------------------------------------------------------------
# Structure


def type_name(value):
    """The JSON type of a value: null, boolean, number, string, object or array."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


class Shape:
    """The merged structure of one or more JSON values found at the same path."""

    def __init__(self, path):
        self.path = path
        self.types = set()
        self.objects = 0
        self.keys = {}  # key -> (times present, Shape)
        self.items = None
        self.lengths = set()
        self.values = set()

    def add(self, value):
        """Merges one more value into the shape."""
        self.types.add(type_name(value))
        if self.path.rsplit(".", 1)[-1] in VALUE_KEYS and value is not None:
            if not isinstance(value, (dict, list)):
                self.values.add(json.dumps(value, ensure_ascii=False))
        elif self.path == "id" and isinstance(value, str):
            self.values.add(json.dumps(value.split("-")[0] + "-…", ensure_ascii=False))
        if isinstance(value, dict):
            self.objects += 1
            is_map = self.path.endswith(MAP_PATHS)
            for key, item in value.items():
                key = "*" if is_map else key
                count, shape = self.keys.get(key, (0, None))
                shape = shape or Shape(f"{self.path}.{key}" if self.path else key)
                shape.add(item)
                self.keys[key] = (count + 1, shape)
        elif isinstance(value, list):
            self.lengths.add(len(value))
            for item in value:
                self.items = self.items or Shape(self.path + "[]")
                self.items.add(item)


def shape_of(values, path=""):
    """The merged shape of a list of JSON values."""
    shape = Shape(path)
    for value in values:
        shape.add(value)
    return shape


def describe(shape):
    """A shape's types, with its values when they are compared."""
    text = " or ".join(sorted(shape.types))
    if shape.values:
        text += " " + ", ".join(sorted(shape.values))
    return text


def compare_shapes(ours, theirs, found):
    """Records each structural difference between two shapes in `found`."""
    path = ours.path or "(top level)"
    if ours.types != theirs.types:
        found.differences.append(f"{path}: {OURS} {describe(ours)}, {THEIRS} {describe(theirs)}")
        return
    if ours.values != theirs.values:
        line = (f"{path}: value {OURS} {', '.join(sorted(ours.values))}, "
                f"{THEIRS} {', '.join(sorted(theirs.values))}")
        if path.endswith("finish_reason") and not found.texts_equal:
            found.notes.append(line + " (the texts differ)")
        else:
            found.differences.append(line)
    if "object" in ours.types:
        compare_keys(ours, theirs, found)
    if "array" in ours.types:
        check_length = found.texts_equal or not ours.path.endswith(TEXT_LENGTH_SUFFIXES)
        if check_length and ours.lengths != theirs.lengths:
            found.differences.append(f"{path}: length {OURS} {sorted(ours.lengths)}, "
                                     f"{THEIRS} {sorted(theirs.lengths)}")
        # When one side's lists are all empty, the lengths above already say so.
        if ours.items and theirs.items:
            compare_shapes(ours.items, theirs.items, found)


def compare_keys(ours, theirs, found):
    """Key sets of two object shapes: keys on one side only, or present in fewer objects."""
    for key in sorted(set(ours.keys) | set(theirs.keys)):
        name = f"{ours.path}.{key}" if ours.path else key
        if key not in theirs.keys:
            found.differences.append(f"{name}: only {OURS} has it ({describe(ours.keys[key][1])})")
        elif key not in ours.keys:
            found.differences.append(
                f"{name}: only {THEIRS} has it ({describe(theirs.keys[key][1])})")
        else:
            ours_count, ours_shape = ours.keys[key]
            theirs_count, theirs_shape = theirs.keys[key]
            ours_always = ours_count == ours.objects
            theirs_always = theirs_count == theirs.objects
            if ours_always != theirs_always:
                found.differences.append(f"{name}: present in {presence(ours_always)} for {OURS}, "
                                         f"in {presence(theirs_always)} for {THEIRS}")
            compare_shapes(ours_shape, theirs_shape, found)


def presence(always):
    """How often a key is present, for a difference line."""
    return "every object" if always else "only some objects"


# ---------------------------------------------------------------------------------------------
# Texts (informational)


def choice_texts(answer):
    """The text of each choice by index, from a whole answer or a stream."""
    texts = {}
    if answer.events is not None:
        for chunk in answer.events:
            for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                texts[choice.get("index")] = texts.get(choice.get("index"), "") + piece
    elif isinstance(answer.body, dict):
        for choice in answer.body.get("choices") or []:
            message = choice.get("message") or {}
            texts[choice.get("index")] = message.get("content") or choice.get("text") or ""
    return texts


def usage_of(answer):
    """The usage object of a whole answer or of a stream's usage chunk."""
    if answer.events is not None:
        found = [c["usage"] for c in answer.events if isinstance(c, dict) and c.get("usage")]
        return found[-1] if found else None
    return answer.body.get("usage") if isinstance(answer.body, dict) else None


def information(case, ours, theirs):
    """Lines that are not structural differences: texts, token counts, token ids."""
    lines = []
    ours_texts, theirs_texts = choice_texts(ours), choice_texts(theirs)
    if case.greedy and ours_texts and theirs_texts:
        for index in sorted(set(ours_texts) | set(theirs_texts), key=str):
            lines.append(f"greedy text of choice {index}: "
                         + text_comparison(ours_texts.get(index), theirs_texts.get(index)))
    ours_usage, theirs_usage = usage_of(ours), usage_of(theirs)
    if isinstance(ours_usage, dict) and isinstance(theirs_usage, dict):
        for key in ("prompt_tokens", "completion_tokens"):
            if ours_usage.get(key) != theirs_usage.get(key):
                lines.append(f"usage.{key}: {OURS} {ours_usage.get(key)}, "
                             f"{THEIRS} {theirs_usage.get(key)}")
    for key in ("tokens", "content"):
        if case.path in ("/tokenize", "/detokenize") and all(
            isinstance(a.body, dict) and key in a.body for a in (ours, theirs)
        ):
            same = ours.body[key] == theirs.body[key]
            lines.append(f"{key}: {'equal' if same else 'differ'} {short(ours.body[key])}"
                         + ("" if same else f" vs {short(theirs.body[key])}"))
    return lines


def text_comparison(ours, theirs):
    """Whether two texts are equal, or where they part and how they go on from there."""
    if ours == theirs:
        return f"equal {short(ours)}"
    if ours is None or theirs is None:
        return f"{OURS} {short(ours)}, {THEIRS} {short(theirs)}"
    start = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                 min(len(ours), len(theirs)))
    return (f"differs from character {start}: {OURS} {short(ours[start:], 40)}, "
            f"{THEIRS} {short(theirs[start:], 40)}")


def short(value, limit=70):
    """A value shown on one line, cut to `limit` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# One case


def compare_answers(ours, theirs):
    """The structural differences between two answers to one case, and notes."""
    texts_equal = bool(choice_texts(ours)) and choice_texts(ours) == choice_texts(theirs)
    found = Findings(texts_equal)
    if ours.failure or theirs.failure:
        for server, answer in ((OURS, ours), (THEIRS, theirs)):
            if answer.failure:
                found.differences.append(f"{server}: {answer.failure}")
        return found
    if is_error(ours) != is_error(theirs):
        # One refuses, the other answers: the status says it all, key by key would be noise.
        found.differences.append(f"HTTP status: {OURS} {ours.status} {gist(ours)}, "
                                 f"{THEIRS} {theirs.status} {gist(theirs)}")
        return found
    if ours.status != theirs.status:
        found.differences.append(f"HTTP status: {OURS} {ours.status}, {THEIRS} {theirs.status}")
    if ours.content_type != theirs.content_type:
        found.differences.append(f"Content-Type: {OURS} {ours.content_type or '(none)'}, "
                                 f"{THEIRS} {theirs.content_type or '(none)'}")
    if ours.events is not None and theirs.events is not None:
        compare_streams(ours, theirs, found)
        return found
    for server, answer in ((OURS, ours), (THEIRS, theirs)):
        if answer.events is None and answer.body is None:
            found.differences.append(f"{server}: the body is not JSON: {short(answer.raw)}")
    if ours.body is not None and theirs.body is not None:
        compare_shapes(shape_of([ours.body]), shape_of([theirs.body]), found)
    return found


def is_error(answer):
    """Whether an answer is an HTTP error."""
    return answer.status is not None and answer.status >= 400


def gist(answer):
    """What an answer is, in a few words: its error fields or its object."""
    body = answer.body if isinstance(answer.body, dict) else {}
    error = body.get("error")
    if isinstance(error, dict):
        fields = ", ".join(f"{k} {json.dumps(error.get(k))}" for k in ("type", "param", "code")
                           if k in error)
        return f"(error: {fields})"
    if answer.events is not None:
        return f"(a stream of {len(answer.events)} chunks)"
    return f"({body.get('object', 'a JSON answer') if body else short(answer.raw, 40)})"


def compare_streams(ours, theirs, found):
    """SSE framing, the order of chunk kinds, and the structure of each kind of chunk."""
    for fact, value in ours.framing.items():
        if theirs.framing.get(fact) != value:
            found.differences.append(
                f"SSE {fact}: {OURS} {value}, {THEIRS} {theirs.framing.get(fact)}")
    ours_order, theirs_order = kind_sequence(ours.events), kind_sequence(theirs.events)
    for index in sorted(set(ours_order) | set(theirs_order), key=str):
        if ours_order.get(index) != theirs_order.get(index):
            which = "without choices" if index is None else f"of choice {index}"
            found.differences.append(
                f"SSE chunks {which}: {OURS} [{ours_order.get(index, 'none')}], "
                f"{THEIRS} [{theirs_order.get(index, 'none')}]")
    by_kind = {}
    for side, chunks in ((0, ours.events), (1, theirs.events)):
        for chunk in chunks:
            by_kind.setdefault(chunk_kind(chunk), ([], []))[side].append(chunk)
    for kind, (ours_chunks, theirs_chunks) in by_kind.items():
        if ours_chunks and theirs_chunks:
            per_kind = Findings(found.texts_equal)
            compare_shapes(shape_of(ours_chunks), shape_of(theirs_chunks), per_kind)
            found.differences.extend(f"[{kind} chunk] {line}" for line in per_kind.differences)
            found.notes.extend(f"[{kind} chunk] {line}" for line in per_kind.notes)


def run_case(case, servers, timeout):
    """Sends a case to both servers; its difference lines and information lines."""
    ours, theirs = (send(server, case, timeout) for server in servers)
    found = compare_answers(ours, theirs)
    found.notes[:0] = information(case, ours, theirs)
    return found


# ---------------------------------------------------------------------------------------------
# The cases


def chat(**fields):
    """A chat completion body for the shared prompt."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    body.update(fields)
    return body


def completion(**fields):
    """A completion body for the shared prompt."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    body.update(fields)
    return body


def cases(prompt_ids, banned_id):
    """Every request of the comparison, in order."""
    usage = {"include_usage": True}
    chat_path, cmpl_path = "/v1/chat/completions", "/v1/completions"
    return [
        Case("GET /v1/models", "/v1/models", method="GET"),
        Case("chat, whole", chat_path, chat(temperature=0), greedy=True),
        Case("chat without a system message (the template's default one)", chat_path,
             chat(temperature=0, messages=[QUESTION]), greedy=True),
        Case("chat, streamed", chat_path, chat(temperature=0, stream=True), greedy=True),
        Case("chat, streamed with include_usage", chat_path,
             chat(temperature=0, stream=True, stream_options=usage), greedy=True),
        Case("chat, logprobs + top_logprobs 3", chat_path,
             chat(temperature=0, logprobs=True, top_logprobs=3), greedy=True),
        Case("chat, logprobs + top_logprobs 3, streamed", chat_path,
             chat(temperature=0, logprobs=True, top_logprobs=3, stream=True,
                  stream_options=usage), greedy=True),
        Case("chat, logprobs without top_logprobs", chat_path,
             chat(temperature=0, logprobs=True), greedy=True),
        Case("chat, stop [\",\", \".\"]", chat_path,
             chat(temperature=0, stop=[",", "."]), greedy=True),
        Case("chat, stop as a string, streamed", chat_path,
             chat(temperature=0, stop=",", stream=True), greedy=True),
        Case("chat, seed 7 + temperature 0.8 + top_p 0.9", chat_path,
             chat(seed=7, temperature=0.8, top_p=0.9)),
        Case("chat, presence 0.6 + frequency 0.6 penalties", chat_path,
             chat(temperature=0, presence_penalty=0.6, frequency_penalty=0.6), greedy=True),
        Case(f"chat, logit_bias {{{banned_id}: -100}}", chat_path,
             chat(temperature=0, logit_bias={str(banned_id): -100}), greedy=True),
        Case("chat, max_tokens 3", chat_path, chat(temperature=0, max_tokens=3), greedy=True),
        Case("chat, max_completion_tokens 3 (no max_tokens)", chat_path,
             {**{k: v for k, v in chat(temperature=0).items() if k != "max_tokens"},
              "max_completion_tokens": 3}, greedy=True),
        Case("chat, n 2", chat_path, chat(n=2, seed=11, temperature=0.8)),
        Case("chat, n 2, streamed", chat_path,
             chat(n=2, seed=11, temperature=0.8, stream=True, stream_options=usage)),
        Case("completions, string prompt", cmpl_path, completion(temperature=0), greedy=True),
        Case("completions, string prompt, streamed", cmpl_path,
             completion(temperature=0, stream=True, stream_options=usage), greedy=True),
        Case("completions, token-id prompt", cmpl_path,
             completion(prompt=prompt_ids, temperature=0), greedy=True),
        Case("completions, two prompts", cmpl_path,
             completion(prompt=[PROMPT, "One, two, three,"], temperature=0), greedy=True),
        Case("completions, echo", cmpl_path, completion(temperature=0, echo=True), greedy=True),
        Case("completions, legacy logprobs 2", cmpl_path,
             completion(temperature=0, logprobs=2), greedy=True),
        Case("completions, legacy logprobs 2, streamed", cmpl_path,
             completion(temperature=0, logprobs=2, stream=True), greedy=True),
        Case("completions, n 2", cmpl_path, completion(n=2, seed=11, temperature=0.8)),
        Case("POST /tokenize", "/tokenize", {"content": PROMPT}),
        Case("POST /tokenize, add_special", "/tokenize", {"content": PROMPT, "add_special": True}),
        Case("POST /detokenize", "/detokenize", {"tokens": prompt_ids}),
        Case("error: chat max_tokens 0", chat_path, chat(max_tokens=0)),
        Case("error: completions max_tokens 0", cmpl_path, completion(max_tokens=0)),
        Case("error: unknown model", chat_path, {**chat(), "model": "no-such-model"}),
        Case("error: bad JSON", chat_path, b'{"model": "x", "messages": ['),
        Case("error: top_logprobs 21", chat_path, chat(logprobs=True, top_logprobs=21)),
        Case("error: temperature 3", chat_path, chat(temperature=3)),
        Case("error: unknown endpoint", "/v1/no-such-endpoint", {}),
    ]


# ---------------------------------------------------------------------------------------------
# llama-server


def free_port():
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_llama_server(binary, model_file, log):
    """Starts llama-server on a free port; the process and its root URL once it is healthy."""
    if not Path(binary).is_file():
        raise CannotRun(f"no llama-server at {binary}; build it with "
                        "`bash benches/anchors/llamacpp.sh llama-server`")
    if not Path(model_file).is_file():
        raise CannotRun(f"no model file at {model_file}; run `scripts/fetch-model.sh`")
    port = free_port()
    # --parallel 4: llama-server caps `n` at its slot count.
    command = [str(binary), "--model", str(model_file), "--host", "127.0.0.1",
               "--port", str(port), "--ctx-size", "8192", "--parallel", "4", "--no-webui"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CannotRun(f"llama-server exited with status {process.returncode}; its log "
                            f"ends with:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    stop_process(process)
    raise CannotRun(f"llama-server did not become healthy within 120 s; its log ends with:\n"
                    f"{log_tail(log)}")


def log_tail(log):
    """The last lines of llama-server's log."""
    log.flush()
    return "\n".join(Path(log.name).read_text(errors="replace").splitlines()[-15:])


def stop_process(process):
    """Stops a process we started: SIGTERM, then SIGKILL after 10 s."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def model_id(server, timeout):
    """The first model id a server lists."""
    listing = get_json(server, "/v1/models", timeout)
    try:
        return listing["data"][0]["id"]
    except (KeyError, IndexError, TypeError) as error:
        raise CannotRun(f"{server.name}: /v1/models lists no model: {short(listing)}") from error


def llama_version(server, timeout):
    """llama-server's build as its /props report it, when it does."""
    try:
        props = get_json(server, "/props", timeout)
    except CannotRun:
        return "unknown"
    return str(props.get("build_info", "unknown")) if isinstance(props, dict) else "unknown"


# ---------------------------------------------------------------------------------------------
# The report


def tokenize(server, text, timeout):
    """Token ids of a text, from a server's /tokenize."""
    case = Case("tokenize", "/tokenize", {"content": text})
    answer = send(server, case, timeout)
    if answer.status != 200 or not isinstance(answer.body, dict):
        raise CannotRun(f"{server.name}: /tokenize answered {answer.status}: {short(answer.raw)}")
    return answer.body["tokens"]


def report(servers, timeout):
    """Runs every case, prints the report; the number of differences."""
    ours, theirs = servers
    prompt_ids = tokenize(ours, PROMPT, timeout)
    # The first token of the greedy chat answers ("The rainbow…"), so that banning it shows.
    banned_id = tokenize(ours, "The", timeout)[0]
    total, with_differences, all_cases = 0, 0, cases(prompt_ids, banned_id)
    seen = {}  # each difference line (chunk kind left out) -> the requests it was found in
    for case in all_cases:
        started = time.monotonic()
        found = run_case(case, servers, timeout)
        total += len(found.differences)
        with_differences += bool(found.differences)
        for line in found.differences:
            seen.setdefault(line.split("] ", 1)[-1] if line.startswith("[") else line, set()).add(
                case.name)
        print(f"\n== {case.name}  ({case.method} {case.path}, {time.monotonic() - started:.1f} s)")
        for line in found.differences:
            print(f"  - {line}")
        for line in found.notes:
            print(f"  . {line}")
        if not found.differences:
            print("  (same structure)")
        sys.stdout.flush()
    print(f"\n== distinct differences, with the number of requests each was found in")
    for line, names in sorted(seen.items(), key=lambda item: (-len(item[1]), item[0])):
        print(f"  {len(names):3} {line}")
    print(f"\n== summary: {total} structural differences ({len(seen)} distinct) in "
          f"{with_differences} of {len(all_cases)} requests "
          "('-' lines; '.' lines are information, not counted)")
    return total


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("meshnet", help="meshnet's base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--llama-server", help="a running llama-server's base URL "
                        "(default: start one on a free port and stop it afterwards)")
    parser.add_argument("--llama-server-bin", default=str(DEFAULT_BINARY))
    parser.add_argument("--model-file", default=str(DEFAULT_MODEL_FILE))
    parser.add_argument("--timeout", type=float, default=300, help="seconds per request")
    return parser.parse_args()


def main():
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: terminated"))
    process = None
    with tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log") as log:
        try:
            ours = Server(OURS, root_url(args.meshnet))
            ours.model = model_id(ours, args.timeout)
            theirs_url = args.llama_server
            if theirs_url is None:
                process, theirs_url = start_llama_server(
                    args.llama_server_bin, args.model_file, log)
            theirs = Server(THEIRS, root_url(theirs_url))
            theirs.model = model_id(theirs, args.timeout)
            print(f"{OURS}: {ours.root}, model {ours.model}")
            print(f"{THEIRS}: {theirs.root}, model {theirs.model}, "
                  f"build {llama_version(theirs, args.timeout)}"
                  + (f", started with {args.model_file}" if process else ""))
            report((ours, theirs), args.timeout)
        except CannotRun as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        finally:
            if process is not None:
                stop_process(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
