//! Quantized weight matrices: parsed from ggml block bytes into a layout the kernels read
//! straight through (the scales of a row together, the quants of a row together), stacked for
//! fused projections, and multiplied by f32 activations.

use rayon::prelude::*;

use crate::activations::ActivationRow;
use crate::activations::{QUAD, QuantizedRows};
use crate::error::{KernelError, Result};
use crate::formats::{BlockFormat, FloatFormat, SUPER_BLOCK, SuperFormat, half_at};
use crate::super_rows::SuperRows;
use crate::{BLOCK, Kernel, Q4_1_QUANT_BYTES, TILE_ROWS, TOGETHER, WIDE_GROUPS};

/// The ggml formats the kernels run: every type `llama-quantize`'s presets Q2_K … Q8_0 write,
/// and the unquantized ones.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// 32 values as 4-bit quants minus 8 with an f16 scale: 18 bytes per block.
    Q4_0,
    /// 32 values as 4-bit quants with an f16 scale and an f16 minimum: 20 bytes per block.
    Q4_1,
    /// 32 values as 5-bit quants minus 16 with an f16 scale: 22 bytes per block.
    Q5_0,
    /// 32 values as 5-bit quants with an f16 scale and an f16 minimum: 24 bytes per block.
    Q5_1,
    /// 32 values as signed bytes with an f16 scale: 34 bytes per block.
    Q8_0,
    /// 256 values as 2-bit quants with 4-bit scales and minimums: 84 bytes per block.
    Q2_K,
    /// 256 values as 3-bit quants with 6-bit scales: 110 bytes per block.
    Q3_K,
    /// 256 values as 4-bit quants with 6-bit scales and minimums: 144 bytes per block.
    Q4_K,
    /// 256 values as 5-bit quants with 6-bit scales and minimums: 176 bytes per block.
    Q5_K,
    /// 256 values as 6-bit quants with 8-bit scales: 210 bytes per block.
    Q6_K,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
}

/// How the kernels hold and multiply a format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    /// Q4_1 and Q8_0: parsed into scales, minimums and quants (`scalar.rs`).
    Parsed,
    /// A 32-value format read from its block bytes.
    Blocks(BlockFormat),
    /// A k-quant read from its super-block bytes.
    Super(SuperFormat),
    /// An unquantized format read from its bytes.
    Float(FloatFormat),
}

impl WeightFormat {
    /// Every format, in ggml's type order.
    pub const ALL: [Self; 13] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::BF16,
    ];

    /// The format's name as ggml spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::F32 => "F32",
        }
    }

    /// The format named `name` as ggml spells it (`Q4_K`, `BF16`).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|format| format.name() == name)
    }

    /// Whether the wide tiles take this format's values as signed bytes (against activations
    /// lifted by 128): Q8_0, and Q4_0 and Q5_0 with their offsets taken off.
    pub(crate) fn enters_signed(self) -> bool {
        matches!(self, Self::Q8_0 | Self::Q4_0 | Self::Q5_0)
    }

    pub(crate) fn family(self) -> Family {
        match self {
            Self::Q4_1 | Self::Q8_0 => Family::Parsed,
            Self::Q4_0 => Family::Blocks(BlockFormat::Q4_0),
            Self::Q5_0 => Family::Blocks(BlockFormat::Q5_0),
            Self::Q5_1 => Family::Blocks(BlockFormat::Q5_1),
            Self::Q2_K => Family::Super(SuperFormat::Q2K),
            Self::Q3_K => Family::Super(SuperFormat::Q3K),
            Self::Q4_K => Family::Super(SuperFormat::Q4K),
            Self::Q5_K => Family::Super(SuperFormat::Q5K),
            Self::Q6_K => Family::Super(SuperFormat::Q6K),
            Self::F16 => Family::Float(FloatFormat::F16),
            Self::BF16 => Family::Float(FloatFormat::Bf16),
            Self::F32 => Family::Float(FloatFormat::F32),
        }
    }

    /// Values per block: 32, 256 for the k-quants, 1 for the unquantized formats. A row is a
    /// whole number of blocks.
    pub fn block_values(self) -> usize {
        match self.family() {
            Family::Parsed | Family::Blocks(_) => BLOCK,
            Family::Super(_) => SUPER_BLOCK,
            Family::Float(_) => 1,
        }
    }

    /// Bytes of one block in a ggml file.
    pub fn block_bytes(self) -> usize {
        match (self, self.family()) {
            (Self::Q4_1, _) => 4 + Q4_1_QUANT_BYTES,
            (_, Family::Parsed) => 2 + BLOCK,
            (_, Family::Blocks(format)) => format.block_bytes(),
            (_, Family::Super(format)) => format.block_bytes(),
            (_, Family::Float(format)) => format.value_bytes(),
        }
    }

    /// Bytes of quants in one parsed block (Q4_1, Q8_0).
    fn quant_bytes(self) -> usize {
        match self {
            Self::Q4_1 => Q4_1_QUANT_BYTES,
            _ => BLOCK,
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
    /// The file's bytes, row after row, for every format but Q4_1 and Q8_0 (else empty).
    blocks: Vec<u8>,
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
            blocks: parts
                .iter()
                .flat_map(|p| p.blocks.iter().copied())
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
        self.cols / self.format.block_values()
    }

    /// Bytes the weights take in memory (scales widened to f32 for Q4_1 and Q8_0).
    pub fn memory_bytes(&self) -> usize {
        (self.scales.len() + self.mins.len()) * std::mem::size_of::<f32>()
            + self.quants.len()
            + self.blocks.len()
    }

    /// Row `row`'s bytes, for the formats held as file bytes.
    fn row_bytes(&self, row: usize) -> &[u8] {
        let bytes = self.blocks_per_row() * self.format.block_bytes();
        &self.blocks[row * bytes..(row + 1) * bytes]
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
        match self.format.family() {
            Family::Parsed => self.dequantize_parsed(row, output),
            Family::Blocks(format) => {
                let bytes = self.row_bytes(row).chunks_exact(format.block_bytes());
                for (block, values) in bytes.zip(output.chunks_exact_mut(BLOCK)) {
                    format.dequantize(block, values);
                }
            }
            Family::Super(format) => {
                let bytes = self.row_bytes(row).chunks_exact(format.block_bytes());
                for (block, values) in bytes.zip(output.chunks_exact_mut(SUPER_BLOCK)) {
                    format.dequantize(block, values);
                }
            }
            Family::Float(format) => format.dequantize(self.row_bytes(row), output),
        }
        Ok(())
    }

    /// [`Self::dequantize_row`] for Q4_1 and Q8_0.
    fn dequantize_parsed(&self, row: usize, output: &mut [f32]) {
        let weights = self.row(row);
        for (block, values) in output.chunks_exact_mut(BLOCK).enumerate() {
            let scale = weights.scales[block];
            if self.format == WeightFormat::Q4_1 {
                let min = weights.mins[block];
                let quants =
                    &weights.quants[block * Q4_1_QUANT_BYTES..(block + 1) * Q4_1_QUANT_BYTES];
                let (low, high) = values.split_at_mut(Q4_1_QUANT_BYTES);
                for ((byte, low), high) in quants.iter().zip(low).zip(high) {
                    *low = f32::from(byte & 0x0F) * scale + min;
                    *high = f32::from(byte >> 4) * scale + min;
                }
            } else {
                let quants = &weights.quants[block * BLOCK..(block + 1) * BLOCK];
                for (byte, value) in quants.iter().zip(values) {
                    *value = f32::from(*byte as i8) * scale;
                }
            }
        }
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
        let activations = Activations::quantize(kernel, self.format, input, m, self.cols);
        let dot = |row: usize, activation: usize| self.dot(kernel, &activations, row, activation);
        if m == 1 && self.rows * self.cols < PARALLEL_BLOCKS * BLOCK {
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
        // cache), writing the band's outputs input row by input row (`[m, band]`); each input
        // row's outputs are then copied into place.
        let groups = activations.groups(m);
        let mut bands = vec![0f32; self.rows * m];
        bands
            .par_chunks_mut(chunk_rows * m)
            .enumerate()
            .for_each(|(chunk, values)| {
                self.dot_band(
                    kernel,
                    (&activations, &groups),
                    chunk * chunk_rows,
                    values,
                    m,
                );
            });
        for (chunk, values) in bands.chunks(chunk_rows * m).enumerate() {
            let band = values.len() / m;
            for (activation, outputs) in values.chunks_exact(band).enumerate() {
                let start = activation * self.rows + chunk * chunk_rows;
                output[start..start + band].copy_from_slice(outputs);
            }
        }
        Ok(())
    }
}

impl QuantizedMatrix {
    /// Weight row `row` against activation row `activation`.
    fn dot(
        &self,
        kernel: Kernel,
        activations: &Activations<'_>,
        row: usize,
        activation: usize,
    ) -> f32 {
        match (self.format.family(), activations) {
            (Family::Parsed, Activations::Blocks(rows)) => {
                kernel.dot(self.format, self.row(row), rows.row(activation))
            }
            (Family::Blocks(format), Activations::Blocks(rows)) => {
                kernel.dot_blocks(format, self.row_bytes(row), rows.row(activation))
            }
            (Family::Super(format), Activations::Super(rows)) => {
                kernel.dot_super(format, self.row_bytes(row), rows.row(activation))
            }
            (Family::Float(format), Activations::Floats(values)) => {
                let values = &values[activation * self.cols..(activation + 1) * self.cols];
                kernel.dot_floats(format, self.row_bytes(row), values)
            }
            _ => unreachable!("activations are quantized for the matrix's own family"),
        }
    }

    /// Weight rows `first..first + band` against every activation row (`activations`, with
    /// their whole groups of [`TOGETHER`] in `groups`), into `values` (`[m, band]`,
    /// `band = values.len() / m`): [`TILE_ROWS`] weight rows at a time, the rows after the last
    /// whole tile one at a time.
    fn dot_band(
        &self,
        kernel: Kernel,
        (activations, groups): (&Activations<'_>, &[[ActivationRow<'_>; TOGETHER]]),
        first: usize,
        values: &mut [f32],
        m: usize,
    ) {
        let band = values.len() / m;
        let whole = band - band % TILE_ROWS;
        for local in (0..whole).step_by(TILE_ROWS) {
            self.dot_tile_columns(
                kernel,
                activations,
                groups,
                first + local,
                Band {
                    values: &mut *values,
                    band,
                    local,
                },
            );
        }
        for local in whole..band {
            self.dot_column(
                kernel,
                activations,
                first + local,
                Band {
                    values: &mut *values,
                    band,
                    local,
                },
            );
        }
    }

    /// Weight rows `first..first + TILE_ROWS` against every activation row, into `outputs`
    /// ([`TOGETHER`] activation rows at a time, the rest one at a time).
    fn dot_tile_columns(
        &self,
        kernel: Kernel,
        activations: &Activations<'_>,
        groups: &[[ActivationRow<'_>; TOGETHER]],
        first: usize,
        mut outputs: Band<'_>,
    ) {
        let m = outputs.values.len() / outputs.band;
        match (self.format.family(), activations) {
            (Family::Parsed, Activations::Blocks(_)) => {
                let weights = std::array::from_fn(|r| self.row(first + r));
                outputs.put_wide_tiles(groups, |columns, tiles| {
                    kernel.dot_tile(self.format, weights, columns, tiles);
                });
            }
            (Family::Blocks(format), Activations::Blocks(_)) => {
                let weights = std::array::from_fn(|r| self.row_bytes(first + r));
                outputs.put_wide_tiles(groups, |columns, tiles| {
                    kernel.dot_blocks_tile(format, weights, columns, tiles);
                });
            }
            _ => {
                for group in (0..m - m % TOGETHER).step_by(TOGETHER) {
                    let tile = std::array::from_fn(|r| {
                        self.dot_together(kernel, activations, first + r, group)
                    });
                    outputs.put_tile(group, tile);
                }
            }
        }
        for activation in m - m % TOGETHER..m {
            for row in 0..TILE_ROWS {
                let value = self.dot(kernel, activations, first + row, activation);
                outputs.put(activation, row, value);
            }
        }
    }

    /// Weight row `row` against every activation row, into `outputs`, [`TOGETHER`] at a time
    /// where the kernel has a way to.
    fn dot_column(
        &self,
        kernel: Kernel,
        activations: &Activations<'_>,
        row: usize,
        mut outputs: Band<'_>,
    ) {
        let m = outputs.values.len() / outputs.band;
        let whole = m - m % TOGETHER;
        for group in (0..whole).step_by(TOGETHER) {
            let values = self.dot_together(kernel, activations, row, group);
            for (offset, value) in values.into_iter().enumerate() {
                outputs.put(group + offset, 0, value);
            }
        }
        for activation in whole..m {
            outputs.put(
                activation,
                0,
                self.dot(kernel, activations, row, activation),
            );
        }
    }

    /// Weight row `row` against activation rows `first..first + TOGETHER`: the bits of as
    /// many [`Self::dot`] calls.
    fn dot_together(
        &self,
        kernel: Kernel,
        activations: &Activations<'_>,
        row: usize,
        first: usize,
    ) -> [f32; TOGETHER] {
        match (self.format.family(), activations) {
            (Family::Parsed, Activations::Blocks(rows)) => kernel.dot_together(
                self.format,
                self.row(row),
                std::array::from_fn(|k| rows.row(first + k)),
            ),
            (Family::Blocks(format), Activations::Blocks(rows)) => kernel.dot_blocks_together(
                format,
                self.row_bytes(row),
                std::array::from_fn(|k| rows.row(first + k)),
            ),
            (Family::Super(format), Activations::Super(rows)) => kernel.dot_super_together(
                format,
                self.row_bytes(row),
                std::array::from_fn(|k| rows.row(first + k)),
            ),
            _ => std::array::from_fn(|k| self.dot(kernel, activations, row, first + k)),
        }
    }
}

/// A band's outputs (`[m, band]`: input row after input row, `band` outputs each) seen from
/// weight row `local` of the band on.
struct Band<'a> {
    values: &'a mut [f32],
    band: usize,
    local: usize,
}

impl Band<'_> {
    /// Sets the output of input row `activation` against the band's weight row `local + row`.
    fn put(&mut self, activation: usize, row: usize, value: f32) {
        self.values[activation * self.band + self.local + row] = value;
    }

    /// Sets the tiles of every whole group of [`TOGETHER`] input rows (`groups`, in order),
    /// [`WIDE_GROUPS`] groups at a time: `tiles(groups, results)` computes one tile per group.
    fn put_wide_tiles(
        &mut self,
        groups: &[[ActivationRow<'_>; TOGETHER]],
        tiles: impl Fn(&[[ActivationRow<'_>; TOGETHER]], &mut [[[f32; TOGETHER]; TILE_ROWS]]),
    ) {
        for (wide, groups) in groups.chunks(WIDE_GROUPS).enumerate() {
            let mut results = [[[0f32; TOGETHER]; TILE_ROWS]; WIDE_GROUPS];
            tiles(groups, &mut results[..groups.len()]);
            for (g, tile) in results[..groups.len()].iter().enumerate() {
                self.put_tile((wide * WIDE_GROUPS + g) * TOGETHER, *tile);
            }
        }
    }

    /// Sets a tile's outputs: weight rows `local..local + TILE_ROWS` against input rows
    /// `group..group + TOGETHER`.
    fn put_tile(&mut self, group: usize, tile: [[f32; TOGETHER]; TILE_ROWS]) {
        let columns: [[f32; TILE_ROWS]; TOGETHER] =
            std::array::from_fn(|k| std::array::from_fn(|r| tile[r][k]));
        for (k, outputs) in columns.iter().enumerate() {
            let start = (group + k) * self.band + self.local;
            self.values[start..start + TILE_ROWS].copy_from_slice(outputs);
        }
    }
}

/// A matmul's input rows, in the form the matrix's format reads.
enum Activations<'a> {
    /// 32-value blocks with scales and sums (Q4_0 … Q8_0).
    Blocks(QuantizedRows),
    /// 256-value super-blocks (the k-quants).
    Super(SuperRows),
    /// The f32 values themselves (the unquantized formats).
    Floats(&'a [f32]),
}

impl<'a> Activations<'a> {
    /// Every whole group of [`TOGETHER`] consecutive input rows, for the tiles (none for the
    /// formats without).
    fn groups(&self, m: usize) -> Vec<[ActivationRow<'_>; TOGETHER]> {
        match self {
            Self::Blocks(rows) => (0..m / TOGETHER)
                .map(|g| std::array::from_fn(|k| rows.row(g * TOGETHER + k)))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `input` (`m` rows of `cols`) quantized for `format` by `kernel`, and interleaved when
    /// the kernel's tiles read them so.
    fn quantize(
        kernel: Kernel,
        format: WeightFormat,
        input: &'a [f32],
        m: usize,
        cols: usize,
    ) -> Self {
        match format.family() {
            Family::Parsed | Family::Blocks(_) => {
                let mut rows = quantize_rows(kernel, input, m, cols);
                if kernel.interleaves() && m >= QUAD {
                    rows.interleave(format.enters_signed());
                }
                Self::Blocks(rows)
            }
            Family::Super(_) => Self::Super(SuperRows::quantize_with(kernel, input, m, cols)),
            Family::Float(_) => Self::Floats(input),
        }
    }
}

/// Below this many blocks a one-row product runs on the calling thread: handing work to the
/// pool costs more than the work. Measured on the default model with the spans running on the
/// pool's own threads (where a split is a cheap fork): 2,048 decoded faster than 16,384, which
/// had kept the 576×576 attention output on one thread.
const PARALLEL_BLOCKS: usize = 2 * 1024;

/// Quantizes the input rows with `kernel`, in parallel when there are several.
fn quantize_rows(kernel: Kernel, input: &[f32], m: usize, cols: usize) -> QuantizedRows {
    if m < 4 {
        return QuantizedRows::quantize_with(kernel, input, m, cols);
    }
    let parts: Vec<QuantizedRows> = input
        .par_chunks(cols)
        .map(|row| QuantizedRows::quantize_with(kernel, row, 1, cols))
        .collect();
    QuantizedRows::concat(parts, cols)
}

/// Weight rows per task: about four tasks per thread, at least a few rows each, and whole
/// tiles ([`TILE_ROWS`]) when there are several input rows.
fn chunk_rows(rows: usize, m: usize) -> usize {
    let tasks = rayon::current_num_threads().max(1) * 4;
    if m == 1 {
        return rows.div_ceil(tasks).max(16);
    }
    rows.div_ceil(tasks).next_multiple_of(TILE_ROWS)
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
        let block = format.block_values();
        if cols == 0 || !cols.is_multiple_of(block) {
            return Err(KernelError::RaggedRow {
                format: format.name(),
                cols,
                block,
            });
        }
        let blocks = rows
            .checked_mul(cols / block)
            .ok_or(KernelError::TooLarge { rows, cols })?;
        let expected = blocks
            .checked_mul(format.block_bytes())
            .ok_or(KernelError::TooLarge { rows, cols })?;
        let parsed = format.family() == Family::Parsed;
        let parsed_blocks = if parsed { blocks } else { 0 };
        let mins = if format == WeightFormat::Q4_1 {
            blocks
        } else {
            0
        };
        let matrix = QuantizedMatrix {
            format,
            rows,
            cols,
            scales: Vec::with_capacity(parsed_blocks),
            mins: Vec::with_capacity(mins),
            quants: Vec::with_capacity(parsed_blocks * format.quant_bytes()),
            blocks: Vec::with_capacity(if parsed { 0 } else { expected }),
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
        if format.family() != Family::Parsed {
            self.matrix.blocks.extend_from_slice(bytes);
            self.received = total;
            return Ok(());
        }
        for block in bytes.chunks_exact(format.block_bytes()) {
            self.matrix.scales.push(half_at(block, 0));
            let quants = if format == WeightFormat::Q4_1 {
                self.matrix.mins.push(half_at(block, 2));
                &block[4..]
            } else {
                &block[2..]
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

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;

    /// Random bytes for `rows × cols` values of `format` whose f16 scales and minimums are
    /// small finite numbers (at the places ggml-common.h puts them).
    fn random_matrix(format: WeightFormat, rows: usize, cols: usize, seed: u64) -> QuantizedMatrix {
        let halves: &[usize] = match format {
            WeightFormat::Q4_0 | WeightFormat::Q5_0 | WeightFormat::Q8_0 => &[0],
            WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => {
                &[0, 2]
            }
            WeightFormat::Q2_K => &[80, 82],
            WeightFormat::Q3_K => &[108],
            WeightFormat::Q6_K => &[208],
            _ => &[],
        };
        let mut state = seed;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        };
        let blocks = rows * cols / format.block_values();
        let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
        for _ in 0..blocks {
            let start = bytes.len();
            bytes.extend((0..format.block_bytes()).map(|_| next() as u8));
            for at in halves {
                let value = f16::from_f32((next() % 1000) as f32 * 1e-4 - 0.05);
                bytes[start + at..start + at + 2].copy_from_slice(&value.to_le_bytes());
            }
        }
        QuantizedMatrix::from_ggml_bytes(format, rows, cols, &bytes).expect("whole blocks")
    }

    /// The fastest of `runs` products of `matrix` with `m` input rows on `pool`, in seconds,
    /// with the fastest kernel.
    fn fastest_matmul(
        pool: &rayon::ThreadPool,
        matrix: &QuantizedMatrix,
        m: usize,
        runs: usize,
    ) -> f64 {
        let input: Vec<f32> = (0..m * matrix.cols())
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let mut output = vec![0f32; m * matrix.rows()];
        pool.install(|| {
            (0..runs)
                .map(|_| {
                    let start = std::time::Instant::now();
                    matrix
                        .matmul_with(Kernel::best(), &input, &mut output)
                        .expect("shapes fit");
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min)
        })
    }

    /// Times the batched matmul (128 input rows, a prefill) of a 1536 × 576 and a 576 × 1536
    /// matrix of each quantized format on one thread with the fastest kernel; prints ns per
    /// weight row × input row.
    /// `cargo test --release -p meshnet-kernels --lib batched_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn batched_timing() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("a pool of one thread");
        let m = 128;
        let formats = [
            WeightFormat::Q8_0,
            WeightFormat::Q4_0,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q4_1,
            WeightFormat::Q4_K,
            WeightFormat::Q6_K,
        ];
        for format in formats {
            for (rows, cols) in [(1536usize, 576usize), (576, 1536)] {
                if !cols.is_multiple_of(format.block_values()) {
                    continue;
                }
                let matrix = random_matrix(format, rows, cols, 17);
                let best = fastest_matmul(&pool, &matrix, m, 10);
                let per = best * 1e9 / (rows * m) as f64;
                println!(
                    "{} {rows}x{cols} x {m} rows: {per:.1} ns per weight row x input row",
                    format.name()
                );
            }
        }
    }

    /// Times passes of 1 to 5 input rows (a decode step and its drafts) through the default
    /// model's matrix shapes (and a 1536 × 1536 one for the k-quants) on two threads; prints each pass's time against one row's.
    /// `cargo test --release -p meshnet-kernels --lib few_rows_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn few_rows_timing() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads");
        for format in [
            WeightFormat::Q4_1,
            WeightFormat::Q8_0,
            WeightFormat::Q4_K,
            WeightFormat::Q6_K,
        ] {
            for (rows, cols) in [(576usize, 576usize), (1536, 576), (576, 1536), (1536, 1536)] {
                if !cols.is_multiple_of(format.block_values()) {
                    continue;
                }
                let matrix = random_matrix(format, rows, cols, 23);
                let mut one = 0.0;
                let mut line = format!("{} {rows}x{cols}:", format.name());
                for m in 1..=5 {
                    let best = fastest_matmul(&pool, &matrix, m, 200);
                    if m == 1 {
                        one = best;
                    }
                    line += &format!(" {m}: {:.1} us ({:.2}x)", best * 1e6, best / one);
                }
                println!("{line}");
            }
        }
    }
}
