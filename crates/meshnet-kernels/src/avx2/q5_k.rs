//! AVX2 dot product of Q5_K rows (equal to `formats::q5_k`'s).
//!
//! Q4_K's kernel (`avx2::q4_k`) with 5-bit quants: each run's nibbles get their fifth bits
//! from the 32 fifth-bit bytes (bit `j` of byte `l` for value `l` of sub-block `j`), moved to
//! bit 4 of every byte before `maddubs`. The integers and their float combination are Q4_K's,
//! and so is the four-row kernel (`q4_k::rows_sum`) over these runs.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::q4_k::{RUNS, add_run, finish, load, scales_and_mins};
use super::q4_k::{ScaledIntegers, row_sum, rows_sum};
use super::{Avx2, TOGETHER};
#[cfg(target_arch = "x86_64")]
use crate::formats::q4_k::RUN_BYTES;
use crate::formats::{q4_k, q5_k};
use crate::super_rows::SuperRow;

/// Q5_K's super-blocks.
struct Q5K;

impl ScaledIntegers for Q5K {
    const BYTES: usize = q5_k::BYTES;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn integers(block: &[u8], quants: &[i8], sums: &[i16]) -> (i32, i32) {
        // SAFETY: `block` holds 176 bytes (the caller's promise).
        let scales_and_mins = unsafe { scales_and_mins(block) };
        let mut scaled = _mm256_setzero_si256();
        for run in 0..RUNS {
            // SAFETY: `block` holds 176 bytes (the caller's promise) and `run < 4`.
            let quants_of_run = unsafe { Self::run_quants(block, run) };
            // SAFETY: `quants` holds 256 activations (the caller's promise).
            scaled = unsafe { add_run(scaled, quants_of_run, quants, run, scales_and_mins) };
        }
        // SAFETY: `sums` holds 16 sums (the caller's promise).
        unsafe { finish(scaled, scales_and_mins, sums) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_quants(block: &[u8], run: usize) -> [__m256i; 2] {
        let nibble_mask = _mm256_set1_epi8(0x0F);
        let (first_bit, second_bit) = (_mm256_set1_epi8(1), _mm256_set1_epi8(2));
        // SAFETY: `block` holds 176 bytes (the caller's promise): bytes 16..48 are in range.
        let fifth_bits = unsafe { load(block, q5_k::HIGH_BITS_AT) };
        // Bits 2 · run and 2 · run + 1 of each fifth-bit byte, shifted down to bits 0 and 1
        // (what the 16-bit shift brings in from the next byte lands above bit 1), moved to
        // bit 4.
        let fifth_bits = _mm256_srl_epi16(fifth_bits, _mm_cvtsi32_si128(2 * run as i32));
        let low_fifth = _mm256_slli_epi16::<4>(_mm256_and_si256(fifth_bits, first_bit));
        let high_fifth = _mm256_slli_epi16::<3>(_mm256_and_si256(fifth_bits, second_bit));
        // SAFETY: as above, and `run < 4` (the caller's promise): the run's 32 bytes at
        // 48 + 32 · run ≤ 144 are in range.
        let packed = unsafe { load(block, q5_k::QUANTS_AT + run * RUN_BYTES) };
        let low = _mm256_or_si256(_mm256_and_si256(packed, nibble_mask), low_fifth);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble_mask);
        [low, _mm256_or_si256(high, high_fifth)]
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn integers(_: &[u8], _: &[i8], _: &[i16]) -> (i32, i32) {
        unreachable!("no AVX2 outside x86_64")
    }
}

/// One Q5_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q4_k::checked_super_blocks(weights, q5_k::BYTES, activations);
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2, and the lengths were checked.
    unsafe { row_sum::<Q5K>(weights, activations) }
}

/// One row against [`TOGETHER`] activation rows: the bits of as many [`dot`] calls, each
/// super-block unpacked once for the four rows (Q4_K's `rows_sum`).
pub(super) fn dot_together(
    _: Avx2,
    weights: &[u8],
    activations: [SuperRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    for row in activations {
        q4_k::checked_super_blocks(weights, q5_k::BYTES, row);
    }
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2, and the lengths were checked.
    unsafe { rows_sum::<Q5K>(weights, activations) }
}

#[cfg(test)]
mod tests {
    use super::super::q4_k::tests::Paths;
    use super::*;

    /// Q5_K's two paths.
    const Q5_K: Paths = Paths {
        block_bytes: q5_k::BYTES,
        reference: q5_k::dot,
        fast: dot,
        together: dot_together,
    };

    #[test]
    fn random_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q5_K.check_random_rows(avx2);
        }
    }

    #[test]
    fn extreme_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q5_K.check_extremes(avx2);
        }
    }

    #[test]
    fn four_random_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q5_K.check_random_rows_together(avx2);
        }
    }

    #[test]
    fn four_extreme_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q5_K.check_extremes_together(avx2);
        }
    }

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing_together() {
        if let Some(avx2) = Avx2::detect() {
            for width in [1536, 768] {
                let (one_row, four_rows) = Q5_K.time_together(avx2, width);
                println!(
                    "Q5_K {width} wide, ns per 256 values per activation row: four one-row \
                     calls {one_row:.1}, four-row kernel {four_rows:.1}"
                );
            }
        }
    }

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing() {
        if let Some(avx2) = Avx2::detect() {
            let (reference, fast) = Q5_K.time(avx2);
            println!("Q5_K ns per 256 values per row: reference {reference:.1}, AVX2 {fast:.1}");
        }
    }
}
