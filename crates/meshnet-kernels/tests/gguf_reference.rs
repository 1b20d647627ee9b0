#![allow(clippy::unwrap_used)]
//! Dequantization agrees with an independent implementation: the `gguf` Python package's
//! `gguf.quants.dequantize`, run on random blocks of every format by
//! `tests/fixtures/make_fixtures.py` (which documents how to rerun it and the file layout).
//!
//! Every value must have the reference's bits; a NaN must be a NaN (its payload may differ:
//! numpy widens an f16 signalling NaN without setting its quiet bit, hardware conversions set
//! it). The numpy code rounds in ggml's order (a k-quant's `d · scale` and `dmin · min` in f32
//! first, then `· q` and the subtraction), so there is no rounding difference to allow for.

use std::path::PathBuf;

use meshnet_kernels::{KernelError, QuantizedMatrix, WeightFormat};

/// The first bytes of every fixture file.
const MAGIC: &[u8; 8] = b"GGMLREF1";

/// One fixture: a matrix's ggml bytes and the values the reference dequantizes them to.
struct Fixture {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    values: Vec<f32>,
}

/// Reads a little-endian u32 at `at`.
fn u32_at(bytes: &[u8], at: usize) -> usize {
    let word: [u8; 4] = bytes[at..at + 4].try_into().unwrap();
    u32::from_le_bytes(word) as usize
}

/// Reads and checks `tests/fixtures/<FORMAT>.bin`.
fn load(format: WeightFormat) -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{}.bin", format.name()));
    let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    assert_eq!(&bytes[..8], MAGIC, "{}", path.display());
    let name = std::str::from_utf8(&bytes[8..16]).unwrap();
    assert_eq!(name.trim_end_matches('\0'), format.name());
    let (rows, cols, length) = (u32_at(&bytes, 16), u32_at(&bytes, 20), u32_at(&bytes, 24));
    let data = bytes[28..28 + length].to_vec();
    let values: Vec<f32> = bytes[28 + length..]
        .chunks_exact(4)
        .map(|word| f32::from_le_bytes(word.try_into().unwrap()))
        .collect();
    assert_eq!(values.len(), rows * cols, "{}", path.display());
    Fixture {
        rows,
        cols,
        data,
        values,
    }
}

/// Whether `ours` is the reference value: the same bits, or both NaN.
fn same(ours: f32, reference: f32) -> bool {
    ours.to_bits() == reference.to_bits() || (ours.is_nan() && reference.is_nan())
}

/// Dequantizes the fixture of `format` row by row and lists every value that differs from the
/// reference, with the block it came from.
fn mismatches(format: WeightFormat) -> Vec<String> {
    let fixture = load(format);
    let matrix =
        QuantizedMatrix::from_ggml_bytes(format, fixture.rows, fixture.cols, &fixture.data)
            .unwrap();
    let block_values = format.block_values();
    let row_bytes = fixture.cols / block_values * format.block_bytes();
    let mut found = Vec::new();
    let mut row_values = vec![0f32; fixture.cols];
    for (row, expected) in fixture.values.chunks_exact(fixture.cols).enumerate() {
        matrix.dequantize_row(row, &mut row_values).unwrap();
        for (col, (ours, reference)) in row_values.iter().zip(expected).enumerate() {
            if same(*ours, *reference) {
                continue;
            }
            let block = col / block_values;
            let start = row * row_bytes + block * format.block_bytes();
            let bytes = &fixture.data[start..start + format.block_bytes()];
            found.push(format!(
                "row {row} value {col} (block {block}, value {} in it): {ours:e} ({:#010x}) \
                 vs gguf {reference:e} ({:#010x}); block bytes {}",
                col % block_values,
                ours.to_bits(),
                reference.to_bits(),
                hex(bytes)
            ));
        }
    }
    found
}

/// `bytes` as lowercase hex.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Asserts that `format`'s fixture dequantizes to the reference's values.
fn assert_matches_gguf(format: WeightFormat) {
    let found = mismatches(format);
    assert!(
        found.is_empty(),
        "{}: {} values differ from gguf.quants.dequantize, first ones:\n{}",
        format.name(),
        found.len(),
        found[..found.len().min(8)].join("\n")
    );
}

/// One test per format, so a run names every format that passes and every one that fails.
macro_rules! gguf_reference_tests {
    ($($test:ident => $format:ident),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                assert_matches_gguf(WeightFormat::$format);
            }
        )*

        #[test]
        fn every_format_has_a_test_and_a_fixture() {
            let tested = [$(WeightFormat::$format),*];
            for format in WeightFormat::ALL {
                assert!(tested.contains(&format), "{} has no test", format.name());
                load(format);
            }
        }
    };
}

gguf_reference_tests! {
    q4_0_matches_gguf => Q4_0,
    q4_1_matches_gguf => Q4_1,
    q5_0_matches_gguf => Q5_0,
    q5_1_matches_gguf => Q5_1,
    q8_0_matches_gguf => Q8_0,
    q2_k_matches_gguf => Q2_K,
    q3_k_matches_gguf => Q3_K,
    q4_k_matches_gguf => Q4_K,
    q5_k_matches_gguf => Q5_K,
    q6_k_matches_gguf => Q6_K,
    f16_matches_gguf => F16,
    bf16_matches_gguf => BF16,
    f32_matches_gguf => F32,
}

#[test]
fn a_fixture_one_byte_short_is_refused() {
    for format in WeightFormat::ALL {
        let fixture = load(format);
        let short = &fixture.data[..fixture.data.len() - 1];
        let error = QuantizedMatrix::from_ggml_bytes(format, fixture.rows, fixture.cols, short)
            .unwrap_err();
        assert!(
            matches!(error, KernelError::ByteLength { .. }),
            "{}: {error}",
            format.name()
        );
    }
}
