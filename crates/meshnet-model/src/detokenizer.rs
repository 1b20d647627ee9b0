//! Turning generated ids into text while they are generated, with work per id that does not
//! grow with the length of the text.

use crate::error::Result;
use crate::tokenizer::ModelTokenizer;

/// What a lossy UTF-8 decoder writes for bytes that are not (yet) a whole character.
const REPLACEMENT: char = '\u{FFFD}';

/// Pending ids beyond which the decoder stops waiting for them to form text.
const MAX_PENDING_IDS: usize = 8;

/// Ids kept pending when the decoder stops waiting: the bytes of one incomplete UTF-8
/// character (at most three of its four) come from at most three ids.
const INCOMPLETE_CHAR_IDS: usize = 3;

/// Decodes a stream of ids into pieces of text, one id at a time.
///
/// Decoding each id on its own goes wrong: a character may be spread over several ids (an
/// emoji's four bytes over two byte-level tokens), and some decoders render an id differently
/// after another. Decoding every id so far at each step is right, but costs time in
/// proportion to the text. This decoder does what Hugging Face's text-generation-inference
/// does: it keeps two offsets into the stream, `prefix_offset` and `read_offset`. The ids
/// before `read_offset` have been turned into text; those from `prefix_offset` to
/// `read_offset` are kept as context. For each new id it decodes `ids[prefix_offset..]` and
/// `ids[prefix_offset..read_offset]`; when the first is longer and does not end in an
/// incomplete character (U+FFFD), the difference is the new piece, `prefix_offset` moves to
/// `read_offset` and `read_offset` to the end. Ids before `prefix_offset` are dropped.
///
/// With a byte-level vocabulary (GPT-2's, SmolLM2's), the pieces followed by what
/// [`finish`](Self::finish) returns add up to decoding all the ids at once, and no piece
/// splits a character. When more than eight ids are pending without
/// forming text (a run of stray bytes or special tokens), all but the last three are released
/// as they decode, so the work per id stays bounded.
#[derive(Debug)]
pub struct IncrementalDecoder<'a> {
    tokenizer: &'a ModelTokenizer,
    /// The ids from `prefix_offset` on.
    ids: Vec<u32>,
    /// `read_offset - prefix_offset`: `ids[..read]` are already text.
    read: usize,
    /// The text of the pending ids `ids[read..]`, without an incomplete character at its end.
    lookahead: String,
}

impl<'a> IncrementalDecoder<'a> {
    /// A decoder at the start of a stream.
    pub fn new(tokenizer: &'a ModelTokenizer) -> Self {
        IncrementalDecoder {
            tokenizer,
            ids: Vec::new(),
            read: 0,
            lookahead: String::new(),
        }
    }

    /// Adds the next id and returns the text it completes: empty while it does not complete
    /// a character yet (or decodes to nothing, as special tokens do). After an error the
    /// decoder is as it was before the call.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let piece = self.step();
        if piece.is_err() {
            self.ids.pop();
        }
        piece
    }

    /// Text the pending ids already decode to: the next pieces start with it. It leaves out a
    /// trailing incomplete character, and is empty when nothing is pending.
    pub fn lookahead(&self) -> &str {
        &self.lookahead
    }

    /// Ends the stream: the text of the ids still pending, a trailing incomplete character
    /// included (as U+FFFD, the way decoding all ids at once renders it).
    pub fn finish(self) -> Result<String> {
        let prefix = self.decode_prefix()?;
        let text = self.tokenizer.decode(&self.ids)?;
        Ok(text.get(prefix.len()..).unwrap_or_default().to_owned())
    }

    fn step(&mut self) -> Result<String> {
        let prefix = self.decode_prefix()?;
        let text = self.tokenizer.decode(&self.ids)?;
        let new = text.get(prefix.len()..).unwrap_or_default();
        if !new.is_empty() && !new.ends_with(REPLACEMENT) {
            let piece = new.to_owned();
            self.advance(self.ids.len());
            return Ok(piece);
        }
        if self.ids.len() - self.read > MAX_PENDING_IDS {
            let cut = self.ids.len() - INCOMPLETE_CHAR_IDS;
            let released = self.tokenizer.decode(&self.ids[..cut])?;
            let piece = released.get(prefix.len()..).unwrap_or_default().to_owned();
            self.advance(cut);
            return Ok(piece);
        }
        self.lookahead = new.strip_suffix(REPLACEMENT).unwrap_or(new).to_owned();
        Ok(String::new())
    }

    /// The text of the context ids, `ids[..read]`.
    fn decode_prefix(&self) -> Result<String> {
        if self.read == 0 {
            return Ok(String::new());
        }
        self.tokenizer.decode(&self.ids[..self.read])
    }

    /// Marks `ids[..read_to]` as text: the old `read_offset` becomes `prefix_offset`.
    fn advance(&mut self, read_to: usize) {
        self.ids.drain(..self.read);
        self.read = read_to - self.read;
        self.lookahead.clear();
    }
}
