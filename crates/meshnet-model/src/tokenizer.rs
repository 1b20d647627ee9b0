//! The tokenizer of a model, rebuilt from a GGUF file's metadata the way llama.cpp builds it,
//! or loaded from a Hugging Face `tokenizer.json`.
//!
//! GGUF vocabularies (`tokenizer.ggml.model`):
//! - `"llama"`: SentencePiece BPE by token scores, `▁` as the space marker, a space written
//!   before the text (`tokenizer.ggml.add_space_prefix`), bytes without a token as `<0xNN>`;
//! - `"gpt2"`: byte-level BPE by merge ranks after the pre-tokenizer `tokenizer.ggml.pre`
//!   names: `default`, `llama-bpe` (also `llama3`, `llama-v3`, `falcon3`), `dbrx`,
//!   `smaug-bpe`, `qwen2` (also `deepseek-r1-qwen`, `stablelm2`), `qwen35`, `smollm`,
//!   `starcoder`, `refact`, `command-r`, `gpt-2`, `phi-2`, `mpt`, `olmo`, `falcon`; a file
//!   without the key gets `default`, as in llama.cpp.
//!
//! Any other model or pre-tokenizer is refused with [`ModelError::UnsupportedTokenizer`]: a
//! file is never tokenized differently from llama.cpp without saying so.

mod bpe;
mod encode;
mod metadata;
mod pre;
mod spm;
mod vocab;

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use tokenizers::Tokenizer;

use crate::error::{ModelError, Result};
use crate::gguf::GgufModel;
use metadata::Metadata;
use vocab::Vocab;

/// How [`ModelTokenizer::encode_with`] treats special tokens. The default is what llama.cpp's
/// tokenizer tests count: no BOS/EOS added, special tokens written in the text are plain text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Add BOS and EOS as the file says (`tokenizer.ggml.add_bos_token`, `add_eos_token`).
    pub add_special: bool,
    /// Control tokens written in the text (`<|im_start|>`) become their ids. User-defined
    /// tokens always do.
    pub parse_special: bool,
}

/// Where the tokens come from.
#[derive(Clone, Debug)]
enum Engine {
    /// A GGUF vocabulary.
    Gguf(Arc<Vocab>),
    /// A Hugging Face tokenizer; `plain` is the same one with special tokens read as text.
    HuggingFace {
        parsing: Box<Tokenizer>,
        plain: Box<Tokenizer>,
    },
}

/// A model's tokenizer and its special token ids.
#[derive(Clone, Debug)]
pub struct ModelTokenizer {
    engine: Engine,
    bos_token: Option<u32>,
    eos_token: Option<u32>,
    end_of_turn: Option<u32>,
    end_of_generation: Vec<u32>,
}

impl ModelTokenizer {
    /// Builds the tokenizer described by an opened GGUF model's metadata.
    pub fn from_gguf(model: &GgufModel) -> Result<Self> {
        Self::from_metadata(Metadata::new(model.path(), model.metadata()))
    }

    /// Builds the tokenizer of a GGUF file from its header alone, so it also works on
    /// vocabulary-only files (no weights) that [`GgufModel::open`] refuses.
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let content =
            Content::read(&mut BufReader::new(file)).map_err(|error| ModelError::CorruptFile {
                path: path.to_path_buf(),
                reason: error.to_string(),
            })?;
        Self::from_metadata(Metadata::new(path, &content.metadata))
    }

    fn from_metadata(metadata: Metadata<'_>) -> Result<Self> {
        let vocab = Vocab::from_metadata(metadata)?;
        Ok(Self {
            bos_token: vocab.special.bos,
            eos_token: vocab.special.eos,
            end_of_turn: vocab.special.eot,
            end_of_generation: vocab.end_of_generation.clone(),
            engine: Engine::Gguf(Arc::new(vocab)),
        })
    }

    /// Loads a Hugging Face `tokenizer.json`, as saved beside a safetensors checkpoint.
    ///
    /// `<|endoftext|>` (GPT-2's only special token), when the vocabulary has it, serves as both
    /// the beginning- and end-of-sequence token, and is the only end-of-generation token.
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let parsing = Tokenizer::from_bytes(&bytes).map_err(|e| {
            ModelError::Tokenizer(format!(
                "{} is not a valid tokenizer.json: {e}",
                path.display()
            ))
        })?;
        let mut plain = parsing.clone();
        plain.set_encode_special_tokens(true);
        let end_of_text = parsing.token_to_id("<|endoftext|>");
        Ok(Self {
            engine: Engine::HuggingFace {
                parsing: Box::new(parsing),
                plain: Box::new(plain),
            },
            bos_token: end_of_text,
            eos_token: end_of_text,
            end_of_turn: None,
            end_of_generation: end_of_text.into_iter().collect(),
        })
    }

    /// Encodes text for a prompt: special tokens written in the text (`<|im_start|>`) become
    /// their ids; no beginning-of-sequence token is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(
            text,
            EncodeOptions {
                add_special: false,
                parse_special: true,
            },
        )
    }

    /// Encodes a prompt as a sequence starts: special tokens written in the text become their
    /// ids, and BOS (and EOS) are added as the file says (`tokenizer.ggml.add_bos_token`), once:
    /// a chat template that wrote BOS itself does not get a second one.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode_with(
            text,
            EncodeOptions {
                add_special: true,
                parse_special: true,
            },
        )?;
        if let (Some(bos), [first, second, ..]) = (self.bos_token(), ids.as_slice())
            && *first == bos
            && *second == bos
        {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// Encodes text with explicit [`EncodeOptions`].
    pub fn encode_with(&self, text: &str, options: EncodeOptions) -> Result<Vec<u32>> {
        match &self.engine {
            Engine::Gguf(vocab) => vocab.encode(text, options.add_special, options.parse_special),
            Engine::HuggingFace { parsing, plain } => {
                let tokenizer = if options.parse_special {
                    parsing
                } else {
                    plain
                };
                let encoding = tokenizer
                    .encode(text, options.add_special)
                    .map_err(|e| ModelError::Tokenizer(format!("encoding: {e}")))?;
                Ok(encoding.get_ids().to_vec())
            }
        }
    }

    /// Decodes ids to text, leaving out control tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_inner(ids, false)
    }

    /// Decodes ids to text, writing control tokens as their text.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.decode_inner(ids, true)
    }

    fn decode_inner(&self, ids: &[u32], render_special: bool) -> Result<String> {
        match &self.engine {
            Engine::Gguf(vocab) => Ok(vocab.decode(ids, render_special)),
            Engine::HuggingFace { parsing, .. } => parsing
                .decode(ids, !render_special)
                .map_err(|e| ModelError::Tokenizer(format!("decoding: {e}"))),
        }
    }

    /// The bytes one token stands for, a control token's text included; a byte-level token
    /// may hold only part of a character.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        match &self.engine {
            Engine::Gguf(vocab) => {
                let mut bytes = Vec::new();
                vocab.token_bytes(id, true, &mut bytes);
                Ok(bytes)
            }
            Engine::HuggingFace { .. } => Ok(self.decode_with_special(&[id])?.into_bytes()),
        }
    }

    /// Whether `id` is a control token (`<|im_end|>`, `<s>`) or the unknown token: one that
    /// stands for no text and is written out only when asked for. An id outside the
    /// vocabulary is not.
    pub fn is_control(&self, id: u32) -> bool {
        match &self.engine {
            Engine::Gguf(vocab) => vocab.is_control(id),
            Engine::HuggingFace { parsing, .. } => parsing
                .get_added_tokens_decoder()
                .get(&id)
                .is_some_and(|token| token.special),
        }
    }

    /// The id of a token's exact text, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.engine {
            Engine::Gguf(vocab) => vocab.ids.get(token).copied(),
            Engine::HuggingFace { parsing, .. } => parsing.token_to_id(token),
        }
    }

    /// The text of a token as the vocabulary stores it (`▁`/`Ġ` markers included).
    pub fn token_text(&self, id: u32) -> Option<String> {
        match &self.engine {
            Engine::Gguf(vocab) => vocab.tokens.get(id as usize).cloned(),
            Engine::HuggingFace { parsing, .. } => parsing.id_to_token(id),
        }
    }

    /// The beginning-of-sequence id.
    pub fn bos_token(&self) -> Option<u32> {
        self.bos_token
    }

    /// The end-of-sequence id.
    pub fn eos_token(&self) -> Option<u32> {
        self.eos_token
    }

    /// The end-of-turn id: the file's `tokenizer.ggml.eot_token_id`, else the first of
    /// `<|eot_id|>`, `<|im_end|>`, `<|end|>`, `<end_of_turn>`, `<|endoftext|>`, … it has.
    pub fn end_of_turn(&self) -> Option<u32> {
        self.end_of_turn
    }

    /// Every id that ends generation, ascending, as llama.cpp lists them: EOS, EOT, EOM, the
    /// fill-in-the-middle pad/repository/file-separator tokens, and every token whose text
    /// is an end-of-generation marker (`<|eot_id|>`, `<|im_end|>`, `<|end|>`,
    /// `<end_of_turn>`, `<|endoftext|>`, `</s>`, …).
    pub fn end_of_generation(&self) -> &[u32] {
        &self.end_of_generation
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.engine {
            Engine::Gguf(vocab) => vocab.tokens.len(),
            Engine::HuggingFace { parsing, .. } => parsing.get_vocab_size(true),
        }
    }

    /// The underlying Hugging Face tokenizer, for one loaded from `tokenizer.json`.
    pub fn hugging_face(&self) -> Option<&Tokenizer> {
        match &self.engine {
            Engine::Gguf(_) => None,
            Engine::HuggingFace { parsing, .. } => Some(parsing),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::quantized::gguf_file::Value;

    use super::*;

    fn strings(items: &[&str]) -> Value {
        Value::Array(
            items
                .iter()
                .map(|s| Value::String((*s).to_owned()))
                .collect(),
        )
    }

    /// A SentencePiece vocabulary: `<unk>` `<s>` `</s>`, `▁ a b ▁a ab`, the byte `!`, a
    /// user-defined `<|user|>` and a normal-typed `<|end|>`.
    fn sentence_piece() -> HashMap<String, Value> {
        let tokens = [
            "<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "<0x21>", "<|user|>", "<|end|>",
        ];
        let types = [2, 3, 3, 1, 1, 1, 1, 1, 6, 4, 1];
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, 0.0, 0.0, 0.0];
        HashMap::from([
            (
                "tokenizer.ggml.model".to_owned(),
                Value::String("llama".to_owned()),
            ),
            ("tokenizer.ggml.tokens".to_owned(), strings(&tokens)),
            (
                "tokenizer.ggml.token_type".to_owned(),
                Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
            ),
            (
                "tokenizer.ggml.scores".to_owned(),
                Value::Array(scores.iter().map(|&s| Value::F32(s)).collect()),
            ),
        ])
    }

    /// A byte-level BPE vocabulary: `a b Ġ ab Ġab <|endoftext|>` with merges `a b`, `Ġ ab`.
    fn byte_pairs(pre: &str) -> HashMap<String, Value> {
        HashMap::from([
            (
                "tokenizer.ggml.model".to_owned(),
                Value::String("gpt2".to_owned()),
            ),
            (
                "tokenizer.ggml.pre".to_owned(),
                Value::String(pre.to_owned()),
            ),
            (
                "tokenizer.ggml.tokens".to_owned(),
                strings(&["a", "b", "Ġ", "ab", "Ġab", "<|endoftext|>"]),
            ),
            (
                "tokenizer.ggml.token_type".to_owned(),
                Value::Array([1, 1, 1, 1, 1, 3].iter().map(|&t| Value::I32(t)).collect()),
            ),
            (
                "tokenizer.ggml.merges".to_owned(),
                strings(&["a b", "Ġ ab"]),
            ),
            ("tokenizer.ggml.bos_token_id".to_owned(), Value::U32(5)),
            ("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(5)),
        ])
    }

    fn build(values: &HashMap<String, Value>) -> Result<ModelTokenizer> {
        ModelTokenizer::from_metadata(Metadata::new(Path::new("v.gguf"), values))
    }

    const PLAIN: EncodeOptions = EncodeOptions {
        add_special: false,
        parse_special: false,
    };

    #[test]
    fn sentence_piece_prefixes_a_space_merges_by_score_and_falls_back_to_bytes() {
        let tokenizer = build(&sentence_piece()).unwrap();
        // "▁a▁ab": both "▁a" (-1) merge before "ab" (-2) could.
        assert_eq!(tokenizer.encode_with("a ab", PLAIN).unwrap(), [6, 6, 5]);
        assert_eq!(tokenizer.encode_with("!", PLAIN).unwrap(), [3, 8]);
        assert_eq!(tokenizer.encode_with("", PLAIN).unwrap(), Vec::<u32>::new());
        assert_eq!(tokenizer.decode(&[6, 6, 5]).unwrap(), "a ab");
        assert_eq!(tokenizer.decode_with_special(&[1, 6]).unwrap(), "<s> a");
        assert_eq!(tokenizer.decode(&[1, 6, 8]).unwrap(), " a!");
    }

    #[test]
    fn token_bytes_are_what_one_token_decodes_to_with_no_prefix_space_dropped() {
        let tokenizer = build(&sentence_piece()).unwrap();
        assert_eq!(tokenizer.token_bytes(6).unwrap(), b" a");
        assert_eq!(tokenizer.token_bytes(8).unwrap(), b"!");
        assert_eq!(tokenizer.token_bytes(1).unwrap(), b"<s>");
        assert_eq!(tokenizer.token_bytes(99).unwrap(), b"");
        let tokenizer = build(&byte_pairs("gpt-2")).unwrap();
        assert_eq!(tokenizer.token_bytes(4).unwrap(), b" ab");
        assert_eq!(tokenizer.token_bytes(5).unwrap(), b"<|endoftext|>");
    }

    #[test]
    fn control_and_unknown_tokens_are_control_and_the_rest_are_not() {
        let tokenizer = build(&sentence_piece()).unwrap();
        let control: Vec<u32> = (0..12).filter(|&id| tokenizer.is_control(id)).collect();
        // <unk>, <s>, </s>, and <|end|> (an end-of-generation text makes it control); the
        // user-defined <|user|> is text.
        assert_eq!(control, [0, 1, 2, 10]);
        let tokenizer = build(&byte_pairs("gpt-2")).unwrap();
        let control: Vec<u32> = (0..7).filter(|&id| tokenizer.is_control(id)).collect();
        assert_eq!(control, [5]);
    }

    #[test]
    fn add_special_adds_bos_by_default_for_sentence_piece_and_as_the_file_says() {
        let mut values = sentence_piece();
        let with_special = EncodeOptions {
            add_special: true,
            parse_special: false,
        };
        let tokenizer = build(&values).unwrap();
        assert_eq!(tokenizer.encode_with("a", with_special).unwrap(), [1, 6]);
        values.insert(
            "tokenizer.ggml.add_bos_token".to_owned(),
            Value::Bool(false),
        );
        values.insert("tokenizer.ggml.add_eos_token".to_owned(), Value::Bool(true));
        let tokenizer = build(&values).unwrap();
        assert_eq!(tokenizer.encode_with("a", with_special).unwrap(), [6, 2]);
        values.insert(
            "tokenizer.ggml.add_space_prefix".to_owned(),
            Value::Bool(false),
        );
        let tokenizer = build(&values).unwrap();
        assert_eq!(tokenizer.encode_with("a b", PLAIN).unwrap(), [4, 3, 5]);
    }

    #[test]
    fn parse_special_reads_control_tokens_and_user_defined_ones_are_always_read() {
        let tokenizer = build(&sentence_piece()).unwrap();
        let parse = EncodeOptions {
            add_special: false,
            parse_special: true,
        };
        // A space is prefixed again after a special token.
        assert_eq!(tokenizer.encode_with("a</s>a", parse).unwrap(), [6, 2, 6]);
        assert_eq!(tokenizer.encode("a</s>a").unwrap(), [6, 2, 6]);
        let plain = tokenizer.encode_with("a</s>a", PLAIN).unwrap();
        assert!(!plain.contains(&2), "{plain:?}");
        assert_eq!(
            tokenizer.encode_with("a<|user|>b", PLAIN).unwrap(),
            [6, 9, 3, 5]
        );
        // "<|end|>" has an end-of-generation text: it became a control token.
        let plain = tokenizer.encode_with("<|end|>", PLAIN).unwrap();
        assert!(!plain.contains(&10), "{plain:?}");
        assert_eq!(tokenizer.encode_with("<|end|>", parse).unwrap(), [10]);
        // The unknown token counts as special only when asked; as text its characters have no
        // tokens and no byte tokens, so each byte is the unknown token.
        assert_eq!(tokenizer.encode_with("<unk>", parse).unwrap(), [0]);
        assert_eq!(
            tokenizer.encode_with("<unk>", PLAIN).unwrap(),
            [3, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn end_of_generation_lists_eos_and_every_end_marker_the_vocabulary_has() {
        let tokenizer = build(&sentence_piece()).unwrap();
        assert_eq!(tokenizer.end_of_generation(), [2, 10]);
        assert_eq!(tokenizer.end_of_turn(), Some(10));
        assert_eq!(tokenizer.eos_token(), Some(2));
        let mut values = sentence_piece();
        values.insert("tokenizer.ggml.eot_token_id".to_owned(), Value::U32(9));
        values.insert("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(99));
        let tokenizer = build(&values).unwrap();
        // An id beyond the vocabulary keeps the default (2), as in llama.cpp.
        assert_eq!(tokenizer.end_of_generation(), [2, 9, 10]);
        assert_eq!(tokenizer.end_of_turn(), Some(9));
    }

    #[test]
    fn byte_pairs_merge_by_rank_and_llama3_takes_whole_words_and_adds_bos() {
        let tokenizer = build(&byte_pairs("gpt-2")).unwrap();
        assert_eq!(tokenizer.encode_with("ab ab", PLAIN).unwrap(), [3, 4]);
        assert_eq!(tokenizer.decode(&[3, 4, 5]).unwrap(), "ab ab");
        let add = EncodeOptions {
            add_special: true,
            parse_special: false,
        };
        assert_eq!(tokenizer.encode_with("ab", add).unwrap(), [3]);
        let llama3 = build(&byte_pairs("llama-bpe")).unwrap();
        assert_eq!(llama3.encode_with("ab", add).unwrap(), [5, 3]);
        assert_eq!(tokenizer.end_of_generation(), [5]);
    }

    #[test]
    fn an_unknown_model_or_pre_tokenizer_is_refused_naming_key_and_value() {
        let mut values = sentence_piece();
        values.insert(
            "tokenizer.ggml.model".to_owned(),
            Value::String("bert".to_owned()),
        );
        let Err(ModelError::UnsupportedTokenizer { key, value, .. }) = build(&values) else {
            panic!("a bert vocabulary was accepted");
        };
        assert_eq!(
            (key.as_str(), value.as_str()),
            ("tokenizer.ggml.model", "bert")
        );
        let Err(ModelError::UnsupportedTokenizer { key, value, .. }) =
            build(&byte_pairs("deepseek-llm"))
        else {
            panic!("an unknown pre-tokenizer was accepted");
        };
        assert_eq!(
            (key.as_str(), value.as_str()),
            ("tokenizer.ggml.pre", "deepseek-llm")
        );
    }

    #[test]
    fn bad_vocabulary_metadata_is_an_error_naming_the_key() {
        let mut values = sentence_piece();
        values.insert("tokenizer.ggml.scores".to_owned(), Value::Array(vec![]));
        let Err(ModelError::Metadata { key, .. }) = build(&values) else {
            panic!("scores of the wrong length were accepted");
        };
        assert_eq!(key, "tokenizer.ggml.scores");
        values.insert("tokenizer.ggml.tokens".to_owned(), Value::Array(vec![]));
        let Err(ModelError::Metadata { key, .. }) = build(&values) else {
            panic!("an empty vocabulary was accepted");
        };
        assert_eq!(key, "tokenizer.ggml.tokens");
    }
}
