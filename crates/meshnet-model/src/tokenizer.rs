//! The tokenizer, rebuilt from a GGUF file's metadata with the `tokenizers` crate.
//!
//! For GPT-2-style byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`, as in
//! SmolLM2): a BPE model over `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`, a
//! pre-tokenizer that splits digits one by one and then maps bytes (without adding a prefix
//! space), the byte-level decoder, and every control or user-defined token registered as a
//! special token so chat markers encode as single ids.

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{ModelError, Result};
use crate::gguf::GgufModel;

/// GGUF token type of a control token (`<|im_start|>`, `<|endoftext|>`, …).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of a user-defined token.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// A model's tokenizer and its special token ids.
#[derive(Clone, Debug)]
pub struct ModelTokenizer {
    inner: Tokenizer,
    bos_token: Option<u32>,
    eos_token: Option<u32>,
}

impl ModelTokenizer {
    /// Builds the tokenizer described by a GGUF file's metadata.
    pub fn from_gguf(model: &GgufModel) -> Result<Self> {
        let metadata = model.metadata();
        let error = |key: &str, reason: String| ModelError::Metadata {
            path: model.path().to_path_buf(),
            key: key.to_owned(),
            reason,
        };
        let kind = metadata
            .get("tokenizer.ggml.model")
            .and_then(|value| value.to_string().ok())
            .ok_or_else(|| error("tokenizer.ggml.model", "missing".into()))?;
        if kind != "gpt2" {
            return Err(error(
                "tokenizer.ggml.model",
                format!("tokenizer model {kind:?} is not supported (supported: gpt2)"),
            ));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            let values = metadata
                .get(key)
                .ok_or_else(|| error(key, "missing".into()))?
                .to_vec()
                .map_err(|e| error(key, e.to_string()))?;
            values
                .iter()
                .map(|value| {
                    value
                        .to_string()
                        .cloned()
                        .map_err(|e| error(key, e.to_string()))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let token_types: Vec<i32> = match metadata.get("tokenizer.ggml.token_type") {
            Some(value) => value
                .to_vec()
                .map_err(|e| error("tokenizer.ggml.token_type", e.to_string()))?
                .iter()
                .map(|v| v.to_i32().unwrap_or(1))
                .collect(),
            None => Vec::new(),
        };

        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, token)| (token.clone(), id as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|merge| {
                merge
                    .split_once(' ')
                    .map(|(left, right)| (left.to_owned(), right.to_owned()))
                    .ok_or_else(|| {
                        error(
                            "tokenizer.ggml.merges",
                            format!("merge {merge:?} is not two tokens"),
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| ModelError::Tokenizer(format!("building BPE: {e}")))?;

        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]))));
        inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(token_types.iter())
            .filter(|(_, kind)| matches!(**kind, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .map(|(token, _)| AddedToken::from(token.clone(), true))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| ModelError::Tokenizer(format!("registering special tokens: {e}")))?;

        let id = |key: &str| metadata.get(key).and_then(|value| value.to_u32().ok());
        Ok(Self {
            inner,
            bos_token: id("tokenizer.ggml.bos_token_id"),
            eos_token: id("tokenizer.ggml.eos_token_id"),
        })
    }

    /// Loads a Hugging Face `tokenizer.json`, as saved beside a safetensors checkpoint.
    ///
    /// `<|endoftext|>` (GPT-2's only special token), when the vocabulary has it, serves as both
    /// the beginning- and end-of-sequence token.
    pub fn from_tokenizer_json(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| {
            ModelError::Tokenizer(format!(
                "{} is not a valid tokenizer.json: {e}",
                path.display()
            ))
        })?;
        let end_of_text = inner.token_to_id("<|endoftext|>");
        Ok(Self {
            inner,
            bos_token: end_of_text,
            eos_token: end_of_text,
        })
    }

    /// Encodes text; special tokens written in the text (`<|im_start|>`) become their ids.
    /// No beginning-of-sequence token is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(format!("encoding: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes ids to text, leaving out special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer(format!("decoding: {e}")))
    }

    /// The id of a token's exact text, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The beginning-of-sequence id from the metadata.
    pub fn bos_token(&self) -> Option<u32> {
        self.bos_token
    }

    /// The end-of-sequence id from the metadata.
    pub fn eos_token(&self) -> Option<u32> {
        self.eos_token
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}
