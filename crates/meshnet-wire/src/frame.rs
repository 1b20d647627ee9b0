//! The activation frame and its body codec: raw or zstd, bounded by the declared shape.

use std::io::Read;

use bytes::Bytes;
use half::bf16;
use http::HeaderMap;

use crate::activations::{bf16_bytes_mut, fix_endianness};
use crate::header::{
    Encoding, FrameMeta, check_media, check_wire_version, read_meta, write_headers,
};
use crate::{Activations, Shape, WireError};

/// The zstd level of ADR-0008: near-lz4 speed with a better ratio.
pub const ZSTD_LEVEL: i32 = 1;

/// The default largest decoded payload a receiver accepts: 64 MiB, sixteen times a 128-token
/// chunk of a 16384-wide model.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Size limits a receiver enforces before it allocates anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest decoded payload (shape elements × 2 bytes) accepted.
    pub max_frame_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        }
    }
}

impl Limits {
    /// The largest body accepted on the wire: the frame limit, plus zstd's worst-case expansion
    /// of incompressible data.
    pub fn max_body_bytes(&self) -> usize {
        zstd::zstd_safe::compress_bound(self.max_frame_bytes)
    }

    /// Checks a declared shape against the frame limit.
    pub fn check_shape(&self, shape: &Shape) -> Result<(), WireError> {
        if shape.byte_len() > self.max_frame_bytes {
            return Err(WireError::FrameTooLarge {
                shape: shape.to_string(),
                declared_bytes: shape.byte_len() as u128,
                limit: self.max_frame_bytes,
            });
        }
        Ok(())
    }

    /// Checks the size of a body on the wire (or its declared Content-Length).
    pub fn check_body_len(&self, body_bytes: u64) -> Result<(), WireError> {
        if body_bytes > self.max_body_bytes() as u64 {
            return Err(WireError::BodyTooLarge {
                body_bytes,
                limit: self.max_body_bytes(),
            });
        }
        Ok(())
    }
}

/// One hop's worth of activations with the metadata that routes and places them.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivationFrame {
    /// Session, chunk, position, layers and route.
    pub meta: FrameMeta,
    /// The bfloat16 tensor.
    pub activations: Activations,
}

/// A frame ready for HTTP: its headers and its (possibly compressed) body.
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    /// The `X-Meshnet-*` headers plus `Content-Type`.
    pub headers: HeaderMap,
    /// The body bytes as they go on the wire.
    pub body: Bytes,
}

impl ActivationFrame {
    /// Encodes the frame for the wire, consuming it: a raw body hands the values over without a
    /// copy on little-endian machines.
    pub fn into_encoded(self, encoding: Encoding) -> EncodedFrame {
        let headers = write_headers(self.activations.shape(), &self.meta, encoding);
        let (_, values) = self.activations.into_parts();
        EncodedFrame {
            headers,
            body: encode_payload(values, encoding),
        }
    }

    /// Encodes a copy of the frame for the wire.
    pub fn encode(&self, encoding: Encoding) -> EncodedFrame {
        self.clone().into_encoded(encoding)
    }

    /// Decodes and validates a frame from its headers and body.
    ///
    /// Checks run in this order, so that the most useful complaint wins: wire version, content
    /// type, dtype, encoding, shape and the other headers, the frame and body limits, and last the
    /// body against the shape. Nothing larger than `limits` is ever allocated.
    pub fn decode(headers: &HeaderMap, body: &[u8], limits: &Limits) -> Result<Self, WireError> {
        check_wire_version(headers)?;
        let encoding = check_media(headers)?;
        let (shape, meta) = read_meta(headers)?;
        limits.check_shape(&shape)?;
        limits.check_body_len(body.len() as u64)?;
        let values = decode_payload(body, encoding, &shape)?;
        Ok(ActivationFrame {
            meta,
            activations: Activations::new(shape, values)?,
        })
    }
}

/// Owns bfloat16 values and lends them as little-endian bytes, so a raw body needs no copy.
struct LittleEndianValues(Vec<bf16>);

impl AsRef<[u8]> for LittleEndianValues {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Encodes bfloat16 values as a body in the given encoding.
pub fn encode_payload(mut values: Vec<bf16>, encoding: Encoding) -> Bytes {
    if cfg!(target_endian = "big") {
        for value in &mut values {
            *value = bf16::from_bits(value.to_bits().to_le());
        }
    }
    match encoding {
        Encoding::Raw => Bytes::from_owner(LittleEndianValues(values)),
        Encoding::Zstd => {
            let raw: &[u8] = bytemuck::cast_slice(&values);
            // Compressing an in-memory slice can only fail on allocation failure inside zstd.
            let compressed = zstd::bulk::compress(raw, ZSTD_LEVEL)
                .expect("zstd compression of an in-memory buffer");
            Bytes::from(compressed)
        }
    }
}

/// Decodes a body into exactly `shape.elements()` values.
///
/// The output buffer is sized from the shape (which the caller has bounded) before reading, and a
/// zstd stream that would inflate past it is cut off and rejected.
pub fn decode_payload(
    body: &[u8],
    encoding: Encoding,
    shape: &Shape,
) -> Result<Vec<bf16>, WireError> {
    let expected = shape.byte_len();
    match encoding {
        Encoding::Raw => {
            if body.len() != expected {
                return Err(WireError::LengthMismatch {
                    shape: shape.to_string(),
                    expected,
                    got: body.len(),
                });
            }
            let mut values = vec![bf16::ZERO; shape.elements()];
            bf16_bytes_mut(&mut values).copy_from_slice(body);
            fix_endianness(&mut values);
            Ok(values)
        }
        Encoding::Zstd => {
            let mut values = vec![bf16::ZERO; shape.elements()];
            let corrupt = |e: std::io::Error| WireError::CorruptCompression {
                reason: e.to_string(),
            };
            let mut decoder = zstd::stream::read::Decoder::with_buffer(body).map_err(corrupt)?;
            let filled = read_up_to(&mut decoder, bf16_bytes_mut(&mut values)).map_err(corrupt)?;
            if filled < expected {
                return Err(WireError::LengthMismatch {
                    shape: shape.to_string(),
                    expected,
                    got: filled,
                });
            }
            let mut probe = [0u8; 1];
            if read_up_to(&mut decoder, &mut probe).map_err(corrupt)? > 0 {
                return Err(WireError::DecompressedTooLarge {
                    shape: shape.to_string(),
                    expected,
                });
            }
            fix_endianness(&mut values);
            Ok(values)
        }
    }
}

/// Reads until `out` is full or the reader ends, returning how many bytes were read.
fn read_up_to(reader: &mut impl Read, out: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < out.len() {
        match reader.read(&mut out[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}
