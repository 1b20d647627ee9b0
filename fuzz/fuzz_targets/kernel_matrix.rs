//! Fuzzes the quantized weight parser and the kernels on arbitrary block bytes.
//!
//! Input: byte 0 picks the format (`WeightFormat::ALL[byte % 13]`: every ggml format the kernels
//! run), byte 1 the rows (1..=16), byte 2 the row length: 1..=24 blocks of the format's block
//! (32 values, 256 for the k-quants), or 1..=256 values for F16, BF16 and F32 (one value a
//! block, so every remainder of the SIMD widths is reached); byte 3 the number of input rows
//! (1..=3); the rest are the matrix's bytes (any length: a wrong one must be refused, never a
//! panic). A parsed matrix is then multiplied with inputs made from the same bytes by every
//! kernel this CPU has, and every kernel must give the scalar reference's bits (infinities
//! included; a NaN must be a NaN, its payload may differ, as the compiler may swap the operands
//! of a multiply).

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshnet_kernels::{Kernel, QuantizedMatrix, WeightFormat};

fuzz_target!(|data: &[u8]| {
    let [format, rows, blocks, inputs, bytes @ ..] = data else {
        return;
    };
    let format = WeightFormat::ALL[usize::from(*format) % WeightFormat::ALL.len()];
    let rows = usize::from(rows % 16) + 1;
    let cols = match format.block_values() {
        1 => usize::from(*blocks) + 1,
        block => (usize::from(blocks % 24) + 1) * block,
    };
    let inputs = usize::from(inputs % 3) + 1;
    let Ok(matrix) = QuantizedMatrix::from_ggml_bytes(format, rows, cols, bytes) else {
        return;
    };
    let input: Vec<f32> = (0..inputs * cols)
        .map(|i| {
            let byte = bytes[i % bytes.len()];
            f32::from(byte as i8) * 0.37 * f32::from(1 + (i % 5) as u8)
        })
        .collect();
    let mut reference = vec![0f32; inputs * rows];
    matrix
        .matmul_with(Kernel::Scalar, &input, &mut reference)
        .expect("shapes fit");
    for kernel in Kernel::available() {
        let mut output = vec![0f32; inputs * rows];
        matrix
            .matmul_with(kernel, &input, &mut output)
            .expect("shapes fit");
        for (ours, expected) in output.iter().zip(&reference) {
            let same = ours.to_bits() == expected.to_bits() || (ours.is_nan() && expected.is_nan());
            assert!(same, "{}: {ours} vs {expected}", kernel.name());
        }
    }
    let mut row = vec![0f32; cols];
    matrix
        .dequantize_row(rows - 1, &mut row)
        .expect("row in range");
});
