//! The one error type of the kernel crate.

/// What can be wrong with a matrix's bytes or a matmul's operands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The row length is not a whole number of quantization blocks.
    #[error("a {format} row of {cols} values is not a whole number of {block}-value blocks")]
    RaggedRow {
        /// The weight format.
        format: &'static str,
        /// The row length asked for.
        cols: usize,
        /// The format's block length.
        block: usize,
    },
    /// The byte buffer does not hold exactly `rows × cols` values of the format.
    #[error("{format} data of {rows}×{cols} needs {expected} bytes, got {actual}")]
    ByteLength {
        /// The weight format.
        format: &'static str,
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The shape's size overflows the address space.
    #[error("a matrix of {rows}×{cols} is too large")]
    TooLarge {
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
    },
    /// A matmul's input or output does not fit the matrix.
    #[error("operand mismatch: {0}")]
    Shape(String),
    /// Matrices stacked together must share their format and row length.
    #[error("cannot stack matrices: {0}")]
    Stack(String),
}

/// The kernel crate's result type.
pub type Result<T> = std::result::Result<T, KernelError>;
