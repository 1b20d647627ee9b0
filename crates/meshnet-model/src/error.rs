//! The one error type of the model crate.

use std::path::PathBuf;

use meshnet_types::Quantization;

/// Everything that can go wrong loading or running a model.
///
/// Messages name the file, the metadata key or the tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be opened or read.
    #[error("cannot read model file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not a readable GGUF file (bad magic, truncated header, bad metadata).
    #[error("{path} is not a valid GGUF file: {reason}")]
    CorruptFile {
        /// The file.
        path: PathBuf,
        /// What the GGUF reader reported.
        reason: String,
    },
    /// The model's architecture is not one this crate runs.
    #[error("{path}: unsupported architecture {architecture:?} (supported: {supported})")]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// The architecture the file declares.
        architecture: String,
        /// The architectures this crate runs, comma-separated.
        supported: String,
    },
    /// A required metadata key is absent or has the wrong type.
    #[error("{path}: metadata key {key}: {reason}")]
    Metadata {
        /// The file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor the span needs is not in the file.
    #[error("{path}: missing tensor {tensor}")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor has a shape other than the one the metadata implies.
    #[error("{path}: tensor {tensor} has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the metadata implies.
        expected: Vec<usize>,
        /// The shape in the file.
        actual: Vec<usize>,
    },
    /// A tensor is present but its data cannot be read or converted.
    #[error("{path}: cannot load tensor {tensor}: {reason}")]
    TensorData {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What went wrong.
        reason: String,
    },
    /// A tensor is stored in a type this crate does not load.
    #[error(
        "{path}: tensor {tensor} has type {type_name} (ggml type {type_id}), which is not \
         loaded here"
    )]
    UnsupportedTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The ggml type id.
        type_id: u32,
        /// ggml's name for the type (`unknown` for an id ggml has not assigned).
        type_name: &'static str,
    },
    /// A weight format this model cannot be held in.
    #[error(
        "this model cannot be held as {asked}: its layers are stored as {} and can be \
         requantised to q8_0",
        shipped.map_or_else(|| "a format without a name here".to_owned(), |q| q.to_string())
    )]
    UnsupportedQuantization {
        /// The format asked for.
        asked: Quantization,
        /// The format the file stores its layers in.
        shipped: Option<Quantization>,
    },
    /// A requested span or configuration does not fit the model.
    #[error("invalid span: {0}")]
    InvalidSpan(String),
    /// The span was asked for a part it did not load (embedding or head).
    #[error("this span has no {0}: load it with that part")]
    PartNotLoaded(&'static str),
    /// A chunk's position does not continue the session's KV cache.
    #[error(
        "session {session}: chunk at position {position} does not continue the KV cache, \
         which holds positions 0..{cached} ({kind})"
    )]
    PositionMismatch {
        /// The session.
        session: String,
        /// The position the chunk declared.
        position: usize,
        /// How many positions the cache holds.
        cached: usize,
        /// "gap" or "overlap".
        kind: &'static str,
    },
    /// A session could not start as a copy of another's cache.
    #[error("cannot fork the KV cache: {0}")]
    Fork(String),
    /// Appending a chunk would exceed the KV cache's byte budget.
    #[error(
        "KV cache budget exceeded: {needed} bytes needed on top of {used} in use, budget {budget}"
    )]
    CacheBudget {
        /// Bytes the chunk adds.
        needed: usize,
        /// Bytes already held.
        used: usize,
        /// The budget.
        budget: usize,
    },
    /// The hidden-state tensor handed to a span has the wrong shape.
    #[error("hidden states have shape {actual:?}, expected [1, tokens, {hidden}]")]
    HiddenShape {
        /// The shape received.
        actual: Vec<usize>,
        /// The model's hidden size.
        hidden: usize,
    },
    /// The file asks for a tokenizer this crate does not implement (`tokenizer.ggml.model`)
    /// or a pre-tokenizer it does not know (`tokenizer.ggml.pre`): refused rather than
    /// tokenized differently.
    #[error("{path}: {key} = {value:?} is not supported (supported: {supported})")]
    UnsupportedTokenizer {
        /// The file.
        path: PathBuf,
        /// The metadata key.
        key: String,
        /// The value the file gives.
        value: String,
        /// The values that are supported, comma-separated.
        supported: String,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A sampling parameter is out of range.
    #[error("invalid sampling setting: {0}")]
    Sampling(String),
    /// A token constraint (structured output) failed, or left no token that may be chosen.
    #[error("token constraint: {0}")]
    Constraint(String),
    /// Converting hidden states to or from the wire format failed.
    #[error("activation conversion: {0}")]
    Wire(#[from] meshnet_wire::WireError),
    /// A remote or custom stage failed.
    ///
    /// The source keeps the stage's own error type, so a caller that knows the stage can
    /// downcast it (`source.downcast_ref::<T>()`) to see what failed, for example which remote
    /// hop.
    #[error("stage {stage}: {source}")]
    Stage {
        /// Which stage.
        stage: String,
        /// What went wrong, in the stage's own error type (a `String` converts into it).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A tensor operation failed while computing.
    #[error("tensor computation failed: {0}")]
    Compute(#[from] candle_core::Error),
    /// A quantized kernel refused its operands.
    #[error("quantized kernel: {0}")]
    Kernel(#[from] meshnet_kernels::KernelError),
    /// A tool definition is not the object chat templates take.
    #[error("invalid tool definition: {0}")]
    Tool(String),
    /// A chat template did not compile, failed while rendering, or raised an error itself
    /// (`raise_exception`): the conversation cannot be formatted as the template asks.
    #[error("chat template ({origin}): {reason}")]
    ChatTemplate {
        /// Where the template came from (the model file, a built-in format, a file).
        origin: String,
        /// The template's own message, or what the engine reported.
        reason: String,
    },
    /// A chunk was fine but the pass it was computed in (with other sessions' chunks) failed.
    #[error("the pass this chunk ran in failed: {0}")]
    PassFailed(String),
}

/// The crate's result type.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_error_keeps_its_source_type_and_message() {
        let error = ModelError::Stage {
            stage: "remote".to_owned(),
            source: Box::new(std::io::Error::other("hop 3 is down")),
        };
        assert_eq!(error.to_string(), "stage remote: hop 3 is down");
        let ModelError::Stage { source, .. } = &error else {
            panic!("expected a stage error");
        };
        assert!(source.downcast_ref::<std::io::Error>().is_some());
        assert!(std::error::Error::source(&error).is_some());
        let plain = ModelError::Stage {
            stage: "remote".to_owned(),
            source: "no hop".into(),
        };
        assert_eq!(plain.to_string(), "stage remote: no hop");
    }
}
