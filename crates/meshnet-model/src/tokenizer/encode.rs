//! Encoding and decoding with a [`Vocab`], as llama.cpp's `llama_tokenize` and
//! `llama_token_to_piece` do.

use super::spm::SentencePieceVocab;
use super::vocab::{Algorithm, Vocab, attr};
use crate::error::Result;

/// The space marker of SentencePiece vocabularies.
const SPACE_MARKER: &str = "\u{2581}";

/// A piece of the input: text still to tokenize, or a special token found in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// Whether C's `isspace` holds for `c` (what llama.cpp strips around special tokens).
fn is_c_space(c: char) -> bool {
    c == ' ' || ('\t'..='\r').contains(&c)
}

impl Vocab {
    /// The ids of `text`. `add_special` adds BOS/EOS as the file says; `parse_special` makes
    /// control tokens written in the text their ids (user-defined tokens always are).
    pub(crate) fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.special.bos);
        }
        match &self.algorithm {
            Algorithm::SentencePiece => self.encode_sentence_piece(&fragments, &mut out)?,
            Algorithm::BytePairs(encoder) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(text) => encoder.encode(text, &self.ids, &mut out)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.special.eos);
        }
        Ok(out)
    }

    /// SentencePiece fragments: spaces become `▁`, and a space is written first at the start
    /// of the input and after each special token (when the file asks for a space prefix).
    fn encode_sentence_piece(&self, fragments: &[Fragment<'_>], out: &mut Vec<u32>) -> Result<()> {
        let encoder = SentencePieceVocab {
            ids: &self.ids,
            scores: &self.scores,
            unknown: self.special.unknown,
        };
        let mut after_special = true;
        for fragment in fragments {
            match *fragment {
                Fragment::Text(text) => {
                    let mut escaped = String::with_capacity(text.len() + 3);
                    if self.add_space_prefix && after_special {
                        escaped.push_str(SPACE_MARKER);
                    }
                    escaped.push_str(&text.replace(' ', SPACE_MARKER));
                    encoder.encode(&escaped, out)?;
                    after_special = false;
                }
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
            }
        }
        Ok(())
    }

    /// Splits `text` at the special tokens written in it, longest token first: each token in
    /// turn splits every remaining text fragment at its occurrences. Control and unknown
    /// tokens count only with `parse_special`.
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut fragments = Vec::new();
        if !text.is_empty() {
            fragments.push(Fragment::Text(text));
        }
        for &id in &self.special_tokens {
            let attrs = self.attrs[id as usize];
            if !parse_special && attrs & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let token = self.tokens[id as usize].as_str();
            if !fragments
                .iter()
                .any(|fragment| matches!(fragment, Fragment::Text(text) if text.contains(token)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                match fragment {
                    Fragment::Text(text) => split_at_token(text, token, id, attrs, &mut next),
                    token_fragment => next.push(token_fragment),
                }
            }
            fragments = next;
        }
        fragments
    }

    /// The bytes of `ids` as text. Control and unknown tokens are left out unless
    /// `render_special`; SentencePiece's `▁` becomes a space and, when the file adds a space
    /// prefix, the first token's leading space is dropped (as llama.cpp does).
    pub(crate) fn decode(&self, ids: &[u32], render_special: bool) -> String {
        let mut bytes = Vec::new();
        for (index, &id) in ids.iter().enumerate() {
            let start = bytes.len();
            self.token_bytes(id, render_special, &mut bytes);
            if index == 0 && self.add_space_prefix && bytes.get(start) == Some(&b' ') {
                bytes.remove(start);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Whether `id` is a control or the unknown token (no text unless rendered).
    pub(crate) fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|&attrs| attrs & (attr::CONTROL | attr::UNKNOWN) != 0)
    }

    /// Appends the bytes one token stands for.
    pub(crate) fn token_bytes(&self, id: u32, render_special: bool, out: &mut Vec<u8>) {
        let (Some(text), Some(&attrs)) =
            (self.tokens.get(id as usize), self.attrs.get(id as usize))
        else {
            return;
        };
        if attrs & (attr::CONTROL | attr::UNKNOWN) != 0 {
            if render_special {
                out.extend_from_slice(text.as_bytes());
            }
        } else if attrs & attr::USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if attrs & attr::BYTE != 0 {
            out.extend(byte_of_token(text));
        } else if attrs & attr::NORMAL != 0 {
            match &self.algorithm {
                Algorithm::SentencePiece => {
                    out.extend_from_slice(text.replace(SPACE_MARKER, " ").as_bytes());
                }
                Algorithm::BytePairs(encoder) => encoder.token_bytes(text, out),
            }
        }
    }
}

/// Pushes `text` split at each occurrence of `token` (the text between, then the token),
/// dropping C whitespace before it with `LSTRIP` and after it with `RSTRIP`.
fn split_at_token<'t>(
    text: &'t str,
    token: &str,
    id: u32,
    attrs: u16,
    out: &mut Vec<Fragment<'t>>,
) {
    let mut rest = text;
    while let Some(position) = rest.find(token) {
        let mut left = &rest[..position];
        if attrs & attr::LSTRIP != 0 {
            left = left.trim_end_matches(is_c_space);
        }
        if !left.is_empty() {
            out.push(Fragment::Text(left));
        }
        out.push(Fragment::Token(id));
        rest = &rest[position + token.len()..];
        if attrs & attr::RSTRIP != 0 {
            rest = rest.trim_start_matches(is_c_space);
        }
    }
    if !rest.is_empty() {
        out.push(Fragment::Text(rest));
    }
}

/// The byte of a `<0xNN>` token.
fn byte_of_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_splits_text_and_strips_spaces_as_its_attributes_say() {
        let mut out = Vec::new();
        split_at_token("a <x>  b<x>", "<x>", 7, 0, &mut out);
        assert_eq!(
            out,
            [
                Fragment::Text("a "),
                Fragment::Token(7),
                Fragment::Text("  b"),
                Fragment::Token(7)
            ]
        );
        out.clear();
        split_at_token("a <x>  b", "<x>", 7, attr::RSTRIP | attr::LSTRIP, &mut out);
        assert_eq!(
            out,
            [Fragment::Text("a"), Fragment::Token(7), Fragment::Text("b")]
        );
    }

    #[test]
    fn byte_tokens_decode_to_their_byte() {
        assert_eq!(byte_of_token("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_of_token("<0xE3>"), Some(0xE3));
        assert_eq!(byte_of_token("<0x>"), None);
        assert_eq!(byte_of_token("0x0A"), None);
    }
}
