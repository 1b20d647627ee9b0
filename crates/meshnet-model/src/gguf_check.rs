//! A bounds-checked walk over a GGUF file's header, done before candle's reader sees the file.
//!
//! Candle's reader trusts parts of the header: it divides by `general.alignment` (zero
//! panics), multiplies tensor dims without overflow checks when a tensor is sized, views the
//! empty buffer of a tensor without values as a slice of blocks through an unaligned pointer,
//! and names neither the key nor the tensor when it refuses a value. This walk reads the header from
//! the bytes with every count bounded by the bytes that remain, allocates only the keys and
//! tensor names it has read, and refuses what candle (or the engine) cannot take with an
//! error naming the key or tensor. After it, [`read_gguf_header`] lets candle parse the same
//! bytes and checks the sizes the metadata declares against what the file holds.

use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{ModelError, Result};

/// "GGUF" read as a little-endian `u32`.
const GGUF_MAGIC: u32 = 0x4655_4747;
/// The same four bytes written by a big-endian machine.
const GGUF_MAGIC_SWAPPED: u32 = 0x4747_5546;
/// The most metadata entries, tensors, array elements or string bytes candle's reader takes
/// in one count (it refuses more).
const MAX_COUNT: u64 = 1 << 30;
/// The most dims a tensor has (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// Tensor data alignment when the file does not set `general.alignment`.
const DEFAULT_ALIGNMENT: u64 = 32;
/// The key that sets the alignment.
const ALIGNMENT_KEY: &str = "general.alignment";
/// Bytes candle holds per metadata value (its `Value` enum), besides a string's own bytes.
const VALUE_BYTES: u64 = std::mem::size_of::<Value>() as u64;
/// The most memory candle's parsed metadata may take; a real vocabulary of 262,144 tokens
/// takes about 30 MiB.
pub const MAX_METADATA_MEMORY: u64 = 512 << 20;

/// One tensor's entry in the header, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// Its dims in ggml order (the innermost, contiguous one first).
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub type_id: u32,
    /// Where its data starts, relative to the start of the tensor data.
    pub offset: u64,
}

/// What the walk over a header found: where tensor data starts and every tensor's entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufLayout {
    /// The GGUF version (2 or 3).
    pub version: u32,
    /// The alignment of tensor data.
    pub alignment: u64,
    /// The byte offset in the file where tensor data starts.
    pub tensor_data_offset: u64,
    /// The number of metadata entries.
    pub metadata_entries: u64,
    /// The tensors, in file order.
    pub tensors: Vec<TensorEntry>,
}

/// The ggml name of a tensor type id, for ids ggml has assigned.
pub fn ggml_type_name(type_id: u32) -> Option<&'static str> {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES.get(usize::try_from(type_id).ok()?).copied()
}

/// The tensor types this crate loads (candle reads each and can dequantize it), by ggml id.
pub fn loadable_type(type_id: u32) -> Option<GgmlDType> {
    Some(match type_id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// Reads a GGUF header from `reader` (positioned at the file's start, `file_len` bytes long)
/// and checks it: structure, metadata value types, tensor types, and that every tensor's data
/// lies inside the file. Allocates only the keys and tensor names it reads.
pub fn check_gguf_layout(reader: &mut impl Read, file_len: u64, path: &Path) -> Result<GgufLayout> {
    let mut walk = Walk {
        reader,
        position: 0,
        file_len,
        path,
        metadata_memory: 0,
    };
    let layout = walk.header()?;
    for tensor in &layout.tensors {
        check_tensor(path, &layout, tensor, file_len)?;
    }
    Ok(layout)
}

/// Reads a GGUF header with candle after [`check_gguf_layout`] has checked it, then checks
/// the sizes its metadata declares against the file ([`check_declared_sizes`]).
pub fn read_gguf_header<R: Read + Seek>(reader: &mut R, path: &Path) -> Result<Content> {
    let io_error = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_len = reader.seek(SeekFrom::End(0)).map_err(io_error)?;
    reader.seek(SeekFrom::Start(0)).map_err(io_error)?;
    let layout = check_gguf_layout(reader, file_len, path)?;
    reader.seek(SeekFrom::Start(0)).map_err(io_error)?;
    let content = Content::read(reader).map_err(|error| corrupt(path, error.to_string()))?;
    if content.tensor_data_offset != layout.tensor_data_offset
        || content.tensor_infos.len() != layout.tensors.len()
    {
        return Err(corrupt(
            path,
            "the header reads differently on a second pass".to_owned(),
        ));
    }
    check_declared_sizes(path, &content)?;
    Ok(content)
}

/// Checks counts the metadata declares against what the file holds, so no one allocates by
/// them: `{arch}.block_count` is at most the number of tensors (each layer has at least one;
/// vocabulary-only files, with no tensors, are exempt), `tokenizer.ggml.tokens` is not empty,
/// and `token_embd.weight`, when present, has one row per token.
pub fn check_declared_sizes(path: &Path, content: &Content) -> Result<()> {
    let metadata_error = |key: &str, reason: String| ModelError::Metadata {
        path: path.to_path_buf(),
        key: key.to_owned(),
        reason,
    };
    let tensors = content.tensor_infos.len() as u64;
    if let Some(Value::String(architecture)) = content.metadata.get("general.architecture") {
        let key = format!("{architecture}.block_count");
        let layers = content.metadata.get(&key).and_then(unsigned);
        if let Some(layers) = layers.filter(|&layers| tensors > 0 && layers > tensors) {
            let reason = format!("{layers} layers, but the file holds only {tensors} tensors");
            return Err(metadata_error(&key, reason));
        }
    }
    let key = "tokenizer.ggml.tokens";
    let Some(Value::Array(tokens)) = content.metadata.get(key) else {
        return Ok(());
    };
    if tokens.is_empty() {
        return Err(metadata_error(key, "the vocabulary is empty".to_owned()));
    }
    let name = "token_embd.weight";
    if let Some(info) = content.tensor_infos.get(name) {
        let dims = info.shape.dims();
        if dims.first() != Some(&tokens.len()) {
            let mut expected = dims.to_vec();
            match expected.first_mut() {
                Some(rows) => *rows = tokens.len(),
                None => expected.push(tokens.len()),
            }
            return Err(ModelError::TensorShape {
                path: path.to_path_buf(),
                tensor: name.to_owned(),
                expected,
                actual: dims.to_vec(),
            });
        }
    }
    Ok(())
}

/// A metadata value as an unsigned integer, when it is a non-negative integer.
fn unsigned(value: &Value) -> Option<u64> {
    match value {
        Value::U8(v) => Some(u64::from(*v)),
        Value::U16(v) => Some(u64::from(*v)),
        Value::U32(v) => Some(u64::from(*v)),
        Value::U64(v) => Some(*v),
        Value::I8(v) => u64::try_from(*v).ok(),
        Value::I16(v) => u64::try_from(*v).ok(),
        Value::I32(v) => u64::try_from(*v).ok(),
        Value::I64(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

fn corrupt(path: &Path, reason: String) -> ModelError {
    ModelError::CorruptFile {
        path: path.to_path_buf(),
        reason,
    }
}

fn tensor_error(path: &Path, tensor: &str, reason: String) -> ModelError {
    ModelError::TensorData {
        path: path.to_path_buf(),
        tensor: tensor.to_owned(),
        reason,
    }
}

/// Checks one tensor: a type this crate loads, at least one dim and an element count neither
/// zero nor beyond counting, rows of whole blocks, an aligned offset, and data inside the file.
fn check_tensor(
    path: &Path,
    layout: &GgufLayout,
    tensor: &TensorEntry,
    file_len: u64,
) -> Result<()> {
    let name = tensor.name.as_str();
    let Some(dtype) = loadable_type(tensor.type_id) else {
        return Err(ModelError::UnsupportedTensorType {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
            type_id: tensor.type_id,
            type_name: ggml_type_name(tensor.type_id).unwrap_or("unknown"),
        });
    };
    // Candle's reader views an empty buffer's (dangling, unaligned) pointer as a slice of
    // blocks, which is undefined behaviour: a tensor without values is refused.
    if tensor.dims.is_empty() || tensor.dims.contains(&0) {
        let reason = format!("dims {:?} hold no values", tensor.dims);
        return Err(tensor_error(path, name, reason));
    }
    let elements = tensor
        .dims
        .iter()
        .try_fold(1u64, |product, &dim| product.checked_mul(dim))
        .filter(|&product| product <= i64::MAX as u64 && usize::try_from(product).is_ok());
    let Some(elements) = elements else {
        let reason = format!(
            "dims {:?} hold more elements than can be counted",
            tensor.dims
        );
        return Err(tensor_error(path, name, reason));
    };
    let block = dtype.block_size() as u64;
    let row = tensor.dims.first().copied().unwrap_or(1);
    if !row.is_multiple_of(block) {
        let reason = format!("rows of {row} values do not fill whole {dtype:?} blocks of {block}");
        return Err(tensor_error(path, name, reason));
    }
    if !tensor.offset.is_multiple_of(layout.alignment) {
        let reason = format!(
            "data offset {} is not a multiple of the alignment {}",
            tensor.offset, layout.alignment
        );
        return Err(tensor_error(path, name, reason));
    }
    // Saturated: a size past u64 is past the end of any file.
    let bytes = (elements / block).saturating_mul(dtype.type_size() as u64);
    let end = layout
        .tensor_data_offset
        .checked_add(tensor.offset)
        .and_then(|start| start.checked_add(bytes));
    match end {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(tensor_error(
            path,
            name,
            format!(
                "{bytes} bytes of data at offset {} past the tensor data start {} run past the \
                 end of the file ({file_len} bytes)",
                tensor.offset, layout.tensor_data_offset
            ),
        )),
    }
}

/// GGUF metadata value types, by id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueKind {
    /// A fixed-size number of this many bytes.
    Number(u64),
    /// A byte that must be 0 or 1.
    Bool,
    /// A length-prefixed string.
    String,
    /// A typed, length-prefixed array.
    Array,
}

impl ValueKind {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 | 1 => Self::Number(1),
            2 | 3 => Self::Number(2),
            4..=6 => Self::Number(4),
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10..=12 => Self::Number(8),
            _ => return None,
        })
    }

    /// The fewest bytes one value of this kind takes in the file.
    fn min_bytes(self) -> u64 {
        match self {
            Self::Number(bytes) => bytes,
            Self::Bool => 1,
            Self::String => 8,
            Self::Array => 12,
        }
    }
}

/// Where a read failure happened, for its error.
enum Place<'a> {
    /// The fixed header or a metadata key.
    Header(&'a str),
    /// The value of a metadata key.
    Key(&'a str),
    /// A tensor's entry.
    Tensor(&'a str),
}

/// The state of the walk: a reader and how far into the file it is.
struct Walk<'r, 'p, R: Read> {
    reader: &'r mut R,
    position: u64,
    file_len: u64,
    path: &'p Path,
    /// Bytes candle will hold for the metadata read so far.
    metadata_memory: u64,
}

impl<R: Read> Walk<'_, '_, R> {
    fn remaining(&self) -> u64 {
        self.file_len.saturating_sub(self.position)
    }

    fn error(&self, place: &Place<'_>, reason: String) -> ModelError {
        match place {
            Place::Header(what) => corrupt(self.path, format!("{what}: {reason}")),
            Place::Key(key) => ModelError::Metadata {
                path: self.path.to_path_buf(),
                key: (*key).to_owned(),
                reason,
            },
            Place::Tensor(name) => tensor_error(self.path, name, reason),
        }
    }

    fn bytes<const N: usize>(&mut self, place: &Place<'_>) -> Result<[u8; N]> {
        let mut buffer = [0u8; N];
        let at = self.position;
        if (N as u64) > self.remaining() {
            return Err(self.error(place, format!("the file ends at byte {}", self.file_len)));
        }
        self.reader
            .read_exact(&mut buffer)
            .map_err(|error| self.error(place, format!("reading at byte {at}: {error}")))?;
        self.position += N as u64;
        Ok(buffer)
    }

    fn u32(&mut self, place: &Place<'_>) -> Result<u32> {
        self.bytes::<4>(place).map(u32::from_le_bytes)
    }

    fn u64(&mut self, place: &Place<'_>) -> Result<u64> {
        self.bytes::<8>(place).map(u64::from_le_bytes)
    }

    /// Passes over `len` bytes without keeping them; `len` must not exceed what remains.
    fn skip(&mut self, len: u64, place: &Place<'_>) -> Result<()> {
        if len > self.remaining() {
            let reason = format!(
                "{len} bytes at byte {} run past the end of the file ({} bytes left)",
                self.position,
                self.remaining()
            );
            return Err(self.error(place, reason));
        }
        let copied = std::io::copy(
            &mut Read::by_ref(self.reader).take(len),
            &mut std::io::sink(),
        )
        .map_err(|error| self.error(place, format!("reading: {error}")))?;
        if copied != len {
            return Err(self.error(
                place,
                format!("the file ends at byte {}", self.position + copied),
            ));
        }
        self.position += len;
        Ok(())
    }

    /// A string's length, checked against what remains.
    fn string_len(&mut self, place: &Place<'_>) -> Result<u64> {
        let len = self.u64(place)?;
        if len > MAX_COUNT || len > self.remaining() {
            let reason = format!(
                "a string of {len} bytes at byte {} runs past the end of the file ({} bytes \
                 left)",
                self.position,
                self.remaining()
            );
            return Err(self.error(place, reason));
        }
        Ok(len)
    }

    /// Reads a string (a key or a tensor name), replacing invalid UTF-8 as candle does.
    fn string(&mut self, place: &Place<'_>) -> Result<String> {
        let len = self.string_len(place)?;
        let mut text = Vec::new();
        let read = Read::by_ref(self.reader)
            .take(len)
            .read_to_end(&mut text)
            .map_err(|error| self.error(place, format!("reading: {error}")))?;
        self.position += read as u64;
        if read as u64 != len {
            return Err(self.error(place, format!("the file ends at byte {}", self.position)));
        }
        while text.last() == Some(&0) {
            text.pop();
        }
        Ok(String::from_utf8_lossy(&text).into_owned())
    }

    /// Checks that `count` array elements of at least `min_bytes` each fit in what remains.
    fn elements_fit(&self, count: u64, min_bytes: u64, place: &Place<'_>) -> Result<()> {
        let needed = count.saturating_mul(min_bytes);
        if count > MAX_COUNT || needed > self.remaining() {
            let reason = format!(
                "an array of {count} elements needs at least {needed} bytes, but {} remain in \
                 the file",
                self.remaining()
            );
            return Err(self.error(place, reason));
        }
        Ok(())
    }

    fn header(&mut self) -> Result<GgufLayout> {
        let place = Place::Header("header");
        match self.u32(&place)? {
            GGUF_MAGIC => {}
            GGUF_MAGIC_SWAPPED => {
                return Err(self.error(&place, "big-endian GGUF files are not supported".into()));
            }
            magic => return Err(self.error(&place, format!("bad magic {magic:#010x}"))),
        }
        let version = self.u32(&place)?;
        if !(2..=3).contains(&version) {
            return Err(self.error(&place, format!("GGUF version {version} is not supported")));
        }
        let tensor_count = self.u64(&place)?;
        let metadata_entries = self.u64(&place)?;
        // A metadata entry is at least a key length, a type and one byte; a tensor entry at
        // least a name length, a dim count, a type and an offset.
        let least = metadata_entries
            .saturating_mul(8 + 4 + 1)
            .saturating_add(tensor_count.saturating_mul(8 + 4 + 4 + 8));
        if metadata_entries > MAX_COUNT || tensor_count > MAX_COUNT || least > self.remaining() {
            let reason = format!(
                "{metadata_entries} metadata entries and {tensor_count} tensors need at least \
                 {least} bytes, but {} remain in the file",
                self.remaining()
            );
            return Err(self.error(&place, reason));
        }
        let alignment = self.metadata(metadata_entries)?;
        let tensors = self.tensor_entries(tensor_count)?;
        let tensor_data_offset = self.position.div_ceil(alignment) * alignment;
        Ok(GgufLayout {
            version,
            alignment,
            tensor_data_offset,
            metadata_entries,
            tensors,
        })
    }

    /// Walks the metadata entries; returns the tensor data alignment.
    fn metadata(&mut self, entries: u64) -> Result<u64> {
        let mut keys = HashSet::new();
        let mut alignment = DEFAULT_ALIGNMENT;
        for index in 0..entries {
            let what = format!("metadata entry {index}'s key");
            let key = self.string(&Place::Header(&what))?;
            let place = Place::Key(&key);
            if keys.contains(&key) {
                return Err(self.error(&place, "the key appears twice".to_owned()));
            }
            let type_id = self.u32(&place)?;
            let Some(kind) = ValueKind::from_id(type_id) else {
                return Err(self.error(&place, format!("unknown value type {type_id}")));
            };
            if key == ALIGNMENT_KEY {
                alignment = self.alignment(type_id, &place)?;
            } else {
                self.value(kind, &place)?;
            }
            self.add_metadata_memory(key.len() as u64 + VALUE_BYTES, &place)?;
            keys.insert(key);
        }
        Ok(alignment)
    }

    /// Reads `general.alignment`: a `u32` power of two.
    fn alignment(&mut self, type_id: u32, place: &Place<'_>) -> Result<u64> {
        const U32: u32 = 4;
        if type_id != U32 {
            return Err(self.error(place, format!("expected a u32, found value type {type_id}")));
        }
        let alignment = self.u32(place)?;
        if !alignment.is_power_of_two() {
            return Err(self.error(place, format!("{alignment} is not a power of two")));
        }
        Ok(u64::from(alignment))
    }

    fn add_metadata_memory(&mut self, bytes: u64, place: &Place<'_>) -> Result<()> {
        self.metadata_memory = self.metadata_memory.saturating_add(bytes);
        if self.metadata_memory > MAX_METADATA_MEMORY {
            let reason = format!(
                "the metadata would take more than {MAX_METADATA_MEMORY} bytes of memory once read"
            );
            return Err(self.error(place, reason));
        }
        Ok(())
    }

    /// Passes over one value of `kind`, checking it.
    fn value(&mut self, kind: ValueKind, place: &Place<'_>) -> Result<()> {
        match kind {
            ValueKind::Number(bytes) => self.skip(bytes, place),
            ValueKind::Bool => match self.bytes::<1>(place)? {
                [0 | 1] => Ok(()),
                [other] => Err(self.error(place, format!("bool byte {other} is neither 0 nor 1"))),
            },
            ValueKind::String => {
                let len = self.string_len(place)?;
                self.skip(len, place)?;
                self.add_metadata_memory(len, place)
            }
            ValueKind::Array => self.array(place),
        }
    }

    fn array(&mut self, place: &Place<'_>) -> Result<()> {
        let type_id = self.u32(place)?;
        let kind = match ValueKind::from_id(type_id) {
            None => return Err(self.error(place, format!("unknown array element type {type_id}"))),
            Some(ValueKind::Array) => {
                return Err(self.error(place, "arrays of arrays are not supported".to_owned()));
            }
            Some(kind) => kind,
        };
        let len = self.u64(place)?;
        self.elements_fit(len, kind.min_bytes(), place)?;
        self.add_metadata_memory(len.saturating_mul(VALUE_BYTES), place)?;
        match kind {
            ValueKind::Number(bytes) => self.skip(len * bytes, place),
            _ => (0..len).try_for_each(|_| self.value(kind, place)),
        }
    }

    fn tensor_entries(&mut self, count: u64) -> Result<Vec<TensorEntry>> {
        let mut names = HashSet::new();
        let mut tensors = Vec::new();
        for index in 0..count {
            let what = format!("tensor entry {index}'s name");
            let name = self.string(&Place::Header(&what))?;
            let place = Place::Tensor(&name);
            if names.contains(&name) {
                return Err(self.error(&place, "the name appears twice".to_owned()));
            }
            let dim_count = self.u32(&place)?;
            if dim_count > MAX_DIMS {
                let reason = format!("{dim_count} dims, at most {MAX_DIMS} are allowed");
                return Err(self.error(&place, reason));
            }
            let dims = (0..dim_count)
                .map(|_| self.u64(&place))
                .collect::<Result<Vec<_>>>()?;
            let type_id = self.u32(&place)?;
            let offset = self.u64(&place)?;
            names.insert(name.clone());
            tensors.push(TensorEntry {
                name,
                dims,
                type_id,
                offset,
            });
        }
        Ok(tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GGUF bytes built by hand: a header, then whatever the test appends.
    struct Bytes(Vec<u8>);

    impl Bytes {
        fn header(version: u32, tensors: u64, entries: u64) -> Self {
            let mut bytes = Self(Vec::new());
            bytes.u32(GGUF_MAGIC).u32(version).u64(tensors).u64(entries);
            bytes
        }
        fn u32(&mut self, value: u32) -> &mut Self {
            self.0.extend_from_slice(&value.to_le_bytes());
            self
        }
        fn u64(&mut self, value: u64) -> &mut Self {
            self.0.extend_from_slice(&value.to_le_bytes());
            self
        }
        fn string(&mut self, text: &str) -> &mut Self {
            self.u64(text.len() as u64);
            self.0.extend_from_slice(text.as_bytes());
            self
        }
        /// A tensor entry with `dims` (ggml order), type and offset.
        fn tensor(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
            self.string(name).u32(dims.len() as u32);
            dims.iter().for_each(|&dim| {
                self.u64(dim);
            });
            self.u32(type_id).u64(offset)
        }
        /// Pads to 32 bytes and appends `data` bytes of tensor data.
        fn data(&mut self, data: usize) -> &mut Self {
            self.0.resize(self.0.len().div_ceil(32) * 32 + data, 0);
            self
        }
        fn check(&self) -> Result<GgufLayout> {
            check_gguf_layout(&mut &self.0[..], self.0.len() as u64, Path::new("t.gguf"))
        }
    }

    /// Writes a metadata value's type and bytes.
    type WriteValue = fn(&mut Bytes);

    fn metadata_key(error: ModelError) -> String {
        match error {
            ModelError::Metadata { key, .. } => key,
            other => panic!("expected a metadata error, got {other}"),
        }
    }

    fn tensor_name(error: ModelError) -> String {
        match error {
            ModelError::TensorData { tensor, .. } => tensor,
            other => panic!("expected a tensor data error, got {other}"),
        }
    }

    #[test]
    fn a_well_formed_header_gives_its_layout() {
        let mut bytes = Bytes::header(3, 2, 1);
        bytes.string("general.alignment").u32(4).u32(64);
        bytes.tensor("a", &[4, 2], 0, 0).tensor("b", &[32], 8, 64);
        let end = bytes.0.len() as u64;
        bytes.0.resize(end.div_ceil(64) as usize * 64 + 64 + 34, 0);
        let layout = bytes.check().unwrap();
        assert_eq!(layout.version, 3);
        assert_eq!(layout.alignment, 64);
        assert_eq!(layout.tensor_data_offset, end.div_ceil(64) * 64);
        assert_eq!(layout.metadata_entries, 1);
        let names: Vec<&str> = layout.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(layout.tensors[1].dims, [32]);
        assert_eq!(layout.tensors[1].offset, 64);
        // One byte less and the Q8_0 tensor's 34 bytes no longer fit.
        bytes.0.pop();
        assert_eq!(tensor_name(bytes.check().unwrap_err()), "b");
    }

    #[test]
    fn bad_magic_versions_and_byte_order_are_refused() {
        for (magic, version, expected) in [
            (0x1234_5678, 3, "bad magic 0x12345678"),
            (GGUF_MAGIC_SWAPPED, 3, "big-endian"),
            (GGUF_MAGIC, 1, "version 1"),
            (GGUF_MAGIC, 4, "version 4"),
        ] {
            let mut bytes = Bytes(Vec::new());
            bytes.u32(magic).u32(version).u64(0).u64(0);
            let error = bytes.check().unwrap_err();
            assert!(matches!(error, ModelError::CorruptFile { .. }), "{error}");
            assert!(error.to_string().contains(expected), "{error}");
        }
        let error = Bytes(b"GGU".to_vec()).check().unwrap_err();
        assert!(
            error.to_string().contains("the file ends at byte 3"),
            "{error}"
        );
    }

    #[test]
    fn a_zero_or_odd_alignment_is_refused_by_name() {
        // Candle divides by this value: zero would panic there.
        for (type_id, value) in [(4, 0), (4, 48), (5, 32)] {
            let mut bytes = Bytes::header(3, 0, 1);
            bytes.string(ALIGNMENT_KEY).u32(type_id).u32(value);
            assert_eq!(metadata_key(bytes.check().unwrap_err()), ALIGNMENT_KEY);
        }
    }

    #[test]
    fn counts_beyond_the_file_are_refused_before_any_allocation() {
        let error = Bytes::header(3, 1 << 40, 0).check().unwrap_err();
        assert!(matches!(error, ModelError::CorruptFile { .. }), "{error}");
        assert!(
            error.to_string().contains("1099511627776 tensors"),
            "{error}"
        );
        let mut bytes = Bytes::header(3, 0, 1);
        bytes
            .string("tokenizer.ggml.scores")
            .u32(9)
            .u32(6)
            .u64(1_000_000_000_000);
        let error = bytes.check().unwrap_err();
        assert!(
            error.to_string().contains("1000000000000 elements"),
            "{error}"
        );
        assert_eq!(metadata_key(error), "tokenizer.ggml.scores");
    }

    #[test]
    fn malformed_values_name_their_key() {
        let cases: [(&str, WriteValue); 5] = [
            ("unknown", |b| {
                b.u32(13);
            }),
            ("nested", |b| {
                b.u32(9).u32(9).u64(0);
            }),
            ("bool", |b| {
                b.u32(7).0.push(2);
            }),
            ("long", |b| {
                b.u32(8).u64(1 << 20).0.extend_from_slice(b"short");
            }),
            ("strings", |b| {
                b.u32(9).u32(8).u64(2).string("one").u64(9);
            }),
        ];
        for (key, write_value) in cases {
            let mut bytes = Bytes::header(3, 0, 1);
            bytes.string(key);
            write_value(&mut bytes);
            assert_eq!(metadata_key(bytes.check().unwrap_err()), key);
        }
        let mut bytes = Bytes::header(3, 0, 2);
        bytes
            .string("twice")
            .u32(4)
            .u32(1)
            .string("twice")
            .u32(4)
            .u32(2);
        assert_eq!(metadata_key(bytes.check().unwrap_err()), "twice");
    }

    #[test]
    fn metadata_that_would_take_too_much_memory_is_refused() {
        // Each u8 element is one byte in the file but a whole `Value` in candle's reader.
        let elements = MAX_METADATA_MEMORY / VALUE_BYTES + 1;
        let mut bytes = Bytes::header(3, 0, 1);
        bytes.string("bytes").u32(9).u32(0).u64(elements);
        bytes.0.resize(bytes.0.len() + elements as usize, 0);
        let error = bytes.check().unwrap_err();
        assert!(error.to_string().contains("memory"), "{error}");
        assert_eq!(metadata_key(error), "bytes");
    }

    #[test]
    fn malformed_tensor_entries_name_the_tensor() {
        let cases: [(&[u64], u32, u64, &str); 6] = [
            (&[1 << 32, 1 << 32, 2], 0, 0, "more elements"),
            (&[1, 1, 1, 1, 1], 0, 0, "5 dims"),
            (&[48], 12, 0, "whole Q4K blocks of 256"),
            (&[8], 0, 16, "not a multiple of the alignment 32"),
            (&[8], 0, 1 << 62, "run past the end"),
            (&[1 << 62], 0, 0, "run past the end"),
        ];
        for (dims, type_id, offset, expected) in cases {
            let mut bytes = Bytes::header(3, 1, 0);
            bytes
                .tensor("blk.0.attn_q.weight", dims, type_id, offset)
                .data(64);
            let error = bytes.check().unwrap_err();
            assert!(error.to_string().contains(expected), "{expected}: {error}");
            assert_eq!(tensor_name(error), "blk.0.attn_q.weight");
        }
        let mut bytes = Bytes::header(3, 2, 0);
        bytes
            .tensor("x", &[8], 0, 0)
            .tensor("x", &[8], 0, 32)
            .data(64);
        assert_eq!(tensor_name(bytes.check().unwrap_err()), "x");
    }

    #[test]
    fn types_outside_the_loadable_list_are_named() {
        for (type_id, type_name) in [(16, "IQ2_XXS"), (9, "Q8_1"), (39, "MXFP4"), (77, "unknown")] {
            let mut bytes = Bytes::header(3, 1, 0);
            bytes.tensor("output.weight", &[256], type_id, 0).data(1024);
            match bytes.check().unwrap_err() {
                ModelError::UnsupportedTensorType {
                    tensor,
                    type_id: id,
                    type_name: name,
                    ..
                } => {
                    assert_eq!(
                        (tensor.as_str(), id, name),
                        ("output.weight", type_id, type_name)
                    );
                }
                other => panic!("expected an unsupported type, got {other}"),
            }
        }
        // Every loadable id is one candle's reader maps back to the same id.
        for type_id in 0..64 {
            if let Some(dtype) = loadable_type(type_id) {
                let ggml = ggml_type_name(type_id).map(|name| name.replace('_', ""));
                assert_eq!(ggml, Some(format!("{dtype:?}").replace('_', "")));
            }
        }
    }

    #[test]
    fn a_tensor_without_values_is_refused_and_a_file_without_tensors_passes() {
        let mut bytes = Bytes::header(2, 1, 0);
        bytes.tensor("empty", &[0, 1 << 40], 0, 0).data(0);
        let error = bytes.check().unwrap_err();
        assert!(error.to_string().contains("hold no values"), "{error}");
        assert_eq!(tensor_name(error), "empty");
        // No dims at all: candle refuses to build a scalar block tensor.
        let mut bytes = Bytes::header(3, 1, 0);
        bytes.tensor("scalar", &[], 0, 0).data(32);
        assert_eq!(tensor_name(bytes.check().unwrap_err()), "scalar");
        assert!(Bytes::header(3, 0, 0).check().unwrap().tensors.is_empty());
    }

    /// The fuzz target's seeds (scripts/make_gguf_seeds.py) must stay valid headers, or the
    /// fuzzer starts from inputs the walk refuses at once.
    #[test]
    fn the_fuzz_seeds_are_accepted() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/gguf_header");
        let mut seeds = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let layout = check_gguf_layout(&mut &bytes[..], bytes.len() as u64, &path);
            assert!(layout.is_ok(), "{}: {:?}", path.display(), layout.err());
            let mut reader = std::io::Cursor::new(&bytes);
            read_gguf_header(&mut reader, &path).unwrap();
            seeds += 1;
        }
        assert_eq!(seeds, 4);
    }
}
