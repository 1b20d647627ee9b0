//! The Jinja environment chat templates are rendered in, set up the way Hugging Face's
//! `apply_chat_template` sets up Python's jinja2: `trim_blocks` and `lstrip_blocks`, loop
//! controls, `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` that is Python's
//! `json.dumps` (not HTML-escaping), the `{% generation %}` block (rendered as its body), and
//! the Python string and dict methods templates call (`.strip()`, `.split()`, `.items()`, ...).
//! Printed `True`, `False` and `None` are spelled as Python prints them.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, Value};

/// The name the template is stored under in its environment.
pub(crate) const TEMPLATE_NAME: &str = "chat_template";

/// What `strftime_now` formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Clock {
    /// The current time, in UTC.
    System,
    /// A fixed moment, in seconds since the Unix epoch (UTC).
    Fixed(i64),
}

impl Clock {
    fn now(self) -> i64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
            Clock::Fixed(seconds) => seconds,
        }
    }
}

/// The message a template passed to `raise_exception`, kept apart from where it was raised.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Raised(pub(crate) String);

/// An environment holding `source` compiled as [`TEMPLATE_NAME`].
pub(crate) fn compile(source: &str, clock: Clock) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_test("iterable", is_python_iterable);
    env.add_test("sequence", is_python_sequence);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", move |format: &str| {
        crate::strftime::format(format, clock.now())
    });
    env.add_template_owned(TEMPLATE_NAME, without_generation_tags(source))?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// Python's `iter(value)` succeeds: not for `None`, numbers or booleans (minijinja iterates
/// `none` as empty).
fn is_python_iterable(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
    )
}

/// jinja2's `sequence` test: anything with a length and items, strings and dicts included.
fn is_python_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
    )
}

/// Prints values as Python's `str()` does where minijinja differs: `True`, `False`, `None`.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    let python = match value.kind() {
        ValueKind::Bool if value.is_true() => "True",
        ValueKind::Bool => "False",
        ValueKind::None => "None",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(python).map_err(Error::from)
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (Hugging Face's marker of assistant
/// text, rendered as its body) by an `if true` block with the same whitespace control.
fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            rest = tag;
            break;
        };
        let inner = &tag[2..end];
        let left = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let body = &inner[left.len()..];
        let right = body
            .strip_suffix(['-', '+'])
            .map_or("", |_| &body[body.len() - 1..]);
        let word = body[..body.len() - right.len()].trim();
        match word {
            "generation" => write!(out, "{{%{left} if true {right}%}}"),
            "endgeneration" => write!(out, "{{%{left} endif {right}%}}"),
            _ => write!(out, "{}", &tag[..end + 2]),
        }
        .unwrap_or_default();
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// How `tojson` lays out its text: Python's `json.dumps` arguments.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

impl JsonStyle {
    fn from_kwargs(kwargs: &Kwargs) -> Result<Self, Error> {
        let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
        let indent = match kwargs.get::<Option<Value>>("indent")? {
            None => None,
            Some(value) if value.is_none() => None,
            Some(value) => match value.as_str() {
                Some(text) => Some(text.to_owned()),
                None => Some(" ".repeat(value.as_usize().ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int")
                })?)),
            },
        };
        let (item_separator, key_separator) = match kwargs.get::<Option<Value>>("separators")? {
            Some(pair) if !pair.is_none() => (
                pair.get_item_by_index(0)?.to_string(),
                pair.get_item_by_index(1)?.to_string(),
            ),
            _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
            _ => (", ".to_owned(), ": ".to_owned()),
        };
        let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
        kwargs.assert_all_used()?;
        Ok(JsonStyle {
            ensure_ascii,
            indent,
            item_separator,
            key_separator,
            sort_keys,
        })
    }
}

/// `value | tojson(...)`: Python's `json.dumps(value, ensure_ascii=False, ...)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let style = JsonStyle::from_kwargs(&kwargs)?;
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

/// Templates nest a handful of levels; this bounds recursion on self-referencing values.
const MAX_JSON_DEPTH: usize = 128;

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), &items, style, depth, |out, item, depth| {
                write_json(out, item, style, depth)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key), item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                ('{', '}'),
                &entries,
                style,
                depth,
                |out, (key, item), depth| {
                    write_json_string(out, key, style);
                    out.push_str(&style.key_separator);
                    write_json(out, item, style, depth)
                },
            )?;
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// Writes `items` between `brackets` as `json.dumps` lays them out.
fn write_container<T>(
    out: &mut String,
    brackets: (char, char),
    items: &[T],
    style: &JsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(brackets.0);
    if items.is_empty() {
        out.push(brackets.1);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &style.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    newline(out, depth + 1);
    for (index, item) in items.iter().enumerate() {
        if index > 0 {
            out.push_str(&style.item_separator);
            newline(out, depth + 1);
        }
        write_item(out, item, depth + 1)?;
    }
    newline(out, depth);
    out.push(brackets.1);
    Ok(())
}

/// A map key as `json.dumps` turns it into a string.
fn json_key(key: &Value) -> String {
    match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::None => "null".to_owned(),
        _ => key.to_string(),
    }
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(number) => out.push_str(&python_float_repr(number)),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// A float as Python's `repr` (and so `json.dumps`) writes it: shortest round-trip digits,
/// `.0` on whole numbers, exponent form below 1e-4 and from 1e16.
pub(crate) fn python_float_repr(number: f64) -> String {
    if number.is_nan() {
        return "NaN".to_owned();
    }
    if number.is_infinite() {
        return if number > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        }
        .to_owned();
    }
    let scientific = format!("{number:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if number == 0.0 || (-4..16).contains(&exponent) {
        let plain = format!("{number}");
        return if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        };
    }
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
}

/// A JSON string as `json.dumps` writes it (`ensure_ascii` escapes all but printable ASCII).
fn write_json_string(out: &mut String, text: &str, style: &JsonStyle) {
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ch if (ch as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", ch as u32);
            }
            ch if style.ensure_ascii && !(' '..='~').contains(&ch) => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            ch => out.push(ch),
        }
    }
    out.push('"');
}

/// JSON text as a template value, as Python's `json.loads` gives it to a template: objects
/// keep their keys in the text's order (a repeated key keeps its first place and its last
/// value), integers stay integers and other numbers are floats.
pub(crate) fn value_from_json(text: &str) -> Result<Value, serde_json::Error> {
    use serde::de::DeserializeSeed as _;
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let value = JsonToValue.deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// `value | tojson` with `json.dumps`' default layout (`", "` and `": "` separators).
pub(crate) fn to_python_json(value: &Value) -> Result<String, Error> {
    let style = JsonStyle {
        ensure_ascii: false,
        indent: None,
        item_separator: ", ".to_owned(),
        key_separator: ": ".to_owned(),
        sort_keys: false,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(out)
}

/// Builds a template value from any JSON as it is read, in order.
struct JsonToValue;

impl<'de> serde::de::DeserializeSeed<'de> for JsonToValue {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for JsonToValue {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(JsonToValue)? {
            items.push(item);
        }
        Ok(Value::from(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut pairs: Vec<(String, Value)> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(JsonToValue)?;
            pairs.push((key, value));
        }
        Ok(Value::from_pairs(pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let env = compile(source, Clock::Fixed(0)).unwrap();
        env.get_template(TEMPLATE_NAME)
            .unwrap()
            .render(ctx)
            .unwrap()
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let ctx = Value::from_pairs([(
            "x",
            Value::from_pairs([
                ("b", Value::from("é\"<\n")),
                (
                    "a",
                    Value::from(vec![Value::from(1), Value::from(2.0), Value::from(())]),
                ),
                ("c", Value::from_pairs(Vec::<(&str, Value)>::new())),
            ]),
        )]);
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": "é\"<\n", "a": [1, 2.0, null], "c": {}}"#
        );
        assert_eq!(
            render(
                "{{ x | tojson(ensure_ascii=True, sort_keys=True) }}",
                ctx.clone()
            ),
            r#"{"a": [1, 2.0, null], "b": "\u00e9\"<\n", "c": {}}"#
        );
        assert_eq!(
            render("{{ x.a | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.0,\n  null\n]"
        );
        assert_eq!(
            render("{{ x.a | tojson(separators=(',', ':')) }}", ctx),
            "[1,2.0,null]"
        );
    }

    #[test]
    fn json_text_keeps_its_key_order_and_number_kinds() {
        let value = value_from_json(
            r#"{"z": 1, "a": [2.0, null, true], "m": {"y": "é", "b": 1e2}, "z": 3}"#,
        )
        .unwrap();
        assert_eq!(
            to_python_json(&value).unwrap(),
            r#"{"z": 3, "a": [2.0, null, true], "m": {"y": "é", "b": 100.0}}"#
        );
        assert_eq!(
            render(
                "{{ v.m.y }} {{ v.a | length }}",
                Value::from_pairs([("v", value)])
            ),
            "é 3"
        );
        assert!(value_from_json("{\"a\": 1} x").is_err());
        assert!(value_from_json("{\"a\": ").is_err());
    }

    #[test]
    fn floats_are_written_as_python_repr() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(python_float_repr(123456.5), "123456.5");
    }

    #[test]
    fn generation_blocks_render_their_body() {
        assert_eq!(
            without_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}"
        );
        assert_eq!(
            render(
                "{% generation %}\nbody\n{% endgeneration %}\n",
                Value::UNDEFINED
            ),
            "body\n"
        );
    }

    #[test]
    fn python_spellings_and_methods() {
        let ctx = Value::from_pairs([("m", Value::from_pairs([("k", "  v  ")]))]);
        assert_eq!(
            render(
                "{{ true }} {{ none }} {{ m.k.strip() }}|{% for k, v in m.items() %}{{ k }}={{ v.lstrip() }}{% endfor %}",
                ctx
            ),
            "True None v|k=v  "
        );
        assert_eq!(
            render(
                "{{ none is iterable }} {{ 'a' is iterable }} {{ {} is sequence }} {{ 1 is sequence }}",
                Value::UNDEFINED
            ),
            "False True True False"
        );
        assert_eq!(
            render(
                "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
                Value::UNDEFINED
            ),
            "012"
        );
    }
}
