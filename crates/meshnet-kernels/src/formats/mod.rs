//! The ggml formats the kernels run straight from their file bytes (every format but Q4_1 and
//! Q8_0, which `matrix.rs` parses into separate scales and quants): each block's layout, its
//! dequantization, and the scalar reference dot product that every SIMD path reproduces bit
//! for bit.
//!
//! Three families, by the activations their dot products read:
//! - [`BlockFormat`] (Q4_0, Q5_0, Q5_1): 32-value blocks against activations quantized to
//!   32-value blocks with a scale and a scaled sum (`activations.rs`).
//! - [`SuperFormat`] (Q2_K … Q6_K): 256-value super-blocks against activations quantized to
//!   256-value super-blocks with exact sums of every 16 quants (`super_rows.rs`). Each
//!   super-block's part is one integer expression, exact, combined in f32 the same way on
//!   every path.
//! - [`FloatFormat`] (F32, F16, BF16): weights widened to f32 against f32 activations, summed
//!   in four accumulators of eight lanes (value `i` into lane `i % 8` of accumulator
//!   `(i / 8) % 4`, multiply then add, never fused) and the lanes added in one fixed order
//!   (`float::combine`).

pub(crate) mod float;
pub(crate) mod legacy;
pub(crate) mod q2_k;
pub(crate) mod q3_k;
pub(crate) mod q4_k;
pub(crate) mod q5_k;
pub(crate) mod q6_k;

use crate::activations::ActivationRow;
use crate::super_rows::SuperRow;

/// Values per k-quant super-block (the activations' super-block, `super_rows.rs`).
pub(crate) use crate::super_rows::SUPER_BLOCK;

/// The 32-value formats read from their block bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockFormat {
    /// 4-bit quants minus 8, an f16 scale: 18 bytes.
    Q4_0,
    /// 5-bit quants minus 16, an f16 scale: 22 bytes.
    Q5_0,
    /// 5-bit quants, an f16 scale and an f16 minimum: 24 bytes.
    Q5_1,
}

/// The k-quant formats (256-value super-blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SuperFormat {
    /// 2-bit quants, 4-bit scales and minimums: 84 bytes.
    Q2K,
    /// 3-bit quants, 6-bit signed scales: 110 bytes.
    Q3K,
    /// 4-bit quants, 6-bit scales and minimums: 144 bytes.
    Q4K,
    /// 5-bit quants, 6-bit scales and minimums: 176 bytes.
    Q5K,
    /// 6-bit quants, 8-bit signed scales: 210 bytes.
    Q6K,
}

/// The unquantized formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloatFormat {
    /// IEEE single precision: 4 bytes a value.
    F32,
    /// IEEE half precision: 2 bytes a value.
    F16,
    /// bfloat16 (the top half of an f32): 2 bytes a value.
    Bf16,
}

impl BlockFormat {
    /// Bytes of one 32-value block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => legacy::Q4_0_BYTES,
            Self::Q5_0 => legacy::Q5_0_BYTES,
            Self::Q5_1 => legacy::Q5_1_BYTES,
        }
    }

    /// Writes one block's 32 values.
    pub(crate) fn dequantize(self, block: &[u8], values: &mut [f32]) {
        match self {
            Self::Q4_0 => legacy::dequantize_q4_0(block, values),
            Self::Q5_0 => legacy::dequantize_q5_0(block, values),
            Self::Q5_1 => legacy::dequantize_q5_1(block, values),
        }
    }

    /// The scalar reference: one row's block bytes against one activation row.
    pub(crate) fn dot(self, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
        match self {
            Self::Q4_0 => legacy::dot_q4_0(weights, activations),
            Self::Q5_0 => legacy::dot_q5_0(weights, activations),
            Self::Q5_1 => legacy::dot_q5_1(weights, activations),
        }
    }
}

impl SuperFormat {
    /// Bytes of one 256-value super-block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Self::Q2K => q2_k::BYTES,
            Self::Q3K => q3_k::BYTES,
            Self::Q4K => q4_k::BYTES,
            Self::Q5K => q5_k::BYTES,
            Self::Q6K => q6_k::BYTES,
        }
    }

    /// Writes one super-block's 256 values.
    pub(crate) fn dequantize(self, block: &[u8], values: &mut [f32]) {
        match self {
            Self::Q2K => q2_k::dequantize(block, values),
            Self::Q3K => q3_k::dequantize(block, values),
            Self::Q4K => q4_k::dequantize(block, values),
            Self::Q5K => q5_k::dequantize(block, values),
            Self::Q6K => q6_k::dequantize(block, values),
        }
    }

    /// The scalar reference: one row's super-block bytes against one activation row.
    pub(crate) fn dot(self, weights: &[u8], activations: SuperRow<'_>) -> f32 {
        match self {
            Self::Q2K => q2_k::dot(weights, activations),
            Self::Q3K => q3_k::dot(weights, activations),
            Self::Q4K => q4_k::dot(weights, activations),
            Self::Q5K => q5_k::dot(weights, activations),
            Self::Q6K => q6_k::dot(weights, activations),
        }
    }
}

impl FloatFormat {
    /// Bytes of one value.
    pub(crate) fn value_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// Writes the values of `bytes` (whole values) as f32.
    pub(crate) fn dequantize(self, bytes: &[u8], values: &mut [f32]) {
        float::dequantize(self, bytes, values);
    }

    /// The scalar reference: one row's bytes against one row of f32 activations.
    pub(crate) fn dot(self, weights: &[u8], activations: &[f32]) -> f32 {
        float::dot(self, weights, activations)
    }
}

/// An f16 stored little-endian at `bytes[at..at + 2]`, as f32.
pub(crate) fn half_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}
