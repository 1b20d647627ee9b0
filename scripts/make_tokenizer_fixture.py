#!/usr/bin/env python3
"""Make the SmolLM2 tokenizer fixture: token ids computed by llama.cpp.

What it makes
-------------
    crates/meshnet-model/tests/fixtures/tokenizer/smollm2-ids.json

For a fixed list of strings (plain ASCII, digits, emoji, CJK, Korean, Arabic,
accents, the SmolLM2 chat markers, leading/trailing/inner whitespace,
contractions, code, a URL, <|endoftext|> inside text) it stores the token ids
that llama.cpp's own tokenizer gives when it reads the model GGUF directly:
no BOS added, special tokens (<|im_start|>, <|endoftext|>, ...) recognised in
the text. The implementation is independent of meshnet's Rust tokenizer
(which builds a `tokenizers` crate BPE from the same GGUF metadata), so a
test comparing the two catches a wrong pre-tokenizer, merge order or
special-token handling.

The JSON holds the model file name and its SHA-256 (the script refuses any
other file than the pinned one), the llama-cpp-python version, the vendored
llama.cpp commit, some of the GGUF's tokenizer metadata (tokenizer.ggml.pre
among it), and a list of cases {"name", "text", "ids", "pieces",
"round_trip"}: `pieces` are the GGUF token strings of the ids (byte-level
form, e.g. "Ġhello"), for reading only; `round_trip` says whether llama.cpp's
detokenize(ids, special=True) gives back exactly the UTF-8 bytes of the text.

How to run it
-------------
From the repository root, with the model in place (scripts/fetch-model.sh
puts it in ~/.cache/meshnet) and a virtual environment in which
llama-cpp-python is built from its sdist, for the CPU only:

    python3 -m venv /tmp/lcpvenv
    CMAKE_BUILD_PARALLEL_LEVEL=1 \\
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \\
        /tmp/lcpvenv/bin/pip install llama-cpp-python==0.3.36
    /tmp/lcpvenv/bin/python scripts/make_tokenizer_fixture.py

The build takes a while on two cores; only the tokenizer is used
(vocab_only=True, no weights are loaded). Options: --model PATH (default
$MESHNET_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf, MESHNET_MODELS defaulting to
~/.cache/meshnet) and --out PATH. The output is deterministic: running it
again with the same versions rewrites a byte-identical file.

Versions it was run with
------------------------
    Python 3.11.7, llama-cpp-python 0.3.36 (vendoring llama.cpp 0c1e57098),
    built with cmake 4.4.5 and ninja 1.13.2 from PyPI, gcc from Debian.
"""

import argparse
import hashlib
import json
import os
import sys

import llama_cpp

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The same value as in scripts/fetch-model.sh and crates/meshnet-peer/src/main.rs.
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The llama.cpp commit that llama-cpp-python 0.3.36 vendors (its CHANGELOG.md).
LLAMA_CPP_COMMIT_BY_VERSION = {"0.3.36": "0c1e57098"}

REPO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT_PATH = os.path.join(
    REPO_ROOT,
    "crates",
    "meshnet-model",
    "tests",
    "fixtures",
    "tokenizer",
    "smollm2-ids.json",
)

# GGUF metadata keys copied into the fixture when present (values as
# llama.cpp reports them, i.e. as strings).
METADATA_KEYS = [
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
]

CASES = [
    ("ascii_sentence", "The capital of France is Paris."),
    ("digits", "In 2024, 1234567 people paid $3.14159."),
    ("emoji", "\U0001F680 launch \U0001F525\U0001F525 ok \U0001F44D\U0001F3FD"),
    ("cjk", "日本語のテキストと中文字符"),
    ("korean", "안녕하세요, 세계! 반갑습니다."),
    ("arabic", "مرحبا بالعالم، كيف حالك؟"),
    ("accents", "Ça va? naïve café, Straße"),
    (
        "chat_markers",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    ("leading_spaces", "   three leading spaces"),
    ("single_leading_space", " hello"),
    ("tabs_newlines", "a\tb\n\nc  d   \n"),
    ("contractions", "don't I'll we're it's"),
    ("code", 'fn main() { println!("hi"); }'),
    ("url", "https://example.com/path?q=1&r=two"),
    ("endoftext_inside", "end<|endoftext|>start"),
]


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def token_text(llm, token):
    # The token's string as stored in tokenizer.ggml.tokens.
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return llama_cpp.llama_vocab_get_text(vocab, token).decode("utf-8")


def render(doc):
    """JSON with two-space indent, but each case's ids and pieces on one line."""
    lines = ["{"]
    top = [(k, v) for k, v in doc.items() if k != "cases"]
    for key, value in top:
        lines.append(
            "  %s: %s," % (json.dumps(key), json.dumps(value, ensure_ascii=False))
        )
    lines.append('  "cases": [')
    for i, case in enumerate(doc["cases"]):
        lines.append("    {")
        items = list(case.items())
        for j, (key, value) in enumerate(items):
            comma = "," if j + 1 < len(items) else ""
            lines.append(
                "      %s: %s%s"
                % (json.dumps(key), json.dumps(value, ensure_ascii=False), comma)
            )
        lines.append("    }" + ("," if i + 1 < len(doc["cases"]) else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main():
    models_dir = os.environ.get(
        "MESHNET_MODELS", os.path.join(os.path.expanduser("~"), ".cache", "meshnet")
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(models_dir, MODEL_NAME))
    parser.add_argument("--out", default=OUT_PATH)
    args = parser.parse_args()

    if not os.path.isfile(args.model):
        sys.exit(f"{args.model} not found: scripts/fetch-model.sh puts it there")
    found = sha256_of(args.model)
    if found != MODEL_SHA256:
        sys.exit(f"{args.model} has sha256 {found}, expected {MODEL_SHA256}")

    version = llama_cpp.__version__
    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    metadata = llm.metadata
    gguf_tokenizer = {k: metadata[k] for k in METADATA_KEYS if k in metadata}

    cases = []
    for name, text in CASES:
        data = text.encode("utf-8")
        ids = llm.tokenize(data, add_bos=False, special=True)
        back = llm.detokenize(ids, special=True)
        round_trip = back == data
        if not round_trip:
            print(f"warning: {name}: detokenize gave {back!r}, not {data!r}",
                  file=sys.stderr)
        cases.append(
            {
                "name": name,
                "text": text,
                "ids": [int(i) for i in ids],
                "pieces": [token_text(llm, int(i)) for i in ids],
                "round_trip": round_trip,
            }
        )

    doc = {
        "description": "Token ids of fixed strings by llama.cpp's tokenizer reading "
        "the GGUF directly (no BOS added, special tokens parsed); made by "
        "scripts/make_tokenizer_fixture.py",
        "model_file": os.path.basename(args.model),
        "model_sha256": found,
        "tokenizer_implementation": "llama.cpp via llama-cpp-python "
        "Llama(vocab_only=True).tokenize(text, add_bos=False, special=True)",
        "llama_cpp_python_version": version,
        "llama_cpp_commit": LLAMA_CPP_COMMIT_BY_VERSION.get(version, "unknown"),
        "tokenizer_ggml_pre": metadata.get("tokenizer.ggml.pre"),
        "gguf_tokenizer_metadata": gguf_tokenizer,
        "n_vocab": llm.n_vocab(),
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.write(render(doc))
    for case in cases:
        print(f"{case['name']}: {len(case['ids'])} ids, round_trip={case['round_trip']}")
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
