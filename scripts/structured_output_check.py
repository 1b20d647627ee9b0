#!/usr/bin/env python3
"""Checks structured output (`response_format`) of a running meshnet API with the official
`openai` Python package and the `jsonschema` package.

Usage:
    python3 scripts/structured_output_check.py http://127.0.0.1:8080/v1 [--model ID]
        [--measure N]

Needs `pip install openai jsonschema` (scripts/setup.sh --dev puts both in .venv). For each of
the schemas below (objects, nested objects, arrays with item bounds, enums, integer and number
ranges, optional properties, patterns, lengths, anyOf, $ref, const, nullable types, tuples) it
asks for an answer greedily (temperature 0) and sampled (temperature 0.8 with a seed), through
/v1/chat/completions and /v1/completions in turn; every answer must have finish_reason "stop",
parse with json.loads and pass jsonschema.validate. Then `json_object` mode (streamed too), and
requests that must be refused with 400 naming `response_format`. With --measure N it prints
the tokens per second of N structured and N unconstrained answers of the same length budget.
Exits non-zero on the first failure.
"""

import argparse
import json
import sys
import time

try:
    import openai
    from openai import OpenAI
except ImportError:
    sys.exit("error: the `openai` package is missing; install it with `pip install openai`")
try:
    import jsonschema
except ImportError:
    sys.exit("error: the `jsonschema` package is missing; install it with `pip install jsonschema`")

# Enough for every schema below: strings, arrays and numbers are bounded, so a complete answer
# fits (the tokens of the longest possible answer are well under this).
MAX_TOKENS = 160
SAMPLED_TEMPERATURE = 0.8

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

# (name, prompt, schema): each schema bounds every string, array and number it allows.
SCHEMAS = [
    (
        "person",
        "Describe a fictional person as JSON with a name and an age.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "address",
        "Give a person and their postal address as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 24},
                        "city": NAME,
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
    ),
    (
        "fruits",
        "List some fruits as a JSON object with an array of names.",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}
            },
            "required": ["fruits"],
            "additionalProperties": False,
        },
    ),
    (
        "color",
        "What color is the sky? Answer in JSON.",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    ),
    (
        "shop",
        "Is the shop open, and how many customers are inside? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "is_open": {"type": "boolean"},
                "customers": {"type": "integer", "minimum": 0, "maximum": 10},
            },
            "required": ["is_open", "customers"],
            "additionalProperties": False,
        },
    ),
    (
        "weather",
        "Report today's temperature in Celsius as JSON.",
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 50},
                "unit": {"const": "C"},
            },
            "required": ["temperature", "unit"],
            "additionalProperties": False,
        },
    ),
    (
        "book",
        "Give the title of a book, and its subtitle if it has one, as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "subtitle": {"type": "string", "maxLength": 30},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    ),
    (
        "order",
        "Write a small shopping order as JSON: items with a name and a quantity.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": NAME,
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["name", "quantity"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
    ),
    (
        "flight",
        "Make up a flight code like ABC-12 and give it as JSON.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    ),
    (
        "word",
        "Give one English word of three to six letters as JSON.",
        {
            "type": "object",
            "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 6}},
            "required": ["word"],
            "additionalProperties": False,
        },
    ),
    (
        "status",
        "Report the status of a service as JSON.",
        {
            "type": "object",
            "properties": {"version": {"const": 1}, "status": {"enum": ["ok", "degraded", "down"]}},
            "required": ["version", "status"],
            "additionalProperties": False,
        },
    ),
    (
        "measurement",
        "Give a value, either a number or a short word, as JSON.",
        {
            "type": "object",
            "properties": {
                "value": {
                    "anyOf": [
                        {"type": "integer", "minimum": -1000, "maximum": 1000},
                        {"type": "string", "maxLength": 10},
                    ]
                }
            },
            "required": ["value"],
            "additionalProperties": False,
        },
    ),
    (
        "middle_name",
        "Does Ada Lovelace have a middle name? Answer in JSON, null if none.",
        {
            "type": "object",
            "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 12}},
            "required": ["middle_name"],
            "additionalProperties": False,
        },
    ),
    (
        "segment",
        "Give a line segment with integer start and end points as JSON.",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -99, "maximum": 99},
                        "y": {"type": "integer", "minimum": -99, "maximum": 99},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
            "additionalProperties": False,
        },
    ),
    (
        "pair",
        "Give a city and its population rank as a JSON pair.",
        {
            "type": "object",
            "properties": {
                "pair": {
                    "type": "array",
                    "prefixItems": [NAME, {"type": "integer", "minimum": 1, "maximum": 100}],
                    "items": False,
                    "minItems": 2,
                }
            },
            "required": ["pair"],
            "additionalProperties": False,
        },
    ),
    (
        "rating",
        "Rate a movie from 1 to 5 stars as JSON.",
        {
            "type": "object",
            "properties": {
                "movie": NAME,
                "stars": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 6},
            },
            "required": ["movie", "stars"],
            "additionalProperties": False,
        },
    ),
    (
        "company",
        "Describe a company, its CEO and its size as JSON.",
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "ceo": {
                            "type": "object",
                            "properties": {
                                "name": NAME,
                                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                            },
                            "required": ["name", "age"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "ceo"],
                    "additionalProperties": False,
                },
                "employees": {"type": "integer", "minimum": 1, "maximum": 100000},
            },
            "required": ["company", "employees"],
            "additionalProperties": False,
        },
    ),
    (
        "schedule",
        "On which days of the week is the gym open? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "days": {
                    "type": "array",
                    "items": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
                    "minItems": 2,
                    "maxItems": 4,
                }
            },
            "required": ["days"],
            "additionalProperties": False,
        },
    ),
    (
        "digits",
        "Give exactly three digits as a JSON array.",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "email",
        "Make up a short email address ending in .com and give it as JSON.",
        {
            "type": "object",
            "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
            "required": ["email"],
            "additionalProperties": False,
        },
    ),
    (
        "city",
        "Which of these cities would you visit? Answer in JSON.",
        {
            "type": "object",
            "properties": {"city": {"enum": ["Zürich", "São Paulo", "東京"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    (
        "even",
        "Pick an even number between 0 and 100 and a short reason, as JSON.",
        {
            "type": "object",
            "properties": {
                "number": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 100},
                "reason": {"type": "string", "maxLength": 20},
            },
            "required": ["number", "reason"],
            "additionalProperties": False,
        },
    ),
]

# (what, response_format, the param the 400 must name, a word its message must have)
REFUSED = [
    ("a string response_format", "json", "response_format", "object"),
    ("an unknown type", {"type": "xml"}, "response_format.type", "xml"),
    ("json_schema without json_schema", {"type": "json_schema"}, "response_format.json_schema",
     "json_schema"),
    (
        "json_schema without a schema",
        {"type": "json_schema", "json_schema": {"name": "x"}},
        "response_format.json_schema.schema",
        "schema",
    ),
    (
        "a name with a space",
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": {"type": "object"}}},
        "response_format.json_schema.name",
        "name",
    ),
    (
        "strict as a string",
        {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"}},
        "response_format.json_schema.strict",
        "strict",
    ),
    (
        "a keyword the engine does not support",
        {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
        "response_format",
        "uniqueItems",
    ),
    (
        "a schema no value satisfies",
        {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
        "response_format",
        "Invalid schema",
    ),
    (
        "a pattern that is no regular expression",
        {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
        "response_format",
        "Invalid schema",
    ),
]


class CheckFailed(Exception):
    """A check did not hold."""


def check(condition, message):
    if not condition:
        raise CheckFailed(message)


def schema_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(client, model, endpoint, prompt, response_format, sampling):
    """The text and finish_reason of one answer, by chat or by completion."""
    common = dict(model=model, max_tokens=MAX_TOKENS, **sampling)
    if endpoint == "chat":
        answer = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}],
            response_format=response_format,
            **common,
        )
        choice = answer.choices[0]
        return choice.message.content, choice.finish_reason, answer.usage
    answer = client.completions.create(
        prompt=f"{prompt}\nJSON:",
        extra_body={"response_format": response_format},
        **common,
    )
    choice = answer.choices[0]
    return choice.text, choice.finish_reason, answer.usage


def valid_answer(what, text, finish, schema):
    check(finish == "stop", f"{what}: finish_reason {finish!r} (text {text!r})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckFailed(f"{what}: the answer is not JSON ({e}): {text!r}") from e
    if schema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            raise CheckFailed(f"{what}: {text!r} does not match the schema: {e.message}") from e
    return value


def schemas(client, model):
    """Every schema, greedy and sampled, alternating the endpoints; the answers' count."""
    count = 0
    for index, (name, prompt, schema) in enumerate(SCHEMAS):
        jsonschema.Draft202012Validator.check_schema(schema)
        for mode, sampling in (
            ("greedy", {"temperature": 0}),
            ("sampled", {"temperature": SAMPLED_TEMPERATURE, "seed": 100 + index}),
        ):
            endpoint = "chat" if (index + (mode == "sampled")) % 2 == 0 else "completion"
            what = f"{name} ({mode}, {endpoint})"
            text, finish, usage = ask(
                client, model, endpoint, prompt, schema_format(name, schema), sampling
            )
            valid_answer(what, text, finish, schema)
            print(f"  {what:36} {usage.completion_tokens:3} tokens  {text}")
            count += 1
    return count


def json_object_mode(client, model):
    """json_object, whole and streamed: any JSON object."""
    prompt = [{"role": "user", "content": "Give the name and age of a fictional person as a JSON object."}]
    answer = client.chat.completions.create(
        model=model, messages=prompt, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_object"},
    )
    choice = answer.choices[0]
    whole = valid_answer("json_object", choice.message.content, choice.finish_reason, None)
    check(isinstance(whole, dict), f"json_object gave {type(whole).__name__}, not an object")
    pieces, finish = [], None
    for chunk in client.chat.completions.create(
        model=model, messages=prompt, max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_object"}, stream=True,
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    streamed = "".join(pieces)
    check(streamed == choice.message.content,
          f"streamed {streamed!r} differs from {choice.message.content!r}")
    valid_answer("json_object streamed", streamed, finish, None)
    return choice.message.content


def refusals(client, model):
    for what, response_format, param, word in REFUSED:
        for endpoint in ("chat", "completion"):
            try:
                ask(client, model, endpoint, "Hi", response_format, {"temperature": 0})
            except openai.BadRequestError as e:
                check(e.param == param, f"{what} ({endpoint}): param {e.param!r}, not {param!r}")
                check(word in e.message, f"{what} ({endpoint}): {e.message!r} lacks {word!r}")
                continue
            raise CheckFailed(f"{what} ({endpoint}) was accepted; expected 400 naming {param}")
        print(f"  {what:44} 400, param {param}")


def measure(client, model, runs):
    """Tokens per second of structured and of unconstrained answers to the same prompt."""
    prompt = "List three facts about the Moon."
    schema = {
        "type": "object",
        "properties": {"facts": {"type": "array", "items": {"type": "string"}}},
        "required": ["facts"],
    }
    rates = {}
    for kind, response_format in (
        ("unconstrained", openai.NOT_GIVEN),
        ("structured", schema_format("facts", schema)),
    ):
        tokens = seconds = 0.0
        for run in range(runs):
            started = time.monotonic()
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64,
                temperature=SAMPLED_TEMPERATURE, seed=run, response_format=response_format,
            )
            seconds += time.monotonic() - started
            tokens += answer.usage.completion_tokens
        rates[kind] = tokens / seconds
        print(f"  {kind:14} {tokens:.0f} tokens in {seconds:.2f} s: {rates[kind]:.1f} tokens/s")
    print(f"  structured / unconstrained: {rates['structured'] / rates['unconstrained']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", metavar="BASE_URL", help="e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--model", help="model id to use (default: the one the server lists)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--measure", type=int, default=0, metavar="N",
                        help="also time N structured and N unconstrained answers")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="meshnet", max_retries=0, timeout=args.timeout)
    step = "connecting"
    try:
        step = "models.list"
        model = args.model or client.models.list().data[0].id
        print(f"model: {model}")
        step = "json_schema answers"
        started = time.monotonic()
        count = schemas(client, model)
        print(f"{count} answers to {len(SCHEMAS)} schemas parse and validate "
              f"({time.monotonic() - started:.1f} s)")
        step = "json_object"
        text = json_object_mode(client, model)
        print(f"json_object: {text} (the same streamed)")
        step = "refused formats"
        refusals(client, model)
        if args.measure > 0:
            step = "measuring"
            measure(client, model, args.measure)
    except CheckFailed as e:
        sys.exit(f"FAILED during {step}: {e}")
    except openai.APIConnectionError as e:
        sys.exit(f"FAILED during {step}: cannot reach {args.base_url}: {e}")
    except openai.APIStatusError as e:
        sys.exit(f"FAILED during {step}: HTTP {e.status_code}: {e.message}")
    except openai.APIError as e:
        sys.exit(f"FAILED during {step}: {e}")
    print("OK: all structured output checks passed")


if __name__ == "__main__":
    main()
