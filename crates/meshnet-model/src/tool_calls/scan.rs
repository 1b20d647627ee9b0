//! Structural scanning of JSON text that may still be arriving: where a value ends, once it
//! has, without building it. Model output is untrusted: every function here takes any text
//! and never panics.

/// How far a value reaches in the text scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reach {
    /// The value ends just before this byte offset.
    Complete(usize),
    /// The text ends inside the value.
    Incomplete,
    /// The text is not JSON from this byte offset on.
    Invalid(usize),
}

/// Nesting deeper than this is refused (a call's arguments nest a few levels).
const MAX_DEPTH: usize = 256;

/// The byte that opens a JSON object.
pub(super) const OBJECT_OPEN: u8 = b'{';
/// The byte that closes a JSON object.
const OBJECT_CLOSE: u8 = b'}';
/// The byte that opens a JSON array.
pub(super) const ARRAY_OPEN: u8 = b'[';
/// The byte that closes a JSON array.
const ARRAY_CLOSE: u8 = b']';

/// The offset of the first byte at or after `from` that is not JSON whitespace.
pub(super) fn skip_whitespace(text: &str, from: usize) -> usize {
    let bytes = text.as_bytes();
    let mut at = from;
    while at < bytes.len() && matches!(bytes[at], b' ' | b'\t' | b'\n' | b'\r') {
        at += 1;
    }
    at
}

/// Where the string starting at `start` (a `"`) ends.
pub(super) fn string_reach(text: &str, start: usize) -> Reach {
    let bytes = text.as_bytes();
    let mut at = start + 1;
    loop {
        match bytes.get(at) {
            None => return Reach::Incomplete,
            Some(b'"') => return Reach::Complete(at + 1),
            Some(b'\\') if at + 1 >= bytes.len() => return Reach::Incomplete,
            Some(b'\\') => at += 2,
            Some(&byte) if byte < 0x20 => return Reach::Invalid(at),
            Some(_) => at += 1,
        }
    }
}

/// Where the JSON value starting at `start` ends. Objects and arrays are checked for
/// matching brackets and well-formed strings only; numbers and literals are checked fully.
pub(super) fn value_reach(text: &str, start: usize) -> Reach {
    match text.as_bytes().get(start) {
        None => Reach::Incomplete,
        Some(b'"') => string_reach(text, start),
        Some(&(OBJECT_OPEN | ARRAY_OPEN)) => container_reach(text, start),
        Some(b'-' | b'0'..=b'9' | b't' | b'f' | b'n') => scalar_reach(text, start),
        Some(_) => Reach::Invalid(start),
    }
}

/// Where the object or array starting at `start` ends.
fn container_reach(text: &str, start: usize) -> Reach {
    let bytes = text.as_bytes();
    let mut closers = Vec::new();
    let mut at = start;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => match string_reach(text, at) {
                Reach::Complete(end) => {
                    at = end;
                    continue;
                }
                other => return other,
            },
            OBJECT_OPEN | ARRAY_OPEN if closers.len() >= MAX_DEPTH => return Reach::Invalid(at),
            OBJECT_OPEN => closers.push(OBJECT_CLOSE),
            ARRAY_OPEN => closers.push(ARRAY_CLOSE),
            OBJECT_CLOSE | ARRAY_CLOSE => {
                if closers.pop() != Some(byte) {
                    return Reach::Invalid(at);
                }
                if closers.is_empty() {
                    return Reach::Complete(at + 1);
                }
            }
            _ => {}
        }
        at += 1;
    }
    Reach::Incomplete
}

/// Where the number or literal starting at `start` ends: it is incomplete while it runs to
/// the end of the text (more digits may follow).
fn scalar_reach(text: &str, start: usize) -> Reach {
    let bytes = text.as_bytes();
    let mut end = start;
    while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || b"+-.".contains(&bytes[end]))
    {
        end += 1;
    }
    if end == bytes.len() {
        return Reach::Incomplete;
    }
    // A bad run is known to be bad only once it has ended, so it breaks there.
    match serde_json::from_str::<serde_json::Value>(&text[start..end]) {
        Ok(_) => Reach::Complete(end),
        Err(_) => Reach::Invalid(end),
    }
}

/// Where a call's arguments value is in the text, and where it ends once it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ArgumentsSpan {
    /// The value's first byte.
    pub start: usize,
    /// Just past its last byte, once the text holds all of it.
    pub end: Option<usize>,
}

/// What is known so far of a call object `{"name": ..., "arguments": ...}` (or
/// `"parameters"`) at the start of a text that may still grow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct CallScan {
    /// The function's name, once its string is complete.
    pub name: Option<String>,
    /// The arguments value, once it has started.
    pub arguments: Option<ArgumentsSpan>,
    /// Just past the object's closing brace, once it has one.
    pub end: Option<usize>,
    /// Where the text stops being (the start of) such an object: it broke JSON's syntax,
    /// or a name was not a string.
    pub invalid_at: Option<usize>,
}

impl CallScan {
    fn invalid(mut self, at: usize) -> Self {
        self.invalid_at = Some(at);
        self
    }
}

/// What the role of an object member is in a call.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Member {
    Name,
    Arguments,
    Other,
}

/// Scans the call object that starts (after whitespace) at the beginning of `text`. Members
/// other than `name`, `arguments` and `parameters` are skipped; of several arguments
/// members the first counts.
pub(super) fn scan_call(text: &str) -> CallScan {
    let bytes = text.as_bytes();
    let mut scan = CallScan::default();
    let mut at = skip_whitespace(text, 0);
    match bytes.get(at) {
        None => return scan,
        Some(&OBJECT_OPEN) => at += 1,
        Some(_) => return scan.invalid(at),
    }
    let mut first = true;
    loop {
        at = skip_whitespace(text, at);
        match bytes.get(at) {
            None => return scan,
            Some(&OBJECT_CLOSE) if first => {
                scan.end = Some(at + 1);
                return scan;
            }
            Some(b'"') => {}
            Some(_) => return scan.invalid(at),
        }
        let (member, value_start) = match member_start(text, at, scan.arguments.is_some()) {
            Ok(Some(found)) => found,
            Ok(None) => return scan,
            Err(invalid_at) => return scan.invalid(invalid_at),
        };
        at = match member_value(text, member, value_start, &mut scan) {
            Ok(Some(end)) => skip_whitespace(text, end),
            Ok(None) => return scan,
            Err(invalid_at) => return scan.invalid(invalid_at),
        };
        match bytes.get(at) {
            None => return scan,
            Some(b',') => {
                at += 1;
                first = false;
            }
            Some(&OBJECT_CLOSE) => {
                scan.end = Some(at + 1);
                return scan;
            }
            Some(_) => return scan.invalid(at),
        }
    }
}

/// The member whose key starts at `at` and where its value starts; `None` while the text ends
/// before the value, `Err` with the offset where the text breaks.
fn member_start(
    text: &str,
    at: usize,
    has_arguments: bool,
) -> Result<Option<(Member, usize)>, usize> {
    let key_end = match string_reach(text, at) {
        Reach::Complete(end) => end,
        Reach::Incomplete => return Ok(None),
        Reach::Invalid(invalid_at) => return Err(invalid_at),
    };
    let key = serde_json::from_str::<String>(&text[at..key_end]).map_err(|_| at)?;
    let member = match key.as_str() {
        "name" => Member::Name,
        "arguments" | "parameters" if !has_arguments => Member::Arguments,
        _ => Member::Other,
    };
    let colon = skip_whitespace(text, key_end);
    match text.as_bytes().get(colon) {
        None => Ok(None),
        Some(b':') => {
            let value_start = skip_whitespace(text, colon + 1);
            Ok((value_start < text.len()).then_some((member, value_start)))
        }
        Some(_) => Err(colon),
    }
}

/// Reads the value of `member` starting at `start` into `scan`; returns where it ends
/// (`None` while it has not), `Err` with the offset where the text breaks.
fn member_value(
    text: &str,
    member: Member,
    start: usize,
    scan: &mut CallScan,
) -> Result<Option<usize>, usize> {
    let reach = value_reach(text, start);
    if member == Member::Name {
        if text.as_bytes()[start] != b'"' {
            return Err(start);
        }
        if let Reach::Complete(end) = reach {
            let name = serde_json::from_str::<String>(&text[start..end]).map_err(|_| start)?;
            // The first name counts: a streamed call was announced with it.
            scan.name.get_or_insert(name);
        }
    }
    if member == Member::Arguments {
        scan.arguments = Some(ArgumentsSpan {
            start,
            end: match reach {
                Reach::Complete(end) => Some(end),
                _ => None,
            },
        });
    }
    match reach {
        Reach::Complete(end) => Ok(Some(end)),
        Reach::Incomplete => Ok(None),
        Reach::Invalid(invalid_at) => Err(invalid_at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_reach_their_end_or_say_they_have_not() {
        assert_eq!(
            value_reach(r#"{"a": "}", "b": [1, {"c": null}]} x"#, 0),
            Reach::Complete(33)
        );
        assert_eq!(value_reach(r#"{"a": [1, 2"#, 0), Reach::Incomplete);
        assert_eq!(value_reach(r#"{"a": "\"#, 0), Reach::Incomplete);
        assert_eq!(value_reach(r#"{"a": ]"#, 0), Reach::Invalid(6));
        assert_eq!(value_reach(r#""x\"y" "#, 0), Reach::Complete(6));
        assert_eq!(value_reach("12.5e3,", 0), Reach::Complete(6));
        assert_eq!(value_reach("12", 0), Reach::Incomplete);
        assert_eq!(value_reach("tru,", 0), Reach::Invalid(3));
        assert_eq!(value_reach("\"a\nb\"", 0), Reach::Invalid(2));
        assert_eq!(value_reach("x", 0), Reach::Invalid(0));
        let deep = "[".repeat(MAX_DEPTH + 1);
        assert_eq!(value_reach(&deep, 0), Reach::Invalid(MAX_DEPTH));
    }

    #[test]
    fn a_call_object_is_known_piece_by_piece() {
        let text = r#" {"name": "get_weather", "arguments": {"city": "Paris"}} rest"#;
        let whole = scan_call(text);
        assert_eq!(whole.name.as_deref(), Some("get_weather"));
        assert_eq!(
            whole.arguments,
            Some(ArgumentsSpan {
                start: 38,
                end: Some(55)
            })
        );
        assert_eq!(&text[38..55], r#"{"city": "Paris"}"#);
        assert_eq!(whole.end, Some(56));
        assert_eq!(whole.invalid_at, None);

        let cut = scan_call(&text[..48]);
        assert_eq!(cut.name.as_deref(), Some("get_weather"));
        assert_eq!(
            cut.arguments,
            Some(ArgumentsSpan {
                start: 38,
                end: None
            })
        );
        assert_eq!(cut.end, None);
        let before_name = scan_call(&text[..15]);
        assert_eq!(before_name, CallScan::default());
    }

    #[test]
    fn parameters_count_as_arguments_and_other_members_are_skipped() {
        let scan = scan_call(r#"{"type": "function", "parameters": [1], "name": "f"}"#);
        assert_eq!(scan.name.as_deref(), Some("f"));
        assert_eq!(scan.arguments.map(|a| a.start), Some(35));
        assert!(scan.end.is_some());
    }

    #[test]
    fn what_is_no_call_object_is_invalid() {
        for text in [
            "[1]",
            "x",
            r#"{"name": 3}"#,
            r#"{"name" 3}"#,
            r#"{"name": "f" "arguments": {}}"#,
            r#"{"name": "f",}"#,
            r#"{name: "f"}"#,
            r#"{"arguments": {]}"#,
        ] {
            assert!(scan_call(text).invalid_at.is_some(), "{text}");
        }
        assert_eq!(scan_call(r#"{"name": 3"#).invalid_at, Some(9));
        assert_eq!(
            scan_call(r#"{"name": "f", "arguments": {"a": ]"#).invalid_at,
            Some(33)
        );
        assert_eq!(scan_call("{}").end, Some(2));
    }
}
