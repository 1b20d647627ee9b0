//! Typed reads of a GGUF file's metadata keys, each failure a [`ModelError::Metadata`] naming
//! the key.

use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{ModelError, Result};

/// The error for metadata key `key` of the file at `path`.
pub(crate) fn metadata_error(path: &Path, key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Metadata {
        path: path.to_path_buf(),
        key: key.to_owned(),
        reason: reason.into(),
    }
}

/// The value of `key`, which must be present.
pub(crate) fn get<'a>(path: &Path, content: &'a Content, key: &str) -> Result<&'a Value> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| metadata_error(path, key, "missing"))
}

/// An unsigned integer key that must be present.
pub(crate) fn get_usize(path: &Path, content: &Content, key: &str) -> Result<usize> {
    let value = get(path, content, key)?;
    let number = match value {
        Value::U8(v) => u64::from(*v),
        Value::U16(v) => u64::from(*v),
        Value::U32(v) => u64::from(*v),
        Value::U64(v) => *v,
        Value::I32(v) if *v >= 0 => *v as u64,
        Value::I64(v) if *v >= 0 => *v as u64,
        other => {
            return Err(metadata_error(
                path,
                key,
                format!(
                    "expected an unsigned integer, found {:?}",
                    other.value_type()
                ),
            ));
        }
    };
    usize::try_from(number).map_err(|_| metadata_error(path, key, "value too large"))
}

/// An unsigned integer key, when present.
pub(crate) fn get_optional_usize(
    path: &Path,
    content: &Content,
    key: &str,
) -> Result<Option<usize>> {
    if content.metadata.contains_key(key) {
        get_usize(path, content, key).map(Some)
    } else {
        Ok(None)
    }
}

/// A float key that must be present.
pub(crate) fn get_f32(path: &Path, content: &Content, key: &str) -> Result<f32> {
    match get(path, content, key)? {
        Value::F32(v) => Ok(*v),
        Value::F64(v) => Ok(*v as f32),
        other => Err(metadata_error(
            path,
            key,
            format!("expected a float, found {:?}", other.value_type()),
        )),
    }
}

/// A string key that must be present.
pub(crate) fn get_string(path: &Path, content: &Content, key: &str) -> Result<String> {
    get(path, content, key)?
        .to_string()
        .cloned()
        .map_err(|error| metadata_error(path, key, error.to_string()))
}
