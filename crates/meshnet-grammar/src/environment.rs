//! The model's vocabulary as the grammar engine sees it, built once per model.

use std::sync::Arc;

use llguidance::ParserFactory;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use meshnet_model::{EncodeOptions, ModelTokenizer};

use crate::error::GrammarError;

/// The longest token, in bytes, the engine's trie takes (it keeps a token's depth in 10 bits).
const MAX_TOKEN_BYTES: usize = 1024;

/// The largest vocabulary the engine's trie takes (it keeps subtree sizes in 22 bits, several
/// nodes per token).
const MAX_VOCABULARY: usize = 1 << 20;

/// Texts the tokenizer must encode into tokens whose bytes join up to the text again, with
/// nothing added (no space before the first word, no BOS), for the engine to tokenize the
/// text a grammar forces with it.
const ROUND_TRIP_PROBES: &[&str] = &[
    "{\"name\": \"Ada\", \"age\": 36}",
    "[1, -2.5e3, true, false, null]",
    " \"x\"",
    "\"caf\u{e9} \u{65e5}\u{672c} \\n\"",
];

/// Encoding options for text a grammar forces: no BOS, control tokens as plain text.
const PLAIN: EncodeOptions = EncodeOptions {
    add_special: false,
    parse_special: false,
};

/// A model's vocabulary as the grammar engine needs it (each token's bytes, control tokens
/// marked, the end-of-text tokens) and the engine's compiler over it: built once per model,
/// shared by every request. Clones share it.
#[derive(Clone)]
pub struct TokenEnvironment {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
}

impl std::fmt::Debug for TokenEnvironment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEnvironment")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl TokenEnvironment {
    /// Builds the environment of `tokenizer`'s vocabulary, where the ids of `end_of_text`
    /// (those in the vocabulary) end the text. Control tokens are marked as such, so no
    /// grammar allows them; ends are allowed only where the grammar is complete.
    pub fn new(tokenizer: &ModelTokenizer, end_of_text: &[u32]) -> Result<Self, GrammarError> {
        let vocab_size = tokenizer.vocab_size();
        if vocab_size == 0 || vocab_size > MAX_VOCABULARY {
            return Err(GrammarError::Tokenizer(format!(
                "a vocabulary of {vocab_size} tokens (1 to {MAX_VOCABULARY} are supported)"
            )));
        }
        let mut ends: Vec<u32> = end_of_text
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab_size)
            .collect();
        ends.sort_unstable();
        ends.dedup();
        let Some(&first_end) = ends.first() else {
            return Err(GrammarError::Tokenizer(
                "it has no end-of-text token".to_owned(),
            ));
        };
        let words = token_words(tokenizer)?;
        let info = TokRxInfo::new(vocab_size as u32, first_end);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&ends);
        let tokens: TokEnv = Arc::new(ModelTokens {
            trie,
            tokenizer: tokenizer.clone(),
            canonical: round_trips(tokenizer),
        });
        let mut factory = ParserFactory::new_simple(&tokens)
            .map_err(|error| GrammarError::Environment(error.to_string()))?;
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size,
        })
    }

    /// How many token ids the vocabulary has; masks cover `0..vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether the engine forces the text a grammar fixes as the tokenizer's own tokens
    /// (when the tokenizer encodes text without adding to it) rather than leaving the
    /// tokenization to the model.
    pub fn forces_canonical_tokens(&self) -> bool {
        self.factory.tok_env().tokenize_is_canonical()
    }

    /// The engine's compiler.
    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }
}

/// Each token id's bytes, a control token's text after the engine's marker byte 0xFF (which
/// no UTF-8 text has, so no grammar produces it).
fn token_words(tokenizer: &ModelTokenizer) -> Result<Vec<Vec<u8>>, GrammarError> {
    (0..tokenizer.vocab_size() as u32)
        .map(|id| {
            let bytes = tokenizer
                .token_bytes(id)
                .map_err(|error| GrammarError::Tokenizer(error.to_string()))?;
            if bytes.len() > MAX_TOKEN_BYTES {
                return Err(GrammarError::Tokenizer(format!(
                    "token {id} has {} bytes (at most {MAX_TOKEN_BYTES} are supported)",
                    bytes.len()
                )));
            }
            if !tokenizer.is_control(id) {
                return Ok(bytes);
            }
            let mut word = Vec::with_capacity(bytes.len() + 1);
            word.push(TokTrie::SPECIAL_TOKEN_MARKER);
            word.extend_from_slice(&bytes);
            Ok(word)
        })
        .collect()
}

/// Whether the tokenizer encodes each probe into tokens whose bytes are exactly the probe.
fn round_trips(tokenizer: &ModelTokenizer) -> bool {
    ROUND_TRIP_PROBES.iter().all(|probe| {
        let Ok(ids) = tokenizer.encode_with(probe, PLAIN) else {
            return false;
        };
        let mut bytes = Vec::with_capacity(probe.len());
        for id in ids {
            match tokenizer.token_bytes(id) {
                Ok(token) if !tokenizer.is_control(id) => bytes.extend_from_slice(&token),
                _ => return false,
            }
        }
        bytes == probe.as_bytes()
    })
}

/// The engine's view of the tokenizer: the trie of every token's bytes, and the tokenizer
/// itself for the text a grammar forces.
struct ModelTokens {
    trie: TokTrie,
    tokenizer: ModelTokenizer,
    /// Whether the tokenizer encodes text without adding to it ([`round_trips`]).
    canonical: bool,
}

impl TokenizerEnv for ModelTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| self.tokenizer.encode_with(text, PLAIN).ok())
            .unwrap_or_else(|| self.trie.greedy_tokenize(bytes))
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}
