//! Typed reads of GGUF metadata values, with errors that name the file and the key.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;

use crate::error::{ModelError, Result};

/// A GGUF file's metadata and the file it came from (for error messages).
#[derive(Clone, Copy)]
pub(crate) struct Metadata<'a> {
    path: &'a Path,
    values: &'a HashMap<String, Value>,
}

impl<'a> Metadata<'a> {
    /// Wraps the metadata of the file at `path`.
    pub(crate) fn new(path: &'a Path, values: &'a HashMap<String, Value>) -> Self {
        Self { path, values }
    }

    /// The file the metadata came from.
    pub(crate) fn path(&self) -> &'a Path {
        self.path
    }

    /// An error about `key`.
    pub(crate) fn error(&self, key: &str, reason: impl Into<String>) -> ModelError {
        ModelError::Metadata {
            path: self.path.to_path_buf(),
            key: key.to_owned(),
            reason: reason.into(),
        }
    }

    /// A string value; `None` when the key is absent.
    pub(crate) fn string(&self, key: &str) -> Result<Option<&'a str>> {
        match self.values.get(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.as_str())),
            Some(other) => Err(self.error(key, type_mismatch("a string", other))),
        }
    }

    /// A non-negative integer of any width; `None` when the key is absent.
    pub(crate) fn unsigned(&self, key: &str) -> Result<Option<u64>> {
        match self.values.get(key) {
            None => Ok(None),
            Some(value) => integer(value)
                .and_then(|number| u64::try_from(number).ok())
                .map(Some)
                .ok_or_else(|| self.error(key, type_mismatch("a non-negative integer", value))),
        }
    }

    /// A boolean value; `None` when the key is absent.
    pub(crate) fn boolean(&self, key: &str) -> Result<Option<bool>> {
        match self.values.get(key) {
            None => Ok(None),
            Some(Value::Bool(flag)) => Ok(Some(*flag)),
            Some(other) => Err(self.error(key, type_mismatch("a boolean", other))),
        }
    }

    /// An array value; `None` when the key is absent.
    fn array(&self, key: &str) -> Result<Option<&'a [Value]>> {
        match self.values.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items.as_slice())),
            Some(other) => Err(self.error(key, type_mismatch("an array", other))),
        }
    }

    /// An array whose every item `convert` accepts (one `what` each); `None` when the key is
    /// absent; the first item it refuses is an error naming the key and the item's index.
    fn typed_array<T>(
        &self,
        key: &str,
        what: &str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                convert(item).ok_or_else(|| {
                    self.error(key, format!("item {index}: {}", type_mismatch(what, item)))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An array of strings; `None` when the key is absent.
    pub(crate) fn strings(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        self.typed_array(key, "a string", |item| match item {
            Value::String(text) => Some(text.as_str()),
            _ => None,
        })
    }

    /// An array of numbers read as `f32`; `None` when the key is absent.
    pub(crate) fn floats(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.typed_array(key, "a number", |item| match item {
            Value::F32(number) => Some(*number),
            Value::F64(number) => Some(*number as f32),
            other => integer(other).map(|number| number as f32),
        })
    }

    /// An array of integers; `None` when the key is absent.
    pub(crate) fn integers(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.typed_array(key, "an integer", integer)
    }
}

/// The value of an integer of any width, or `None` for other types (and `u64` beyond `i64`).
fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::U8(v) => Some(i64::from(*v)),
        Value::I8(v) => Some(i64::from(*v)),
        Value::U16(v) => Some(i64::from(*v)),
        Value::I16(v) => Some(i64::from(*v)),
        Value::U32(v) => Some(i64::from(*v)),
        Value::I32(v) => Some(i64::from(*v)),
        Value::U64(v) => i64::try_from(*v).ok(),
        Value::I64(v) => Some(*v),
        _ => None,
    }
}

/// "expected X, found <type>".
fn type_mismatch(expected: &str, found: &Value) -> String {
    format!("expected {expected}, found {:?}", found.value_type())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> HashMap<String, Value> {
        HashMap::from([
            ("name".to_owned(), Value::String("llama".to_owned())),
            ("id".to_owned(), Value::U32(7)),
            ("negative".to_owned(), Value::I32(-1)),
            ("flag".to_owned(), Value::Bool(true)),
            (
                "list".to_owned(),
                Value::Array(vec![Value::String("a".to_owned()), Value::U8(1)]),
            ),
            (
                "scores".to_owned(),
                Value::Array(vec![Value::F32(-1.5), Value::I32(2)]),
            ),
        ])
    }

    #[test]
    fn values_of_the_right_type_are_read_and_absent_keys_are_none() {
        let values = values();
        let metadata = Metadata::new(Path::new("m.gguf"), &values);
        assert_eq!(metadata.string("name").unwrap(), Some("llama"));
        assert_eq!(metadata.unsigned("id").unwrap(), Some(7));
        assert_eq!(metadata.boolean("flag").unwrap(), Some(true));
        assert_eq!(metadata.floats("scores").unwrap(), Some(vec![-1.5, 2.0]));
        assert_eq!(metadata.integers("absent").unwrap(), None);
        assert_eq!(metadata.string("absent").unwrap(), None);
    }

    #[test]
    fn a_value_of_the_wrong_type_is_an_error_naming_the_key() {
        let values = values();
        let metadata = Metadata::new(Path::new("m.gguf"), &values);
        for error in [
            metadata.string("id").unwrap_err(),
            metadata.unsigned("negative").unwrap_err(),
            metadata.boolean("name").unwrap_err(),
        ] {
            assert!(matches!(error, ModelError::Metadata { .. }), "{error}");
        }
        let error = metadata.strings("list").unwrap_err();
        let ModelError::Metadata { key, reason, .. } = error else {
            panic!("expected a metadata error");
        };
        assert_eq!(key, "list");
        assert!(reason.starts_with("item 1: expected a string"), "{reason}");
    }
}
