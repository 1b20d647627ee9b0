#![allow(clippy::unwrap_used)]
//! Every kernel gives the scalar reference's bits on random blocks of every format, the
//! reference computes the product it claims to (against a float evaluation of the same
//! quantized operands), and bad shapes and bytes are refused.

use half::{bf16, f16};
use meshnet_kernels::{BLOCK, Kernel, KernelError, MatrixBuilder, QuantizedMatrix, WeightFormat};
use proptest::prelude::*;

/// Values in a k-quant super-block (and in one activation super-block).
const SUPER_BLOCK: usize = 256;

/// A small deterministic generator (splitmix64) for block bytes and inputs.
struct Random(u64);

impl Random {
    /// The next 64 random bits.
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A random byte.
    fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }

    /// A value in [-1, 1].
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// One of `items`.
    fn pick(&mut self, items: &[f32]) -> f32 {
        items[(self.next() % items.len() as u64) as usize]
    }
}

/// Where a format's f16 scale and minimum fields sit in a block (ggml-common.h): Q2_K ends
/// with `d, dmin`, Q3_K and Q6_K end with `d`, the others start with `d` (and `m` or `dmin`).
fn half_fields(format: WeightFormat) -> &'static [usize] {
    match format {
        WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => &[0],
        WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => {
            &[0, 2]
        }
        WeightFormat::Q2_K => &[80, 82],
        WeightFormat::Q3_K => &[108],
        WeightFormat::Q6_K => &[208],
        WeightFormat::F16 | WeightFormat::BF16 | WeightFormat::F32 => &[],
    }
}

/// How the quant bytes of a block are filled.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// Random bytes.
    Random,
    /// Every bit set: the largest unsigned quants and scales.
    Ones,
    /// Every bit clear.
    Zeros,
}

fn fill_strategy() -> impl Strategy<Value = Fill> {
    prop_oneof![6 => Just(Fill::Random), 1 => Just(Fill::Ones), 1 => Just(Fill::Zeros)]
}

/// Valid ggml bytes for `blocks` blocks of `format` (values, for F16/BF16/F32): quant bytes
/// as `fill` says, every f16 scale and minimum a finite value of `scales` with a random sign;
/// unquantized values are a random fraction of a value of `scales` (`Ones`: all of it).
fn valid_blocks(
    format: WeightFormat,
    blocks: usize,
    random: &mut Random,
    scales: &[f32],
    fill: Fill,
) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        if format.block_values() == 1 {
            let value = match fill {
                Fill::Random => random.unit() * random.pick(scales),
                Fill::Ones => random.pick(scales),
                Fill::Zeros => 0.0,
            };
            bytes.extend_from_slice(&float_bytes(format, value));
            continue;
        }
        let start = bytes.len();
        bytes.extend((0..format.block_bytes()).map(|_| match fill {
            Fill::Random => random.byte(),
            Fill::Ones => 0xFF,
            Fill::Zeros => 0,
        }));
        for at in half_fields(format) {
            let sign = if random.byte() & 1 == 0 { 1.0 } else { -1.0 };
            let half = f16::from_f32(sign * random.pick(scales)).to_le_bytes();
            bytes[start + at..start + at + 2].copy_from_slice(&half);
        }
    }
    bytes
}

/// `value` in an unquantized format's bytes.
fn float_bytes(format: WeightFormat, value: f32) -> Vec<u8> {
    match format {
        WeightFormat::F16 => f16::from_f32(value).to_le_bytes().to_vec(),
        WeightFormat::BF16 => bf16::from_f32(value).to_le_bytes().to_vec(),
        _ => value.to_le_bytes().to_vec(),
    }
}

/// `m` rows of `cols` inputs, uniform in ±`scale`.
fn random_input(random: &mut Random, m: usize, cols: usize, scale: f32) -> Vec<f32> {
    (0..m * cols).map(|_| random.unit() * scale).collect()
}

/// A format and a row length of whole blocks: 1..30 blocks of 32, 1..5 super-blocks of 256,
/// or 1..700 values of an unquantized format (every remainder of the SIMD widths).
fn format_and_cols() -> impl Strategy<Value = (WeightFormat, usize)> {
    prop::sample::select(WeightFormat::ALL.to_vec()).prop_flat_map(|format| {
        let blocks = match format.block_values() {
            1 => 1usize..700,
            BLOCK => 1..30,
            _ => 1..5,
        };
        (
            Just(format),
            blocks.prop_map(move |blocks| blocks * format.block_values()),
        )
    })
}

/// A row of activations as the kernels see them for `format`, each value as f64: 32-value
/// blocks with the f16-rounded scale `max|x|/127` and quants `round(x / scale)` taken with
/// the unrounded scale (Q4_0 … Q8_0); 256-value super-blocks with the unrounded scale (the
/// k-quants); the values themselves (F16, BF16, F32).
fn seen_activations(format: WeightFormat, row: &[f32]) -> Vec<f64> {
    let (block, round_scale) = match format.block_values() {
        1 => return row.iter().map(|x| f64::from(*x)).collect(),
        BLOCK => (BLOCK, true),
        _ => (SUPER_BLOCK, false),
    };
    let mut seen = Vec::with_capacity(row.len());
    for values in row.chunks_exact(block) {
        let largest = values.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = largest / 127.0;
        let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let kept_scale = if round_scale {
            f16::from_f32(scale).to_f32()
        } else {
            scale
        };
        for x in values {
            let quant = (x * inverse).round() as i8;
            seen.push(f64::from(quant) * f64::from(kept_scale));
        }
    }
    seen
}

/// The size of the float minimum a block adds to every weight, as far as the reference may
/// apply it apart from the quants' products (times `Σa`): `|m|` for Q4_1 and Q5_1, 15·|dmin|
/// for Q2_K, 63·|dmin| for Q4_K and Q5_K (the largest 4- and 6-bit minimums), else 0 (the
/// other formats' offsets are integers, folded into the exact integer dot products).
fn block_minimum(format: WeightFormat, block: &[u8]) -> f64 {
    let half = |at: usize| f64::from(f16::from_le_bytes([block[at], block[at + 1]]).to_f32());
    match format {
        WeightFormat::Q4_1 | WeightFormat::Q5_1 => half(2).abs(),
        WeightFormat::Q2_K => 15.0 * half(82).abs(),
        WeightFormat::Q4_K | WeightFormat::Q5_K => 63.0 * half(2).abs(),
        _ => 0.0,
    }
}

/// `Σ |Σ a|` over the groups of activations a minimum meets as one sum: the whole 32-value
/// block (its scaled sum), or each 16 values of a super-block (its exact sums).
fn summed_groups(activations: &[f64]) -> f64 {
    let group = if activations.len() == SUPER_BLOCK {
        16
    } else {
        activations.len()
    };
    activations
        .chunks_exact(group)
        .map(|group| group.iter().sum::<f64>().abs())
        .sum()
}

/// How far the reference may be from the float evaluation of one output, given `magnitude`
/// (`Σ|w·a|`), `minimums` (each block's [`block_minimum`] times its [`summed_groups`]) and `bare`
/// (the sum of the blocks' minimums):
/// - f32 rounding, in units of `magnitude + minimums` (a bound on every term the reference
///   adds): a few roundings per block and one per block added, `4·(blocks + 4)·ε`; for the
///   unquantized formats a rounding per value of a lane and the lanes' sum, `2·(cols/8 + 32)·ε`
///   (any layout of at least eight lanes added in at most 32 steps);
/// - for 32-value blocks, whose minimums meet the activations' f16-rounded scaled sums
///   `f16(f16(Σq) · scale)` (two f16 roundings, 2⁻¹⁰ together): `2⁻⁹ · minimums`, and
///   `2⁻²⁴` per unit of minimum where that sum is an f16 subnormal (absolute error 2⁻²⁵).
fn allowed_distance(
    format: WeightFormat,
    cols: usize,
    magnitude: f64,
    minimums: f64,
    bare: f64,
) -> f64 {
    let epsilon = f64::from(f32::EPSILON);
    let tiny = f64::from(f32::MIN_POSITIVE) * cols as f64;
    match format.block_values() {
        1 => 2.0 * (cols as f64 / 8.0 + 32.0) * epsilon * magnitude + tiny,
        BLOCK => {
            let rounding = 4.0 * ((cols / BLOCK) as f64 + 4.0) * epsilon;
            rounding * (magnitude + minimums) + minimums / 512.0 + bare / f64::from(1u32 << 24)
        }
        values => 4.0 * ((cols / values) as f64 + 4.0) * epsilon * (magnitude + minimums) + tiny,
    }
}

/// The float evaluation of the same quantized operands the kernels see, per output (input
/// row after input row): `Σ w·a` in f64 over the weights as `dequantize_row` gives them and
/// the activations as [`seen_activations`] gives them, with the allowed distance.
fn float_evaluation(matrix: &QuantizedMatrix, bytes: &[u8], input: &[f32]) -> Vec<(f64, f64)> {
    let (format, cols) = (matrix.format(), matrix.cols());
    let block_values = format.block_values();
    let row_bytes = cols / block_values * format.block_bytes();
    let mut weights = vec![0f32; cols];
    let mut evaluations = Vec::new();
    for row in input.chunks_exact(cols) {
        let activations = seen_activations(format, row);
        for (index, row_bytes) in bytes.chunks_exact(row_bytes).enumerate() {
            matrix.dequantize_row(index, &mut weights).unwrap();
            let (mut sum, mut magnitude, mut minimums, mut bare) = (0f64, 0f64, 0f64, 0f64);
            for ((w, a), block) in weights
                .chunks_exact(block_values)
                .zip(activations.chunks_exact(block_values))
                .zip(row_bytes.chunks_exact(format.block_bytes()))
            {
                for (w, a) in w.iter().zip(a) {
                    sum += f64::from(*w) * a;
                    magnitude += (f64::from(*w) * a).abs();
                }
                let minimum = block_minimum(format, block);
                minimums += minimum * summed_groups(a);
                bare += minimum;
            }
            let allowed = allowed_distance(format, cols, magnitude, minimums, bare);
            evaluations.push((sum, allowed));
        }
    }
    evaluations
}

/// Whether two outputs are the same: equal bits, or both NaN (a NaN's payload may differ, as
/// the compiler may swap the operands of a multiply).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// Asserts that every kernel gives the scalar reference's outputs for `input`, all rows
/// together and one row at a time; returns the reference's outputs.
fn assert_every_kernel_agrees(
    matrix: &QuantizedMatrix,
    input: &[f32],
) -> std::result::Result<Vec<f32>, TestCaseError> {
    let (rows, cols) = (matrix.rows(), matrix.cols());
    let m = input.len() / cols;
    let mut reference = vec![0f32; m * rows];
    matrix
        .matmul_with(Kernel::Scalar, input, &mut reference)
        .unwrap();
    for kernel in Kernel::available() {
        let mut output = vec![f32::NAN; m * rows];
        matrix.matmul_with(kernel, input, &mut output).unwrap();
        prop_assert!(
            same_bits(&output, &reference),
            "{} {}: {} differs from scalar",
            matrix.format().name(),
            cols,
            kernel.name()
        );
        // One row at a time gives the same bits as all rows together.
        for (row, expected) in input.chunks_exact(cols).zip(reference.chunks_exact(rows)) {
            let mut alone = vec![0f32; rows];
            matrix.matmul_with(kernel, row, &mut alone).unwrap();
            prop_assert!(same_bits(&alone, expected), "{} alone", kernel.name());
        }
    }
    Ok(reference)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(13 * 32))]

    #[test]
    fn every_kernel_gives_the_reference_bits(
        (format, cols) in format_and_cols(),
        rows in 1usize..40,
        m in 1usize..11,
        fill in fill_strategy(),
        scales in proptest::collection::vec(
            prop_oneof![8 => 1e-4f32..2.0, 1 => Just(0.0f32), 1 => Just(1000.0f32)],
            1..8,
        ),
        input_scale in prop_oneof![Just(1.0f32), Just(300.0), Just(1e-3), Just(0.0)],
        seed in any::<u64>(),
    ) {
        let mut random = Random(seed);
        let blocks = rows * cols / format.block_values();
        let bytes = valid_blocks(format, blocks, &mut random, &scales, fill);
        let matrix = QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap();
        let input = random_input(&mut random, m, cols, input_scale);
        let reference = assert_every_kernel_agrees(&matrix, &input)?;
        // And the reference computes the product of the quantized operands: the only
        // differences are f32 rounding and, where a block has a float minimum, the f16
        // rounding of the 32-value activation blocks' scaled sums.
        let evaluations = float_evaluation(&matrix, &bytes, &input);
        for (index, (ours, (exact, allowed))) in reference.iter().zip(&evaluations).enumerate() {
            prop_assert!(
                (f64::from(*ours) - exact).abs() <= *allowed,
                "{} output {}: {} vs {} (allowed {})",
                format.name(), index, ours, exact, allowed
            );
        }
    }

    #[test]
    fn every_kernel_agrees_on_arbitrary_bytes(
        (format, cols) in format_and_cols(),
        rows in 1usize..12,
        m in 1usize..6,
        input_scale in prop_oneof![Just(1.0f32), Just(3e4)],
        seed in any::<u64>(),
    ) {
        // Any bytes: f16 scales and float weights may be infinite or NaN.
        let mut random = Random(seed);
        let length = rows * cols / format.block_values() * format.block_bytes();
        let bytes: Vec<u8> = (0..length).map(|_| random.byte()).collect();
        let matrix = QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap();
        let input = random_input(&mut random, m, cols, input_scale);
        assert_every_kernel_agrees(&matrix, &input)?;
        let mut row = vec![0f32; cols];
        matrix.dequantize_row(rows - 1, &mut row).unwrap();
    }

    #[test]
    fn a_matrix_built_piece_by_piece_equals_one_parsed_whole(
        (format, cols) in format_and_cols(),
        rows in 1usize..20,
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        seed in any::<u64>(),
    ) {
        let blocks = rows * cols / format.block_values();
        let bytes = valid_blocks(format, blocks, &mut Random(seed), &[0.03, 0.7, 1e-3], Fill::Random);
        let whole = QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap();
        // Pieces of whole blocks, cut at random block boundaries (empty pieces included).
        let mut boundaries: Vec<usize> = cuts.iter().map(|cut| cut.index(blocks + 1)).collect();
        boundaries.extend([0, blocks]);
        boundaries.sort_unstable();
        let mut builder = MatrixBuilder::new(format, rows, cols).unwrap();
        prop_assert_eq!(builder.expected_bytes(), bytes.len());
        for piece in boundaries.windows(2) {
            let span = piece[0] * format.block_bytes()..piece[1] * format.block_bytes();
            builder.push(&bytes[span]).unwrap();
        }
        let built = builder.finish().unwrap();
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for row in 0..rows {
            whole.dequantize_row(row, &mut a).unwrap();
            built.dequantize_row(row, &mut b).unwrap();
            prop_assert!(same_bits(&a, &b), "{} row {}", format.name(), row);
        }
    }

    #[test]
    fn stacked_matrices_give_their_parts_outputs_side_by_side(
        (format, cols) in format_and_cols(),
        first_rows in 1usize..20,
        second_rows in 1usize..20,
        seed in any::<u64>(),
    ) {
        let mut random = Random(seed);
        let scales = [0.01f32, 0.02, 0.5];
        let mut part = |rows: usize| {
            let blocks = rows * cols / format.block_values();
            let bytes = valid_blocks(format, blocks, &mut random, &scales, Fill::Random);
            QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap()
        };
        let (first, second) = (part(first_rows), part(second_rows));
        let stacked = QuantizedMatrix::stack(&[&first, &second]).unwrap();
        prop_assert_eq!(stacked.rows(), first_rows + second_rows);
        let input: Vec<f32> = (0..2 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut together = vec![0f32; 2 * stacked.rows()];
        stacked.matmul(&input, &mut together).unwrap();
        let mut a = vec![0f32; 2 * first_rows];
        let mut b = vec![0f32; 2 * second_rows];
        first.matmul(&input, &mut a).unwrap();
        second.matmul(&input, &mut b).unwrap();
        for m in 0..2 {
            let row = &together[m * stacked.rows()..(m + 1) * stacked.rows()];
            prop_assert!(same_bits(&row[..first_rows], &a[m * first_rows..(m + 1) * first_rows]));
            prop_assert!(same_bits(&row[first_rows..], &b[m * second_rows..(m + 1) * second_rows]));
        }
    }
}

/// The formats the batched product computes in register tiles (several weight rows against
/// several input rows at once), drawn twice as often as the others.
fn batched_format_and_cols() -> impl Strategy<Value = (WeightFormat, usize)> {
    let tiled = [
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
        WeightFormat::Q4_0,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q4_K,
        WeightFormat::Q6_K,
    ];
    prop_oneof![
        2 => prop::sample::select(tiled.to_vec()),
        1 => prop::sample::select(WeightFormat::ALL.to_vec()),
    ]
    .prop_flat_map(|format| {
        let blocks = match format.block_values() {
            1 => 1usize..300,
            BLOCK => 1..40,
            _ => 1..6,
        };
        (
            Just(format),
            blocks.prop_map(move |blocks| blocks * format.block_values()),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Prefill-shaped products (whole tiles of weight rows and of input rows, and every
    /// remainder of both) give, output by output, the bits of the one-row scalar reference.
    #[test]
    fn batched_products_give_each_outputs_reference_bits(
        (format, cols) in batched_format_and_cols(),
        rows in prop_oneof![
            (1usize..6).prop_map(|tiles| tiles * 4),
            1usize..24,
            (40usize..80),
        ],
        m in prop_oneof![4usize..19, 30usize..75],
        fill in fill_strategy(),
        seed in any::<u64>(),
    ) {
        let mut random = Random(seed);
        let blocks = rows * cols / format.block_values();
        let bytes = valid_blocks(format, blocks, &mut random, &[0.02, 0.5, 1e-3], fill);
        let matrix = QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap();
        let input = random_input(&mut random, m, cols, 1.0);
        for kernel in Kernel::available() {
            let mut output = vec![f32::NAN; m * rows];
            matrix.matmul_with(kernel, &input, &mut output).unwrap();
            for (activation, row) in input.chunks_exact(cols).enumerate() {
                let mut alone = vec![f32::NAN; rows];
                matrix.matmul_with(Kernel::Scalar, row, &mut alone).unwrap();
                let ours = &output[activation * rows..(activation + 1) * rows];
                prop_assert!(
                    same_bits(ours, &alone),
                    "{} {}x{} against {} rows, {}: input row {} differs",
                    format.name(), rows, cols, m, kernel.name(), activation
                );
            }
        }
    }
}

#[test]
fn a_large_matrix_split_over_the_pool_gives_each_rows_own_output() {
    // 257 rows of 512 values: a one-row product this large is split over the pool, and every
    // output must equal that row's product computed alone (a one-row matrix, never split).
    let (rows, cols) = (257, 512);
    for format in WeightFormat::ALL {
        let mut random = Random(u64::from(format.block_bytes() as u32));
        let blocks = rows * cols / format.block_values();
        let bytes = valid_blocks(format, blocks, &mut random, &[0.01, 0.3], Fill::Random);
        let matrix = QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap();
        for m in [1, 5] {
            let input = random_input(&mut random, m, cols, 1.0);
            for kernel in Kernel::available() {
                let mut output = vec![f32::NAN; m * rows];
                matrix.matmul_with(kernel, &input, &mut output).unwrap();
                for (row, row_bytes) in bytes.chunks_exact(bytes.len() / rows).enumerate() {
                    let alone = QuantizedMatrix::from_ggml_bytes(format, 1, cols, row_bytes);
                    let mut expected = vec![0f32; m];
                    alone
                        .unwrap()
                        .matmul_with(kernel, &input, &mut expected)
                        .unwrap();
                    let ours: Vec<f32> = (0..m).map(|i| output[i * rows + row]).collect();
                    assert!(same_bits(&ours, &expected), "{} row {row}", format.name());
                }
            }
        }
    }
}

#[test]
fn every_format_has_ggml_block_sizes() {
    let ggml = [
        (WeightFormat::F32, 1, 4),
        (WeightFormat::F16, 1, 2),
        (WeightFormat::Q4_0, 32, 18),
        (WeightFormat::Q4_1, 32, 20),
        (WeightFormat::Q5_0, 32, 22),
        (WeightFormat::Q5_1, 32, 24),
        (WeightFormat::Q8_0, 32, 34),
        (WeightFormat::Q2_K, 256, 84),
        (WeightFormat::Q3_K, 256, 110),
        (WeightFormat::Q4_K, 256, 144),
        (WeightFormat::Q5_K, 256, 176),
        (WeightFormat::Q6_K, 256, 210),
        (WeightFormat::BF16, 1, 2),
    ];
    for (format, (expected, values, bytes)) in WeightFormat::ALL.into_iter().zip(ggml) {
        assert_eq!(format, expected);
        assert_eq!(format.block_values(), values, "{}", format.name());
        assert_eq!(format.block_bytes(), bytes, "{}", format.name());
        assert_eq!(WeightFormat::from_name(format.name()), Some(format));
    }
}

#[test]
fn every_format_refuses_rows_that_are_not_whole_blocks() {
    for format in WeightFormat::ALL {
        let block = format.block_values();
        let mut ragged = vec![0];
        if block > 1 {
            ragged.extend([
                1,
                block - 1,
                block + 1,
                3 * block / 2,
                2 * block + BLOCK / 2,
            ]);
        }
        if block == SUPER_BLOCK {
            ragged.extend([BLOCK, 4 * BLOCK, SUPER_BLOCK + BLOCK]);
        }
        for cols in ragged {
            let refused = |error: KernelError| {
                error
                    == KernelError::RaggedRow {
                        format: format.name(),
                        cols,
                        block,
                    }
            };
            let error = QuantizedMatrix::from_ggml_bytes(format, 2, cols, &[]).unwrap_err();
            assert!(refused(error.clone()), "{} {cols}: {error}", format.name());
            let error = MatrixBuilder::new(format, 2, cols).unwrap_err();
            assert!(refused(error.clone()), "{} {cols}: {error}", format.name());
        }
    }
}

#[test]
fn every_format_takes_whole_blocks_of_zeros_and_refuses_a_byte_more_or_less() {
    for format in WeightFormat::ALL {
        let cols = 2 * format.block_values();
        let length = 3 * 2 * format.block_bytes();
        for wrong in [length - 1, length + 1] {
            let error = QuantizedMatrix::from_ggml_bytes(format, 3, cols, &vec![0; wrong]);
            assert!(
                matches!(error, Err(KernelError::ByteLength { actual, .. }) if actual == wrong),
                "{} {wrong}: {error:?}",
                format.name()
            );
        }
        let matrix = QuantizedMatrix::from_ggml_bytes(format, 3, cols, &vec![0; length]).unwrap();
        let mut row = vec![f32::NAN; cols];
        matrix.dequantize_row(2, &mut row).unwrap();
        assert!(row.iter().all(|value| *value == 0.0), "{}", format.name());
        let input: Vec<f32> = (0..2 * cols).map(|i| i as f32 - 7.5).collect();
        for kernel in Kernel::available() {
            let mut output = vec![f32::NAN; 2 * 3];
            matrix.matmul_with(kernel, &input, &mut output).unwrap();
            assert_eq!(output, vec![0.0; 6], "{} {}", format.name(), kernel.name());
        }
    }
}

#[test]
fn q4_1_dequantizes_low_nibbles_first_then_high() {
    // One block: scale 0.5, minimum -1, byte j = (j + 1) << 4 | j.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
    bytes.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
    bytes.extend((0u8..16).map(|j| ((j + 1) % 16) << 4 | j));
    let matrix = QuantizedMatrix::from_ggml_bytes(WeightFormat::Q4_1, 1, 32, &bytes).unwrap();
    let mut row = vec![0f32; 32];
    matrix.dequantize_row(0, &mut row).unwrap();
    for j in 0..16 {
        assert_eq!(row[j], j as f32 * 0.5 - 1.0);
        assert_eq!(row[j + 16], ((j + 1) % 16) as f32 * 0.5 - 1.0);
    }
}

#[test]
fn q8_0_reads_signed_bytes() {
    let mut bytes = f16::from_f32(0.25).to_le_bytes().to_vec();
    bytes.extend((0..32).map(|j: i32| (j - 16) as i8 as u8));
    let matrix = QuantizedMatrix::from_ggml_bytes(WeightFormat::Q8_0, 1, 32, &bytes).unwrap();
    let mut row = vec![0f32; 32];
    matrix.dequantize_row(0, &mut row).unwrap();
    assert_eq!(row[0], -4.0);
    assert_eq!(row[31], 3.75);
    // A one-hot input picks one weight; 127 quantizes exactly (scale 1).
    let mut input = vec![0f32; 32];
    input[3] = 127.0;
    let mut output = [0f32];
    for kernel in Kernel::available() {
        matrix.matmul_with(kernel, &input, &mut output).unwrap();
        assert_eq!(output[0], 127.0 * row[3], "{}", kernel.name());
    }
}

#[test]
fn bad_shapes_and_bytes_are_refused_with_the_reason() {
    let error = QuantizedMatrix::from_ggml_bytes(WeightFormat::Q4_1, 2, 33, &[0; 40]).unwrap_err();
    assert!(
        matches!(error, KernelError::RaggedRow { cols: 33, .. }),
        "{error}"
    );
    let error = QuantizedMatrix::from_ggml_bytes(WeightFormat::Q8_0, 2, 32, &[0; 67]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "Q8_0 data of 2×32 needs 68 bytes, got 67"
    );
    let error =
        QuantizedMatrix::from_ggml_bytes(WeightFormat::Q4_1, usize::MAX, 64, &[]).unwrap_err();
    assert!(matches!(error, KernelError::TooLarge { .. }), "{error}");

    let matrix = QuantizedMatrix::from_ggml_bytes(WeightFormat::Q8_0, 2, 32, &[0; 68]).unwrap();
    assert!(matrix.matmul(&[0.0; 31], &mut [0.0; 2]).is_err());
    assert!(matrix.matmul(&[0.0; 64], &mut [0.0; 3]).is_err());
    assert!(matrix.dequantize_row(2, &mut [0.0; 32]).is_err());
    let other = QuantizedMatrix::from_ggml_bytes(WeightFormat::Q8_0, 1, 64, &[0; 68]).unwrap();
    assert!(QuantizedMatrix::stack(&[&matrix, &other]).is_err());
    assert!(QuantizedMatrix::stack(&[]).is_err());
}

#[test]
fn a_builder_refuses_partial_blocks_too_many_bytes_and_too_few() {
    let mut builder = MatrixBuilder::new(WeightFormat::Q8_0, 2, 32).unwrap();
    let error = builder.push(&[0; 33]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "Q8_0 data of 2×32 needs 68 bytes, got 33"
    );
    builder.push(&[0; 34]).unwrap();
    let error = builder.push(&[0; 68]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "Q8_0 data of 2×32 needs 68 bytes, got 102"
    );
    let error = builder.finish().unwrap_err();
    assert_eq!(
        error.to_string(),
        "Q8_0 data of 2×32 needs 68 bytes, got 34"
    );
    let error = MatrixBuilder::new(WeightFormat::Q4_1, 1, 48).unwrap_err();
    assert!(
        matches!(error, KernelError::RaggedRow { cols: 48, .. }),
        "{error}"
    );
}

#[test]
fn this_machine_runs_the_avx2_kernel_when_it_has_avx2() {
    #[cfg(target_arch = "x86_64")]
    assert_eq!(
        Kernel::avx2().is_some(),
        std::arch::is_x86_feature_detected!("avx2")
    );
    assert_eq!(Kernel::available()[0], Kernel::Scalar);
}
