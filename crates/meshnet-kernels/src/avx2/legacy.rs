//! AVX2 dot products of Q4_0, Q5_0 and Q5_1 rows (equal to `formats::legacy`'s bit for bit).
//!
//! Eight blocks at a time: each block's products summed in pairs by `maddubs` (exact, see
//! below), the eight blocks' sums finished together (`group_dots`), their scales (and Q5_1's
//! minimums) widened from f16 with F16C (exact, as the reference's `half_at`), the eight terms
//! computed lane-wise with the reference's multiplies and adds (never fused) and added to
//! eight running lanes with one vector add: block `b` into lane `b % 8`, as the reference sums
//! them. The blocks after the last whole group (fewer than eight) are computed first, as a
//! group whose lanes past the row's end add `+0.0`; the lanes are then combined by the
//! reference's own `combine_lanes`.
//!
//! Against four activation rows at once (`dot_*_together`, a prefill's matmul), each whole
//! group's blocks are unpacked and its scales widened once for the four rows; each row then
//! runs the operations of its one-row dot from the integer dots on (float terms, lanes), so
//! it gets that dot's bits. Q4_0 and Q5_0 blocks are unpacked there to the signed values
//! `w = q − c` (−16..=15), which enter `maddubs` as its signed side against the activations
//! plus 128 (their sign bit flipped: 0..=255): `Σ(a + 128)·w`, less the group's `128 · Σw`
//! (`maddubs` of 128 with `w`, reduced once for the four rows), is the exact `Σ(q − c)·a`.
//! A pair is then at most 2 · 255 · 16 = 8160 in magnitude and a reduced lane of eight
//! products 8 · 255 · 16 = 32640 < 32768: still no step saturates or wraps.
//!
//! The quants enter `maddubs` unsigned, in value order (16 low nibbles, then 16 high nibbles);
//! a 5-bit quant gets bit 4 from its bit of the block's high bits, spread to one byte per value.
//! The offsets of Q4_0 (8) and Q5_0 (16) are a second `maddubs` of the offsets with the same
//! activations, subtracted in i16 before `madd`: `Σ(q − c)·a = Σq·a − Σc·a`. For Q5_0, whose
//! quant is `nibble + 16·bit`, that is `Σ nibble·a − Σ 16·(1 − bit)·a`.
//!
//! Saturation: `maddubs` adds two products of an unsigned byte and an activation (|a| ≤ 128)
//! into an i16: at most 2 · 31 · 128 = 7936 for a 5-bit quant, 2 · 16 · 128 = 4096 for an
//! offset, and their difference is a sum of two `(q − c)·a` with |q − c| ≤ 16, at most 4096.
//! No step saturates, for any activation byte.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Avx2, TOGETHER};
use crate::activations::ActivationRow;
use crate::formats::legacy;
#[cfg(target_arch = "x86_64")]
use {super::GROUP, crate::BLOCK};

/// One Q4_0 row against one activation row.
pub(super) fn dot_q4_0(_: Avx2, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    let blocks = legacy::checked_blocks(weights, activations, legacy::Q4_0_BYTES);
    // SAFETY: the token exists only when the CPU has AVX2, FMA and F16C (`Avx2::detect`), and
    // `checked_blocks` checked that the weights and every part of the activations hold
    // `blocks` blocks.
    unsafe { row::<Q4_0>(weights, activations, blocks) }
}

/// One Q5_0 row against one activation row.
pub(super) fn dot_q5_0(_: Avx2, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    let blocks = legacy::checked_blocks(weights, activations, legacy::Q5_0_BYTES);
    // SAFETY: as in `dot_q4_0`.
    unsafe { row::<Q5_0>(weights, activations, blocks) }
}

/// One Q5_1 row against one activation row.
pub(super) fn dot_q5_1(_: Avx2, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    let blocks = legacy::checked_blocks(weights, activations, legacy::Q5_1_BYTES);
    // SAFETY: as in `dot_q4_0`.
    unsafe { row::<Q5_1>(weights, activations, blocks) }
}

/// The Q4_0 kernel's parts.
pub(super) struct Q4_0;
/// The Q5_0 kernel's parts.
pub(super) struct Q5_0;
/// The Q5_1 kernel's parts.
pub(super) struct Q5_1;

/// What differs between the three formats' kernels.
#[cfg(target_arch = "x86_64")]
pub(super) trait Layout {
    /// Bytes of one block.
    const BYTES: usize;

    /// Where a block's f16 minimum lies, for the formats that have one.
    const MIN: Option<usize>;

    /// Whether [`Self::pairs`] multiplies the activations plus 128 (and the dots of a group
    /// then exceed the exact ones by [`bias`] of its blocks), for the formats with an offset.
    const BIASED: bool;

    /// The products of one block's quants (less the offset) with its 32 activations, added in
    /// adjacent pairs: 16 i16 lanes, each at most 7936 in magnitude (see the module's notes),
    /// whose sum is the block's exact integer dot product.
    ///
    /// # Safety
    /// The CPU must have AVX2; `block` must point at `BYTES` readable bytes and `activations`
    /// at 32.
    unsafe fn block_pairs(block: *const u8, activations: *const i8) -> __m256i;

    /// A block's quants unpacked for any number of activation rows (the part of a block's work
    /// that does not depend on the activations): the 32 values `q − c` as signed bytes for the
    /// formats with an offset `c`, the 32 quants `q` for Q5_1.
    ///
    /// # Safety
    /// The CPU must have AVX2; `block` must point at `BYTES` readable bytes.
    unsafe fn unpack(block: *const u8) -> __m256i;

    /// The products of an unpacked block with its 32 activations, added in adjacent pairs;
    /// their sum is the block's exact dot product, plus `128 · Σ(q − c)` when `BIASED`.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    unsafe fn pairs(unpacked: __m256i, activations: __m256i) -> __m256i;
}

#[cfg(target_arch = "x86_64")]
impl Layout for Q4_0 {
    const BYTES: usize = legacy::Q4_0_BYTES;
    const MIN: Option<usize> = None;
    const BIASED: bool = true;

    #[target_feature(enable = "avx2")]
    unsafe fn block_pairs(block: *const u8, activations: *const i8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `block` and 32 bytes at `activations`.
        let (quants, activations) = unsafe {
            (
                nibbles(block.add(legacy::Q4_0_NIBBLES)),
                _mm256_loadu_si256(activations.cast()),
            )
        };
        let offsets = _mm256_maddubs_epi16(_mm256_set1_epi8(8), activations);
        _mm256_sub_epi16(_mm256_maddubs_epi16(quants, activations), offsets)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack(block: *const u8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `block`.
        let quants = unsafe { nibbles(block.add(legacy::Q4_0_NIBBLES)) };
        _mm256_sub_epi8(quants, _mm256_set1_epi8(8))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pairs(unpacked: __m256i, activations: __m256i) -> __m256i {
        biased_pairs(unpacked, activations)
    }
}

#[cfg(target_arch = "x86_64")]
impl Layout for Q5_0 {
    const BYTES: usize = legacy::Q5_0_BYTES;
    const MIN: Option<usize> = None;
    const BIASED: bool = true;

    #[target_feature(enable = "avx2")]
    unsafe fn block_pairs(block: *const u8, activations: *const i8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `block` and 32 bytes at `activations`.
        let (nibbles, missing, activations) = unsafe {
            let (nibbles, missing) = q5_0_parts(block);
            (nibbles, missing, _mm256_loadu_si256(activations.cast()))
        };
        let offsets = _mm256_maddubs_epi16(missing, activations);
        _mm256_sub_epi16(_mm256_maddubs_epi16(nibbles, activations), offsets)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack(block: *const u8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `block`.
        let (nibbles, missing) = unsafe { q5_0_parts(block) };
        // `nibble + 16 · bit − 16`.
        _mm256_sub_epi8(nibbles, missing)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pairs(unpacked: __m256i, activations: __m256i) -> __m256i {
        biased_pairs(unpacked, activations)
    }
}

/// A Q5_0 block's 32 low nibbles in value order, and per value the part of the offset 16 that
/// its quant lacks: 16 where bit 4 is clear, else 0.
///
/// # Safety
/// The CPU must have AVX2; `block` must point at a whole Q5_0 block.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q5_0_parts(block: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees a whole block at `block`.
    let (nibbles, high) = unsafe {
        (
            nibbles(block.add(legacy::Q5_0_NIBBLES)),
            high_bits(block.add(legacy::Q5_0_HIGH_BITS)),
        )
    };
    (nibbles, _mm256_andnot_si256(high, _mm256_set1_epi8(16)))
}

#[cfg(target_arch = "x86_64")]
impl Layout for Q5_1 {
    const BYTES: usize = legacy::Q5_1_BYTES;
    const MIN: Option<usize> = Some(legacy::Q5_1_MIN);
    const BIASED: bool = false;

    #[target_feature(enable = "avx2")]
    unsafe fn block_pairs(block: *const u8, activations: *const i8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `block` and 32 bytes at `activations`.
        unsafe { Self::pairs(Self::unpack(block), _mm256_loadu_si256(activations.cast())) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack(block: *const u8) -> __m256i {
        // SAFETY: the caller guarantees a whole block at `block`.
        let (nibbles, high) = unsafe {
            (
                nibbles(block.add(legacy::Q5_1_NIBBLES)),
                high_bits(block.add(legacy::Q5_1_HIGH_BITS)),
            )
        };
        _mm256_or_si256(nibbles, _mm256_and_si256(high, _mm256_set1_epi8(16)))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pairs(unpacked: __m256i, activations: __m256i) -> __m256i {
        _mm256_maddubs_epi16(unpacked, activations)
    }
}

/// The pairs of `(a + 128) · w` for signed values `w = q − c` and activations `a`: the
/// activations' sign bit flipped makes them the unsigned operand of `maddubs`, one `xor`
/// where the offset would cost a second `maddubs` and a subtraction per activation row.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn biased_pairs(values: __m256i, activations: __m256i) -> __m256i {
    let shifted = _mm256_xor_si256(activations, _mm256_set1_epi8(-128));
    _mm256_maddubs_epi16(shifted, values)
}

/// The pairs of `128 · w` for the signed values `w` of an unpacked block of a `BIASED`
/// format: what [`biased_pairs`] adds to the exact products.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn bias(values: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_set1_epi8(-128), values)
}

/// The f16 numbers at `first + k · stride` for `k < 8`, widened to f32 (exactly, as `half_at`
/// widens one); places past the first `count` repeat the last of those (their lanes are then
/// dropped), so only readable bytes are read.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `1 <= count <= 8`, and the two bytes at each of the first
/// `count` places must be readable.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn halves(first: *const u8, stride: usize, count: usize) -> __m256 {
    let half = |k: usize| {
        // SAFETY: `min(k, count − 1) < count`, a place the caller guarantees readable.
        let at = unsafe { first.add(k.min(count - 1) * stride) };
        // SAFETY: as above, two readable bytes.
        u64::from(unsafe { at.cast::<u16>().read_unaligned() })
    };
    // Packed in general-purpose registers (idle here) rather than inserted lane by lane.
    let four = |k: usize| half(k) | half(k + 1) << 16 | half(k + 2) << 32 | half(k + 3) << 48;
    let bits = _mm_set_epi64x(four(4) as i64, four(0) as i64);
    _mm256_cvtph_ps(bits)
}

/// The scales and the minimums (zero for the formats without) of the first `count` blocks at
/// `group`, by [`halves`].
///
/// # Safety
/// The CPU must have AVX2 and F16C; `1 <= count <= 8`, and `count` blocks must be readable at
/// `group`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales_and_mins<F: Layout>(group: *const u8, count: usize) -> (__m256, __m256) {
    // SAFETY: the scale (at 0) and the minimum (at `F::MIN`) lie inside each readable block.
    let widen = |at: usize| unsafe { halves(group.add(at), F::BYTES, count) };
    (widen(0), F::MIN.map_or(_mm256_setzero_ps(), widen))
}

/// The dot products of the first `count` blocks at `group` with their activations at `quants`,
/// one block per i32 lane, the other lanes zero (by [`reduce_group`]).
///
/// # Safety
/// The CPU must have AVX2; `count <= 8`, and `count` blocks must be readable at `group` and
/// `32 · count` bytes at `quants`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn group_dots<F: Layout>(group: *const u8, quants: *const i8, count: usize) -> __m256i {
    reduce_group(|offset: usize| {
        if offset < count {
            // SAFETY: block `offset < count` and its 32 activations are readable (the caller).
            unsafe { F::block_pairs(group.add(offset * F::BYTES), quants.add(offset * BLOCK)) }
        } else {
            _mm256_setzero_si256()
        }
    })
}

/// Eight blocks' dot products, one block per i32 lane, from their `pairs` (offset `0..8` in the
/// group: the block's products added in adjacent pairs, as [`Layout::pairs`] gives them).
///
/// The sums stay in i16 for two rounds of `hadd` (each lane then a sum of at most eight
/// products, at most 4 · 7936 = 31744 in magnitude, 32640 for the biased pairs: no lane
/// wraps), then `madd` widens them
/// to i32 (sums of 16 products: values 0..16 in the low half, 16..32 in the high half) and the
/// two halves are added. Eight blocks take two `madd` instead of eight; the integer sums are
/// exact, so their order does not matter.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn reduce_group(pairs: impl Fn(usize) -> __m256i) -> __m256i {
    let (first_four, last_four) = (four_blocks(&pairs, 0), four_blocks(&pairs, 4));
    let low_halves = _mm256_permute2x128_si256(first_four, last_four, 0x20);
    let high_halves = _mm256_permute2x128_si256(first_four, last_four, 0x31);
    _mm256_add_epi32(low_halves, high_halves)
}

/// [`reduce_group`] of a group of at most four blocks (`pairs` of offsets `0..4`): their dots
/// in lanes 0..4, the other lanes zero.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn reduce_half_group(pairs: impl Fn(usize) -> __m256i) -> __m256i {
    let sums = four_blocks(&pairs, 0);
    let halves_added = _mm_add_epi32(
        _mm256_castsi256_si128(sums),
        _mm256_extracti128_si256(sums, 1),
    );
    _mm256_zextsi128_si256(halves_added)
}

/// Four blocks' dot products from their `pairs` (offsets `first..first + 4`), in both 128-bit
/// halves as `a b c d` in i32 (the low half the sums of values 0..16, the high half of 16..32).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn four_blocks(pairs: &impl Fn(usize) -> __m256i, first: usize) -> __m256i {
    // Per half, blocks a, b: a a a a b b b b (sums of four products).
    let two_blocks = |first: usize| _mm256_hadd_epi16(pairs(first), pairs(first + 1));
    // Per half, blocks a..d: a b c d (sums of 16 products).
    let eights = _mm256_hadd_epi16(two_blocks(first), two_blocks(first + 2));
    _mm256_madd_epi16(eights, _mm256_set1_epi16(1))
}

/// The terms of eight blocks, lane by lane as the reference computes one: `dot · d · d_a`
/// (`legacy::scaled_term`), plus `m · s_a` for the formats with a minimum
/// (`legacy::offset_term`); multiplies and adds, never fused.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn combine<F: Layout>(
    dots: __m256i,
    (scales, mins): (__m256, __m256),
    activation_scales: __m256,
    activation_sums: __m256,
) -> __m256 {
    let scaled = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(dots), scales),
        activation_scales,
    );
    match F::MIN {
        Some(_) => _mm256_add_ps(scaled, _mm256_mul_ps(mins, activation_sums)),
        None => scaled,
    }
}

/// The 16 nibble bytes at `packed` as 32 quants in value order: the 16 low nibbles (values
/// 0..16), then the 16 high nibbles (values 16..32). The bytes are loaded into both halves
/// of the vector and the upper half shifted by four bits, which keeps the work off the
/// shuffle ports.
///
/// # Safety
/// The CPU must have AVX2; `packed` must point at 16 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(packed: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `packed`.
    let twice = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(packed.cast())) };
    let shifted = _mm256_srlv_epi32(twice, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The four bytes at `bits` (a little-endian u32) spread to one byte per bit: byte `k` is
/// 0xFF where bit `k` is set, else 0.
///
/// # Safety
/// The CPU must have AVX2; `bits` must point at four readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn high_bits(bits: *const u8) -> __m256i {
    // SAFETY: the caller guarantees four readable bytes at `bits`.
    let word = unsafe { bits.cast::<i32>().read_unaligned() };
    // Bytes 0-7 copy the word's byte 0, bytes 8-15 its byte 1, and so on (each 128-bit half
    // of the shuffle indexes its own copy of the word).
    let which_byte = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(word), which_byte);
    // Byte k keeps bit k % 8 of its copy.
    let which_bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, which_bit), which_bit)
}

/// The dot product of a whole row of `F` blocks.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `weights` must hold `blocks` blocks of `F` and every
/// part of `activations` `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row<F: Layout>(weights: &[u8], activations: ActivationRow<'_>, blocks: usize) -> f32 {
    let whole = blocks / GROUP * GROUP;
    let mut lanes = _mm256_setzero_ps();
    if whole < blocks {
        // The blocks after the last whole group come first, as in the reference; lanes without
        // one add `+0.0`, which leaves them as they were.
        // SAFETY: passed on from the caller.
        lanes = _mm256_add_ps(lanes, unsafe {
            tail::<F>(weights, activations, whole..blocks)
        });
    }
    for first in (0..whole).step_by(GROUP) {
        // SAFETY: `first + 8 <= blocks`, so blocks `first..first + 8` are in range of the
        // weights and of every part of the activations.
        let terms = unsafe {
            let group = weights.as_ptr().add(first * F::BYTES);
            let quants = activations.quants.as_ptr().add(first * BLOCK);
            combine::<F>(
                group_dots::<F>(group, quants, GROUP),
                scales_and_mins::<F>(group, GROUP),
                _mm256_loadu_ps(activations.scales.as_ptr().add(first)),
                _mm256_loadu_ps(activations.sums.as_ptr().add(first)),
            )
        };
        lanes = _mm256_add_ps(lanes, terms);
    }
    let mut sums = [0f32; GROUP];
    // SAFETY: `sums` holds eight f32, what an unaligned 256-bit store writes.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), lanes) };
    legacy::combine_lanes(sums)
}

/// The terms of the blocks after a row's last whole group (one to seven) in the lanes of their
/// blocks, computed as a group's; the other lanes are `+0.0`.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `weights` and every part of `activations` must hold at
/// least `tail.end` blocks, and `tail` must hold one to seven blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tail<F: Layout>(
    weights: &[u8],
    activations: ActivationRow<'_>,
    tail: std::ops::Range<usize>,
) -> __m256 {
    let count = tail.len();
    let present = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(count as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    // SAFETY: blocks `tail` are in range of the weights and of every part of the activations
    // (the caller); the masked loads read only the lanes of those blocks.
    let terms = unsafe {
        let group = weights.as_ptr().add(tail.start * F::BYTES);
        let quants = activations.quants.as_ptr().add(tail.start * BLOCK);
        combine::<F>(
            group_dots::<F>(group, quants, count),
            scales_and_mins::<F>(group, count),
            _mm256_maskload_ps(activations.scales.as_ptr().add(tail.start), present),
            _mm256_maskload_ps(activations.sums.as_ptr().add(tail.start), present),
        )
    };
    _mm256_and_ps(terms, _mm256_castsi256_ps(present))
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn row<F>(_: &[u8], _: ActivationRow<'_>, _: usize) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

/// One Q4_0 row against [`TOGETHER`] activation rows: the bits of as many [`dot_q4_0`] calls.
pub(super) fn dot_q4_0_together(
    _: Avx2,
    weights: &[u8],
    activations: [ActivationRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    let blocks = checked_rows(weights, &activations, legacy::Q4_0_BYTES);
    // SAFETY: the token exists only when the CPU has AVX2, FMA and F16C (`Avx2::detect`), and
    // `checked_rows` checked that the weights and every part of every activation row hold
    // `blocks` blocks.
    unsafe { rows::<Q4_0>(weights, activations, blocks) }
}

/// One Q5_0 row against [`TOGETHER`] activation rows: the bits of as many [`dot_q5_0`] calls.
pub(super) fn dot_q5_0_together(
    _: Avx2,
    weights: &[u8],
    activations: [ActivationRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    let blocks = checked_rows(weights, &activations, legacy::Q5_0_BYTES);
    // SAFETY: as in `dot_q4_0_together`.
    unsafe { rows::<Q5_0>(weights, activations, blocks) }
}

/// One Q5_1 row against [`TOGETHER`] activation rows: the bits of as many [`dot_q5_1`] calls.
pub(super) fn dot_q5_1_together(
    _: Avx2,
    weights: &[u8],
    activations: [ActivationRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    let blocks = checked_rows(weights, &activations, legacy::Q5_1_BYTES);
    // SAFETY: as in `dot_q4_0_together`.
    unsafe { rows::<Q5_1>(weights, activations, blocks) }
}

/// The number of blocks of a weight row, after checking (`legacy::checked_blocks`) that every
/// one of the activation rows holds that many.
pub(super) fn checked_rows(
    weights: &[u8],
    activations: &[ActivationRow<'_>],
    block_bytes: usize,
) -> usize {
    let mut blocks = weights.len() / block_bytes;
    for row in activations {
        blocks = legacy::checked_blocks(weights, *row, block_bytes);
    }
    blocks
}

/// The dot products of a whole row of `F` blocks with [`TOGETHER`] activation rows, each with
/// the operations [`row`] performs for it, so with its bits.
///
/// Each whole group of eight blocks is unpacked once (`Layout::unpack`) and its scales (and
/// minimums) widened once, then used by the four rows in turn: what a row adds on its own is
/// its activations' `maddubs`, the group's reduction and the float terms. Each row keeps its
/// own eight lanes. The blocks after the last whole group come first, by [`tail_four`].
///
/// # Safety
/// The CPU must have AVX2 and F16C; `weights` must hold `blocks` blocks of `F` and every
/// part of every activation row `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn rows<F: Layout>(
    weights: &[u8],
    activations: [ActivationRow<'_>; TOGETHER],
    blocks: usize,
) -> [f32; TOGETHER] {
    let whole = blocks / GROUP * GROUP;
    let mut lanes = [_mm256_setzero_ps(); TOGETHER];
    if whole < blocks {
        // SAFETY: passed on from the caller.
        unsafe { tail_four::<F>(weights, &activations, whole..blocks, &mut lanes) };
    }
    for first in (0..whole).step_by(GROUP) {
        // SAFETY: `first + 8 <= blocks`, so blocks `first..first + 8` are in range of the
        // weights and of every part of every activation row.
        unsafe { group_four::<F>(weights, &activations, first, &mut lanes) };
    }
    lanes.map(|lanes| {
        let mut sums = [0f32; GROUP];
        // SAFETY: `sums` holds eight f32, what an unaligned 256-bit store writes.
        unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), lanes) };
        legacy::combine_lanes(sums)
    })
}

/// Adds the terms of blocks `first..first + 8` to each activation row's `lanes`, the weight
/// blocks unpacked once for the four rows.
///
/// # Safety
/// The CPU must have AVX2 and F16C; blocks `first..first + 8` must be in range of `weights`
/// and of every part of every activation row.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn group_four<F: Layout>(
    weights: &[u8],
    activations: &[ActivationRow<'_>; TOGETHER],
    first: usize,
    lanes: &mut [__m256; TOGETHER],
) {
    // SAFETY: blocks `first..first + 8` of the weights are readable (the caller).
    let group = unsafe { weights.as_ptr().add(first * F::BYTES) };
    let unpacked: [__m256i; GROUP] = std::array::from_fn(|offset| {
        // SAFETY: block `first + offset` is readable.
        unsafe { F::unpack(group.add(offset * F::BYTES)) }
    });
    // SAFETY: as above.
    let scales = unsafe { scales_and_mins::<F>(group, GROUP) };
    let biases = reduce_group(|offset: usize| bias(unpacked[offset]));
    for (lanes, row) in lanes.iter_mut().zip(activations) {
        // SAFETY: blocks `first..first + 8` of every part of the row are readable.
        let terms = unsafe {
            let quants = row.quants.as_ptr().add(first * BLOCK);
            let dots = reduce_group(|offset: usize| {
                let block = _mm256_loadu_si256(quants.add(offset * BLOCK).cast());
                F::pairs(unpacked[offset], block)
            });
            combine::<F>(
                unbiased::<F>(dots, biases),
                scales,
                _mm256_loadu_ps(row.scales.as_ptr().add(first)),
                _mm256_loadu_ps(row.sums.as_ptr().add(first)),
            )
        };
        *lanes = _mm256_add_ps(*lanes, terms);
    }
}

/// Adds the terms of the blocks after the last whole group (one to seven) to each activation
/// row's `lanes`, each row as [`tail`] computes and adds them, the weight blocks unpacked and
/// their scales widened once for the four rows.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `weights` and every part of every activation row must
/// hold at least `tail.end` blocks, and `tail` must hold one to seven blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tail_four<F: Layout>(
    weights: &[u8],
    activations: &[ActivationRow<'_>; TOGETHER],
    tail: std::ops::Range<usize>,
    lanes: &mut [__m256; TOGETHER],
) {
    let count = tail.len();
    let present = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(count as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    // SAFETY: blocks `tail` of the weights are readable (the caller).
    let group = unsafe { weights.as_ptr().add(tail.start * F::BYTES) };
    let unpacked: [__m256i; GROUP] = std::array::from_fn(|offset| {
        // SAFETY: block `tail.start + min(offset, count − 1)` is readable; the places past the
        // tail repeat its last block, whose pairs are then not used.
        unsafe { F::unpack(group.add(offset.min(count - 1) * F::BYTES)) }
    });
    // SAFETY: as above.
    let scales = unsafe { scales_and_mins::<F>(group, count) };
    // The lanes past the tail take the biases of its last block; `present` drops them.
    let biases = reduce_tail(count, |offset: usize| bias(unpacked[offset]));
    for (lanes, row) in lanes.iter_mut().zip(activations) {
        // SAFETY: blocks `tail` of every part of the row are readable; the masked loads read
        // only the lanes of those blocks.
        let terms = unsafe {
            let quants = row.quants.as_ptr().add(tail.start * BLOCK);
            let pairs = |offset: usize| {
                if offset < count {
                    let block = _mm256_loadu_si256(quants.add(offset * BLOCK).cast());
                    F::pairs(unpacked[offset], block)
                } else {
                    _mm256_setzero_si256()
                }
            };
            combine::<F>(
                unbiased::<F>(reduce_tail(count, pairs), biases),
                scales,
                _mm256_maskload_ps(row.scales.as_ptr().add(tail.start), present),
                _mm256_maskload_ps(row.sums.as_ptr().add(tail.start), present),
            )
        };
        *lanes = _mm256_add_ps(*lanes, _mm256_and_ps(terms, _mm256_castsi256_ps(present)));
    }
}

/// [`reduce_group`] of the first `count` blocks of a group (`pairs` zero past them); a tail
/// of at most four blocks (a 576-wide row's is two) takes half the reduction.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn reduce_tail(count: usize, pairs: impl Fn(usize) -> __m256i) -> __m256i {
    if count <= GROUP / 2 {
        reduce_half_group(pairs)
    } else {
        reduce_group(pairs)
    }
}

/// A group's exact dots from the [`Layout::pairs`] sums `dots`: less `biases` (the reduced
/// [`bias`] of its blocks) for a `BIASED` format. Both are exact, so is the difference.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn unbiased<F: Layout>(dots: __m256i, biases: __m256i) -> __m256i {
    if F::BIASED {
        _mm256_sub_epi32(dots, biases)
    } else {
        dots
    }
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows<F>(_: &[u8], _: [ActivationRow<'_>; TOGETHER], _: usize) -> [f32; TOGETHER] {
    unreachable!("no AVX2 outside x86_64")
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use half::f16;

    use super::*;
    use crate::BLOCK;
    use crate::formats::half_at;

    /// A small deterministic generator (xorshift64*) for random operands.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// Uniform in `-1..1`.
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }

        fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.next() as usize % items.len()]
        }
    }

    /// The kinds of weight blocks the tests draw.
    #[derive(Clone, Copy, Debug)]
    enum Weights {
        /// Random bytes with small random scales (and minimums).
        Random,
        /// Every byte zero: scale zero, every quant zero.
        Zero,
        /// Quants all at their least or all at their greatest, scales at the ends of f16.
        Extreme,
    }

    /// The kinds of activation rows the tests draw.
    #[derive(Clone, Copy, Debug)]
    enum Activations {
        /// Random quants in -127..=127, random f16 scales and sums.
        Random,
        /// Every quant 127 or every quant -127, large scales and sums.
        Extreme,
        /// Every quant -128 (beyond what quantizing makes, which the kernels also handle).
        Lowest,
        /// Zero scales, sums and quants.
        Zero,
    }

    fn half_bytes(value: f32) -> [u8; 2] {
        f16::from_f32(value).to_le_bytes()
    }

    /// One block of `block_bytes` of the given kind.
    fn weight_block(random: &mut Random, kind: Weights, block_bytes: usize) -> Vec<u8> {
        let mut block = match kind {
            Weights::Random => (0..block_bytes).map(|_| random.next() as u8).collect(),
            Weights::Zero => vec![0; block_bytes],
            Weights::Extreme => vec![random.pick(&[0x00, 0xFF]); block_bytes],
        };
        let scales = match kind {
            Weights::Random => [random.unit() * 4.0, random.unit() * 60.0],
            Weights::Zero => [0.0, 0.0],
            Weights::Extreme => [
                random.pick(&[65504.0, -65504.0, 6e-8, -6e-8]),
                random.pick(&[65504.0, -65504.0, 6e-8]),
            ],
        };
        block[..2].copy_from_slice(&half_bytes(scales[0]));
        if block_bytes == legacy::Q5_1_BYTES {
            block[2..4].copy_from_slice(&half_bytes(scales[1]));
        }
        block
    }

    /// An activation row of `blocks` blocks: scales, sums, quants.
    fn activation_row(
        random: &mut Random,
        kind: Activations,
        blocks: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<i8>) {
        let rounded = |value: f32| f16::from_f32(value).to_f32();
        let (scales, sums): (Vec<f32>, Vec<f32>) = (0..blocks)
            .map(|_| match kind {
                Activations::Random => {
                    (rounded(random.unit().abs()), rounded(random.unit() * 90.0))
                }
                Activations::Extreme | Activations::Lowest => (
                    rounded(random.pick(&[1000.0, 65504.0, 6e-8])),
                    rounded(random.pick(&[-65504.0, 65504.0, 4064.0])),
                ),
                Activations::Zero => (0.0, 0.0),
            })
            .unzip();
        let quants = match kind {
            Activations::Random => (0..blocks * BLOCK)
                .map(|_| ((random.next() % 255) as i32 - 127) as i8)
                .collect(),
            Activations::Extreme => (0..blocks)
                .flat_map(|_| [random.pick(&[127i8, -127]); BLOCK])
                .collect(),
            Activations::Lowest => vec![-128; blocks * BLOCK],
            Activations::Zero => vec![0; blocks * BLOCK],
        };
        (scales, sums, quants)
    }

    type Reference = fn(&[u8], ActivationRow<'_>) -> f32;
    type Fast = fn(Avx2, &[u8], ActivationRow<'_>) -> f32;

    const FORMATS: [(&str, usize, Reference, Fast); 3] = [
        ("Q4_0", legacy::Q4_0_BYTES, legacy::dot_q4_0, dot_q4_0),
        ("Q5_0", legacy::Q5_0_BYTES, legacy::dot_q5_0, dot_q5_0),
        ("Q5_1", legacy::Q5_1_BYTES, legacy::dot_q5_1, dot_q5_1),
    ];

    const BLOCK_COUNTS: [usize; 14] = [1, 2, 3, 7, 8, 9, 15, 16, 17, 18, 31, 48, 63, 97];

    #[test]
    fn the_avx2_dots_give_the_reference_bits() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut random = Random(0x0123_4567_89AB_CDEF);
        let weight_kinds = [Weights::Random, Weights::Zero, Weights::Extreme];
        let activation_kinds = [
            Activations::Random,
            Activations::Extreme,
            Activations::Lowest,
            Activations::Zero,
        ];
        for (name, block_bytes, reference, fast) in FORMATS {
            for blocks in BLOCK_COUNTS {
                for round in 0..24 {
                    // Mostly random blocks, some rows mixing every kind of block.
                    let weights: Vec<u8> = (0..blocks)
                        .flat_map(|_| {
                            let kind = if round < 12 {
                                Weights::Random
                            } else {
                                random.pick(&weight_kinds)
                            };
                            weight_block(&mut random, kind, block_bytes)
                        })
                        .collect();
                    let kind = if round < 8 {
                        Activations::Random
                    } else {
                        random.pick(&activation_kinds)
                    };
                    let (scales, sums, quants) = activation_row(&mut random, kind, blocks);
                    let row = ActivationRow {
                        scales: &scales,
                        sums: &sums,
                        quants: &quants,
                        quad: None,
                    };
                    let (want, got) = (reference(&weights, row), fast(token, &weights, row));
                    assert_eq!(
                        want.to_bits(),
                        got.to_bits(),
                        "{name}, {blocks} blocks, {kind:?} activations: {want} vs {got}"
                    );
                }
            }
        }
    }

    #[test]
    fn raw_random_blocks_with_infinite_or_nan_scales_give_the_reference_result() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut random = Random(0xFEED_F00D);
        for (name, block_bytes, reference, fast) in FORMATS {
            for blocks in BLOCK_COUNTS {
                for round in 0..40 {
                    // Every byte random: one scale in 32 is infinite or NaN; in half the rows
                    // the last block's scale is infinite.
                    let mut weights: Vec<u8> = (0..blocks * block_bytes)
                        .map(|_| random.next() as u8)
                        .collect();
                    if round % 2 == 0 {
                        let last = (blocks - 1) * block_bytes;
                        let infinity = random.pick(&[f16::INFINITY, f16::NEG_INFINITY]);
                        weights[last..last + 2].copy_from_slice(&infinity.to_le_bytes());
                    }
                    let (scales, sums, quants) =
                        activation_row(&mut random, Activations::Random, blocks);
                    let row = ActivationRow {
                        scales: &scales,
                        sums: &sums,
                        quants: &quants,
                        quad: None,
                    };
                    let (want, got) = (reference(&weights, row), fast(token, &weights, row));
                    // NaN payloads may differ (an add's operands may be taken either way).
                    assert!(
                        want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                        "{name}, {blocks} blocks: {want} vs {got}"
                    );
                }
            }
        }
    }

    /// `group_dots` of the first `count` blocks of `F`, as eight i32.
    fn avx2_dots<F: Layout>(blocks: &[u8], quants: &[i8], count: usize) -> [i32; 8] {
        assert!(count <= 8 && blocks.len() >= count * F::BYTES && quants.len() >= count * BLOCK);
        let mut lanes = [0i32; 8];
        // SAFETY: the CPU has AVX2 (the caller checked); `count` blocks and their quants are
        // in range; `lanes` holds eight i32.
        unsafe {
            let dots = group_dots::<F>(blocks.as_ptr(), quants.as_ptr(), count);
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), dots);
        }
        lanes
    }

    #[test]
    fn the_avx2_group_dots_equal_the_exact_integer_dots() {
        let Some(_) = Avx2::detect() else {
            return;
        };
        let mut random = Random(42);
        type BlockDot = fn(&[u8], &[i8]) -> i32;
        type GroupDots = fn(&[u8], &[i8], usize) -> [i32; 8];
        let formats: [(usize, BlockDot, GroupDots); 3] = [
            (
                legacy::Q4_0_BYTES,
                legacy::q4_0_block_dot,
                avx2_dots::<Q4_0>,
            ),
            (
                legacy::Q5_0_BYTES,
                legacy::q5_0_block_dot,
                avx2_dots::<Q5_0>,
            ),
            (
                legacy::Q5_1_BYTES,
                legacy::q5_1_block_dot,
                avx2_dots::<Q5_1>,
            ),
        ];
        for (block_bytes, reference, fast) in formats {
            for round in 0..2000 {
                let count = 1 + round % 8;
                let weights: Vec<u8> = (0..count)
                    .flat_map(|_| {
                        let kind = random.pick(&[Weights::Random, Weights::Extreme]);
                        weight_block(&mut random, kind, block_bytes)
                    })
                    .collect();
                let kind = random.pick(&[
                    Activations::Random,
                    Activations::Extreme,
                    Activations::Lowest,
                ]);
                let (_, _, quants) = activation_row(&mut random, kind, count);
                let lanes = fast(&weights, &quants, count);
                for (block, lane) in lanes.into_iter().enumerate() {
                    let want = if block < count {
                        let bytes = &weights[block * block_bytes..(block + 1) * block_bytes];
                        reference(bytes, &quants[block * BLOCK..(block + 1) * BLOCK])
                    } else {
                        0
                    };
                    assert_eq!(
                        lane, want,
                        "{block_bytes}-byte blocks, {count}, lane {block}"
                    );
                }
            }
        }
    }

    #[test]
    fn f16c_widens_every_half_as_the_reference_does() {
        let Some(_) = Avx2::detect() else {
            return;
        };
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        for group in bytes.chunks_exact(16) {
            let mut widened = [0f32; 8];
            // SAFETY: the CPU has AVX2 and F16C; `group` holds eight halves two bytes apart.
            unsafe { _mm256_storeu_ps(widened.as_mut_ptr(), halves(group.as_ptr(), 2, 8)) };
            for (k, value) in widened.iter().enumerate() {
                assert_eq!(
                    value.to_bits(),
                    half_at(group, 2 * k).to_bits(),
                    "{group:?}"
                );
            }
        }
    }

    /// Times the reference and the AVX2 dots on a 1536 × 576 and a 576 × 1536 matrix of each
    /// format against one activation row (a decode step); prints ns per 256 values per row.
    /// `cargo test --release -p meshnet-kernels --lib timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn timing() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut random = Random(7);
        for (name, block_bytes, reference, fast) in FORMATS {
            for (rows, cols) in [(1536, 576), (576, 1536)] {
                let blocks = cols / BLOCK;
                let weights: Vec<u8> = (0..rows * blocks)
                    .flat_map(|_| weight_block(&mut random, Weights::Random, block_bytes))
                    .collect();
                let (scales, sums, quants) =
                    activation_row(&mut random, Activations::Random, blocks);
                let row = ActivationRow {
                    scales: &scales,
                    sums: &sums,
                    quants: &quants,
                    quad: None,
                };
                let row_bytes = blocks * block_bytes;
                let time = |dot: &dyn Fn(&[u8]) -> f32| {
                    let mut best = f64::MAX;
                    let mut total = 0f32;
                    for _ in 0..30 {
                        let start = std::time::Instant::now();
                        for weights in weights.chunks_exact(row_bytes) {
                            total += dot(std::hint::black_box(weights));
                        }
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                    std::hint::black_box(total);
                    best * 1e9 / rows as f64 / (cols as f64 / 256.0)
                };
                let scalar = time(&|weights| reference(weights, row));
                let avx2 = time(&|weights| fast(token, weights, row));
                println!(
                    "{name} {rows}x{cols}: scalar {scalar:.1} ns, avx2 {avx2:.1} ns per 256 values per row"
                );
            }
        }
    }

    type Together = fn(Avx2, &[u8], [ActivationRow<'_>; TOGETHER]) -> [f32; TOGETHER];

    const TOGETHER_FORMATS: [(&str, usize, Reference, Together); 3] = [
        (
            "Q4_0",
            legacy::Q4_0_BYTES,
            legacy::dot_q4_0,
            dot_q4_0_together,
        ),
        (
            "Q5_0",
            legacy::Q5_0_BYTES,
            legacy::dot_q5_0,
            dot_q5_0_together,
        ),
        (
            "Q5_1",
            legacy::Q5_1_BYTES,
            legacy::dot_q5_1,
            dot_q5_1_together,
        ),
    ];

    /// Four activation rows of `blocks` blocks, each of a kind drawn on its own (all random
    /// in the first eight rounds).
    fn four_rows(
        random: &mut Random,
        blocks: usize,
        round: usize,
    ) -> [(Vec<f32>, Vec<f32>, Vec<i8>); TOGETHER] {
        let kinds = [
            Activations::Random,
            Activations::Extreme,
            Activations::Lowest,
            Activations::Zero,
        ];
        std::array::from_fn(|_| {
            let kind = if round < 8 {
                Activations::Random
            } else {
                random.pick(&kinds)
            };
            activation_row(random, kind, blocks)
        })
    }

    #[test]
    fn the_four_row_dots_give_the_bits_of_four_reference_dots() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut random = Random(0x5EED_4444);
        let weight_kinds = [Weights::Random, Weights::Zero, Weights::Extreme];
        for (name, block_bytes, reference, together) in TOGETHER_FORMATS {
            for blocks in BLOCK_COUNTS {
                for round in 0..24 {
                    let weights: Vec<u8> = (0..blocks)
                        .flat_map(|_| {
                            let kind = if round < 12 {
                                Weights::Random
                            } else {
                                random.pick(&weight_kinds)
                            };
                            weight_block(&mut random, kind, block_bytes)
                        })
                        .collect();
                    let rows = four_rows(&mut random, blocks, round);
                    let rows = rows.each_ref().map(|(scales, sums, quants)| ActivationRow {
                        scales,
                        sums,
                        quants,
                        quad: None,
                    });
                    let got = together(token, &weights, rows);
                    for (k, (row, got)) in rows.into_iter().zip(got).enumerate() {
                        let want = reference(&weights, row);
                        assert_eq!(
                            want.to_bits(),
                            got.to_bits(),
                            "{name}, {blocks} blocks, round {round}, row {k}: {want} vs {got}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn four_row_dots_of_raw_random_blocks_give_the_reference_results() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut random = Random(0xBAD_5EED);
        for (name, block_bytes, reference, together) in TOGETHER_FORMATS {
            for blocks in BLOCK_COUNTS {
                for round in 0..16 {
                    // Every byte random (some scales infinite or NaN).
                    let weights: Vec<u8> = (0..blocks * block_bytes)
                        .map(|_| random.next() as u8)
                        .collect();
                    let rows = four_rows(&mut random, blocks, round);
                    let rows = rows.each_ref().map(|(scales, sums, quants)| ActivationRow {
                        scales,
                        sums,
                        quants,
                        quad: None,
                    });
                    let got = together(token, &weights, rows);
                    for (row, got) in rows.into_iter().zip(got) {
                        let want = reference(&weights, row);
                        // NaN payloads may differ (an add's operands may be taken either way).
                        assert!(
                            want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
                            "{name}, {blocks} blocks: {want} vs {got}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "unequal length")]
    fn four_row_dots_refuse_a_row_of_another_length() {
        let Some(token) = Avx2::detect() else {
            panic!("unequal length (no AVX2 to test)");
        };
        let weights = vec![0u8; 2 * legacy::Q5_0_BYTES];
        let (scales, sums, quants) = (vec![0f32; 2], vec![0f32; 2], vec![0i8; 2 * BLOCK]);
        let row = ActivationRow {
            scales: &scales,
            sums: &sums,
            quants: &quants,
            quad: None,
        };
        let short = ActivationRow {
            scales: &scales[..1],
            sums: &sums[..1],
            quants: &quants[..BLOCK],
            quad: None,
        };
        dot_q5_0_together(token, &weights, [row, row, short, row]);
    }

    /// Times four one-row dots against the four-row dot of each format on 1536- and 576-wide
    /// rows (576 rows of 1536 values, 1536 of 576), four activation rows as in a prefill; prints
    /// ns per 256 values per activation row.
    /// `cargo test --release -p meshnet-kernels --lib together_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn together_timing() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut random = Random(11);
        for (name, block_bytes, _, together) in TOGETHER_FORMATS {
            let (_, _, _, one) = FORMATS.into_iter().find(|f| f.0 == name).unwrap();
            for (rows, cols) in [(576, 1536), (1536, 576)] {
                let blocks = cols / BLOCK;
                let weights: Vec<u8> = (0..rows * blocks)
                    .flat_map(|_| weight_block(&mut random, Weights::Random, block_bytes))
                    .collect();
                let activations: [_; TOGETHER] = std::array::from_fn(|_| {
                    activation_row(&mut random, Activations::Random, blocks)
                });
                let activations =
                    activations
                        .each_ref()
                        .map(|(scales, sums, quants)| ActivationRow {
                            scales,
                            sums,
                            quants,
                            quad: None,
                        });
                let row_bytes = blocks * block_bytes;
                let time = |dot: &dyn Fn(&[u8]) -> [f32; TOGETHER]| {
                    let mut best = f64::MAX;
                    let mut total = 0f32;
                    for _ in 0..30 {
                        let start = std::time::Instant::now();
                        for weights in weights.chunks_exact(row_bytes) {
                            total += dot(std::hint::black_box(weights)).iter().sum::<f32>();
                        }
                        best = best.min(start.elapsed().as_secs_f64());
                    }
                    std::hint::black_box(total);
                    best * 1e9 / (rows * TOGETHER) as f64 / (cols as f64 / 256.0)
                };
                let singly = time(&|weights| activations.map(|row| one(token, weights, row)));
                let four = time(&|weights| together(token, weights, activations));
                println!(
                    "{name} {rows}x{cols}: one-row x4 {singly:.1} ns, four-row {four:.1} ns per 256 values per row"
                );
            }
        }
    }
}
