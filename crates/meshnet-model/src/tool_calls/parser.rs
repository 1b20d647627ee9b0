//! The incremental parser that finds tool calls in generated text as it streams.
//!
//! Text goes in piece by piece; what comes out is the answer's own text and its calls, each
//! call announced once its name is known and its arguments given out as they arrive. Feeding
//! a text whole or in any pieces gives out the same answer (the events' text joined).

use super::scan::{
    ARRAY_OPEN, CallScan, OBJECT_OPEN, Reach, scan_call, skip_whitespace, string_reach,
};
use super::{CallSyntax, ToolEvent, ToolFormat};

/// The tag that opens a call in the tagged syntax.
pub(crate) const TOOL_CALL_OPEN: &str = "<tool_call>";
/// The tag that closes a call in the tagged syntax.
pub(crate) const TOOL_CALL_CLOSE: &str = "</tool_call>";
/// The tag before a call in Llama 3.x answers (when the decoder writes control tokens).
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";

/// Finds tool calls in generated text fed to it in pieces.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    syntax: CallSyntax,
    parallel: bool,
    /// Text received and not yet given out or dropped.
    pending: String,
    state: State,
    /// Calls announced so far, dropped ones included.
    announced: usize,
    /// Whitespace at the start of the next content is dropped (it follows a call).
    trim_start: bool,
}

#[derive(Debug, Clone)]
enum State {
    /// Outside any call; in the JSON syntax, `call_may_start` says whether a `{` here opens
    /// one (at the start of the answer and right after a call).
    Text { call_may_start: bool },
    /// Inside a call whose object starts at the beginning of `pending`.
    Call(CallProgress),
    /// Past a call's object, before its closing tag (tagged syntax); `discard` drops
    /// everything up to the tag (the object broke off).
    Closing { discard: bool },
}

#[derive(Debug, Clone)]
struct CallProgress {
    /// What opened the call (with the whitespace before it), given back as text if it turns
    /// out to be no call.
    opened_by: String,
    /// Once announced: the call's index, and whether its events are dropped (a second call
    /// when parallel calls are off).
    announced: Option<(usize, bool)>,
    /// Bytes of the arguments value given out.
    arguments_sent: usize,
}

impl ToolCallParser {
    /// A parser for answers in `format`; without `parallel`, calls after the first are
    /// dropped.
    pub fn new(format: ToolFormat, parallel: bool) -> Self {
        let syntax = format.syntax();
        ToolCallParser {
            syntax,
            parallel,
            pending: String::new(),
            state: State::Text {
                call_may_start: syntax == CallSyntax::Json,
            },
            announced: 0,
            trim_start: false,
        }
    }

    /// How many calls were given out so far.
    pub fn calls(&self) -> usize {
        if self.parallel {
            self.announced
        } else {
            self.announced.min(1)
        }
    }

    /// Takes the next piece of the answer; returns what it makes known.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.pending.push_str(text);
        let mut events = Vec::new();
        while self.step(&mut events, false) {}
        events
    }

    /// Ends the answer; returns what the text held back makes known. Whitespace at the end
    /// of an answer with calls is dropped.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut events = Vec::new();
        while self.step(&mut events, true) {}
        let state = std::mem::replace(
            &mut self.state,
            State::Text {
                call_may_start: false,
            },
        );
        let rest = std::mem::take(&mut self.pending);
        match state {
            State::Text { .. } => {
                let rest = if self.announced > 0 {
                    rest.trim_end()
                } else {
                    &rest
                };
                self.content(&mut events, rest);
            }
            State::Call(progress) => self.finish_call(&mut events, progress, &rest),
            State::Closing { .. } => {}
        }
        events
    }

    /// One step of progress on `pending`; false when nothing more can be done until more text
    /// comes (or, `at_end`, until [`finish`](Self::finish) handles the rest).
    fn step(&mut self, events: &mut Vec<ToolEvent>, at_end: bool) -> bool {
        match self.state {
            State::Text { call_may_start } => self.step_text(events, call_may_start, at_end),
            State::Call(_) => self.step_call(events),
            State::Closing { discard } => self.step_closing(discard, at_end),
        }
    }

    /// Gives out `text` as content (without leading whitespace right after a call).
    fn content(&mut self, events: &mut Vec<ToolEvent>, text: &str) {
        let text = if self.trim_start {
            text.trim_start()
        } else {
            text
        };
        if text.is_empty() {
            return;
        }
        self.trim_start = false;
        events.push(ToolEvent::Content(text.to_owned()));
    }

    fn step_text(
        &mut self,
        events: &mut Vec<ToolEvent>,
        call_may_start: bool,
        at_end: bool,
    ) -> bool {
        if call_may_start {
            return self.step_json_start();
        }
        let opener = self.syntax.opener();
        if let Some(at) = self.pending.find(opener) {
            let before = self.pending[..at].to_owned();
            let kept = before.trim_end();
            self.content(events, kept);
            let opened_by = format!("{}{opener}", &before[kept.len()..]);
            self.pending.drain(..at + opener.len());
            self.open_call(opened_by);
            return true;
        }
        if !at_end {
            let shown = self.pending[..held_back(&self.pending, opener)].to_owned();
            self.content(events, &shown);
            self.pending.drain(..shown.len());
        }
        false
    }

    /// At the start of a JSON-syntax answer or after a call: a `{` after whitespace (and
    /// `;`) opens a call; anything else is text.
    fn step_json_start(&mut self) -> bool {
        let Some(first) = self.pending.find(|c: char| !c.is_whitespace() && c != ';') else {
            return false;
        };
        if self.pending.as_bytes()[first] == OBJECT_OPEN {
            let opened_by: String = self.pending.drain(..first).collect();
            self.open_call(opened_by);
        } else {
            self.state = State::Text {
                call_may_start: false,
            };
        }
        true
    }

    fn open_call(&mut self, opened_by: String) {
        self.state = State::Call(CallProgress {
            opened_by,
            announced: None,
            arguments_sent: 0,
        });
    }

    fn step_call(&mut self, events: &mut Vec<ToolEvent>) -> bool {
        let State::Call(progress) = &mut self.state else {
            return false;
        };
        let scan = scan_call(&self.pending);
        let started = scan.name.is_some() && (scan.arguments.is_some() || scan.end.is_some());
        if progress.announced.is_none() {
            if !started && (scan.invalid_at.is_some() || scan.end.is_some()) {
                // No call after all: what opened it is text, and the rest is read again.
                let opened_by = std::mem::take(&mut progress.opened_by);
                self.state = State::Text {
                    call_may_start: false,
                };
                self.trim_start = false;
                self.content(events, &opened_by);
                return true;
            }
            if !started {
                return false;
            }
            let index = self.announced;
            let dropped = !self.parallel && index > 0;
            progress.announced = Some((index, dropped));
            self.announced += 1;
            if !dropped {
                let name = scan.name.clone().unwrap_or_default();
                events.push(ToolEvent::CallStart { index, name });
            }
        }
        let Some((index, dropped)) = progress.announced else {
            return false;
        };
        let arguments = new_arguments(&self.pending, &scan, progress, false);
        if let (false, Some(text)) = (dropped, arguments) {
            events.push(ToolEvent::CallArguments { index, text });
        }
        let Some(end) = scan.end.or(scan.invalid_at) else {
            return false;
        };
        // Past the object, or where it broke: the tagged syntax drops what is left of a
        // broken block; in the JSON syntax what follows a broken object is text.
        let broke = scan.end.is_none();
        self.trim_start = true;
        self.pending.drain(..end);
        self.state = match self.syntax {
            CallSyntax::Tagged => State::Closing { discard: broke },
            CallSyntax::Json => State::Text {
                call_may_start: !broke,
            },
        };
        true
    }

    /// After a call's object: drops whitespace and the closing tag (and, `discard`, all
    /// before the tag); anything else is text again.
    fn step_closing(&mut self, discard: bool, at_end: bool) -> bool {
        if discard {
            if let Some(at) = self.pending.find(TOOL_CALL_CLOSE) {
                self.pending.drain(..at + TOOL_CALL_CLOSE.len());
            } else {
                let keep = self.pending.len() - held_back_partial(&self.pending, TOOL_CALL_CLOSE);
                self.pending.drain(..keep);
                if !at_end {
                    return false;
                }
                self.pending.clear();
            }
        } else {
            let start = skip_whitespace(&self.pending, 0);
            let rest = &self.pending[start..];
            if rest.starts_with(TOOL_CALL_CLOSE) {
                self.pending.drain(..start + TOOL_CALL_CLOSE.len());
            } else if TOOL_CALL_CLOSE.starts_with(rest) {
                if !at_end {
                    return false;
                }
                self.pending.clear();
            }
        }
        self.state = State::Text {
            call_may_start: false,
        };
        true
    }

    /// The end of the answer inside a call: an announced call gets the rest of its
    /// arguments; one never announced was no call, and its text is content.
    fn finish_call(&mut self, events: &mut Vec<ToolEvent>, mut progress: CallProgress, rest: &str) {
        let scan = scan_call(rest);
        match progress.announced {
            Some((index, dropped)) => {
                let arguments = new_arguments(rest, &scan, &mut progress, true);
                if let (false, Some(text)) = (dropped, arguments) {
                    events.push(ToolEvent::CallArguments { index, text });
                }
            }
            None => {
                let text = format!("{}{rest}", progress.opened_by);
                self.trim_start = false;
                self.content(events, &text);
            }
        }
    }
}

/// The arguments text of the call in `pending` not given out yet, if any. An object or array
/// is given out as it arrives (up to where the text breaks, if it does); a string (arguments
/// written as encoded JSON) or another value once complete, a string decoded. A call that
/// ended without arguments has `{}`. At the end of the answer (`at_end`) an unfinished value
/// is given out as it is.
fn new_arguments(
    pending: &str,
    scan: &CallScan,
    progress: &mut CallProgress,
    at_end: bool,
) -> Option<String> {
    let Some(span) = scan.arguments else {
        let ended = scan.end.is_some() || scan.invalid_at.is_some() || at_end;
        if ended && progress.arguments_sent == 0 {
            progress.arguments_sent = 2;
            return Some("{}".to_owned());
        }
        return None;
    };
    let first = pending.as_bytes()[span.start];
    let streams = matches!(first, OBJECT_OPEN | ARRAY_OPEN);
    let available = match (span.end, scan.invalid_at) {
        (Some(end), _) => end,
        (None, Some(broken)) if streams => broken,
        (None, _) if streams || at_end => pending.len(),
        (None, _) => return None,
    };
    if !streams {
        if progress.arguments_sent > 0 {
            return None;
        }
        progress.arguments_sent = available - span.start;
        let raw = &pending[span.start..available];
        let decoded = match string_reach(raw, 0) {
            Reach::Complete(_) if first == b'"' => serde_json::from_str::<String>(raw).ok(),
            _ => None,
        };
        return Some(decoded.unwrap_or_else(|| raw.to_owned()));
    }
    let from = span.start + progress.arguments_sent;
    if from >= available {
        return None;
    }
    progress.arguments_sent = available - span.start;
    Some(pending[from..available].to_owned())
}

/// How long the longest tail of `text` that may still become `tag` is (a proper prefix of
/// it).
fn held_back_partial(text: &str, tag: &str) -> usize {
    tag.char_indices()
        .skip(1)
        .map(|(cut, _)| cut)
        .filter(|&cut| text.ends_with(&tag[..cut]))
        .max()
        .unwrap_or(0)
}

/// How much of `text` may be given out as content now: all but a tail that may still become
/// `opener` and the whitespace before it.
fn held_back(text: &str, opener: &str) -> usize {
    let before = &text[..text.len() - held_back_partial(text, opener)];
    before.trim_end().len()
}
