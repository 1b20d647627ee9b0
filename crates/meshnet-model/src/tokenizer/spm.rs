//! SentencePiece BPE (`tokenizer.ggml.model = "llama"`) as llama.cpp runs it: the text (its
//! spaces already written as `▁`) starts as one symbol per character; the adjacent pair whose
//! concatenation is the token with the highest score merges first (the leftmost pair among
//! equal scores), until no adjacent pair forms a token. A character that is not a token is
//! written as its bytes, `<0xNN>`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::{ModelError, Result};

/// A candidate merge: the symbols at `left` and `right` would form a token of `score`.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged text, to tell a stale candidate from a live one.
    size: usize,
}

impl Ord for Candidate {
    /// Higher scores first; among equal scores the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// A piece of the text being merged: `text[start..start + len]`, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// What the SentencePiece encoder needs of the vocabulary.
pub(crate) struct SentencePieceVocab<'a> {
    /// Token text → id.
    pub ids: &'a HashMap<String, u32>,
    /// Score of each token, by id.
    pub scores: &'a [f32],
    /// The unknown token, written for a byte that has no `<0xNN>` token.
    pub unknown: Option<u32>,
}

impl SentencePieceVocab<'_> {
    /// Appends the ids of `text` (spaces already escaped as `▁`) to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: None,
                next: None,
            })
            .collect();
        let count = symbols.len();
        for (index, symbol) in symbols.iter_mut().enumerate() {
            symbol.prev = index.checked_sub(1);
            symbol.next = (index + 1 < count).then_some(index + 1);
        }
        let mut queue = BinaryHeap::new();
        for left in 0..count {
            self.push_candidate(text, &symbols, left, &mut queue);
        }
        while let Some(candidate) = queue.pop() {
            let (left, right) = (candidate.left, candidate.right);
            if symbols[left].len == 0
                || symbols[right].len == 0
                || symbols[left].len + symbols[right].len != candidate.size
            {
                continue;
            }
            let right_symbol = symbols[right];
            symbols[left].len += right_symbol.len;
            symbols[left].next = right_symbol.next;
            symbols[right].len = 0;
            if let Some(after) = right_symbol.next {
                symbols[after].prev = Some(left);
            }
            if let Some(before) = symbols[left].prev {
                self.push_candidate(text, &symbols, before, &mut queue);
            }
            self.push_candidate(text, &symbols, left, &mut queue);
        }
        let mut next = (count > 0).then_some(0);
        while let Some(index) = next {
            let symbol = symbols[index];
            self.emit(&text[symbol.start..symbol.start + symbol.len], out)?;
            next = symbol.next;
        }
        Ok(())
    }

    /// Queues the merge of the symbol at `left` with the next one, when it forms a token.
    fn push_candidate(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        queue: &mut BinaryHeap<Candidate>,
    ) {
        let Some(right) = symbols[left].next else {
            return;
        };
        let start = symbols[left].start;
        let size = symbols[left].len + symbols[right].len;
        let Some(&id) = self.ids.get(&text[start..start + size]) else {
            return;
        };
        let Some(&score) = self.scores.get(id as usize) else {
            return;
        };
        queue.push(Candidate {
            score,
            left,
            right,
            size,
        });
    }

    /// Appends a final symbol: its token, or its bytes as byte tokens.
    fn emit(&self, piece: &str, out: &mut Vec<u32>) -> Result<()> {
        if let Some(&id) = self.ids.get(piece) {
            out.push(id);
            return Ok(());
        }
        for byte in piece.bytes() {
            out.push(self.byte_token(byte)?);
        }
        Ok(())
    }

    /// The token of one byte: `<0xNN>`, else the byte itself as a one-character token, else
    /// the unknown token.
    fn byte_token(&self, byte: u8) -> Result<u32> {
        let hex = format!("<0x{byte:02X}>");
        let plain = byte.is_ascii().then(|| char::from(byte).to_string());
        self.ids
            .get(&hex)
            .or_else(|| plain.and_then(|plain| self.ids.get(&plain)))
            .copied()
            .or(self.unknown)
            .ok_or_else(|| {
                ModelError::Tokenizer(format!(
                    "byte 0x{byte:02X} has no token and the vocabulary has no unknown token"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(tokens: &[(&str, f32)], text: &str) -> Result<Vec<u32>> {
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, (token, _))| ((*token).to_owned(), id as u32))
            .collect();
        let scores: Vec<f32> = tokens.iter().map(|(_, score)| *score).collect();
        let vocab = SentencePieceVocab {
            ids: &ids,
            scores: &scores,
            unknown: None,
        };
        let mut out = Vec::new();
        vocab.encode(text, &mut out)?;
        Ok(out)
    }

    #[test]
    fn the_pair_forming_the_highest_scored_token_merges_first() {
        let tokens = [
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("ab", -2.0),
            ("bc", -1.0),
            ("abc", -3.0),
        ];
        // "bc" (-1) beats "ab" (-2), then "a"+"bc" forms "abc".
        assert_eq!(encode(&tokens, "abc").unwrap(), [5]);
        // Without "abc", "a" and "bc" stay apart.
        assert_eq!(encode(&tokens[..5], "abc").unwrap(), [0, 4]);
    }

    #[test]
    fn equal_scores_merge_the_leftmost_pair() {
        let tokens = [("a", 0.0), ("aa", -1.0)];
        assert_eq!(encode(&tokens, "aaa").unwrap(), [1, 0]);
    }

    #[test]
    fn characters_without_a_token_fall_back_to_byte_tokens() {
        let tokens = [("a", 0.0), ("<0xC3>", 0.0), ("<0xA9>", 0.0)];
        assert_eq!(encode(&tokens, "aé").unwrap(), [0, 1, 2]);
        let error = encode(&tokens[..1], "é").unwrap_err();
        assert!(error.to_string().contains("0xC3"), "{error}");
    }
}
