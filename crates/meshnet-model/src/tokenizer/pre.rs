//! Pre-tokenizers of byte-level BPE vocabularies: how `tokenizer.ggml.pre` splits text into
//! words before merges run, as llama.cpp does it.
//!
//! Each pre-tokenizer is a list of regular expressions applied in turn: the first splits the
//! text into its matches and the text between them, the next splits each of those pieces
//! the same way, and so on. The patterns are llama.cpp's (`llama-vocab.cpp`), which are the
//! Hugging Face `tokenizer.json` patterns with case-insensitive groups spelled out.

use fancy_regex::Regex;

use crate::error::{ModelError, Result};

/// GPT-2's word pattern: contractions, letters, numbers, other symbols, spaces.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's word pattern: numbers in groups of at most three.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's word pattern: Llama 3's with digits one by one.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 3.5's word pattern: Qwen 2's with combining marks kept with letters.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One digit.
const DIGIT: &str = r"\p{N}";

/// One pre-tokenizer: its patterns and the options llama.cpp ties to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PreTokenizerSpec {
    /// The patterns, applied in turn.
    pub patterns: &'static [&'static str],
    /// Whether a word that is itself a token is taken whole, without merges (Llama 3).
    pub ignore_merges: bool,
    /// Whether a beginning-of-sequence token is added when the file does not say
    /// (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
}

const fn spec(patterns: &'static [&'static str]) -> PreTokenizerSpec {
    PreTokenizerSpec {
        patterns,
        ignore_merges: false,
        add_bos: false,
    }
}

/// llama.cpp's default pre-tokenizer (also used when a file names none).
const DEFAULT: PreTokenizerSpec =
    spec(&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]);

/// Every `tokenizer.ggml.pre` value this crate implements, with its pre-tokenizer.
const KNOWN: &[(&str, PreTokenizerSpec)] = &[
    ("default", DEFAULT),
    (
        "llama-bpe",
        PreTokenizerSpec {
            patterns: &[LLAMA3],
            ignore_merges: true,
            add_bos: true,
        },
    ),
    (
        "llama3",
        PreTokenizerSpec {
            patterns: &[LLAMA3],
            ignore_merges: true,
            add_bos: true,
        },
    ),
    (
        "llama-v3",
        PreTokenizerSpec {
            patterns: &[LLAMA3],
            ignore_merges: true,
            add_bos: true,
        },
    ),
    (
        "falcon3",
        PreTokenizerSpec {
            patterns: &[LLAMA3],
            ignore_merges: true,
            add_bos: true,
        },
    ),
    ("dbrx", spec(&[LLAMA3])),
    ("smaug-bpe", spec(&[LLAMA3])),
    ("qwen2", spec(&[QWEN2])),
    ("deepseek-r1-qwen", spec(&[QWEN2])),
    ("stablelm2", spec(&[QWEN2])),
    ("qwen35", spec(&[QWEN35])),
    ("smollm", spec(&[DIGIT, GPT2])),
    ("starcoder", spec(&[DIGIT, GPT2])),
    ("refact", spec(&[DIGIT, GPT2])),
    ("command-r", spec(&[DIGIT, GPT2])),
    ("gpt-2", spec(&[GPT2])),
    ("phi-2", spec(&[GPT2])),
    ("mpt", spec(&[GPT2])),
    ("olmo", spec(&[GPT2])),
    (
        "falcon",
        spec(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"]),
    ),
];

/// The `tokenizer.ggml.pre` values this crate implements, comma-separated.
pub(crate) fn supported_names() -> String {
    KNOWN
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The pre-tokenizer a `tokenizer.ggml.pre` value names; `None` for an unknown name.
/// A file without the key gets llama.cpp's default.
pub(crate) fn lookup(name: Option<&str>) -> Option<PreTokenizerSpec> {
    let name = name.unwrap_or("default");
    KNOWN
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, spec)| *spec)
}

/// A compiled pre-tokenizer.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
}

impl PreTokenizer {
    /// Compiles the patterns of `spec`.
    pub(crate) fn new(spec: &PreTokenizerSpec) -> Result<Self> {
        let regexes = spec
            .patterns
            .iter()
            .map(|pattern| {
                Regex::new(pattern).map_err(|error| {
                    ModelError::Tokenizer(format!("pre-tokenizer pattern {pattern:?}: {error}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { regexes })
    }

    /// Splits `text` into words: every pattern in turn splits each piece into its matches and
    /// the text between them. The words, in order, make up `text`; none is empty.
    pub(crate) fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let mut pieces = vec![text];
        for regex in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len());
            for piece in pieces {
                split_by(regex, piece, &mut next)?;
            }
            pieces = next;
        }
        pieces.retain(|piece| !piece.is_empty());
        Ok(pieces)
    }
}

/// Pushes the matches of `regex` in `text` and the text between them, in order.
fn split_by<'t>(regex: &Regex, text: &'t str, out: &mut Vec<&'t str>) -> Result<()> {
    let mut end_of_last = 0;
    for found in regex.find_iter(text) {
        let found = found.map_err(|error| {
            ModelError::Tokenizer(format!(
                "pre-tokenizer pattern {:?}: {error}",
                regex.as_str()
            ))
        })?;
        if found.start() > end_of_last {
            out.push(&text[end_of_last..found.start()]);
        }
        if found.end() > found.start() {
            out.push(found.as_str());
        }
        end_of_last = found.end();
    }
    if end_of_last < text.len() {
        out.push(&text[end_of_last..]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str, text: &str) -> Vec<String> {
        let spec = lookup(Some(name)).unwrap();
        PreTokenizer::new(&spec)
            .unwrap()
            .split(text)
            .unwrap()
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn llama3_groups_digits_by_three_and_keeps_a_space_before_symbols() {
        assert_eq!(
            split("llama-bpe", "I've 12345 cats!!\n\n  ok"),
            ["I", "'ve", " ", "123", "45", " cats", "!!\n\n", " ", " ok"]
        );
    }

    #[test]
    fn qwen2_splits_every_digit() {
        assert_eq!(split("qwen2", "a 123"), ["a", " ", "1", "2", "3"]);
    }

    #[test]
    fn gpt2_keeps_numbers_whole_and_smollm_splits_them() {
        assert_eq!(split("gpt-2", "x 2024 y"), ["x", " 2024", " y"]);
        assert_eq!(
            split("smollm", "x 2024 y"),
            ["x", " ", "2", "0", "2", "4", " y"]
        );
    }

    #[test]
    fn default_isolates_punctuation_then_numbers_by_three() {
        assert_eq!(
            split("default", "a,b 1234"),
            ["a", ",", "b", " ", "123", "4"]
        );
    }

    #[test]
    fn the_words_make_up_the_text() {
        let text = "Hello  world!\t\n 3.14 éà 日本語 🚀 don't";
        for (name, _) in KNOWN {
            assert_eq!(split(name, text).concat(), text, "{name}");
        }
    }

    #[test]
    fn an_absent_name_is_the_default_and_an_unknown_one_is_none() {
        assert_eq!(lookup(None), Some(DEFAULT));
        assert_eq!(lookup(Some("no-such-pre")), None);
        assert!(supported_names().contains("llama-bpe"));
    }
}
