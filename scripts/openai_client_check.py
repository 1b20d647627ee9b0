#!/usr/bin/env python3
"""Checks a running meshnet API with the official `openai` Python package.

Usage:
    python3 scripts/openai_client_check.py http://127.0.0.1:8080/v1 [--model ID]

Needs `pip install openai`. Lists the models, asks for a chat completion with and without
streaming (temperature 0, so both must produce the same text), and checks that an invalid
request is refused with 400. Prints a short summary; exits non-zero on the first failure.
"""

import argparse
import sys
import time

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
