//! One door to every model family: [`Model`] opens a Llama GGUF file or a Hugging Face GPT-2
//! directory, loads [`ModelSpan`]s of either, and builds the [`TextSide`] (tokenizer, chat
//! format, stop tokens) a front end needs. Code that serves spans is written once against
//! these types, whatever the family.

use std::path::Path;

use candle_core::Tensor;
use meshnet_types::LayerSpan;

use crate::batch::BatchItem;
use crate::error::{ModelError, Result};
use crate::generation::{LogitsHead, Stage, TokenEmbedder};
use crate::gguf::{GgufModel, ModelDescription};
use crate::gpt2::{Gpt2Model, Gpt2Span};
use crate::kv_cache::{KvStore, SessionId};
use crate::llama::{LlamaSpan, SpanSpec};
use crate::{ChatTemplate, ModelTokenizer, SpecialTokens};

/// The file the GPT-2 family keeps its tokenizer in, beside the weights.
pub const GPT2_TOKENIZER_FILE: &str = "tokenizer.json";

/// An opened model of any supported family. Weights are read only when a span is loaded.
#[derive(Debug)]
pub enum Model {
    /// A Llama-family model in a GGUF file.
    Llama(GgufModel),
    /// A GPT-2 model in a Hugging Face directory (`config.json`, `model.safetensors`).
    Gpt2(Gpt2Model),
}

impl Model {
    /// Opens `path`: a directory is read as a Hugging Face GPT-2 checkpoint, a file as GGUF.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Ok(Model::Gpt2(Gpt2Model::open(path)?))
        } else {
            Ok(Model::Llama(GgufModel::open(path)?))
        }
    }

    /// What the model's metadata says about it.
    pub fn description(&self) -> &ModelDescription {
        match self {
            Model::Llama(model) => model.description(),
            Model::Gpt2(model) => model.description(),
        }
    }

    /// The file or directory the model was opened from.
    pub fn path(&self) -> &Path {
        match self {
            Model::Llama(model) => model.path(),
            Model::Gpt2(model) => model.directory(),
        }
    }

    /// The files whose bytes define the model (for hashing its identity), in a fixed order.
    pub fn content_files(&self) -> Vec<std::path::PathBuf> {
        match self {
            Model::Llama(model) => vec![model.path().to_path_buf()],
            Model::Gpt2(model) => [
                crate::GPT2_CONFIG_FILE,
                crate::GPT2_WEIGHTS_FILE,
                GPT2_TOKENIZER_FILE,
            ]
            .iter()
            .map(|name| model.directory().join(name))
            .filter(|path| path.is_file())
            .collect(),
        }
    }

    /// Loads the parts `spec` names, calling `progress(layers_loaded, layers_total)` as it
    /// goes (per layer for Llama; at the start and end for GPT-2).
    pub fn load_span(
        &self,
        spec: &SpanSpec,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<ModelSpan> {
        match self {
            Model::Llama(model) => Ok(ModelSpan::Llama(LlamaSpan::load_with_progress(
                model, spec, progress,
            )?)),
            Model::Gpt2(model) => {
                let total = spec.layers.len() as usize;
                progress(0, total);
                let span = Gpt2Span::load(model, spec)?;
                progress(total, total);
                Ok(ModelSpan::Gpt2(span))
            }
        }
    }
}

/// A loaded span of any family.
#[derive(Debug)]
pub enum ModelSpan {
    /// A span of a Llama-family model.
    Llama(LlamaSpan),
    /// A span of a GPT-2 model.
    Gpt2(Gpt2Span),
}

impl ModelSpan {
    /// The layers this span runs.
    pub fn layers(&self) -> LayerSpan {
        match self {
            ModelSpan::Llama(span) => span.layers(),
            ModelSpan::Gpt2(span) => span.layers(),
        }
    }

    /// The span's KV caches.
    pub fn kv_store(&self) -> &KvStore {
        match self {
            ModelSpan::Llama(span) => span.kv_store(),
            ModelSpan::Gpt2(span) => span.kv_store(),
        }
    }

    /// Runs `layers` (absolute, within the span) on `hidden` for the chunk at `position`.
    pub fn forward_range(
        &self,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
        layers: LayerSpan,
    ) -> Result<Tensor> {
        match self {
            ModelSpan::Llama(span) => span.forward_range(session, position, hidden, layers),
            ModelSpan::Gpt2(span) => span.forward_range(session, position, hidden, layers),
        }
    }

    /// Runs `layers` over several sessions' chunks, results in the order of `items`, each with
    /// the bits it would have alone. Llama spans share every matmul among the chunks; GPT-2
    /// spans run them one after another.
    pub fn forward_batch(&self, layers: LayerSpan, items: Vec<BatchItem>) -> Vec<Result<Tensor>> {
        match self {
            ModelSpan::Llama(span) => span.forward_batch(layers, items),
            ModelSpan::Gpt2(span) => items
                .into_iter()
                .map(|item| span.forward_range(item.session, item.position, &item.hidden, layers))
                .collect(),
        }
    }

    /// The next-token logits for each hidden state of `hiddens`, as [`LogitsHead::logits`]
    /// gives them one by one. Llama spans run one LM-head matmul for all.
    pub fn logits_batch(&self, hiddens: &[Tensor]) -> Vec<Result<Vec<f32>>> {
        match self {
            ModelSpan::Llama(span) => span.logits_batch(hiddens),
            ModelSpan::Gpt2(span) => hiddens.iter().map(|hidden| span.logits(hidden)).collect(),
        }
    }
}

impl Stage for ModelSpan {
    fn forward(&self, session: SessionId, position: usize, hidden: Tensor) -> Result<Tensor> {
        match self {
            ModelSpan::Llama(span) => span.forward(session, position, hidden),
            ModelSpan::Gpt2(span) => span.forward(session, position, hidden),
        }
    }

    fn end_session(&self, session: SessionId) {
        match self {
            ModelSpan::Llama(span) => Stage::end_session(span, session),
            ModelSpan::Gpt2(span) => Stage::end_session(span, session),
        }
    }

    fn can_rewind(&self) -> bool {
        true
    }

    fn rewind(&self, session: SessionId, len: usize) -> Result<()> {
        self.kv_store().rewind(session, len)
    }

    fn name(&self) -> String {
        match self {
            ModelSpan::Llama(span) => span.name(),
            ModelSpan::Gpt2(span) => span.name(),
        }
    }
}

impl TokenEmbedder for ModelSpan {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        match self {
            ModelSpan::Llama(span) => span.embed(tokens),
            ModelSpan::Gpt2(span) => span.embed(tokens),
        }
    }
}

impl LogitsHead for ModelSpan {
    fn logits(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        match self {
            ModelSpan::Llama(span) => span.logits(hidden),
            ModelSpan::Gpt2(span) => span.logits(hidden),
        }
    }
}

/// What turns text into tokens and back for one model.
#[derive(Debug)]
pub struct TextSide {
    /// The model's tokenizer.
    pub tokenizer: ModelTokenizer,
    /// Its chat format, when the model has one (GPT-2 has none).
    pub template: Option<ChatTemplate>,
    /// Tokens that end any generation: every end-of-generation token the model names
    /// ([`ModelTokenizer::end_of_generation`]).
    pub stop_tokens: Vec<u32>,
    /// The token that ends a chat turn, when the model has one.
    pub end_of_turn: Option<u32>,
}

impl TextSide {
    /// The tokenizer and chat format of `model`. The chat template is the file at
    /// `chat_template` when given; else, for GGUF, the file's own `tokenizer.chat_template`,
    /// or the built-in format of its architecture when it has none. For GPT-2 the tokenizer
    /// comes from `tokenizer.json` beside the weights, and there is no chat format unless a
    /// template file is given.
    pub fn of(model: &Model, chat_template: Option<&Path>) -> Result<Self> {
        match model {
            Model::Llama(model) => {
                let description = model.description();
                let tokenizer = ModelTokenizer::from_gguf(model)?;
                let template = ChatTemplate::for_model(
                    chat_template,
                    description.chat_template.as_deref(),
                    &description.architecture,
                    |token| tokenizer.token_id(token).is_some(),
                    special_tokens(&tokenizer, description.bos_token, description.eos_token),
                )?;
                Ok(TextSide {
                    stop_tokens: tokenizer.end_of_generation().to_vec(),
                    end_of_turn: tokenizer.end_of_turn().or(description.im_end_token),
                    tokenizer,
                    template: Some(template),
                })
            }
            Model::Gpt2(model) => {
                let path = model.directory().join(GPT2_TOKENIZER_FILE);
                if !path.is_file() {
                    return Err(ModelError::Tokenizer(format!(
                        "{} has no {GPT2_TOKENIZER_FILE}: the tokenizer must be saved beside \
                         the weights",
                        model.directory().display()
                    )));
                }
                let tokenizer = ModelTokenizer::from_tokenizer_json(&path)?;
                let template = chat_template
                    .map(|path| {
                        let tokens = special_tokens(&tokenizer, None, tokenizer.eos_token());
                        ChatTemplate::from_file(path, tokens)
                    })
                    .transpose()?;
                Ok(TextSide {
                    stop_tokens: tokenizer.end_of_generation().to_vec(),
                    tokenizer,
                    template,
                    end_of_turn: None,
                })
            }
        }
    }
}

/// The texts of the `bos` and `eos` tokens, as chat templates see them.
fn special_tokens(tokenizer: &ModelTokenizer, bos: Option<u32>, eos: Option<u32>) -> SpecialTokens {
    let text = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .unwrap_or_default()
    };
    SpecialTokens {
        bos: text(bos),
        eos: text(eos),
    }
}
