//! AVX2 dot products of F32, F16 and BF16 rows (equal to `formats::float`'s).
//!
//! Each accumulator of the reference is one vector: eight weights are widened at once (F16
//! with F16C's exact `vcvtph2ps`; BF16 by one byte shuffle that puts each value's two bytes on
//! top of a 32-bit lane over zeros), then their products are rounded and added to the
//! accumulator (`vmulps`, `vaddps`: never fused, as the reference's `step`). A last group
//! shorter than eight values is copied into zeroed buffers: its missing lanes add `0·0`, which
//! leaves a lane as it was (a lane is never `-0.0`). The four accumulators are then added in
//! the reference's order (`combine`).
//!
//! Speed: a row in cache takes about one cycle per eight values, bound by the two loads each
//! group needs (weights and f32 activations). Activations that start 16 bytes past a 32-byte
//! boundary make every other 32-byte load cross a cache line and cost 20-40% in cache; rows
//! streamed from memory are bound by their bytes (F16 and BF16 rows take half the time of
//! F32 rows).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::Avx2;
use crate::formats::FloatFormat;
use crate::formats::float;
#[cfg(target_arch = "x86_64")]
use crate::formats::float::{ACCUMULATORS, LANES, STRIDE};

/// One row of weights against one row of f32 activations.
pub(super) fn dot(_: Avx2, format: FloatFormat, weights: &[u8], activations: &[f32]) -> f32 {
    float::check_lengths(format, weights, activations);
    // SAFETY: the token exists only when the CPU has AVX2, FMA and F16C (`Avx2::detect`), and
    // `check_lengths` checked that `weights` holds one value per activation.
    unsafe { dot_format(format, weights, activations) }
}

/// [`dot`] for the format, through its widening.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and `weights` must hold `activations.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_format(format: FloatFormat, weights: &[u8], activations: &[f32]) -> f32 {
    // SAFETY: passed on from the caller.
    unsafe {
        match format {
            FloatFormat::F32 => dot_row::<F32Weights>(weights, activations),
            FloatFormat::F16 => dot_row::<F16Weights>(weights, activations),
            FloatFormat::Bf16 => dot_row::<Bf16Weights>(weights, activations),
        }
    }
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dot_format(_: FloatFormat, _: &[u8], _: &[f32]) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

/// How eight weights of one format are read and widened to f32.
#[cfg(target_arch = "x86_64")]
trait Widen {
    /// Bytes of one value.
    const BYTES: usize;

    /// Eight values at `bytes`, as f32 (exactly the reference's widening).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C, and `bytes` must point at `8 · BYTES` readable
    /// bytes.
    unsafe fn eight(bytes: *const u8) -> __m256;
}

/// F32 weights: loaded as they are.
#[cfg(target_arch = "x86_64")]
struct F32Weights;

/// F16 weights: widened by F16C.
#[cfg(target_arch = "x86_64")]
struct F16Weights;

/// BF16 weights: their bits moved to the top half of 32-bit lanes.
#[cfg(target_arch = "x86_64")]
struct Bf16Weights;

#[cfg(target_arch = "x86_64")]
impl Widen for F32Weights {
    const BYTES: usize = 4;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(bytes: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 32 readable bytes at `bytes`.
        unsafe { _mm256_loadu_ps(bytes.cast()) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Widen for F16Weights {
    const BYTES: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(bytes: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes at `bytes`.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(bytes.cast()) })
    }
}

#[cfg(target_arch = "x86_64")]
impl Widen for Bf16Weights {
    const BYTES: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(bytes: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 16 readable bytes at `bytes`.
        let both = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(bytes.cast())) };
        let to_top = _mm256_setr_epi8(
            -1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, //
            -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15,
        );
        _mm256_castsi256_ps(_mm256_shuffle_epi8(both, to_top))
    }
}

/// The dot product of a whole row: every whole group of eight values into its accumulator,
/// then the short last group, then the reference's combination.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and `weights` must hold `activations.len()` values
/// of `W::BYTES` bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_row<W: Widen>(weights: &[u8], activations: &[f32]) -> f32 {
    let mut sums = [_mm256_setzero_ps(); ACCUMULATORS];
    let strides = activations.len() / STRIDE;
    for stride in 0..strides {
        for (accumulator, sum) in sums.iter_mut().enumerate() {
            let first = stride * STRIDE + accumulator * LANES;
            // SAFETY: `first + 8 <= strides · 32 <= activations.len()`, so eight values of
            // each slice are in range.
            *sum = unsafe { add_group::<W>(*sum, weights, activations, first) };
        }
    }
    let mut first = strides * STRIDE;
    let mut accumulator = 0;
    while first + LANES <= activations.len() {
        // SAFETY: as above, `first + 8 <= activations.len()`.
        sums[accumulator] =
            unsafe { add_group::<W>(sums[accumulator], weights, activations, first) };
        first += LANES;
        accumulator += 1;
    }
    if first < activations.len() {
        // SAFETY: passed on from the caller.
        sums[accumulator] =
            unsafe { add_short_group::<W>(sums[accumulator], weights, activations, first) };
    }
    combine(sums)
}

/// `sum` plus the products of values `first..first + 8`: each product rounded, then each sum.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `activations` must hold at least `first + 8` values
/// and `weights` as many of `W::BYTES` bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_group<W: Widen>(
    sum: __m256,
    weights: &[u8],
    activations: &[f32],
    first: usize,
) -> __m256 {
    // SAFETY: the caller guarantees eight values of each slice from `first`.
    let (weights, activations) = unsafe {
        (
            W::eight(weights.as_ptr().add(first * W::BYTES)),
            _mm256_loadu_ps(activations.as_ptr().add(first)),
        )
    };
    _mm256_add_ps(sum, _mm256_mul_ps(weights, activations))
}

/// `sum` plus the products of values `first..` (fewer than eight), in the first lanes.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, `first < activations.len() < first + 8`, and
/// `weights` must hold `activations.len()` values of `W::BYTES` bytes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_short_group<W: Widen>(
    sum: __m256,
    weights: &[u8],
    activations: &[f32],
    first: usize,
) -> __m256 {
    let mut weight_bytes = [0u8; 4 * LANES];
    let mut activation_values = [0f32; LANES];
    let count = activations.len() - first;
    weight_bytes[..count * W::BYTES].copy_from_slice(&weights[first * W::BYTES..]);
    activation_values[..count].copy_from_slice(&activations[first..]);
    // SAFETY: both buffers hold eight values of their kind.
    unsafe { add_group::<W>(sum, &weight_bytes, &activation_values, 0) }
}

/// The four accumulators added as `float::combine` adds them.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn combine(sums: [__m256; ACCUMULATORS]) -> f32 {
    let column = _mm256_add_ps(
        _mm256_add_ps(sums[0], sums[1]),
        _mm256_add_ps(sums[2], sums[3]),
    );
    let quarters = _mm_add_ps(
        _mm256_castps256_ps128(column),
        _mm256_extractf128_ps(column, 1),
    );
    let halves = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
    _mm_cvtss_f32(_mm_add_ss(halves, _mm_shuffle_ps(halves, halves, 1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::float::tests::{FORMATS, Random, encode};

    /// Equal bits, or both NaN (which NaN is not part of the contract).
    fn same(left: f32, right: f32) -> bool {
        left.to_bits() == right.to_bits() || (left.is_nan() && right.is_nan())
    }

    /// Row lengths: every length up to 140 (every short last group after every number of whole
    /// groups), and longer ones.
    fn lengths() -> impl Iterator<Item = usize> {
        (0..140).chain([255, 256, 257, 576, 1000, 1536, 4099])
    }

    #[test]
    fn avx2_gives_the_reference_bits_on_random_rows() {
        let Some(token) = Avx2::detect() else { return };
        let mut random = Random(3);
        for format in FORMATS {
            for count in lengths() {
                let values: Vec<f32> = (0..count).map(|_| random.spread(-14, 14)).collect();
                let (bytes, _) = encode(format, &values);
                let activations: Vec<f32> = (0..count).map(|_| random.spread(-20, 20)).collect();
                let reference = float::dot(format, &bytes, &activations);
                let fast = dot(token, format, &bytes, &activations);
                assert_eq!(fast.to_bits(), reference.to_bits(), "{format:?} × {count}");
            }
        }
    }

    #[test]
    fn avx2_gives_the_reference_bits_on_any_bit_patterns() {
        let Some(token) = Avx2::detect() else { return };
        let mut random = Random(5);
        for format in FORMATS {
            for count in lengths() {
                // Any bytes: NaNs, infinities, subnormals, huge values whose products overflow.
                let bytes: Vec<u8> = (0..count * format.value_bytes())
                    .map(|_| random.bits() as u8)
                    .collect();
                let activations: Vec<f32> = (0..count)
                    .map(|_| f32::from_bits(random.bits() as u32))
                    .collect();
                let reference = float::dot(format, &bytes, &activations);
                let fast = dot(token, format, &bytes, &activations);
                assert!(
                    same(fast, reference),
                    "{format:?} × {count}: {fast} vs {reference}"
                );
            }
        }
    }

    #[test]
    fn avx2_gives_the_reference_bits_on_extreme_rows() {
        let Some(token) = Avx2::detect() else { return };
        let mut random = Random(9);
        let kinds: [fn(&mut Random) -> f32; 4] = [
            |_| 0.0,
            |random| random.spread(100, 127), // products overflow to infinity
            |random| random.spread(-149, -120), // subnormal products
            |random| {
                if random.bits() % 3 == 0 {
                    -0.0
                } else {
                    random.spread(-2, 2)
                }
            },
        ];
        for format in FORMATS {
            for count in lengths() {
                for (weight_kind, activation_kind) in
                    kinds.iter().flat_map(|w| kinds.iter().map(move |a| (w, a)))
                {
                    let values: Vec<f32> = (0..count).map(|_| weight_kind(&mut random)).collect();
                    let (bytes, _) = encode(format, &values);
                    let activations: Vec<f32> =
                        (0..count).map(|_| activation_kind(&mut random)).collect();
                    let reference = float::dot(format, &bytes, &activations);
                    let fast = dot(token, format, &bytes, &activations);
                    assert!(
                        same(fast, reference),
                        "{format:?} × {count}: {fast} vs {reference}"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "unequal length")]
    fn avx2_refuses_rows_of_unequal_length() {
        let Some(token) = Avx2::detect() else {
            panic!("unequal length (no AVX2 here)")
        };
        dot(token, FloatFormat::F16, &[0; 6], &[0.0; 4]);
    }

    /// `source` copied to a place `skew` bytes past a 64-byte boundary (a multiple of 4).
    fn placed<T: Copy + Default>(
        source: &[T],
        skew: usize,
        storage: &mut Vec<T>,
    ) -> (usize, usize) {
        let size = std::mem::size_of::<T>();
        storage.clear();
        storage.resize(source.len() + 128 / size, T::default());
        let misalignment = storage.as_ptr() as usize % 64;
        let start = ((64 + skew - misalignment) % 64) / size;
        storage[start..start + source.len()].copy_from_slice(source);
        (start, start + source.len())
    }

    /// Nanoseconds per 256 values per row of `dot` over a `rows × cols` matrix whose rows and
    /// activations start `skew` bytes past a 64-byte boundary, best of several passes.
    fn time_rows(
        (rows, cols): (usize, usize),
        format: FloatFormat,
        skew: usize,
        dot: impl Fn(&[u8], &[f32]) -> f32,
    ) -> f64 {
        let mut random = Random(1);
        let values: Vec<f32> = (0..rows * cols).map(|_| random.spread(-6, 2)).collect();
        let activations: Vec<f32> = (0..cols).map(|_| random.spread(-3, 3)).collect();
        let (mut weight_storage, mut activation_storage) = (Vec::new(), Vec::new());
        let weights = placed(&encode(format, &values).0, skew, &mut weight_storage);
        let weights = &weight_storage[weights.0..weights.1];
        let activations = placed(&activations, skew, &mut activation_storage);
        let activations = &activation_storage[activations.0..activations.1];
        let mut best = f64::INFINITY;
        for _ in 0..(20_000_000 / (rows * cols)).clamp(5, 3000) {
            let start = std::time::Instant::now();
            let mut total = 0f32;
            for row in weights.chunks_exact(cols * format.value_bytes()) {
                total += dot(row, activations);
            }
            std::hint::black_box(total);
            best = best.min(start.elapsed().as_secs_f64() * 1e9 / rows as f64);
        }
        best * 256.0 / cols as f64
    }

    /// Prints the scalar reference's and the AVX2 kernel's speed on a few matrix shapes, with
    /// rows and activations 64-byte aligned and 16 bytes past (where half the 32-byte loads of
    /// f32 activations cross a cache line).
    #[test]
    #[ignore = "timing: cargo test --release -- --ignored --nocapture float_timing"]
    fn float_timing() {
        let Some(token) = Avx2::detect() else { return };
        for shape in [(1536, 576), (576, 1536), (4096, 4096)] {
            for format in FORMATS {
                let scalar = time_rows(shape, format, 0, |w, a| float::dot(format, w, a));
                let [aligned, skewed] = [0, 16]
                    .map(|skew| time_rows(shape, format, skew, |w, a| dot(token, format, w, a)));
                println!(
                    "{format:?} {}x{}: ns per 256 values per row: scalar {scalar:.1}, \
                     avx2 {aligned:.1} aligned, {skewed:.1} 16 bytes past",
                    shape.0, shape.1
                );
            }
        }
    }
}
