//! Fuzzes reading tool calls out of generated text (untrusted: whatever a model writes).
//!
//! The first byte picks the call format and whether parallel calls are on; the rest, as
//! UTF-8, is the answer, fed once whole and once in pieces whose lengths the first byte also
//! picks. Neither may panic; both must make the same answer known; an answer in which no call
//! was found comes out as its own text; and the parser's count of calls is the calls'.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshnet_model::{ParsedAnswer, ToolCallParser, ToolFormat, parse_answer};

fuzz_target!(|data: &[u8]| {
    let Some((&choice, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let format = [ToolFormat::Hermes, ToolFormat::Llama3, ToolFormat::Generic][usize::from(choice % 3)];
    let parallel = choice & 4 != 0;
    let whole = parse_answer(format, text, parallel);

    let mut parser = ToolCallParser::new(format, parallel);
    let mut pieces = ParsedAnswer::default();
    let step = usize::from(choice >> 3) + 1;
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + step).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        for event in parser.push(&text[start..end]) {
            pieces.apply(event);
        }
        start = end;
    }
    for event in parser.finish() {
        pieces.apply(event);
    }
    assert_eq!(pieces, whole, "{text:?} in pieces of {step}");
    assert_eq!(parser.calls(), whole.calls.len());
    if whole.calls.is_empty() {
        assert_eq!(whole.content, text);
    }
    if !parallel {
        assert!(whole.calls.len() <= 1);
    }
});
