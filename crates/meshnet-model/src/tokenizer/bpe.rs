//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) as llama.cpp runs it: the pre-tokenizer
//! splits text into words, each word's bytes are written as GPT-2's printable characters, and
//! the adjacent pair with the lowest merge rank is merged until no pair has a rank (the
//! leftmost pair first among equal ranks).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::pre::{PreTokenizer, PreTokenizerSpec};
use crate::error::Result;

/// GPT-2's printable character for each byte: printable Latin-1 bytes stand for themselves,
/// the others for the characters from U+0100 on, in byte order.
pub(crate) fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_spare = 0u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let byte = byte as u32;
        let printable = (0x21..=0x7E).contains(&byte)
            || (0xA1..=0xAC).contains(&byte)
            || (0xAE..=0xFF).contains(&byte);
        let code = if printable {
            byte
        } else {
            next_spare += 1;
            0xFF + next_spare
        };
        *slot = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    table
}

/// The merges of a byte-level BPE vocabulary and its pre-tokenizer.
#[derive(Debug)]
pub(crate) struct BytePairEncoder {
    /// (left id, right id) → (rank, id of the merged token).
    merges: HashMap<(u32, u32), (u32, u32)>,
    pre_tokenizer: PreTokenizer,
    ignore_merges: bool,
    byte_chars: [char; 256],
    char_bytes: HashMap<char, u8>,
}

/// A piece of a word being merged: `text[start..start + len]`, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    id: Option<u32>,
    prev: Option<usize>,
    next: Option<usize>,
}

impl BytePairEncoder {
    /// Builds the encoder from the merges (`"left right"` strings, rank = position).
    ///
    /// A merge whose parts or result are not tokens can never apply to ids and is left out.
    pub(crate) fn new(
        merges: &[&str],
        ids: &HashMap<String, u32>,
        spec: &PreTokenizerSpec,
    ) -> Result<Self> {
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            let Some((left, right)) = split_merge(merge) else {
                continue;
            };
            let (Some(&left_id), Some(&right_id), Some(&merged)) = (
                ids.get(left),
                ids.get(right),
                ids.get(&format!("{left}{right}")),
            ) else {
                continue;
            };
            let rank = u32::try_from(rank).unwrap_or(u32::MAX);
            table.entry((left_id, right_id)).or_insert((rank, merged));
        }
        Ok(Self {
            merges: table,
            pre_tokenizer: PreTokenizer::new(spec)?,
            ignore_merges: spec.ignore_merges,
            byte_chars: byte_chars(),
            char_bytes: byte_chars()
                .iter()
                .enumerate()
                .map(|(byte, &c)| (c, byte as u8))
                .collect(),
        })
    }

    /// Appends the ids of `text` (a fragment without special tokens) to `out`.
    pub(crate) fn encode(
        &self,
        text: &str,
        ids: &HashMap<String, u32>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        for word in self.pre_tokenizer.split(text)? {
            let mapped: String = word
                .bytes()
                .map(|byte| self.byte_chars[usize::from(byte)])
                .collect();
            if self.ignore_merges
                && let Some(&id) = ids.get(&mapped)
            {
                out.push(id);
                continue;
            }
            self.encode_word(&mapped, ids, out);
        }
        Ok(())
    }

    /// Merges one byte-mapped word and appends its ids.
    fn encode_word(&self, word: &str, ids: &HashMap<String, u32>, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = word
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                id: ids.get(&word[start..start + c.len_utf8()]).copied(),
                prev: None,
                next: None,
            })
            .collect();
        let count = symbols.len();
        for (index, symbol) in symbols.iter_mut().enumerate() {
            symbol.prev = index.checked_sub(1);
            symbol.next = (index + 1 < count).then_some(index + 1);
        }
        // (rank, left index) smallest first; the lengths tell a stale entry from a live one.
        let mut queue = BinaryHeap::new();
        let push = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize| {
            let Some(right) = symbols[left].next else {
                return;
            };
            let (Some(left_id), Some(right_id)) = (symbols[left].id, symbols[right].id) else {
                return;
            };
            if let Some(&(rank, merged)) = self.merges.get(&(left_id, right_id)) {
                let lengths = (symbols[left].len, symbols[right].len);
                queue.push(Reverse((rank, left, right, lengths, merged)));
            }
        };
        for left in 0..count {
            push(&mut queue, &symbols, left);
        }
        while let Some(Reverse((_, left, right, lengths, merged))) = queue.pop() {
            if (symbols[left].len, symbols[right].len) != lengths
                || symbols[left].next != Some(right)
            {
                continue;
            }
            let right_symbol = symbols[right];
            symbols[left].len += right_symbol.len;
            symbols[left].id = Some(merged);
            symbols[left].next = right_symbol.next;
            symbols[right].len = 0;
            if let Some(after) = right_symbol.next {
                symbols[after].prev = Some(left);
            }
            if let Some(before) = symbols[left].prev {
                push(&mut queue, &symbols, before);
            }
            push(&mut queue, &symbols, left);
        }
        for symbol in symbols.iter().filter(|symbol| symbol.len > 0) {
            match symbol.id {
                Some(id) => out.push(id),
                // A character that is not a token: llama.cpp looks up each of its bytes as a
                // one-byte token, which only an ASCII byte can be.
                None => out.extend(
                    word[symbol.start..symbol.start + symbol.len]
                        .bytes()
                        .filter(u8::is_ascii)
                        .filter_map(|byte| ids.get(&char::from(byte).to_string()).copied()),
                ),
            }
        }
    }

    /// The bytes a normal token's text stands for (characters outside GPT-2's table are
    /// kept as their UTF-8).
    pub(crate) fn token_bytes(&self, text: &str, out: &mut Vec<u8>) {
        for c in text.chars() {
            match self.char_bytes.get(&c) {
                Some(&byte) => out.push(byte),
                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
    }
}

/// Splits `"left right"` at the first space after the first byte, as llama.cpp does.
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    let position = merge.bytes().skip(1).position(|byte| byte == b' ')? + 1;
    Some((&merge[..position], &merge[position + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::pre::lookup;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let table = byte_chars();
        assert_eq!(table[usize::from(b'a')], 'a');
        assert_eq!(table[usize::from(b' ')], 'Ġ');
        assert_eq!(table[usize::from(b'\n')], 'Ċ');
        assert_eq!(table[0], 'Ā');
        assert_eq!(table[0xAD], 'Ń');
        let mut sorted = table.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn a_merge_splits_at_the_first_space_after_its_first_byte() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ", "t")));
        assert_eq!(split_merge("a b c"), Some(("a", "b c")));
        assert_eq!(split_merge("ab"), None);
    }

    fn vocab(tokens: &[&str]) -> HashMap<String, u32> {
        tokens
            .iter()
            .enumerate()
            .map(|(id, token)| ((*token).to_owned(), id as u32))
            .collect()
    }

    #[test]
    fn the_lowest_rank_merges_first_and_unmerged_characters_stay_apart() {
        // "a b c ab bc abc Ġ": with "b c" ranked before "a b", "abc" can only come from "a bc".
        let ids = vocab(&["a", "b", "c", "ab", "bc", "abc", "Ġ"]);
        let spec = lookup(Some("gpt-2")).unwrap();
        let encoder = BytePairEncoder::new(&["b c", "a bc", "a b", "ab c"], &ids, &spec).unwrap();
        let mut out = Vec::new();
        encoder.encode("abc", &ids, &mut out).unwrap();
        assert_eq!(out, [5]);
        out.clear();
        encoder.encode("ab cab", &ids, &mut out).unwrap();
        // "ab" then " cab": "Ġ" "c" "ab" (no merge joins Ġ or c to ab).
        assert_eq!(out, [3, 6, 2, 3]);
        let mut bytes = Vec::new();
        encoder.token_bytes("Ġab", &mut bytes);
        assert_eq!(bytes, b" ab");
    }
}
