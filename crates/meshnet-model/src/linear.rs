//! Linear layers of a Llama span: every ggml format the file may hold runs on
//! `meshnet-kernels` (activations quantized once per matmul, SIMD when the CPU has it, the same
//! bits on every CPU path; Q4_1 and Q8_0 also the same bits as candle's own path). Candle's
//! `QMatMul` runs them only when `MESHNET_KERNEL=candle` asks for it, to compare against.
//!
//! Projections that read the same input are stacked into one matrix (query, key and value;
//! gate and up), so one matmul and one activation quantization serve them all.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use meshnet_kernels::{MatrixBuilder, QuantizedMatrix, WeightFormat};

use crate::error::{ModelError, Result};
use crate::gguf::TensorReader;

/// Whether `MESHNET_KERNEL=candle` asks for candle's own quantized matmul everywhere (to
/// compare against it); decided once per process.
fn candle_requested() -> bool {
    static CANDLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CANDLE.get_or_init(|| {
        std::env::var(meshnet_kernels::KERNEL_VARIABLE).is_ok_and(|value| value == "candle")
    })
}

/// The kernel format of a ggml type, when the kernels run it.
fn kernel_format(dtype: GgmlDType) -> Option<WeightFormat> {
    if candle_requested() {
        return None;
    }
    WeightFormat::from_name(&crate::gguf::type_name(dtype))
}

/// A quantized tensor as a kernel matrix, when its format is one the kernels run.
pub(crate) fn kernel_matrix(tensor: &QTensor) -> Result<Option<QuantizedMatrix>> {
    let Some(format) = kernel_format(tensor.dtype()) else {
        return Ok(None);
    };
    let (rows, cols) = tensor.shape().dims2()?;
    let bytes = tensor.data()?;
    Ok(Some(QuantizedMatrix::from_ggml_bytes(
        format, rows, cols, &bytes,
    )?))
}

/// Blocks read from the file at a time when a matrix is parsed as it is read.
const BLOCKS_PER_PIECE: usize = 4096;

/// Tensor `name` (`[rows, cols]`) as a kernel matrix parsed while it is read, so it is never
/// in memory twice (a model's embedding table is its largest tensor); `None` when its type is
/// not one the kernels run as shipped (`requantise` turns every type but Q8_0 into Q8_0).
pub(crate) fn read_kernel_matrix(
    reader: &mut TensorReader<'_>,
    name: &str,
    dims: [usize; 2],
    requantise: bool,
) -> Result<Option<QuantizedMatrix>> {
    // The shape is checked against the file's before anything is sized by it.
    let dtype = reader.checked_info(name, &dims)?.ggml_dtype;
    let Some(format) = kernel_format(dtype) else {
        return Ok(None);
    };
    if requantise && format != WeightFormat::Q8_0 {
        return Ok(None);
    }
    let mut builder = MatrixBuilder::new(format, dims[0], dims[1])
        .map_err(|error| reader.data_error(name, error))?;
    let piece = format.block_bytes() * BLOCKS_PER_PIECE;
    reader
        .read_pieces(name, &dims, piece, &mut |bytes| Ok(builder.push(bytes)?))
        .map_err(|error| match error {
            ModelError::Kernel(error) => reader.data_error(name, error),
            other => other,
        })?;
    builder
        .finish()
        .map(Some)
        .map_err(|error| reader.data_error(name, error))
}

/// One or more projections of the same input: `[tokens, in]` → one `[tokens, out_i]` each.
#[derive(Debug)]
pub(crate) enum Projections {
    /// Stacked into one kernel matrix; `widths` are the parts' output sizes in order.
    Stacked {
        /// The parts' rows, one under the other.
        matrix: Arc<QuantizedMatrix>,
        /// Each part's number of outputs.
        widths: Vec<usize>,
    },
    /// Separate kernel matrices: parts in different formats (a Q4_K_M file keeps its value
    /// projection in a larger type than its query and key), which do not stack.
    Kernels(Vec<Arc<QuantizedMatrix>>),
    /// Separate candle matmuls (under `MESHNET_KERNEL=candle`).
    Separate(Vec<QMatMul>),
    /// One candle matmul over a fused matrix whose output rows are split into `widths`.
    Split {
        /// The fused matrix.
        matmul: QMatMul,
        /// Each part's number of outputs.
        widths: Vec<usize>,
    },
}

impl Projections {
    /// Stacks `parts` when they share one format, else keeps them as separate kernel matrices
    /// (candle's matmuls when `MESHNET_KERNEL=candle` asks for them).
    pub(crate) fn new(parts: Vec<QTensor>) -> Result<Self> {
        let matrices = parts
            .iter()
            .map(kernel_matrix)
            .collect::<Result<Option<Vec<_>>>>()?;
        if let Some(matrices) = matrices {
            let references: Vec<&QuantizedMatrix> = matrices.iter().collect();
            return Ok(match QuantizedMatrix::stack(&references) {
                Ok(stacked) => Self::Stacked {
                    widths: matrices.iter().map(QuantizedMatrix::rows).collect(),
                    matrix: Arc::new(stacked),
                },
                Err(_) => Self::Kernels(matrices.into_iter().map(Arc::new).collect()),
            });
        }
        parts
            .into_iter()
            .map(|tensor| QMatMul::from_qtensor(tensor).map_err(ModelError::from))
            .collect::<Result<Vec<_>>>()
            .map(Self::Separate)
    }

    /// A fused matrix (the parts' rows one under the other, as Phi-3 ships its query/key/value
    /// and gate/up) used as one projection per entry of `widths`.
    pub(crate) fn fused(tensor: QTensor, widths: Vec<usize>) -> Result<Self> {
        Ok(match kernel_matrix(&tensor)? {
            Some(matrix) => Self::Stacked {
                matrix: Arc::new(matrix),
                widths,
            },
            None => Self::Split {
                matmul: QMatMul::from_qtensor(tensor)?,
                widths,
            },
        })
    }

    /// One candle projection over a shared tensor (a tied LM head in a format the kernels do
    /// not run).
    pub(crate) fn candle_shared(tensor: Arc<QTensor>) -> Result<Self> {
        Ok(Self::Separate(vec![QMatMul::from_arc(tensor)?]))
    }

    /// One projection over a shared kernel matrix (the LM head on a tied embedding table).
    pub(crate) fn shared(matrix: Arc<QuantizedMatrix>) -> Self {
        Self::Stacked {
            widths: vec![matrix.rows()],
            matrix,
        }
    }

    /// The projections of `input` (`[tokens, in]` f32, row-major) as f32 rows, one vector
    /// per part, each `[tokens, out_i]` row-major.
    pub(crate) fn forward_values(&self, input: &[f32], tokens: usize) -> Result<Vec<Vec<f32>>> {
        match self {
            Self::Stacked { matrix, widths } => {
                let mut output = vec![0f32; tokens * matrix.rows()];
                matrix.matmul(input, &mut output)?;
                Ok(split_rows(output, widths))
            }
            Self::Kernels(matrices) => matrices
                .iter()
                .map(|matrix| {
                    let mut output = vec![0f32; tokens * matrix.rows()];
                    matrix.matmul(input, &mut output)?;
                    Ok(output)
                })
                .collect(),
            Self::Separate(matmuls) => matmuls
                .iter()
                .map(|matmul| candle_matmul(matmul, input, tokens))
                .collect(),
            Self::Split { matmul, widths } => {
                Ok(split_rows(candle_matmul(matmul, input, tokens)?, widths))
            }
        }
    }
}

/// `input` (`[tokens, in]`) through one candle matmul, row-major.
fn candle_matmul(matmul: &QMatMul, input: &[f32], tokens: usize) -> Result<Vec<f32>> {
    let columns = input.len() / tokens.max(1);
    let input = Tensor::from_slice(input, (tokens, columns), &Device::Cpu)?;
    Ok(matmul.forward(&input)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Rows of several parts side by side (`[tokens, Σ widths]`) as one `[tokens, width]` block
/// per part.
fn split_rows(output: Vec<f32>, widths: &[usize]) -> Vec<Vec<f32>> {
    if widths.len() == 1 {
        return vec![output];
    }
    let total: usize = widths.iter().sum();
    let tokens = output.len() / total.max(1);
    let mut parts: Vec<Vec<f32>> = widths
        .iter()
        .map(|width| Vec::with_capacity(tokens * width))
        .collect();
    for row in output.chunks_exact(total) {
        let mut start = 0;
        for (part, width) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&row[start..start + width]);
            start += width;
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tensor type the loader accepts runs on the kernels, and the product agrees with
    /// candle's own quantized matmul of the same tensor to within the activations' rounding.
    #[test]
    fn every_loadable_type_runs_on_the_kernels() {
        let (rows, cols) = (8, 512);
        let weights: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let input: Vec<f32> = (0..cols)
            .map(|i| ((i * 31) % 200) as f32 / 17.0 - 6.0)
            .collect();
        let weights =
            Tensor::from_vec(weights, (rows, cols), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        let tensor =
            Tensor::from_slice(&input, (1, cols), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        let loadable = (0..40).filter_map(crate::gguf_check::loadable_type);
        let mut checked = Vec::new();
        for dtype in loadable {
            let quantized = QTensor::quantize(&weights, dtype).unwrap_or_else(|e| panic!("{e}"));
            let ours = kernel_matrix(&quantized)
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|| panic!("{dtype:?} runs on the kernels"));
            let mut output = vec![0f32; rows];
            ours.matmul(&input, &mut output)
                .unwrap_or_else(|e| panic!("{e}"));
            let expected = QMatMul::from_qtensor(quantized)
                .and_then(|matmul| matmul.forward(&tensor)?.flatten_all()?.to_vec1::<f32>())
                .unwrap_or_else(|e| panic!("{e}"));
            let scale = expected.iter().fold(1f32, |m, v| m.max(v.abs()));
            for (ours, theirs) in output.iter().zip(&expected) {
                // Both sides quantize the activations (to 8 bits) or round them (to f16).
                assert!(
                    (ours - theirs).abs() <= scale * 0.02,
                    "{dtype:?}: {ours} vs {theirs}"
                );
            }
            checked.push(format!("{dtype:?}"));
        }
        assert_eq!(checked.len(), 13, "{checked:?}");
    }

    /// Projections in different formats stay on the kernels, each part computing what it
    /// would alone.
    #[test]
    fn projections_in_different_formats_stay_on_the_kernels() {
        let cols = 256;
        let weights = |rows: usize| {
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"))
        };
        let parts = [
            (GgmlDType::Q5_0, 4),
            (GgmlDType::Q5_0, 2),
            (GgmlDType::Q8_0, 2),
        ]
        .map(|(dtype, rows)| {
            QTensor::quantize(&weights(rows), dtype).unwrap_or_else(|e| panic!("{e}"))
        });
        let alone: Vec<QuantizedMatrix> = parts
            .iter()
            .map(|part| {
                kernel_matrix(part)
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| panic!("kernel"))
            })
            .collect();
        let projections = Projections::new(parts.into()).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            matches!(projections, Projections::Kernels(_)),
            "{projections:?}"
        );
        let input: Vec<f32> = (0..2 * cols).map(|i| (i % 13) as f32 - 6.0).collect();
        let outputs = projections
            .forward_values(&input, 2)
            .unwrap_or_else(|e| panic!("{e}"));
        for (output, matrix) in outputs.iter().zip(&alone) {
            let mut expected = vec![0f32; 2 * matrix.rows()];
            matrix
                .matmul(&input, &mut expected)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(output, &expected);
        }
    }

    /// Our kernels give candle's quantized matmul bit for bit, so switching changes no text.
    #[test]
    fn the_kernels_give_candles_bits() {
        let rows = 40;
        let cols = 576;
        let weights: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let weights =
            Tensor::from_vec(weights, (rows, cols), &Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let quantized = QTensor::quantize(&weights, dtype).unwrap_or_else(|e| panic!("{e}"));
            let ours = kernel_matrix(&quantized)
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|| panic!("{dtype:?} runs on the kernels"));
            let candle = QMatMul::from_qtensor(quantized).unwrap_or_else(|e| panic!("{e}"));
            for tokens in [1, 3] {
                // Outliers as real activations have them.
                let input: Vec<f32> = (0..tokens * cols)
                    .map(|i| {
                        if i % 97 == 5 {
                            3000.0
                        } else {
                            ((i * 31) % 200) as f32 / 17.0 - 6.0
                        }
                    })
                    .collect();
                let tensor = Tensor::from_slice(&input, (tokens, cols), &Device::Cpu)
                    .unwrap_or_else(|e| panic!("{e}"));
                let expected = candle
                    .forward(&tensor)
                    .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut output = vec![0f32; tokens * rows];
                ours.matmul(&input, &mut output)
                    .unwrap_or_else(|e| panic!("{e}"));
                if dtype == GgmlDType::Q4_1 {
                    // candle's Q4_1 path is ggml's reference arithmetic: equal bits.
                    assert_eq!(output, expected, "{dtype:?}, {tokens} tokens");
                } else {
                    // candle's Q8_0 path sums the blocks in its own SIMD order.
                    for (ours, theirs) in output.iter().zip(&expected) {
                        assert!(
                            (ours - theirs).abs() <= theirs.abs() * 1e-5 + 1e-3,
                            "{ours} {theirs}"
                        );
                    }
                }
            }
        }
    }
}
