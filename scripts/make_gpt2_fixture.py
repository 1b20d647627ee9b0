#!/usr/bin/env python3
"""Make the tiny random GPT-2 test fixture used by meshnet-model's GPT-2 tests.

What it makes
-------------
A GPT-2 model with random weights, small enough to commit, in Hugging Face
format, plus reference outputs computed with the Hugging Face `transformers`
implementation, all under

    crates/meshnet-model/tests/fixtures/gpt2-tiny/

  config.json, model.safetensors
      written by GPT2LMHeadModel.save_pretrained: tensor names carry the
      `transformer.` prefix, Conv1D weights are stored [in, out], and the
      lm_head is tied to `transformer.wte.weight`.
  no-prefix/config.json, no-prefix/model.safetensors
      the same weights saved from the bare GPT2Model (names without the
      `transformer.` prefix, no lm_head).
  reference.json
      config summary, a fixed input of token ids, and in float32 (stored as
      exact JSON numbers): the full logits [seq, vocab]; the embeddings that
      enter block 0; the output of every block (before ln_f); the output of
      ln_f; and the logits of incremental decoding with a KV cache.
  README.md
      what the files are and how they were made.

The config is: vocab_size 256, n_positions 64, n_embd 48, n_layer 4, n_head 4
(head_dim 12), n_inner 4*n_embd, activation `gelu_new` (GPT-2's tanh GELU),
layer_norm_epsilon 1e-5, float32, eager attention, initializer_range 0.2.
After the usual initialisation the LayerNorm weights and biases and all linear
biases (which transformers sets to 1 and 0) are also drawn at random, so a
mix-up of any of them changes the outputs.

How to run it
-------------
From the repository root, with a Python virtual environment (ignored by git):

    python3 -m venv .venv-fixture
    .venv-fixture/bin/pip install torch transformers safetensors numpy
    .venv-fixture/bin/python scripts/make_gpt2_fixture.py

It takes a few seconds on a CPU and needs no network nor GPU (it forces the
CPU). An optional argument gives another output folder. It is deterministic:
the torch seed is fixed, and running it again with the same package versions
rewrites byte-identical files.

Package versions it was run with
--------------------------------
    Python 3.11.7, torch 2.15.0, transformers 5.24.0, safetensors 0.8.0,
    numpy 2.4.6
"""

import json
import math
import os
import sys

import numpy as np
import safetensors
import safetensors.numpy
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

SEED = 20240521
OUT_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "crates",
    "meshnet-model",
    "tests",
    "fixtures",
    "gpt2-tiny",
)

VOCAB = 256
N_POSITIONS = 64
N_EMBD = 48
N_LAYER = 4
N_HEAD = 4
INIT_STD = 0.2

# A fixed input of 20 token ids within the vocab, including the first and
# last id.
INPUT_IDS = [17, 0, 201, 88, 255, 3, 142, 64, 99, 230, 5, 128, 77, 31, 190, 12, 250, 46, 160, 9]
# Incremental decoding: the first len-4 tokens at once, then the last 4 one at
# a time with past_key_values.
N_INCREMENTAL = 4


def to_list(t):
    """A float32 tensor as nested lists of Python floats, exact: float32 -> float64 is lossless."""
    assert t.dtype == torch.float32
    return t.detach().cpu().double().tolist()


def make_config():
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        n_embd=N_EMBD,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_inner=None,  # 4 * n_embd
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        initializer_range=INIT_STD,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=True,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        use_cache=True,
        torch_dtype="float32",
        attn_implementation="eager",
    )


def randomise_norms_and_biases(model, gen):
    """Draw LayerNorm weights/biases and linear biases at random (transformers sets them to 1/0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif ("ln_" in name) and name.endswith(".weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)


def block_outputs(model, input_ids):
    """Logits, embeddings into block 0, output of each block, and ln_f output, in one forward pass."""
    captured = {}

    def hook_for(i):
        def hook(_module, _inputs, output):
            hs = output[0] if isinstance(output, (tuple, list)) else output
            captured[i] = hs.detach().clone()

        return hook

    def pre_hook(_module, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        captured["embeddings"] = hs.detach().clone()

    handles = [blk.register_forward_hook(hook_for(i)) for i, blk in enumerate(model.transformer.h)]
    handles.append(model.transformer.h[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
    try:
        out = model(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()

    blocks = [captured[i][0] for i in range(N_LAYER)]
    hidden = out.hidden_states  # (embeddings, block 0 .. block n-2 outputs, ln_f(block n-1 output))
    # Cross-check the hooks with transformers' own hidden_states.
    assert torch.equal(hidden[0][0], captured["embeddings"][0])
    for i in range(N_LAYER - 1):
        assert torch.equal(hidden[i + 1][0], blocks[i])
    ln_f = model.transformer.ln_f(captured[N_LAYER - 1])[0]
    assert torch.equal(hidden[N_LAYER][0], ln_f)
    return out.logits[0], captured["embeddings"][0], blocks, ln_f


def incremental_logits(model, input_ids):
    n = input_ids.shape[1]
    prefix = input_ids[:, : n - N_INCREMENTAL]
    out = model(input_ids=prefix, use_cache=True)
    past = out.past_key_values
    prefix_logits = out.logits[0]
    steps = []
    for pos in range(n - N_INCREMENTAL, n):
        tok = input_ids[:, pos : pos + 1]
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits[0, -1])
    return prefix_logits, steps


def max_abs_diff(a, b):
    return float((a - b).abs().max())


def main():
    out_dir = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else OUT_DIR)
    no_prefix_dir = os.path.join(out_dir, "no-prefix")
    os.makedirs(no_prefix_dir, exist_ok=True)

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    config = make_config()
    model = GPT2LMHeadModel(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    randomise_norms_and_biases(model, gen)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "lm_head not tied"

    model.save_pretrained(out_dir, safe_serialization=True)
    model.transformer.save_pretrained(no_prefix_dir, safe_serialization=True)
    # save_pretrained also writes generation_config.json, which the fixture does not need.
    for d in (out_dir, no_prefix_dir):
        extra = os.path.join(d, "generation_config.json")
        if os.path.exists(extra):
            os.remove(extra)

    input_ids = torch.tensor([INPUT_IDS], dtype=torch.long)
    assert int(input_ids.max()) < VOCAB and len(INPUT_IDS) <= N_POSITIONS

    with torch.no_grad():
        logits, embeddings, blocks, ln_f = block_outputs(model, input_ids)
        prefix_logits, steps = incremental_logits(model, input_ids)

    n = len(INPUT_IDS)
    inc_diff = max(max_abs_diff(s, logits[n - N_INCREMENTAL + i]) for i, s in enumerate(steps))
    prefix_diff = max_abs_diff(prefix_logits, logits[: n - N_INCREMENTAL])
    assert inc_diff < 1e-4 and prefix_diff < 1e-4, (inc_diff, prefix_diff)

    # Reload both saved variants and check they give the same logits.
    with torch.no_grad():
        reloaded = GPT2LMHeadModel.from_pretrained(out_dir, attn_implementation="eager").eval()
        assert torch.equal(reloaded(input_ids=input_ids).logits[0], logits)
        bare = GPT2Model.from_pretrained(no_prefix_dir, attn_implementation="eager").eval()
        hs = bare(input_ids=input_ids).last_hidden_state[0]
        assert torch.equal(hs, ln_f)
        assert torch.equal(hs @ bare.wte.weight.T, logits) or max_abs_diff(hs @ bare.wte.weight.T, logits) < 1e-5

    # Check tensor names, dtypes, and layouts on disk.
    with_prefix = safetensors.numpy.load_file(os.path.join(out_dir, "model.safetensors"))
    without = safetensors.numpy.load_file(os.path.join(no_prefix_dir, "model.safetensors"))
    assert all(k.startswith("transformer.") for k in with_prefix), sorted(with_prefix)
    assert not any(k.startswith("transformer.") for k in without), sorted(without)
    assert sorted(k[len("transformer."):] for k in with_prefix) == sorted(without)
    for k, v in without.items():
        assert v.dtype == np.float32, k
        assert np.array_equal(v, with_prefix["transformer." + k]), k
    assert with_prefix["transformer.h.0.attn.c_attn.weight"].shape == (N_EMBD, 3 * N_EMBD)
    assert with_prefix["transformer.h.0.mlp.c_fc.weight"].shape == (N_EMBD, 4 * N_EMBD)
    lm_head_stored = "lm_head.weight" in with_prefix

    reference = {
        "description": (
            "Reference outputs of Hugging Face transformers' GPT2LMHeadModel (eager attention, eval mode, "
            "float32) for the weights in model.safetensors, made by scripts/make_gpt2_fixture.py."
        ),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "seed": SEED,
        "config": {
            "vocab_size": config.vocab_size,
            "n_positions": config.n_positions,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "head_dim": config.n_embd // config.n_head,
            "n_inner": 4 * config.n_embd if config.n_inner is None else config.n_inner,
            "activation_function": config.activation_function,
            "layer_norm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range,
            "scale_attn_weights": config.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
            "tie_word_embeddings": config.tie_word_embeddings,
            "lm_head_weight_stored": lm_head_stored,
            "dtype": "float32",
        },
        "input_ids": INPUT_IDS,
        "shapes": {
            "logits": [n, VOCAB],
            "embeddings": [n, N_EMBD],
            "block_outputs": [N_LAYER, n, N_EMBD],
            "ln_f_output": [n, N_EMBD],
            "incremental.step_logits": [N_INCREMENTAL, VOCAB],
        },
        "notes": {
            "logits": "whole model, all positions, one forward pass without cache",
            "embeddings": "wte[input_ids] + wpe[0..n]: the input of block 0",
            "block_outputs": (
                "block_outputs[i] is the output of block i (residual stream after block i, before ln_f); "
                "a span of blocks a..b (inclusive) maps block_outputs[a-1] (or embeddings if a == 0) "
                "to block_outputs[b]"
            ),
            "ln_f_output": "ln_f(block_outputs[n_layer-1]); logits = ln_f_output @ wte^T",
            "incremental": (
                "the first prefix_len tokens in one pass with use_cache, then each of the last "
                "len(step_logits) tokens alone with past_key_values; step_logits[k] are the logits at "
                "position prefix_len + k"
            ),
        },
        "logits": to_list(logits),
        "embeddings": to_list(embeddings),
        "block_outputs": [to_list(b) for b in blocks],
        "ln_f_output": to_list(ln_f),
        "incremental": {
            "prefix_len": n - N_INCREMENTAL,
            "prefix_logits_last": to_list(prefix_logits[-1]),
            "step_token_ids": INPUT_IDS[n - N_INCREMENTAL :],
            "step_logits": [to_list(s) for s in steps],
            "max_abs_diff_vs_full_logits": inc_diff,
        },
    }

    def check_finite(x):
        if isinstance(x, list):
            for y in x:
                check_finite(y)
        elif isinstance(x, float):
            assert math.isfinite(x)

    check_finite(reference["logits"])
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f, separators=(",", ":"))
        f.write("\n")

    print(f"wrote {out_dir}")
    print(f"tensors: {len(with_prefix)} (lm_head.weight stored: {lm_head_stored})")
    print(f"logits: min {float(logits.min()):.4f} max {float(logits.max()):.4f} std {float(logits.std()):.4f}")
    print(f"incremental vs full max |diff|: {inc_diff:.3e}; prefix: {prefix_diff:.3e}")


if __name__ == "__main__":
    main()
