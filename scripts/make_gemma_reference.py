#!/usr/bin/env python3
"""Greedy text of the real Gemma 3 270M instruct Q4_K_M file, as llama.cpp computes it.

For three chat prompts this renders Gemma's turn format, lets llama.cpp tokenize it (with BOS,
special tokens parsed), decodes 32 tokens greedily, and writes the prompt ids, the generated
ids, their text, and at each step the five best logits and the margin between the best two (a
near-tie explains a divergence between two correct engines). The result is committed as
crates/meshnet-model/tests/fixtures/gemma3-270m-reference.json; the Rust test feeds the same
prompt ids to our spans and compares the tokens.

Needs `llama-cpp-python` (it builds llama.cpp from source: minutes) and the model file
(`scripts/fetch-model.sh gemma3-270m`):

    python3 -m venv /tmp/reference-venv
    /tmp/reference-venv/bin/pip install llama-cpp-python==0.3.36 numpy
    /tmp/reference-venv/bin/python scripts/make_gemma_reference.py \\
        ~/.cache/meshnet/gemma-3-270m-q4_k_m.gguf \\
        crates/meshnet-model/tests/fixtures/gemma3-270m-reference.json
"""

import argparse
import hashlib
import json

import llama_cpp
import numpy as np

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
STEPS = 32


def gemma_turns(question):
    """Gemma's chat format for one user turn, with the model's turn opened."""
    return (
        "<start_of_turn>user\n" + question + "<end_of_turn>\n<start_of_turn>model\n"
    )


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def greedy(llm, prompt_ids):
    """Greedy ids, the top-two logit margin and the five best (id, logit) at each step."""
    llm.reset()
    llm.eval(prompt_ids)
    ids, margins, tops = [], [], []
    for _ in range(STEPS):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        order = np.argsort(logits)[::-1]
        best = int(order[0])
        ids.append(best)
        margins.append(float(logits[order[0]] - logits[order[1]]))
        tops.append([[int(i), round(float(logits[i]), 4)] for i in order[:5]])
        llm.eval([best])
    return ids, margins, tops


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("output")
    args = parser.parse_args()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=512,
        n_threads=2,
        logits_all=True,
        verbose=False,
    )
    cases = []
    for question in PROMPTS:
        text = gemma_turns(question)
        prompt_ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        ids, margins, tops = greedy(llm, prompt_ids)
        cases.append(
            {
                "question": question,
                "prompt": text,
                "prompt_ids": prompt_ids,
                "generated_ids": ids,
                "generated_text": llm.detokenize(ids).decode("utf-8", "replace"),
                "top2_margins": [round(m, 4) for m in margins],
                "top5_logits": tops,
            }
        )
    result = {
        "model_sha256": file_sha256(args.model),
        "llama_cpp_python": llama_cpp.__version__,
        "settings": "CPU, n_threads 2, n_ctx 512, greedy, prompt evaluated in one batch",
        "cases": cases,
    }
    with open(args.output, "w") as handle:
        json.dump(result, handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    main()
