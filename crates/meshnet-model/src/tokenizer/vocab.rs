//! A GGUF vocabulary read the way llama.cpp reads it (`llama-vocab.cpp`): tokens, scores and
//! types; the special ids with llama.cpp's defaults; the add-BOS/EOS and space-prefix rules;
//! the tokens it recognises by their text (end of turn, fill-in-the-middle, end of
//! generation); and the special tokens matched in text before anything else.

use std::collections::HashMap;

use super::bpe::BytePairEncoder;
use super::metadata::Metadata;
use super::pre;
use crate::error::{ModelError, Result};

/// Token attributes (llama.cpp's `llama_token_attr` bits).
pub(crate) mod attr {
    /// The unknown token.
    pub const UNKNOWN: u16 = 1;
    /// A normal token.
    pub const NORMAL: u16 = 1 << 2;
    /// A control token (`<s>`, `<|im_end|>`): written only when asked.
    pub const CONTROL: u16 = 1 << 3;
    /// A user-defined token: matched in text before tokenization, always.
    pub const USER_DEFINED: u16 = 1 << 4;
    /// A byte token (`<0x0A>`).
    pub const BYTE: u16 = 1 << 5;
    /// Spaces before the token are dropped when it is matched in text.
    pub const LSTRIP: u16 = 1 << 7;
    /// Spaces after the token are dropped when it is matched in text.
    pub const RSTRIP: u16 = 1 << 8;
}

/// GGUF token types (`tokenizer.ggml.token_type`) and the attribute each stands for.
fn attribute_of_type(token_type: i64) -> u16 {
    match token_type {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => 1 << 1,
        6 => attr::BYTE,
        _ => 0,
    }
}

/// Texts llama.cpp takes for the end-of-turn token when the file names none, in the order
/// this crate prefers them.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts of the fill-in-the-middle tokens llama.cpp recognises (prefix, suffix, middle, pad,
/// repository, file separator), each with the metadata key that names it instead.
const FIM_TEXTS: &[(&str, &[&str])] = &[
    (
        "tokenizer.ggml.fim_pre_token_id",
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_suf_token_id",
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_mid_token_id",
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (
        "tokenizer.ggml.fim_pad_token_id",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        "tokenizer.ggml.fim_rep_token_id",
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
    ),
    ("tokenizer.ggml.fim_sep_token_id", &["<|file_sep|>"]),
];

/// Texts of the tokens llama.cpp ends generation on, whatever the metadata says.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// The tokenizer models this crate implements.
const SUPPORTED_MODELS: &str = "llama, gpt2";

/// How text becomes tokens.
#[derive(Debug)]
pub(crate) enum Algorithm {
    /// SentencePiece by scores (`tokenizer.ggml.model = "llama"`).
    SentencePiece,
    /// Byte-level BPE by merge ranks (`"gpt2"`).
    BytePairs(Box<BytePairEncoder>),
}

/// The special ids of a vocabulary, each `None` when it has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SpecialIds {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence.
    pub eos: Option<u32>,
    /// End of turn.
    pub eot: Option<u32>,
    /// End of message (Llama 3.1's `<|eom_id|>`).
    pub eom: Option<u32>,
    /// Unknown.
    pub unknown: Option<u32>,
}

/// A vocabulary read from GGUF metadata.
#[derive(Debug)]
pub(crate) struct Vocab {
    /// Token texts by id.
    pub tokens: Vec<String>,
    /// Token attributes by id ([`attr`]).
    pub attrs: Vec<u16>,
    /// SentencePiece scores by id (zeros when the file has none).
    pub scores: Vec<f32>,
    /// Token text → id (the first id of a repeated text).
    pub ids: HashMap<String, u32>,
    /// How text becomes tokens.
    pub algorithm: Algorithm,
    /// Control, user-defined and unknown tokens, longest text first: matched in text first.
    pub special_tokens: Vec<u32>,
    /// The special ids.
    pub special: SpecialIds,
    /// Every token that ends generation, ascending.
    pub end_of_generation: Vec<u32>,
    /// Whether encoding with special tokens starts with BOS.
    pub add_bos: bool,
    /// Whether encoding with special tokens ends with EOS.
    pub add_eos: bool,
    /// Whether a space is written before text that starts the input or follows a special
    /// token (SentencePiece only).
    pub add_space_prefix: bool,
}

impl Vocab {
    /// Reads the vocabulary from GGUF metadata; an unknown tokenizer model or pre-tokenizer is
    /// refused with [`ModelError::UnsupportedTokenizer`].
    pub(crate) fn from_metadata(metadata: Metadata<'_>) -> Result<Self> {
        let model_key = "tokenizer.ggml.model";
        let model = metadata
            .string(model_key)?
            .ok_or_else(|| metadata.error(model_key, "missing"))?;
        let tokens_key = "tokenizer.ggml.tokens";
        let tokens = metadata
            .strings(tokens_key)?
            .ok_or_else(|| metadata.error(tokens_key, "missing"))?;
        if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
            return Err(metadata.error(
                tokens_key,
                format!("{} tokens: expected 1 to 2^32 - 1", tokens.len()),
            ));
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        for (id, token) in tokens.iter().enumerate() {
            ids.entry((*token).to_owned()).or_insert(id as u32);
        }
        let (algorithm, defaults) = match model {
            "llama" => (Algorithm::SentencePiece, sentence_piece_defaults()),
            "gpt2" => byte_pair_algorithm(metadata, &ids)?,
            other => {
                return Err(unsupported(metadata, model_key, other, SUPPORTED_MODELS));
            }
        };
        let mut vocab = Vocab {
            attrs: read_attributes(metadata, tokens.len())?,
            scores: read_scores(metadata, tokens.len())?,
            tokens: tokens.into_iter().map(str::to_owned).collect(),
            ids,
            algorithm,
            special_tokens: Vec::new(),
            special: SpecialIds::default(),
            end_of_generation: Vec::new(),
            add_bos: defaults.add_bos,
            add_eos: false,
            add_space_prefix: defaults.add_space_prefix,
        };
        vocab.read_special_ids(metadata, defaults.special)?;
        vocab.read_flags(metadata)?;
        vocab.find_end_of_generation(metadata)?;
        vocab.collect_special_tokens();
        vocab.apply_name_rules(metadata)?;
        Ok(vocab)
    }

    /// The id of a token's exact text.
    fn id_of(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// An id read from `key`, or `default`; an id beyond the vocabulary is ignored (as
    /// llama.cpp does, keeping the default).
    fn special_id(
        &self,
        metadata: Metadata<'_>,
        key: &str,
        default: Option<u32>,
    ) -> Result<Option<u32>> {
        let in_range = |id: u32| (id as usize) < self.tokens.len();
        let default = default.filter(|&id| in_range(id));
        Ok(match metadata.unsigned(key)? {
            Some(id) => u32::try_from(id)
                .ok()
                .filter(|&id| in_range(id))
                .or(default),
            None => default,
        })
    }

    fn read_special_ids(&mut self, metadata: Metadata<'_>, defaults: SpecialIds) -> Result<()> {
        self.special = SpecialIds {
            bos: self.special_id(metadata, "tokenizer.ggml.bos_token_id", defaults.bos)?,
            eos: self.special_id(metadata, "tokenizer.ggml.eos_token_id", defaults.eos)?,
            eot: self.special_id(metadata, "tokenizer.ggml.eot_token_id", None)?,
            eom: self.special_id(metadata, "tokenizer.ggml.eom_token_id", None)?,
            unknown: self.special_id(
                metadata,
                "tokenizer.ggml.unknown_token_id",
                defaults.unknown,
            )?,
        };
        // Found by text when the file names none, and then marked as control tokens.
        if self.special.eot.is_none() {
            self.special.eot = END_OF_TURN_TEXTS.iter().find_map(|text| self.id_of(text));
            self.mark_control(self.special.eot);
        }
        if self.special.eom.is_none() {
            self.special.eom = self.id_of("<|eom_id|>");
            self.mark_control(self.special.eom);
        }
        Ok(())
    }

    fn mark_control(&mut self, id: Option<u32>) {
        if let Some(attrs) = id.and_then(|id| self.attrs.get_mut(id as usize)) {
            *attrs |= attr::CONTROL;
        }
    }

    fn read_flags(&mut self, metadata: Metadata<'_>) -> Result<()> {
        if let Some(flag) = metadata.boolean("tokenizer.ggml.add_bos_token")? {
            self.add_bos = flag;
        }
        if let Some(flag) = metadata.boolean("tokenizer.ggml.add_eos_token")? {
            self.add_eos = flag;
        }
        if let Some(flag) = metadata.boolean("tokenizer.ggml.add_space_prefix")? {
            self.add_space_prefix = flag;
        }
        Ok(())
    }

    /// The fill-in-the-middle ids (from their keys, else by text), marked as control tokens;
    /// the pad, repository and file-separator ones end generation.
    fn fill_in_the_middle(&mut self, metadata: Metadata<'_>) -> Result<Vec<u32>> {
        let mut ending = Vec::new();
        for (index, (key, texts)) in FIM_TEXTS.iter().enumerate() {
            let id = match self.special_id(metadata, key, None)? {
                Some(id) => Some(id),
                None => {
                    let found = texts.iter().find_map(|text| self.id_of(text));
                    self.mark_control(found);
                    found
                }
            };
            // Prefix, suffix and middle (the first three) do not end generation.
            if index >= 3 {
                ending.extend(id);
            }
        }
        Ok(ending)
    }

    /// llama.cpp's end-of-generation list: the fill-in-the-middle pad/repository/separator
    /// tokens, every token with an end-of-generation text (marked as control), and the
    /// EOS, EOT and EOM ids; then its two exceptions (gpt-oss's `<|end|>`, Gemma 4's `</s>`).
    fn find_end_of_generation(&mut self, metadata: Metadata<'_>) -> Result<()> {
        let mut ending = self.fill_in_the_middle(metadata)?;
        for text in END_OF_GENERATION_TEXTS {
            if let Some(id) = self.id_of(text) {
                self.mark_control(Some(id));
                ending.push(id);
            }
        }
        for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = self.id_of(text) {
                self.attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        ending.extend(
            [self.special.eos, self.special.eot, self.special.eom]
                .into_iter()
                .flatten(),
        );
        ending.sort_unstable();
        ending.dedup();
        let present = |text: &str| self.id_of(text).filter(|id| ending.contains(id));
        let end = present("<|end|>");
        let harmony = present("<|return|>").is_some() && present("<|call|>").is_some();
        let solar = present("<|calls|>").is_some() && present("<|flush|>").is_some();
        let close = present("</s>");
        let marker = present("<|tool_response>").is_some();
        if let Some(end) = end.filter(|_| harmony || solar) {
            ending.retain(|&id| id != end);
            self.attrs[end as usize] = attr::USER_DEFINED;
        }
        if let Some(close) = close.filter(|_| marker) {
            ending.retain(|&id| id != close);
            self.attrs[close as usize] = attr::NORMAL;
        }
        self.end_of_generation = ending;
        Ok(())
    }

    /// The tokens matched in text before tokenization, longest first.
    fn collect_special_tokens(&mut self) {
        let mask = attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN;
        let mut special: Vec<u32> = (0..self.tokens.len() as u32)
            .filter(|&id| self.attrs[id as usize] & mask != 0)
            .filter(|&id| !self.tokens[id as usize].is_empty())
            .collect();
        special.sort_by_key(|&id| std::cmp::Reverse(self.tokens[id as usize].len()));
        self.special_tokens = special;
    }

    /// llama.cpp's per-model token attributes: Phi-3's special tokens swallow the spaces
    /// after them (except `<unk>`, `<s>` and `<|endoftext|>`), and so does its `</s>`.
    fn apply_name_rules(&mut self, metadata: Metadata<'_>) -> Result<()> {
        let name = metadata
            .string("general.name")?
            .unwrap_or_default()
            .to_ascii_lowercase();
        if !(name.contains("phi-3") || name.contains("phi3")) {
            return Ok(());
        }
        for &id in &self.special_tokens {
            self.attrs[id as usize] |= attr::RSTRIP;
        }
        if let Some(id) = self.id_of("</s>") {
            self.attrs[id as usize] |= attr::RSTRIP;
        }
        for text in ["<unk>", "<s>", "<|endoftext|>"] {
            if let Some(id) = self.id_of(text) {
                self.attrs[id as usize] &= !attr::RSTRIP;
            }
        }
        Ok(())
    }
}

/// What a tokenizer model implies when the file does not say.
struct Defaults {
    special: SpecialIds,
    add_bos: bool,
    add_space_prefix: bool,
}

/// SentencePiece: `<unk>` 0, `<s>` 1, `</s>` 2, BOS added, a space prefix.
fn sentence_piece_defaults() -> Defaults {
    Defaults {
        special: SpecialIds {
            bos: Some(1),
            eos: Some(2),
            unknown: Some(0),
            ..SpecialIds::default()
        },
        add_bos: true,
        add_space_prefix: true,
    }
}

/// The BPE encoder of a `"gpt2"` vocabulary, refusing an unknown `tokenizer.ggml.pre`.
fn byte_pair_algorithm(
    metadata: Metadata<'_>,
    ids: &HashMap<String, u32>,
) -> Result<(Algorithm, Defaults)> {
    let pre_key = "tokenizer.ggml.pre";
    let name = metadata.string(pre_key)?;
    let spec = pre::lookup(name).ok_or_else(|| {
        unsupported(
            metadata,
            pre_key,
            name.unwrap_or_default(),
            &pre::supported_names(),
        )
    })?;
    let merges_key = "tokenizer.ggml.merges";
    let merges = metadata
        .strings(merges_key)?
        .ok_or_else(|| metadata.error(merges_key, "missing"))?;
    let encoder = BytePairEncoder::new(&merges, ids, &spec)?;
    // llama.cpp's BPE defaults: id 11 for both BOS and EOS, unless the file says otherwise.
    let defaults = Defaults {
        special: SpecialIds {
            bos: Some(11),
            eos: Some(11),
            ..SpecialIds::default()
        },
        add_bos: spec.add_bos,
        add_space_prefix: false,
    };
    Ok((Algorithm::BytePairs(Box::new(encoder)), defaults))
}

/// Token attributes from `tokenizer.ggml.token_type` (all normal when absent).
fn read_attributes(metadata: Metadata<'_>, count: usize) -> Result<Vec<u16>> {
    let key = "tokenizer.ggml.token_type";
    match metadata.integers(key)? {
        None => Ok(vec![attr::NORMAL; count]),
        Some(types) if types.len() == count => {
            Ok(types.into_iter().map(attribute_of_type).collect())
        }
        Some(types) => {
            Err(metadata.error(key, format!("{} types for {count} tokens", types.len())))
        }
    }
}

/// Scores from `tokenizer.ggml.scores` (zeros when absent).
fn read_scores(metadata: Metadata<'_>, count: usize) -> Result<Vec<f32>> {
    let key = "tokenizer.ggml.scores";
    match metadata.floats(key)? {
        None => Ok(vec![0.0; count]),
        Some(scores) if scores.len() == count => Ok(scores),
        Some(scores) => {
            Err(metadata.error(key, format!("{} scores for {count} tokens", scores.len())))
        }
    }
}

/// The refusal of an unsupported tokenizer model or pre-tokenizer.
fn unsupported(metadata: Metadata<'_>, key: &str, value: &str, supported: &str) -> ModelError {
    ModelError::UnsupportedTokenizer {
        path: metadata.path().to_path_buf(),
        key: key.to_owned(),
        value: value.to_owned(),
        supported: supported.to_owned(),
    }
}
