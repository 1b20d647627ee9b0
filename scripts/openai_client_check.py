#!/usr/bin/env python3
"""Checks a running meshnet API with the official `openai` Python package.

Usage:
    python3 scripts/openai_client_check.py http://127.0.0.1:8080/v1 [--model ID]

Needs `pip install openai`. Lists the models, asks for a chat completion with and without
streaming (temperature 0, so both must produce the same text), checks logprobs (parsed by the
SDK's own types, streamed and not), logit_bias, the penalties, the top_k and min_p extensions,
a completion from token ids and the /tokenize and /detokenize extensions, n choices (each equal
to its own single request, streamed too), completions' echo with legacy logprobs and several
prompts, tool calls (`tool_choice` required and a named function, whole and streamed, read by
the SDK's own types, and a tool's result continuing the conversation), and that an invalid
request is refused with 400. Prints a short summary; exits non-zero on the first failure.
"""

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

try:
    import openai
    from openai import OpenAI
except ImportError:
    sys.exit("error: the `openai` package is missing; install it with `pip install openai`")

PROMPT = [{"role": "user", "content": "Say hello to the mesh."}]
MAX_TOKENS = 16


class CheckFailed(Exception):
    """A check did not hold."""


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


def pick_model(client, wanted):
    models = client.models.list().data
    ids = [m.id for m in models]
    check(len(ids) == 1, f"models.list() returned {len(ids)} models {ids}, expected exactly one")
    if wanted is not None:
        check(wanted in ids, f"model {wanted!r} is not served; the server offers {ids}")
        return wanted
    return ids[0]


def whole_chat(client, model):
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=model, messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS
    )
    elapsed = time.monotonic() - started
    check(len(answer.choices) == 1, f"expected one choice, got {len(answer.choices)}")
    choice = answer.choices[0]
    text = choice.message.content
    check(bool(text), "the non-streaming answer has empty content")
    check(choice.message.role == "assistant", f"unexpected role {choice.message.role!r}")
    check(
        choice.finish_reason in ("stop", "length"),
        f"unexpected finish_reason {choice.finish_reason!r}",
    )
    usage = answer.usage
    check(usage is not None, "the answer has no usage")
    check(
        usage.prompt_tokens > 0 and usage.completion_tokens > 0,
        f"usage numbers must be positive: {usage}",
    )
    check(
        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens,
        f"total_tokens is not the sum: {usage}",
    )
    check(
        usage.completion_tokens <= MAX_TOKENS,
        f"{usage.completion_tokens} completion tokens exceed max_tokens={MAX_TOKENS}",
    )
    return text, choice.finish_reason, usage, elapsed


def streamed_chat(client, model):
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=PROMPT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    chunks = 0
    finish_reason = None
    usage = None
    first_at = None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if first_at is None:
                    first_at = time.monotonic() - started
                pieces.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
    elapsed = time.monotonic() - started
    text = "".join(pieces)
    check(bool(text), "the streamed chunks carry no content")
    check(
        finish_reason in ("stop", "length"),
        f"the stream ended without a valid finish_reason (got {finish_reason!r})",
    )
    check(usage is not None, "include_usage was set but no usage chunk arrived")
    return text, chunks, first_at, elapsed


def with_logprobs(client, model, text):
    """Greedy chat with logprobs, whole and streamed: the entries' bytes are the text."""
    asked = dict(model=model, messages=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    answer = client.chat.completions.create(logprobs=True, top_logprobs=2, **asked)
    content = answer.choices[0].logprobs.content
    check(answer.choices[0].message.content == text, "logprobs changed the greedy text")
    joined = b"".join(bytes(entry.bytes) for entry in content)
    check(joined == text.encode(), f"the logprobs' bytes {joined!r} are not the text {text!r}")
    for entry in content:
        check(len(entry.top_logprobs) == 2, f"expected 2 top_logprobs: {entry}")
        check(entry.token == entry.top_logprobs[0].token, f"greedy took another token: {entry}")
        check(entry.logprob <= 0.0, f"a log-probability above 0: {entry}")
    streamed = []
    for chunk in client.chat.completions.create(
        logprobs=True, top_logprobs=2, stream=True, **asked
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    check(
        [e.token for e in streamed] == [e.token for e in content],
        "the streamed logprobs differ from the whole answer's",
    )
    return content


def extension(base_url, path, body):
    """POSTs to an extension endpoint beside /v1 (e.g. /tokenize)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(
        f"{root}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        raise CheckFailed(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def sampling_fields(client, base_url, model, text):
    """logit_bias, penalties, top_k and min_p through the SDK (extensions in extra_body)."""
    asked = dict(model=model, messages=PROMPT, max_tokens=MAX_TOKENS)
    first = extension(base_url, "/tokenize", {"content": text})["tokens"][0]
    banned = client.chat.completions.create(
        temperature=0, logit_bias={str(first): -100}, **asked
    ).choices[0].message.content
    other_first = extension(base_url, "/tokenize", {"content": banned})["tokens"][0]
    check(other_first != first, f"token {first} was banned but starts {banned!r}")
    client.chat.completions.create(
        temperature=0, presence_penalty=0.5, frequency_penalty=1.0, **asked
    )
    for only_the_best in ({"top_k": 1}, {"min_p": 1.0}):
        hot = client.chat.completions.create(
            temperature=1.5, seed=3, extra_body=only_the_best, **asked
        ).choices[0].message.content
        check(hot == text, f"{only_the_best} at temperature 1.5 gave {hot!r}, not {text!r}")
    return first, banned


def token_prompt(client, base_url, model):
    """A completion from token ids equals the one from their text; ids decode back."""
    prompt = "The capital of France is"
    ids = extension(base_url, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    asked = dict(model=model, temperature=0, max_tokens=MAX_TOKENS)
    from_text = client.completions.create(prompt=prompt, **asked).choices[0].text
    from_ids = client.completions.create(prompt=ids, **asked).choices[0].text
    check(from_ids == from_text, f"token ids gave {from_ids!r}, the text {from_text!r}")
    back = extension(base_url, "/detokenize", {"tokens": ids})["content"]
    check(back.endswith(prompt), f"/detokenize gave {back!r} for {prompt!r}")
    return ids, from_ids


def several_choices(client, model):
    """n=3 sampled chats: choice i equals a single chat with seed 7 + i; streamed, the
    choices' pieces come under their indexes and add up to the same texts."""
    asked = dict(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9)
    answer = client.chat.completions.create(n=3, seed=7, **asked)
    texts = [choice.message.content for choice in answer.choices]
    check([c.index for c in answer.choices] == [0, 1, 2], f"indexes {answer.choices}")
    for index, text in enumerate(texts):
        alone = client.chat.completions.create(seed=7 + index, **asked).choices[0].message.content
        check(alone == text, f"choice {index} is {text!r}, alone with seed {7 + index}: {alone!r}")
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(n=3, seed=7, stream=True, **asked):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    check(streamed == texts, f"streamed choices {streamed!r} differ from {texts!r}")
    return texts


def echoed_completion(client, model):
    """Legacy completions logprobs with echo: the prompt's tokens come first, unscored first."""
    prompt = "The capital of France is"
    asked = dict(model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    plain = client.completions.create(**asked).choices[0]
    echoed = client.completions.create(echo=True, **asked).choices[0]
    check(echoed.text == prompt + plain.text, f"echo gave {echoed.text!r}")
    logprobs = echoed.logprobs
    check("".join(logprobs.tokens) == echoed.text, f"tokens {logprobs.tokens} are not the text")
    check(logprobs.token_logprobs[0] is None, "the first prompt token has a logprob")
    generated = len(plain.logprobs.tokens)
    check(
        logprobs.token_logprobs[-generated:] == plain.logprobs.token_logprobs,
        "the generated tokens' logprobs differ with echo",
    )
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    check(logprobs.text_offset == offsets, f"text_offset {logprobs.text_offset} != {offsets}")
    several = client.completions.create(
        model=model, prompt=[prompt, "Once upon a time"], n=2, temperature=0, max_tokens=4
    )
    check(len(several.choices) == 4, f"2 prompts x n=2 gave {len(several.choices)} choices")
    check(several.choices[1].text == several.choices[0].text, "greedy choices of one prompt differ")
    return echoed
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city over the next days.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def checked_arguments(name, arguments):
    """The call's arguments (JSON text), checked against TOOLS' schemas by hand."""
    values = json.loads(arguments)
    check(isinstance(values, dict), f"{name} arguments are not an object: {arguments!r}")
    if name == "get_weather":
        check(values.get("city") in ("Paris", "Rome", "Tokyo"), f"bad city in {arguments!r}")
        check(set(values) <= {"city", "days"}, f"unexpected arguments {arguments!r}")
        check(values.get("days", 1) in range(1, 8), f"bad days in {arguments!r}")
    elif name == "get_time":
        check(values == {"zone": "UTC"} or values == {"zone": "CET"}, f"bad {arguments!r}")
    else:
        raise CheckFailed(f"the model called {name!r}, which was not offered")
    return values


def tool_calls(client, model):
    """tool_choice required and a named function, whole and streamed, parsed by the SDK's own
    types; then the call's result continues the conversation."""
    asked = dict(
        model=model, messages=WEATHER_QUESTION, tools=TOOLS, temperature=0, max_tokens=64,
        parallel_tool_calls=False,
    )
    answer = client.chat.completions.create(tool_choice="required", **asked)
    choice = answer.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason!r}")
    check(choice.message.content is None, f"content {choice.message.content!r} beside the call")
    calls = choice.message.tool_calls
    check(calls is not None and len(calls) == 1, f"expected one call, got {calls!r}")
    call = calls[0]
    check(call.type == "function" and call.id.startswith("call_"), f"bad call {call!r}")
    checked_arguments(call.function.name, call.function.arguments)

    named = dict(tool_choice={"type": "function", "function": {"name": "get_time"}}, **asked)
    whole = client.chat.completions.create(**named).choices[0].message.tool_calls
    check(len(whole) == 1 and whole[0].function.name == "get_time", f"named gave {whole!r}")
    checked_arguments("get_time", whole[0].function.arguments)
    streamed = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **named):
        for streamed_choice in chunk.choices:
            check(not streamed_choice.delta.content, "text streamed beside a required call")
            for piece in streamed_choice.delta.tool_calls or []:
                entry = streamed.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id is not None:
                    check(entry["id"] is None, "a call's id came twice")
                    entry["id"], entry["name"] = piece.id, piece.function.name
                entry["arguments"] += piece.function.arguments or ""
            finish = streamed_choice.finish_reason or finish
    check(list(streamed) == [0], f"streamed calls {streamed!r}")
    check(streamed[0]["name"] == "get_time", f"streamed {streamed!r}")
    check(
        streamed[0]["arguments"] == whole[0].function.arguments,
        f"streamed arguments {streamed[0]['arguments']!r} differ from "
        f"{whole[0].function.arguments!r}",
    )
    check(finish == "tool_calls", f"the stream finished with {finish!r}")

    result = [
        *WEATHER_QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    followed = client.chat.completions.create(
        model=model, messages=result, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=MAX_TOKENS,
    ).choices[0]
    check(followed.message.tool_calls is None, "tool_choice none answered with a call")
    check(isinstance(followed.message.content, str), "no text after the tool's result")
    try:
        client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "nope"}}, **asked
        )
        raise CheckFailed("a tool_choice naming no offered function was accepted")
    except openai.BadRequestError as e:
        check(e.param == "tool_choice", f"the refusal names {e.param!r}")
    return call, whole[0], followed.message.content


def bad_request(client, model):
    try:
        client.chat.completions.create(model=model, messages=PROMPT, max_tokens=0)
    except openai.BadRequestError as e:
        return e
    raise CheckFailed("max_tokens=0 was accepted; expected openai.BadRequestError")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", metavar="BASE_URL", help="e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--model", help="model id to use (default: the one the server lists)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for each request"
    )
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="meshnet", max_retries=0, timeout=args.timeout)
    step = "connecting"
    try:
        step = "models.list"
        model = pick_model(client, args.model)
        print(f"model:        {model}")

        step = "non-streaming chat completion"
        text, finish, usage, elapsed = whole_chat(client, model)
        print(
            f"whole:        {text!r} (finish_reason={finish}, prompt_tokens={usage.prompt_tokens}, "
            f"completion_tokens={usage.completion_tokens}, {elapsed:.2f} s)"
        )

        step = "streaming chat completion"
        streamed, chunks, first_at, elapsed = streamed_chat(client, model)
        print(
            f"streamed:     {chunks} chunks, first text after {first_at:.2f} s, "
            f"done after {elapsed:.2f} s"
        )
        check(
            streamed == text,
            f"streamed text {streamed!r} differs from the non-streaming text {text!r} "
            "at temperature 0",
        )
        print("              same text as the non-streaming answer")

        step = "logprobs"
        content = with_logprobs(client, model, text)
        print(f"logprobs:     {len(content)} tokens, first {content[0].token!r} "
              f"({content[0].logprob:.3f}), the same streamed")

        step = "logit_bias, penalties, top_k and min_p"
        first, banned = sampling_fields(client, args.base_url, model, text)
        print(f"logit_bias:   without token {first}: {banned!r}; top_k 1 and min_p 1 are greedy")

        step = "token-id prompt, /tokenize and /detokenize"
        ids, continued = token_prompt(client, args.base_url, model)
        print(f"token ids:    {ids} -> {continued!r}, as from their text")

        step = "n choices"
        texts = several_choices(client, model)
        print(f"n=3:          {texts!r}, each its own single request with seed 7 + i, streamed too")

        step = "completions echo and legacy logprobs"
        echoed = echoed_completion(client, model)
        print(f"echo:         {echoed.text!r}, {len(echoed.logprobs.tokens)} tokens scored")

        step = "tool calls"
        call, named, followed = tool_calls(client, model)
        print(
            f"tool calls:   required -> {call.function.name}({call.function.arguments}), "
            f"named -> {named.function.name}({named.function.arguments}), the same streamed; "
            f"after the result: {followed!r}"
        )

        step = "invalid request"
        error = bad_request(client, model)
        print(f"bad request:  400 BadRequestError (param={error.param!r})")
    except CheckFailed as e:
        sys.exit(f"FAILED during {step}: {e}")
    except openai.APIConnectionError as e:
        sys.exit(f"FAILED during {step}: cannot reach {args.base_url}: {e}")
    except openai.APIStatusError as e:
        sys.exit(f"FAILED during {step}: HTTP {e.status_code}: {e.message}")
    except openai.APIError as e:
        sys.exit(f"FAILED during {step}: {e}")
    print("OK: all checks passed")


if __name__ == "__main__":
    main()
