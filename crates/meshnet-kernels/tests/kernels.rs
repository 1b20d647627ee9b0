#![allow(clippy::unwrap_used)]
//! Every kernel gives the scalar reference's bits on random blocks, the reference computes the
//! product it claims to (against a float evaluation of the same quantized operands), and bad
//! shapes and bytes are refused.

use half::f16;
use meshnet_kernels::{BLOCK, Kernel, KernelError, MatrixBuilder, QuantizedMatrix, WeightFormat};
use proptest::prelude::*;

/// ggml block bytes for `rows × cols` with scales and minimums drawn from `scales`.
fn block_bytes(format: WeightFormat, blocks: usize, seed: &[u8], scales: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
    for block in 0..blocks {
        let scale = scales[block % scales.len()];
        bytes.extend_from_slice(&f16::from_f32(scale).to_le_bytes());
        if format == WeightFormat::Q4_1 {
            let min = -scales[(block + 1) % scales.len()] * 7.0;
            bytes.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        }
        let quant_bytes = format.block_bytes() - if format == WeightFormat::Q4_1 { 4 } else { 2 };
        for i in 0..quant_bytes {
            bytes.push(seed[(block * 31 + i * 7) % seed.len()].wrapping_add(i as u8));
        }
    }
    bytes
}

fn format_strategy() -> impl Strategy<Value = WeightFormat> {
    prop_oneof![Just(WeightFormat::Q4_1), Just(WeightFormat::Q8_0)]
}

/// The float evaluation of the same quantized operands the kernels see: weights dequantized
/// as ggml does, activations quantized to blocks and back, summed in f64.
fn float_reference(matrix: &QuantizedMatrix, input: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let cols = matrix.cols();
    let mut values = Vec::new();
    let mut bounds = Vec::new();
    let mut weights = vec![0f32; cols];
    for activations in input.chunks_exact(cols) {
        for row in 0..matrix.rows() {
            matrix.dequantize_row(row, &mut weights).unwrap();
            let mut sum = 0f64;
            let mut magnitude = 0f64;
            for (w, a) in weights
                .chunks_exact(BLOCK)
                .zip(activations.chunks_exact(BLOCK))
            {
                let largest = a.iter().fold(0f32, |m, x| m.max(x.abs()));
                let scale = largest / 127.0;
                let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                let rounded_scale = f64::from(f16::from_f32(scale).to_f32());
                for (w, a) in w.iter().zip(a) {
                    let quant = f64::from((a * inverse).round() as i8);
                    sum += f64::from(*w) * quant * rounded_scale;
                    magnitude += (f64::from(*w) * quant * rounded_scale).abs();
                }
            }
            values.push(sum);
            bounds.push(magnitude);
        }
    }
    (values, bounds)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_kernel_gives_the_reference_bits(
        format in format_strategy(),
        rows in 1usize..40,
        blocks_per_row in 1usize..30,
        m in 1usize..11,
        seed in proptest::collection::vec(any::<u8>(), 1..64),
        scales in proptest::collection::vec(1e-4f32..2.0, 1..8),
        input_scale in prop_oneof![Just(1.0f32), Just(300.0), Just(1e-3)],
        input_seed in any::<u64>(),
    ) {
        let cols = blocks_per_row * BLOCK;
        let bytes = block_bytes(format, rows * blocks_per_row, &seed, &scales);
        let matrix = QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).unwrap();
        let mut state = input_seed | 1;
        let input: Vec<f32> = (0..m * cols)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state % 20001) as f32 / 10000.0 - 1.0) * input_scale
            })
            .collect();
        let mut reference = vec![0f32; m * rows];
        matrix.matmul_with(Kernel::Scalar, &input, &mut reference).unwrap();
        for kernel in Kernel::available() {
            let mut output = vec![f32::NAN; m * rows];
            matrix.matmul_with(kernel, &input, &mut output).unwrap();
            let same = output.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
            prop_assert!(same, "{} differs from scalar", kernel.name());
            // One row at a time gives the same bits as all rows together.
            for (row, expected) in input.chunks_exact(cols).zip(reference.chunks_exact(rows)) {
                let mut alone = vec![0f32; rows];
                matrix.matmul_with(kernel, row, &mut alone).unwrap();
                prop_assert!(alone.iter().zip(expected).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
        // And the reference computes the product of the quantized operands: the only
        // differences are f32 rounding and, for Q4_1, the f16 rounding of each block's sum.
        let (exact, magnitudes) = float_reference(&matrix, &input);
        for ((ours, exact), magnitude) in reference.iter().zip(&exact).zip(&magnitudes) {
            let bound = magnitude * 4e-3 + 1e-6;
            prop_assert!(
                (f64::from(*ours) - exact).abs() <= bound,
                "{ours} vs {exact} (bound {bound})"
            );
        }
    }

    #[test]
    fn a_matrix_built_piece_by_piece_equals_one_parsed_whole(
        format in format_strategy(),
        rows in 1usize..20,
        blocks_per_row in 1usize..6,
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        seed in proptest::collection::vec(any::<u8>(), 1..64),
    ) {
        let cols = blocks_per_row * BLOCK;
        let blocks = rows * blocks_per_row;
        let bytes = block_bytes(format, blocks, &seed, &[0.03, 0.7, 1e-3]);
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
            prop_assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "row {}", row);
        }
    }

    #[test]
    fn stacked_matrices_give_their_parts_outputs_side_by_side(
        format in format_strategy(),
        first_rows in 1usize..20,
        second_rows in 1usize..20,
        seed in proptest::collection::vec(any::<u8>(), 1..64),
    ) {
        let cols = 3 * BLOCK;
        let scales = [0.01f32, 0.02, 0.5];
        let first = QuantizedMatrix::from_ggml_bytes(
            format, first_rows, cols, &block_bytes(format, first_rows * 3, &seed, &scales),
        ).unwrap();
        let second = QuantizedMatrix::from_ggml_bytes(
            format, second_rows, cols, &block_bytes(format, second_rows * 3, &seed[1..].iter().copied().chain([7]).collect::<Vec<_>>(), &scales),
        ).unwrap();
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
            prop_assert_eq!(&row[..first_rows], &a[m * first_rows..(m + 1) * first_rows]);
            prop_assert_eq!(&row[first_rows..], &b[m * second_rows..(m + 1) * second_rows]);
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
