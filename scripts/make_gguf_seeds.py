#!/usr/bin/env python3
"""Writes the seed inputs of the `gguf_header` fuzz target into fuzz/seeds/gguf_header/.

Small, valid GGUF files (version 3 unless named otherwise) that together use every metadata
value type, an explicit alignment, and tensors of several types, so the fuzzer starts from
headers that pass every check and mutates from there. Only Python's standard library is
used; the bytes follow the GGUF layout directly. A test in meshnet-model checks that every
seed is still accepted.

    python3 scripts/make_gguf_seeds.py
"""

import os
import struct

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "seeds", "gguf_header")

# GGUF metadata value type ids.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
                  BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
# ggml tensor type ids and (values per block, bytes per block).
F32_T, F16_T, Q8_0_T, Q4_K_T = 0, 1, 8, 12
BLOCKS = {F32_T: (1, 4), F16_T: (1, 2), Q8_0_T: (32, 34), Q4_K_T: (256, 144)}


def string(text):
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def value(type_id, item):
    if type_id == STRING:
        return string(item)
    if type_id == ARRAY:
        element_type, items = item
        body = b"".join(value(element_type, x) for x in items)
        return struct.pack("<IQ", element_type, len(items)) + body
    return struct.pack(SCALAR_FORMATS[type_id], item)


def gguf(metadata, tensors, version=3, alignment=32):
    """metadata: [(key, type, value)]; tensors: [(name, dims innermost first, type)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, type_id, item in metadata:
        out += string(key) + struct.pack("<I", type_id) + value(type_id, item)
    offset, data = 0, b""
    for name, dims, type_id in tensors:
        out += string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", type_id, offset)
        count = 1
        for d in dims:
            count *= d
        per_block, block_bytes = BLOCKS[type_id]
        size = count // per_block * block_bytes
        # Deterministic, non-zero bytes; f16 0x3c3c and the Q8_0 scales stay finite.
        chunk = bytes((i * 7 + 60) % 256 for i in range(size))
        padded = (size + alignment - 1) // alignment * alignment
        data += chunk + b"\0" * (padded - size)
        offset += padded
    out += b"\0" * ((-len(out)) % alignment)
    return out + data


def seeds():
    tokens = (STRING, ["<s>", "</s>", "a", "b"])
    llama = [
        ("general.architecture", STRING, "llama"),
        ("llama.block_count", U32, 1),
        ("llama.embedding_length", U32, 32),
        ("tokenizer.ggml.tokens", ARRAY, tokens),
        ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, -1.0, -2.0, -3.0])),
    ]
    every_type = [
        ("u8", U8, 200), ("i8", I8, -5), ("u16", U16, 60000), ("i16", I16, -300),
        ("u32", U32, 1 << 31), ("i32", I32, -1), ("f32", F32, 0.5), ("bool", BOOL, True),
        ("string", STRING, "text"), ("u64", U64, 1 << 40), ("i64", I64, -(1 << 40)),
        ("f64", F64, 0.25), ("bytes", ARRAY, (U8, [1, 2, 3])),
        ("strings", ARRAY, (STRING, ["x", ""])), ("bools", ARRAY, (BOOL, [False, True])),
    ]
    return {
        "empty": gguf([], []),
        "metadata_every_type": gguf(every_type, []),
        "tiny_llama": gguf(llama, [
            ("token_embd.weight", [32, 4], F32_T),
            ("blk.0.attn_q.weight", [32, 2], Q8_0_T),
            ("blk.0.ffn_down.weight", [256], Q4_K_T),
        ]),
        "v2_alignment_64": gguf(
            [("general.alignment", U32, 64)], [("a", [3, 2], F16_T), ("b", [5], F32_T)],
            version=2, alignment=64),
    }


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    for name, data in seeds().items():
        with open(os.path.join(OUT_DIR, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
