//! meshnet-kernels: the quantized matrix products that dominate a transformer layer on a CPU.
//!
//! A [`QuantizedMatrix`] holds a linear layer's weights in any ggml type a `llama-quantize`
//! preset writes ([`WeightFormat`]: Q4_0 … Q8_0, Q2_K … Q6_K, F16, BF16, F32). Q4_1 and Q8_0 are
//! parsed into rows of f32 scales and packed quants; every other format is read in place from
//! the file's bytes (`formats/`). [`QuantizedMatrix::matmul`] quantizes the f32 input rows once
//! (32-value blocks with a scale and a sum for the 32-value formats, 256-value super-blocks with
//! exact sums of every 16 quants for the k-quants, none for the float formats), then computes
//! every output from exact integer block products combined in f32, with the weight rows split
//! over rayon's pool (one pool per process, sized to the cores).
//!
//! Two kernels compute the same bits: a scalar reference that runs everywhere and an AVX2
//! kernel (with FMA and F16C) chosen at run time when the CPU has it ([`Kernel::best`]). Each
//! format's float combination is written once and called by both. For Q4_1 and Q8_0 the bits
//! also equal candle 0.11's quantized matmul. `MESHNET_KERNEL=scalar` forces the reference,
//! `MESHNET_KERNEL=avx2` the AVX2 kernel without its AVX-512 VNNI tiles.
//!
//! [`attend_head`] is a layer's attention over one cached key/value head (scores, softmax,
//! weighted values) in f32, in a fixed order of operations that the scalar reference and the
//! AVX2 kernel both follow, so a volunteer's attention has the same bits on either.
//!
//! This is the only meshnet crate with `unsafe` code, confined to the `avx2` module.

mod activations;
mod attention;
mod avx2;
mod error;
mod formats;
mod matrix;
mod scalar;
mod super_rows;

pub use attention::{
    CachedHead, PIECE_POSITIONS, attend_head, attend_piece, combine_pieces, piece_len, pieces,
};
pub use error::{KernelError, Result};
pub use matrix::{MatrixBuilder, QuantizedMatrix, WeightFormat};

use std::sync::OnceLock;

use activations::ActivationRow;
use avx2::{TILE_ROWS, TOGETHER, WIDE_GROUPS};
use formats::{BlockFormat, FloatFormat, SuperFormat};
use matrix::WeightRow;
use super_rows::SuperRow;

/// Runs `work` on a thread of the compute pool (rayon's global pool, one per process, sized
/// to the cores) and waits for it; runs it in place when already on a pool thread. Work that
/// makes many matmuls in a row should run here: each matmul then splits its rows with cheap
/// forks on the pool instead of handing its work to the pool and back.
pub fn on_compute_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return work();
    }
    rayon::join(work, || ()).0
}

/// Values per quantization block in every format here.
pub const BLOCK: usize = 32;

/// Bytes of 4-bit quants in a Q4_1 block.
pub(crate) const Q4_1_QUANT_BYTES: usize = BLOCK / 2;

/// The environment variable that forces a kernel: `scalar`, or `avx2` for the AVX2 kernel
/// without its AVX-512 VNNI tiles.
pub const KERNEL_VARIABLE: &str = "MESHNET_KERNEL";

/// Which implementation computes the dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, every CPU: the reference.
    Scalar,
    /// AVX2 integer dot products and float attention (x86_64 CPUs that have AVX2, FMA and
    /// F16C), with 512-bit tiles where the CPU also has AVX-512 VNNI.
    Avx2(Avx2Kernel),
}

/// The AVX2 kernel; holding one proves the CPU has AVX2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Avx2Kernel(avx2::Avx2);

impl Kernel {
    /// The fastest kernel this CPU has, unless `MESHNET_KERNEL` asks for `scalar` (the
    /// reference) or `avx2` (no AVX-512); decided once per process.
    pub fn best() -> Self {
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            let forced = std::env::var(KERNEL_VARIABLE).unwrap_or_default();
            match (forced.as_str(), avx2::Avx2::detect()) {
                ("scalar", _) | (_, None) => Self::Scalar,
                ("avx2", Some(token)) => Self::Avx2(Avx2Kernel(token.narrow())),
                (_, Some(token)) => Self::Avx2(Avx2Kernel(token)),
            }
        })
    }

    /// The AVX2 kernel, when the CPU has AVX2 (with its AVX-512 VNNI tiles when it has those).
    pub fn avx2() -> Option<Self> {
        avx2::Avx2::detect().map(|token| Self::Avx2(Avx2Kernel(token)))
    }

    /// Every kernel this CPU can run, the reference first, then the AVX2 kernel without and
    /// with its AVX-512 VNNI tiles.
    pub fn available() -> Vec<Self> {
        let mut kernels = vec![Self::Scalar];
        if let Some(token) = avx2::Avx2::detect() {
            kernels.push(Self::Avx2(Avx2Kernel(token.narrow())));
            if token.is_wide() {
                kernels.push(Self::Avx2(Avx2Kernel(token)));
            }
        }
        kernels
    }

    /// Whether the kernel's tiles read activation rows interleaved in groups of four
    /// (`QuantizedRows::interleave`): the AVX2 kernel with its AVX-512 VNNI tiles.
    fn interleaves(self) -> bool {
        matches!(self, Self::Avx2(Avx2Kernel(token)) if token.is_wide())
    }

    /// The kernel's name (`scalar`, `avx2`, or `avx512vnni` for AVX2 with the 512-bit tiles).
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2(Avx2Kernel(token)) if token.is_wide() => "avx512vnni",
            Self::Avx2(_) => "avx2",
        }
    }

    fn dot(
        self,
        format: WeightFormat,
        weights: WeightRow<'_>,
        activations: ActivationRow<'_>,
    ) -> f32 {
        match (self, format) {
            (Self::Scalar, WeightFormat::Q4_1) => scalar::dot_q4_1(weights, activations),
            (Self::Scalar, WeightFormat::Q8_0) => scalar::dot_q8_0(weights, activations),
            (Self::Avx2(Avx2Kernel(token)), WeightFormat::Q4_1) => {
                token.dot_q4_1(weights, activations)
            }
            (Self::Avx2(Avx2Kernel(token)), WeightFormat::Q8_0) => {
                token.dot_q8_0(weights, activations)
            }
            _ => unreachable!("{} is not parsed into scales and quants", format.name()),
        }
    }

    /// One row of a 32-value format's bytes against one activation row.
    fn dot_blocks(
        self,
        format: BlockFormat,
        weights: &[u8],
        activations: ActivationRow<'_>,
    ) -> f32 {
        match self {
            Self::Scalar => format.dot(weights, activations),
            Self::Avx2(Avx2Kernel(token)) => token.dot_blocks(format, weights, activations),
        }
    }

    /// One row of a 32-value format's bytes against [`TOGETHER`] activation rows: the bits of
    /// as many [`Self::dot_blocks`] calls.
    fn dot_blocks_together(
        self,
        format: BlockFormat,
        weights: &[u8],
        activations: [ActivationRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        match self {
            Self::Scalar => activations.map(|row| format.dot(weights, row)),
            Self::Avx2(Avx2Kernel(token)) => {
                token.dot_blocks_together(format, weights, activations)
            }
        }
    }

    /// [`TILE_ROWS`] rows of a 32-value format's bytes against groups of [`TOGETHER`]
    /// activation rows (at most [`WIDE_GROUPS`]), one tile of results per group: the bits of
    /// as many [`Self::dot_blocks`] calls.
    fn dot_blocks_tile(
        self,
        format: BlockFormat,
        weights: [&[u8]; TILE_ROWS],
        activations: &[[ActivationRow<'_>; TOGETHER]],
        results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
    ) {
        match self {
            Self::Scalar => {
                for (group, result) in activations.iter().zip(results) {
                    *result = weights.map(|row| group.map(|column| format.dot(row, column)));
                }
            }
            Self::Avx2(Avx2Kernel(token)) => {
                token.dot_blocks_tile(format, weights, activations, results)
            }
        }
    }

    /// One row of a k-quant's bytes against [`TOGETHER`] activation rows: the bits of as many
    /// [`Self::dot_super`] calls.
    fn dot_super_together(
        self,
        format: SuperFormat,
        weights: &[u8],
        activations: [SuperRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        match self {
            Self::Scalar => activations.map(|row| format.dot(weights, row)),
            Self::Avx2(Avx2Kernel(token)) => token.dot_super_together(format, weights, activations),
        }
    }

    /// One row of a k-quant's bytes against one activation row.
    fn dot_super(self, format: SuperFormat, weights: &[u8], activations: SuperRow<'_>) -> f32 {
        match self {
            Self::Scalar => format.dot(weights, activations),
            Self::Avx2(Avx2Kernel(token)) => token.dot_super(format, weights, activations),
        }
    }

    /// One row of unquantized weights against one row of f32 activations.
    fn dot_floats(self, format: FloatFormat, weights: &[u8], activations: &[f32]) -> f32 {
        match self {
            Self::Scalar => format.dot(weights, activations),
            Self::Avx2(Avx2Kernel(token)) => token.dot_floats(format, weights, activations),
        }
    }

    /// Quantizes 32 activations into `quants`: the unrounded scale and the sum of the quants
    /// (`activations::quantize_values`, whose bits every kernel gives).
    fn quantize_values(self, values: &[f32], quants: &mut [i8]) -> (f32, i32) {
        match self {
            Self::Scalar => activations::quantize_values(values, quants),
            Self::Avx2(Avx2Kernel(token)) => token.quantize_values(values, quants),
        }
    }

    /// Quantizes 256 activations into `quants`: the unrounded scale
    /// (`super_rows::quantize_super_block`, whose bits every kernel gives).
    fn quantize_super_values(self, values: &[f32], quants: &mut [i8]) -> f32 {
        match self {
            Self::Scalar => super_rows::quantize_super_block(values, quants),
            Self::Avx2(Avx2Kernel(token)) => token.quantize_super_values(values, quants),
        }
    }

    /// One weight row against [`TOGETHER`] activation rows: the bits of as many [`Self::dot`]
    /// calls, computed together where the kernel has a way to.
    fn dot_together(
        self,
        format: WeightFormat,
        weights: WeightRow<'_>,
        activations: [ActivationRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        match (self, format) {
            (Self::Avx2(Avx2Kernel(token)), WeightFormat::Q4_1) => {
                token.dot_q4_1_four(weights, activations)
            }
            (Self::Avx2(Avx2Kernel(token)), WeightFormat::Q8_0) => {
                token.dot_q8_0_four(weights, activations)
            }
            _ => activations.map(|row| self.dot(format, weights, row)),
        }
    }

    /// [`TILE_ROWS`] weight rows against groups of [`TOGETHER`] activation rows (at most
    /// [`WIDE_GROUPS`]), one tile of results per group: the bits of as many [`Self::dot`]
    /// calls, computed as one tile where the kernel has a way to.
    fn dot_tile(
        self,
        format: WeightFormat,
        weights: [WeightRow<'_>; TILE_ROWS],
        activations: &[[ActivationRow<'_>; TOGETHER]],
        results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
    ) {
        match (self, format) {
            (Self::Avx2(Avx2Kernel(token)), WeightFormat::Q8_0) => {
                token.dot_q8_0_tile(weights, activations, results)
            }
            (Self::Avx2(Avx2Kernel(token)), WeightFormat::Q4_1) => {
                token.dot_q4_1_tile(weights, activations, results)
            }
            _ => {
                for (group, result) in activations.iter().zip(results) {
                    *result = weights.map(|row| self.dot_together(format, row, *group));
                }
            }
        }
    }
}
