//! Quantized weight matrices: parsed from ggml block bytes into a layout the kernels read
//! straight through (the scales of a row together, the quants of a row together), stacked for
//! fused projections, and multiplied by f32 activations.

use half::f16;
use rayon::prelude::*;

use crate::activations::QuantizedRows;
use crate::error::{KernelError, Result};
use crate::{BLOCK, Kernel, Q4_1_QUANT_BYTES, TOGETHER};

/// The ggml block formats the kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// 32 values as 4-bit quants with an f16 scale and an f16 minimum: 20 bytes per block.
    Q4_1,
    /// 32 values as signed bytes with an f16 scale: 34 bytes per block.
    Q8_0,
}

impl WeightFormat {
    /// The format's name as ggml spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }

    /// Bytes of one 32-value block in a ggml file.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 4 + Q4_1_QUANT_BYTES,
            Self::Q8_0 => 2 + BLOCK,
        }
    }

    /// Bytes of quants in one block.
    fn quant_bytes(self) -> usize {
        match self {
            Self::Q4_1 => Q4_1_QUANT_BYTES,
            Self::Q8_0 => BLOCK,
        }
    }
}

/// One weight row as the kernels read it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightRow<'a> {
    pub(crate) scales: &'a [f32],
    /// Empty for formats without a minimum.
    pub(crate) mins: &'a [f32],
    pub(crate) quants: &'a [u8],
}

/// A `rows × cols` matrix of quantized weights (a linear layer's `[out, in]` weight).
#[derive(Clone, Debug)]
pub struct QuantizedMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    /// One scale per block, as the f32 value of the file's f16.
    scales: Vec<f32>,
    /// One minimum per block (Q4_1), else empty.
    mins: Vec<f32>,
    quants: Vec<u8>,
}

impl QuantizedMatrix {
    /// Parses `rows × cols` values of `format` from ggml block bytes (little-endian, row after
    /// row), checking that the shape is whole blocks and that `bytes` holds exactly that much.
    pub fn from_ggml_bytes(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<Self> {
        let mut builder = MatrixBuilder::new(format, rows, cols)?;
        if bytes.len() != builder.expected {
            return Err(builder.length_error(bytes.len()));
        }
        builder.push(bytes)?;
        builder.finish()
    }

    /// Stacks matrices of one format and row length on top of each other (rows of the first,
    /// then of the second, …): one matmul then computes several projections of one input.
    pub fn stack(parts: &[&QuantizedMatrix]) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| KernelError::Stack("no matrices given".into()))?;
        for part in parts {
            if part.format != first.format || part.cols != first.cols {
                return Err(KernelError::Stack(format!(
                    "{} with rows of {} does not stack on {} with rows of {}",
                    part.format.name(),
                    part.cols,
                    first.format.name(),
                    first.cols
                )));
            }
        }
        Ok(Self {
            format: first.format,
            rows: parts.iter().map(|part| part.rows).sum(),
            cols: first.cols,
            scales: parts
                .iter()
                .flat_map(|p| p.scales.iter().copied())
                .collect(),
            mins: parts.iter().flat_map(|p| p.mins.iter().copied()).collect(),
            quants: parts
                .iter()
                .flat_map(|p| p.quants.iter().copied())
                .collect(),
        })
    }

    /// The weight format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        self.cols
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    fn row(&self, row: usize) -> WeightRow<'_> {
        let blocks = row * self.blocks_per_row()..(row + 1) * self.blocks_per_row();
        let quant_bytes = self.format.quant_bytes();
        WeightRow {
            scales: &self.scales[blocks.clone()],
            mins: if self.mins.is_empty() {
                &[]
            } else {
                &self.mins[blocks.clone()]
            },
            quants: &self.quants[blocks.start * quant_bytes..blocks.end * quant_bytes],
        }
    }

    /// Writes row `row` as f32 into `output` (`cols` values), as ggml dequantizes it
    /// (`q · d + m` for Q4_1, `q · d` for Q8_0): an embedding lookup.
    pub fn dequantize_row(&self, row: usize, output: &mut [f32]) -> Result<()> {
        if row >= self.rows || output.len() != self.cols {
            return Err(KernelError::Shape(format!(
                "row {row} of {} into {} values (rows have {})",
                self.rows,
                output.len(),
                self.cols
            )));
        }
        let weights = self.row(row);
        for (block, values) in output.chunks_exact_mut(BLOCK).enumerate() {
            let scale = weights.scales[block];
            match self.format {
                WeightFormat::Q4_1 => {
                    let min = weights.mins[block];
                    let quants =
                        &weights.quants[block * Q4_1_QUANT_BYTES..(block + 1) * Q4_1_QUANT_BYTES];
                    let (low, high) = values.split_at_mut(Q4_1_QUANT_BYTES);
                    for ((byte, low), high) in quants.iter().zip(low).zip(high) {
                        *low = f32::from(byte & 0x0F) * scale + min;
                        *high = f32::from(byte >> 4) * scale + min;
                    }
                }
                WeightFormat::Q8_0 => {
                    let quants = &weights.quants[block * BLOCK..(block + 1) * BLOCK];
                    for (byte, value) in quants.iter().zip(values) {
                        *value = f32::from(*byte as i8) * scale;
                    }
                }
            }
        }
        Ok(())
    }

    /// `output = input · selfᵀ` with the fastest kernel this CPU has: `input` is `m` rows of
    /// `cols` values, `output` `m` rows of `rows` values.
    pub fn matmul(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        self.matmul_with(Kernel::best(), input, output)
    }

    /// [`Self::matmul`] with a chosen kernel (every kernel gives the same bits).
    pub fn matmul_with(&self, kernel: Kernel, input: &[f32], output: &mut [f32]) -> Result<()> {
        let m = input.len() / self.cols;
        if input.len() != m * self.cols || output.len() != m * self.rows {
            return Err(KernelError::Shape(format!(
                "{} input values and {} output values do not fit a {}×{} matrix",
                input.len(),
                output.len(),
                self.rows,
                self.cols
            )));
        }
        if m == 0 {
            return Ok(());
        }
        let activations = quantize_rows(input, m, self.cols);
        let dot = |row: usize, activation: usize| {
            kernel.dot(self.format, self.row(row), activations.row(activation))
        };
        if m == 1 && self.rows * self.blocks_per_row() < PARALLEL_BLOCKS {
            for (row, value) in output.iter_mut().enumerate() {
                *value = dot(row, 0);
            }
            return Ok(());
        }
        let chunk_rows = chunk_rows(self.rows, m);
        if m == 1 {
            output
                .par_chunks_mut(chunk_rows)
                .enumerate()
                .for_each(|(chunk, values)| {
                    for (offset, value) in values.iter_mut().enumerate() {
                        *value = dot(chunk * chunk_rows + offset, 0);
                    }
                });
            return Ok(());
        }
        // Each task takes a band of weight rows against every input row (the band stays in
        // cache), writing a `[rows, m]` buffer that is then turned around into `[m, rows]`.
        let mut transposed = vec![0f32; self.rows * m];
        transposed
            .par_chunks_mut(chunk_rows * m)
            .enumerate()
            .for_each(|(chunk, values)| {
                for (offset, column) in values.chunks_exact_mut(m).enumerate() {
                    let row = chunk * chunk_rows + offset;
                    let mut groups = column.chunks_exact_mut(TOGETHER);
                    for (group, values) in groups.by_ref().enumerate() {
                        let first = group * TOGETHER;
                        let rows = std::array::from_fn(|k| activations.row(first + k));
                        values.copy_from_slice(&kernel.dot_together(
                            self.format,
                            self.row(row),
                            rows,
                        ));
                    }
                    let done = m - m % TOGETHER;
                    for (offset, value) in groups.into_remainder().iter_mut().enumerate() {
                        *value = dot(row, done + offset);
                    }
                }
            });
        for (row, column) in transposed.chunks_exact(m).enumerate() {
            for (activation, value) in column.iter().enumerate() {
                output[activation * self.rows + row] = *value;
            }
        }
        Ok(())
    }
}

/// Below this many blocks a one-row product runs on the calling thread: handing work to the
/// pool costs more than the work. Measured on the default model with the spans running on the
/// pool's own threads (where a split is a cheap fork): 2,048 decoded faster than 16,384, which
/// had kept the 576×576 attention output on one thread.
const PARALLEL_BLOCKS: usize = 2 * 1024;

/// Quantizes the input rows, in parallel when there are several.
fn quantize_rows(input: &[f32], m: usize, cols: usize) -> QuantizedRows {
    if m < 4 {
        return QuantizedRows::quantize(input, m, cols);
    }
    let parts: Vec<QuantizedRows> = input
        .par_chunks(cols)
        .map(|row| QuantizedRows::quantize(row, 1, cols))
        .collect();
    QuantizedRows::concat(parts, cols)
}

/// Weight rows per task: about four tasks per thread, at least a few rows each.
fn chunk_rows(rows: usize, m: usize) -> usize {
    let tasks = rayon::current_num_threads().max(1) * 4;
    let minimum = if m == 1 { 16 } else { 4 };
    rows.div_ceil(tasks).max(minimum)
}

/// Builds a [`QuantizedMatrix`] from its ggml block bytes a piece at a time, so a large table
/// (a model's token embedding) is parsed while it is read and never held twice.
#[derive(Debug)]
pub struct MatrixBuilder {
    matrix: QuantizedMatrix,
    /// The bytes the whole matrix takes in the file.
    expected: usize,
    /// The bytes pushed so far.
    received: usize,
}

impl MatrixBuilder {
    /// A builder for `rows × cols` values of `format`, checking that the shape is whole blocks
    /// and that its byte size fits in memory.
    pub fn new(format: WeightFormat, rows: usize, cols: usize) -> Result<Self> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(KernelError::RaggedRow {
                format: format.name(),
                cols,
                block: BLOCK,
            });
        }
        let blocks = rows
            .checked_mul(cols / BLOCK)
            .ok_or(KernelError::TooLarge { rows, cols })?;
        let expected = blocks
            .checked_mul(format.block_bytes())
            .ok_or(KernelError::TooLarge { rows, cols })?;
        let mins = if format == WeightFormat::Q4_1 {
            blocks
        } else {
            0
        };
        let matrix = QuantizedMatrix {
            format,
            rows,
            cols,
            scales: Vec::with_capacity(blocks),
            mins: Vec::with_capacity(mins),
            quants: Vec::with_capacity(blocks * format.quant_bytes()),
        };
        Ok(Self {
            matrix,
            expected,
            received: 0,
        })
    }

    /// The bytes the whole matrix takes in the file.
    pub fn expected_bytes(&self) -> usize {
        self.expected
    }

    fn length_error(&self, actual: usize) -> KernelError {
        KernelError::ByteLength {
            format: self.matrix.format.name(),
            rows: self.matrix.rows,
            cols: self.matrix.cols,
            expected: self.expected,
            actual,
        }
    }

    /// Parses the next whole blocks of the file's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Result<()> {
        let format = self.matrix.format;
        let total = self.received.saturating_add(bytes.len());
        if total > self.expected || !bytes.len().is_multiple_of(format.block_bytes()) {
            return Err(self.length_error(total));
        }
        let half =
            |block: &[u8], at: usize| f16::from_le_bytes([block[at], block[at + 1]]).to_f32();
        for block in bytes.chunks_exact(format.block_bytes()) {
            self.matrix.scales.push(half(block, 0));
            let quants = match format {
                WeightFormat::Q4_1 => {
                    self.matrix.mins.push(half(block, 2));
                    &block[4..]
                }
                WeightFormat::Q8_0 => &block[2..],
            };
            self.matrix.quants.extend_from_slice(quants);
        }
        self.received = total;
        Ok(())
    }

    /// The matrix, once every byte of it was pushed.
    pub fn finish(self) -> Result<QuantizedMatrix> {
        if self.received != self.expected {
            return Err(self.length_error(self.received));
        }
        Ok(self.matrix)
    }
}
