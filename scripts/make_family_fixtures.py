#!/usr/bin/env python3
"""Tiny random GGUF models, one per model family, and llama.cpp's logits for them.

Subcommands:
  write DIR      write the GGUF files (deterministic: same bytes on every run)
  reference DIR  run llama.cpp (through llama-cpp-python) on each GGUF in DIR and write
                 <name>.logits.f32 (little-endian f32, positions x vocab) and <name>.json
  check DIR      regenerate the GGUFs into a temporary directory and compare their sha256
                 with the files in DIR (and with the sha256 recorded in each <name>.json)
  verify DIR     run an independent float64 forward pass (written from family_fixtures.md) on
                 each GGUF, print its gap to llama.cpp's logits, and check that getting any
                 one family feature wrong moves the logits far more than that gap

`write`, `check` and `verify` need only `gguf==0.19.0` and numpy; `reference` also needs
`llama-cpp-python==0.3.36` (it builds llama.cpp from source). Use a virtual environment outside
the repository; the fixtures' README has the commands. The per-family facts the models exercise are in
family_fixtures.md beside this script.

Weights are random but valid blocks of the stated quantization type, built directly as bytes
(scale fields are chosen f16 values, quant fields are random), from a counter-based generator
implemented here, so the bytes do not depend on numpy's random streams.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

N_POSITIONS = 64
N_VOCAB = 384
HIDDEN = 256
N_FF = 512

# llama.cpp as vendored in llama-cpp-python 0.3.36 (vendor/llama.cpp in its sdist).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


# ---------------------------------------------------------------------------------------------
# Deterministic random numbers (splitmix64 over a counter, keyed by a string)
# ---------------------------------------------------------------------------------------------

def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def random_u64(key: str, n: int) -> np.ndarray:
    """n pseudo-random uint64 values determined by `key` alone."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    with np.errstate(over="ignore"):
        counter = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    return _splitmix64(counter)


def random_bytes(key: str, n: int) -> np.ndarray:
    return random_u64(key, (n + 7) // 8).astype("<u8").view(np.uint8)[:n].copy()


def random_uniform(key: str, n: int) -> np.ndarray:
    """n values uniform in [-1, 1), float64."""
    u = (random_u64(key, n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return u * 2.0 - 1.0


# ---------------------------------------------------------------------------------------------
# Random but valid quantized blocks
# ---------------------------------------------------------------------------------------------


def _f16_bytes(value: float, n_blocks: int) -> np.ndarray:
    return np.full(n_blocks, value, dtype="<f2").view(np.uint8).reshape(n_blocks, 2)


def _blocks_q8_0(key: str, n_blocks: int, amp: float) -> np.ndarray:
    # block_q8_0: f16 d, int8 qs[32]; w = d * q
    qs = random_bytes(key, n_blocks * 32).reshape(n_blocks, 32)
    return np.concatenate([_f16_bytes(amp / 127.0, n_blocks), qs], axis=1)


def _blocks_q5_0(key: str, n_blocks: int, amp: float) -> np.ndarray:
    # block_q5_0: f16 d, u8 qh[4], u8 qs[16]; w = d * (q - 16), q in 0..31
    rest = random_bytes(key, n_blocks * 20).reshape(n_blocks, 20)
    return np.concatenate([_f16_bytes(amp / 16.0, n_blocks), rest], axis=1)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block into the 12-byte Q4_K layout."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    return out


def _blocks_q4_k(key: str, n_blocks: int, amp: float) -> np.ndarray:
    # block_q4_K: f16 d, f16 dmin, u8 scales[12], u8 qs[128];
    # w = d * sc * q - dmin * m, q in 0..15; m chosen so each sub-block is centred near 0.
    d = amp / (63.0 * 7.5)
    dmin = 8.0 * d
    sc = (32 + random_bytes(key + "/sc", n_blocks * 8) % 32).astype(np.uint8).reshape(n_blocks, 8)
    mn = np.round(sc.astype(np.float64) * 7.5 / 8.0).astype(np.uint8)
    qs = random_bytes(key + "/qs", n_blocks * 128).reshape(n_blocks, 128)
    head = np.concatenate([_f16_bytes(d, n_blocks), _f16_bytes(dmin, n_blocks)], axis=1)
    return np.concatenate([head, _pack_k4_scales(sc, mn), qs], axis=1)


def _blocks_q6_k(key: str, n_blocks: int, amp: float) -> np.ndarray:
    # block_q6_K: u8 ql[128], u8 qh[64], int8 scales[16], f16 d; w = d * scale * (q - 32)
    qlh = random_bytes(key + "/q", n_blocks * 192).reshape(n_blocks, 192)
    mag = 64 + random_bytes(key + "/sc", n_blocks * 16).astype(np.int16) % 64
    sign = np.where(random_bytes(key + "/sg", n_blocks * 16) & 1, -1, 1).astype(np.int16)
    scales = (mag * sign).astype(np.int8).view(np.uint8).reshape(n_blocks, 16)
    d = amp / (127.0 * 32.0)
    return np.concatenate([qlh, scales, _f16_bytes(d, n_blocks)], axis=1)


_BLOCK_MAKERS = {
    QT.Q8_0: _blocks_q8_0,
    QT.Q5_0: _blocks_q5_0,
    QT.Q4_K: _blocks_q4_k,
    QT.Q6_K: _blocks_q6_k,
}


def make_matrix(key: str, qtype: QT, n_in: int, n_out: int, amp: float) -> np.ndarray:
    """Bytes (or f16/f32 values) of an {n_in, n_out} matrix: n_out rows of n_in values."""
    if qtype == QT.F16:
        return (random_uniform(key, n_in * n_out) * amp).astype("<f2").reshape(n_out, n_in)
    if qtype == QT.F32:
        return (random_uniform(key, n_in * n_out) * amp).astype("<f4").reshape(n_out, n_in)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if n_in % block_size != 0:
        raise ValueError(f"{key}: row length {n_in} is not a multiple of {qtype.name} block {block_size}")
    n_blocks = n_in // block_size * n_out
    blocks = _BLOCK_MAKERS[qtype](key, n_blocks, amp)
    if blocks.shape != (n_blocks, type_size):
        raise AssertionError(f"{key}: {qtype.name} block size {blocks.shape[1]} != {type_size}")
    return blocks.reshape(n_out, n_in // block_size * type_size)


def make_vector(key: str, n: int, centre: float, amp: float) -> np.ndarray:
    return (centre + random_uniform(key, n) * amp).astype("<f4")


# ---------------------------------------------------------------------------------------------
# Vocabulary: GPT-2 style byte-level BPE that llama.cpp accepts
# ---------------------------------------------------------------------------------------------


def _byte_to_unicode() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping = {}
    extra = 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def build_vocab() -> tuple[list[str], list[int], list[str], int]:
    tokens = _byte_to_unicode()
    types = [gguf.TokenType.NORMAL] * 256
    letters = "etaoinsh"
    merges = []
    for a in letters:
        for b in letters:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(gguf.TokenType.NORMAL)
    eos_id = len(tokens)
    # llama.cpp looks these three up by text when general.name contains "phi3" or "phi-3"
    # (src/llama-vocab.cpp) and fails the load if one is missing.
    for special in ("<|endoftext|>", "<s>", "</s>", "<unk>"):
        tokens.append(special)
        types.append(gguf.TokenType.CONTROL)
    while len(tokens) < N_VOCAB:
        tokens.append(f"<|extra_{len(tokens) - eos_id - 4}|>")
        types.append(gguf.TokenType.CONTROL)
    return tokens, [int(t) for t in types], merges, eos_id


# ---------------------------------------------------------------------------------------------
# Family descriptions
# ---------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """One fixture model: architecture, shapes, metadata and per-tensor types."""

    name: str
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    context_length: int
    freq_base: float
    tied_output: bool
    types: dict[str, QT]
    extra_kv: dict[str, object] = field(default_factory=dict)
    n_ctx: int = 128
    n_ff: int = N_FF
    note: str = ""


def _llama3_rope_factors(head_dim: int, base: float) -> np.ndarray:
    """The factors llama.cpp's converter writes to rope_freqs.weight for rope_type llama3.

    Llama 3.1 uses original_max_position_embeddings 8192; the fixture uses 64 so that the
    scaled frequencies are ones that actually turn within the 64 fed positions.
    """
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 64.0
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (base ** (i / head_dim))
        wavelen = 2.0 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.array(out, dtype="<f4")


PHI3_CTX, PHI3_ORIG_CTX = 131072, 4096
PHI3_ATTN_FACTOR = math.sqrt(1.0 + math.log(PHI3_CTX / PHI3_ORIG_CTX) / math.log(PHI3_ORIG_CTX))

SPECS = [
    Spec("llama", "llama", 2, 4, 2, 64, 1e-5, 4096, 10000.0, False,
         {"token_embd": QT.Q4_K, "attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q6_K,
          "attn_output": QT.Q4_K, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K, "ffn_down": QT.Q6_K,
          "output": QT.Q6_K},
         note="plain llama, GQA 4/2, untied output"),
    Spec("llama3", "llama", 2, 4, 2, 64, 1e-5, 131072, 500000.0, True,
         {"token_embd": QT.Q8_0, "attn_q": QT.Q5_0, "attn_k": QT.Q5_0, "attn_v": QT.Q5_0,
          "attn_output": QT.Q5_0, "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_0, "ffn_down": QT.Q8_0},
         note="llama with Llama 3 rope_freqs (converter formula: factor 8, low 1, high 4, "
              "original context 64), tied output"),
    Spec("qwen2", "qwen2", 2, 4, 2, 64, 1e-6, 32768, 1000000.0, True,
         {"token_embd": QT.F16, "attn_q": QT.Q5_0, "attn_k": QT.Q5_0, "attn_v": QT.Q5_0,
          "attn_output": QT.Q8_0, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K, "ffn_down": QT.Q6_K},
         note="qwen2 with Q/K/V biases, tied output"),
    Spec("qwen3", "qwen3", 2, 4, 2, 128, 1e-6, 40960, 1000000.0, True,
         {"token_embd": QT.Q6_K, "attn_q": QT.Q4_K, "attn_k": QT.Q4_K, "attn_v": QT.Q4_K,
          "attn_output": QT.Q4_K, "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_0, "ffn_down": QT.Q8_0},
         note="qwen3 with Q/K RMS norm, head_dim 128 != hidden/heads 64, tied output"),
    Spec("gemma3", "gemma3", 7, 4, 1, 128, 1e-6, 32768, 1000000.0, True,
         {"token_embd": QT.Q6_K, "attn_q": QT.Q4_K, "attn_k": QT.Q5_0, "attn_v": QT.Q8_0,
          "attn_output": QT.Q4_K, "ffn_gate": QT.Q4_K, "ffn_up": QT.Q4_K, "ffn_down": QT.Q6_K},
         extra_kv={"attention.sliding_window": 8, "rope.freq_base_swa": 10000.0,
                   "rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
         n_ff=256,
         note="gemma3, 7 layers (0-4 and 6 local with window 8, 5 global), MQA, head_dim 128, "
              "linear rope scaling 8 on the global layer, tied output"),
    Spec("phi3", "phi3", 2, 4, 4, 64, 1e-5, PHI3_CTX, 10000.0, False,
         {"token_embd": QT.Q8_0, "attn_qkv": QT.Q4_K, "attn_output": QT.Q6_K, "ffn_up": QT.Q5_0,
          "ffn_down": QT.Q8_0, "output": QT.Q6_K},
         extra_kv={"rope.scaling.original_context_length": PHI3_ORIG_CTX,
                   "rope.scaling.attn_factor": PHI3_ATTN_FACTOR,
                   "attention.sliding_window": 262144},
         note="phi3, fused qkv and gate+up, LongRoPE short/long factors and attn_factor, "
              "untied output"),
]

# Reference runs: (name of the output, spec name, n_ctx). phi3_long uses an n_ctx above the
# original context length, which switches llama.cpp to the long RoPE factors.
REFERENCE_RUNS = [(s.name, s.name, s.n_ctx) for s in SPECS] + [("phi3_long", "phi3", 4352)]


def fixed_tokens() -> list[int]:
    """The fed token ids: deterministic, spread over the whole vocabulary (incl. control ids)."""
    return [int(v % N_VOCAB) for v in random_u64("tokens", N_POSITIONS)]


# ---------------------------------------------------------------------------------------------
# GGUF writing
# ---------------------------------------------------------------------------------------------


def _add_matrix(w: gguf.GGUFWriter, spec: Spec, name: str, kind: str, n_in: int, n_out: int,
                amp: float) -> None:
    qtype = spec.types[kind]
    data = make_matrix(f"{spec.name}/{name}", qtype, n_in, n_out, amp)
    if qtype in (QT.F16, QT.F32):
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _add_norm(w: gguf.GGUFWriter, spec: Spec, name: str, n: int, centre: float = 1.0) -> None:
    w.add_tensor(name, make_vector(f"{spec.name}/{name}", n, centre, 0.2))


def _add_metadata(w: gguf.GGUFWriter, spec: Spec) -> None:
    a = spec.arch
    w.add_string("general.name", f"meshnet tiny random {spec.name}")
    w.add_uint32("general.quantization_version", 2)
    w.add_uint32(f"{a}.context_length", spec.context_length)
    w.add_uint32(f"{a}.embedding_length", HIDDEN)
    w.add_uint32(f"{a}.block_count", spec.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", spec.n_ff)
    w.add_uint32(f"{a}.attention.head_count", spec.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    w.add_float32(f"{a}.rope.freq_base", spec.freq_base)
    if spec.head_dim != HIDDEN // spec.n_head:
        w.add_uint32(f"{a}.attention.key_length", spec.head_dim)
        w.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    w.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    for key, value in spec.extra_kv.items():
        full = f"{a}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    tokens, types, merges, eos_id = build_vocab()
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", eos_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", eos_id)
    w.add_bool("tokenizer.ggml.add_bos_token", False)


def _add_attention(w: gguf.GGUFWriter, spec: Spec, p: str) -> None:
    q_dim = spec.n_head * spec.head_dim
    kv_dim = spec.n_head_kv * spec.head_dim
    if spec.arch == "phi3":
        _add_matrix(w, spec, p + "attn_qkv.weight", "attn_qkv", HIDDEN, q_dim + 2 * kv_dim, 0.08)
    else:
        _add_matrix(w, spec, p + "attn_q.weight", "attn_q", HIDDEN, q_dim, 0.08)
        _add_matrix(w, spec, p + "attn_k.weight", "attn_k", HIDDEN, kv_dim, 0.08)
        _add_matrix(w, spec, p + "attn_v.weight", "attn_v", HIDDEN, kv_dim, 0.08)
    if spec.arch == "qwen2":
        for part, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            name = f"{p}attn_{part}.bias"
            w.add_tensor(name, make_vector(f"{spec.name}/{name}", n, 0.0, 0.5))
    if spec.arch in ("qwen3", "gemma3"):
        _add_norm(w, spec, p + "attn_q_norm.weight", spec.head_dim)
        _add_norm(w, spec, p + "attn_k_norm.weight", spec.head_dim)
    _add_matrix(w, spec, p + "attn_output.weight", "attn_output", q_dim, HIDDEN, 0.08)


def _add_ffn(w: gguf.GGUFWriter, spec: Spec, p: str) -> None:
    if spec.arch == "phi3":
        _add_matrix(w, spec, p + "ffn_up.weight", "ffn_up", HIDDEN, 2 * spec.n_ff, 0.1)
    else:
        _add_matrix(w, spec, p + "ffn_gate.weight", "ffn_gate", HIDDEN, spec.n_ff, 0.1)
        _add_matrix(w, spec, p + "ffn_up.weight", "ffn_up", HIDDEN, spec.n_ff, 0.1)
    _add_matrix(w, spec, p + "ffn_down.weight", "ffn_down", spec.n_ff, HIDDEN, 0.08)


def _add_rope_factor_tensors(w: gguf.GGUFWriter, spec: Spec) -> None:
    n = spec.head_dim // 2
    if spec.name == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(spec.head_dim, spec.freq_base))
    if spec.arch == "phi3":
        long_f = (1.0 + (random_uniform("phi3/rope_factors_long", n) + 1.0) * 0.5
                  * np.linspace(0.0, 40.0, n)).astype("<f4")
        short_f = (1.0 + (random_uniform("phi3/rope_factors_short", n) + 1.0) * 0.5
                   * np.linspace(0.0, 2.0, n)).astype("<f4")
        w.add_tensor("rope_factors_long.weight", long_f)
        w.add_tensor("rope_factors_short.weight", short_f)


def write_gguf(spec: Spec, path: Path) -> None:
    w = gguf.GGUFWriter(str(path), spec.arch)
    _add_metadata(w, spec)
    _add_matrix(w, spec, "token_embd.weight", "token_embd", HIDDEN, N_VOCAB, 0.06)
    _add_norm(w, spec, "output_norm.weight", HIDDEN)
    if not spec.tied_output:
        _add_matrix(w, spec, "output.weight", "output", HIDDEN, N_VOCAB, 0.1)
    _add_rope_factor_tensors(w, spec)
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        _add_norm(w, spec, p + "attn_norm.weight", HIDDEN)
        _add_attention(w, spec, p)
        if spec.arch == "gemma3":
            # the one global layer (5) gets a larger post-attention norm so that its RoPE
            # (base and linear scaling) weighs clearly in the logits
            centre = 3.0 if il % 6 == 5 else 1.0
            _add_norm(w, spec, p + "post_attention_norm.weight", HIDDEN, centre)
        _add_norm(w, spec, p + "ffn_norm.weight", HIDDEN)
        _add_ffn(w, spec, p)
        if spec.arch == "gemma3":
            _add_norm(w, spec, p + "post_ffw_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_weights_sane(path: Path) -> None:
    """Every tensor dequantizes to finite values of a sensible size."""
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        values = gguf.dequantize(t.data, t.tensor_type)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{path.name}: {t.name} has non-finite values")
        if not t.name.startswith("rope_") and float(np.max(np.abs(values))) > 4.0:
            raise ValueError(f"{path.name}: {t.name} max |w| {np.max(np.abs(values))} > 4")


def cmd_write(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec in SPECS:
        path = out_dir / f"{spec.name}.gguf"
        write_gguf(spec, path)
        check_weights_sane(path)
        print(f"{path}  {path.stat().st_size} bytes  sha256 {sha256_of(path)}")


# ---------------------------------------------------------------------------------------------
# Reference logits
# ---------------------------------------------------------------------------------------------


def reference_logits(gguf_path: Path, tokens: list[int], n_ctx: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx,
                n_threads=2, n_threads_batch=2, verbose=False)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype="<f4")
    llm.close()
    return logits


def cmd_reference(out_dir: Path) -> None:
    import llama_cpp

    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        print(f"warning: llama-cpp-python {llama_cpp.__version__}, the fixtures were made with "
              f"{LLAMA_CPP_PYTHON_VERSION} (llama.cpp {LLAMA_CPP_COMMIT[:9]})", file=sys.stderr)
    tokens = fixed_tokens()
    by_name = {s.name: s for s in SPECS}
    for run_name, spec_name, n_ctx in REFERENCE_RUNS:
        spec = by_name[spec_name]
        gguf_path = out_dir / f"{spec_name}.gguf"
        logits = reference_logits(gguf_path, tokens, n_ctx)
        if logits.shape != (len(tokens), N_VOCAB) or not np.all(np.isfinite(logits)):
            raise RuntimeError(f"{run_name}: bad logits shape {logits.shape} or non-finite values")
        (out_dir / f"{run_name}.logits.f32").write_bytes(logits.tobytes())
        meta = {
            "family": spec.arch,
            "gguf": gguf_path.name,
            "gguf_sha256": sha256_of(gguf_path),
            "description": spec.note,
            "tokens": tokens,
            "n_positions": len(tokens),
            "n_vocab": N_VOCAB,
            "logits_file": f"{run_name}.logits.f32",
            "logits_layout": "little-endian f32, row-major [position][vocab]",
            "n_ctx": n_ctx,
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_commit": LLAMA_CPP_COMMIT if llama_cpp.__version__ == LLAMA_CPP_PYTHON_VERSION
            else "unknown",
            "llama_cpp_settings": "CPU, n_threads 2, flash attention off, f16 K/V cache, "
                                  "whole sequence in one batch, teacher-forced",
            "logits_abs_max": float(np.max(np.abs(logits))),
            "logits_std": float(np.std(logits)),
        }
        (out_dir / f"{run_name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{run_name}: logits {logits.shape} std {meta['logits_std']:.4f} "
              f"max|x| {meta['logits_abs_max']:.4f}")


# ---------------------------------------------------------------------------------------------
# Verify: an independent float64 forward pass written from family_fixtures.md, compared with
# llama.cpp's logits, plus variants that each drop one family feature (each must move the
# logits far more than the numeric gap, or the fixture would not exercise that feature)
# ---------------------------------------------------------------------------------------------


class GgufModel:
    """Metadata and dequantized float64 tensors of one GGUF file."""

    def __init__(self, path: Path):
        reader = gguf.GGUFReader(str(path))
        self.meta = {name: f.contents() for name, f in reader.fields.items()
                     if not name.startswith("tokenizer.")}
        self.arch = self.meta["general.architecture"]
        self.t = {}
        for t in reader.tensors:
            self.t[t.name] = gguf.dequantize(t.data, t.tensor_type).astype(np.float64)

    def kv(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, freq_scale: float,
          factors: np.ndarray | None, mscale: float, neox: bool) -> np.ndarray:
    """x: (T, heads, head_dim)."""
    i = np.arange(n_rot // 2)
    theta = pos[:, None] * freq_scale * base ** (-2.0 * i / n_rot)
    if factors is not None:
        theta = theta / factors[None, :]
    cos, sin = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., : n_rot // 2], x[..., n_rot // 2: n_rot]
        out[..., : n_rot // 2] = a * cos - b * sin
        out[..., n_rot // 2: n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def numpy_forward(m: GgufModel, tokens: list[int], n_ctx: int, drop: str = "") -> np.ndarray:
    """Logits [T, vocab]. `drop` names one feature to get wrong on purpose (a variant)."""
    t, arch = m.t, m.arch
    n_layer, n_head = m.kv("block_count"), m.kv("attention.head_count")
    n_kv, eps = m.kv("attention.head_count_kv"), m.kv("attention.layer_norm_rms_epsilon")
    n_embd = m.kv("embedding_length")
    hd = m.kv("attention.key_length", n_embd // n_head)
    n_rot = m.kv("rope.dimension_count", hd)
    neox = (arch != "llama") != (drop == "rope_type")
    n_swa = 0 if drop == "swa" else m.kv("attention.sliding_window", 0)
    if arch != "gemma3":
        n_swa = 0
    pos = np.arange(len(tokens), dtype=np.float64)
    factors = t.get("rope_freqs.weight")
    if "rope_factors_short.weight" in t:
        orig = m.kv("rope.scaling.original_context_length", m.kv("context_length"))
        long = (n_ctx > orig) != (drop == "long_short")
        factors = t["rope_factors_long.weight" if long else "rope_factors_short.weight"]
    if drop == "rope_factors":
        factors = None
    mscale = 1.0 if drop == "attn_factor" else m.kv("rope.scaling.attn_factor", 1.0)
    linear = m.kv("rope.scaling.type", "linear") == "linear" and drop != "rope_scaling"
    global_scale = 1.0 / m.kv("rope.scaling.factor", 1.0) if linear else 1.0

    def norm(x, name):
        w = t[name] + (1.0 if drop == "gemma_norm_plus_one" else 0.0)
        return _rms(x, w, eps)

    x = t["token_embd.weight"][tokens]
    if arch == "gemma3" and drop != "embd_scale":
        x = x * math.sqrt(n_embd)
    T = len(tokens)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for il in range(n_layer):
        p = f"blk.{il}."
        is_swa = n_swa > 0 and (il % 6 < 5)
        h = norm(x, p + "attn_norm.weight")
        if p + "attn_qkv.weight" in t:
            qkv = h @ t[p + "attn_qkv.weight"].T
            q, k, v = np.split(qkv, [n_head * hd, (n_head + n_kv) * hd], axis=1)
        else:
            q, k, v = (h @ t[p + f"attn_{n}.weight"].T for n in "qkv")
        if p + "attn_q.bias" in t and drop != "qkv_bias":
            q, k, v = q + t[p + "attn_q.bias"], k + t[p + "attn_k.bias"], v + t[p + "attn_v.bias"]
        q, k, v = q.reshape(T, n_head, hd), k.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if p + "attn_q_norm.weight" in t and drop != "qk_norm":
            q, k = norm(q, p + "attn_q_norm.weight"), norm(k, p + "attn_k_norm.weight")
        base = m.kv("rope.freq_base", 10000.0)
        scale = global_scale
        if is_swa and drop != "swa_base":
            base, scale = m.kv("rope.freq_base_swa", 10000.0), 1.0
        q = _rope(q, pos, n_rot, base, scale, factors, mscale, neox)
        k = _rope(k, pos, n_rot, base, scale, factors, mscale, neox)
        mask = causal.copy()
        if is_swa:
            mask &= (pos[:, None] - pos[None, :]) < n_swa
        group = n_head // n_kv
        heads = []
        for hh in range(n_head):
            s = q[:, hh, :] @ k[:, hh // group, :].T / math.sqrt(hd)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((s / s.sum(axis=1, keepdims=True)) @ v[:, hh // group, :])
        a = np.concatenate(heads, axis=1) @ t[p + "attn_output.weight"].T
        if arch == "gemma3" and drop != "post_norms":
            a = norm(a, p + "post_attention_norm.weight")
        x = x + a
        h = norm(x, p + "ffn_norm.weight")
        if p + "ffn_gate.weight" in t:
            gate, up = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
        else:
            gate, up = np.split(h @ t[p + "ffn_up.weight"].T, 2, axis=1)
            if drop == "gate_up_order":
                gate, up = up, gate
        act = _gelu_tanh(gate) if (arch == "gemma3") != (drop == "activation") else _silu(gate)
        f = (act * up) @ t[p + "ffn_down.weight"].T
        if arch == "gemma3" and drop != "post_norms":
            f = norm(f, p + "post_ffw_norm.weight")
        x = x + f
    x = norm(x, "output_norm.weight")
    out = t.get("output.weight", t["token_embd.weight"])
    return x @ out.T


VARIANTS = {
    "llama": ["rope_type"],
    "llama3": ["rope_type", "rope_factors"],
    "qwen2": ["rope_type", "qkv_bias"],
    "qwen3": ["rope_type", "qk_norm"],
    "gemma3": ["rope_type", "embd_scale", "gemma_norm_plus_one", "post_norms", "qk_norm",
               "activation", "swa", "swa_base", "rope_scaling"],
    "phi3": ["rope_type", "gate_up_order", "attn_factor", "rope_factors", "long_short"],
    "phi3_long": ["long_short"],
}


def cmd_verify(fixture_dir: Path) -> int:
    by_name = {s.name: s for s in SPECS}
    worst = 0.0
    failures = []
    for run_name, spec_name, n_ctx in REFERENCE_RUNS:
        meta = json.loads((fixture_dir / f"{run_name}.json").read_text())
        ref = np.frombuffer((fixture_dir / f"{run_name}.logits.f32").read_bytes(), dtype="<f4")
        ref = ref.reshape(meta["n_positions"], meta["n_vocab"]).astype(np.float64)
        model = GgufModel(fixture_dir / f"{spec_name}.gguf")
        ours = numpy_forward(model, meta["tokens"], n_ctx)
        gap = float(np.max(np.abs(ours - ref)))
        worst = max(worst, gap)
        argmax = float(np.mean(np.argmax(ours, 1) == np.argmax(ref, 1)))
        line = f"{run_name:10s} max|numpy-llama.cpp| {gap:.4f} (logit std {np.std(ref):.3f}, " \
               f"argmax agreement {argmax:.2f})"
        print(line)
        for drop in VARIANTS[run_name]:
            moved = float(np.max(np.abs(numpy_forward(model, meta["tokens"], n_ctx, drop) - ref)))
            verdict = "ok" if moved > 4 * gap else "TOO SMALL"
            print(f"    without {drop:20s} max diff {moved:.4f}  {verdict}")
            if moved <= 4 * gap:
                failures.append(f"{run_name}: dropping {drop} moves the logits only {moved:.4f}")
    for f in failures:
        print("FAIL", f, file=sys.stderr)
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# Check
# ---------------------------------------------------------------------------------------------


def cmd_check(fixture_dir: Path) -> int:
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SPECS:
            fresh = Path(tmp) / f"{spec.name}.gguf"
            write_gguf(spec, fresh)
            committed = fixture_dir / f"{spec.name}.gguf"
            if not committed.is_file():
                failures.append(f"{committed} is missing")
                continue
            want = sha256_of(fresh)
            if sha256_of(committed) != want:
                failures.append(f"{committed.name}: sha256 differs from a fresh write ({want})")
    for run_name, spec_name, _ in REFERENCE_RUNS:
        meta_path = fixture_dir / f"{run_name}.json"
        if not meta_path.is_file():
            failures.append(f"{meta_path} is missing")
            continue
        meta = json.loads(meta_path.read_text())
        gguf_path = fixture_dir / f"{spec_name}.gguf"
        if gguf_path.is_file() and meta.get("gguf_sha256") != sha256_of(gguf_path):
            failures.append(f"{meta_path.name}: gguf_sha256 does not match {gguf_path.name}")
        logits_path = fixture_dir / f"{run_name}.logits.f32"
        want_size = 4 * meta.get("n_positions", 0) * meta.get("n_vocab", 0)
        if not logits_path.is_file() or logits_path.stat().st_size != want_size:
            failures.append(f"{logits_path.name}: missing or not {want_size} bytes")
        if meta.get("tokens") != fixed_tokens():
            failures.append(f"{meta_path.name}: token ids differ from the script's")
    for line in failures:
        print("FAIL", line, file=sys.stderr)
    if not failures:
        print(f"ok: {len(SPECS)} GGUFs and {len(REFERENCE_RUNS)} references match")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("write", "reference", "check", "verify"):
        sub.add_parser(name).add_argument("dir", type=Path)
    args = parser.parse_args()
    if args.command == "write":
        cmd_write(args.dir)
        return 0
    if args.command == "reference":
        cmd_reference(args.dir)
        return 0
    if args.command == "verify":
        return cmd_verify(args.dir)
    return cmd_check(args.dir)


if __name__ == "__main__":
    sys.exit(main())
