//! Fuzzes activation frame decoding: arbitrary header values and an arbitrary body.
//!
//! The input is split at the first NUL byte: before it, newline-separated header values in a
//! fixed order (version, content type, dtype, shape, session, chunk index, chunk total, position,
//! layers, route, encoding, return-to, return ticket, rewind; a missing line leaves the header out);
//! after it, the body. Decoding
//! must never panic, never allocate past the frame limit, and every success must re-encode to a
//! frame that decodes to itself.

#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use meshnet_wire::header::{
    CHUNK_INDEX, CHUNK_TOTAL, DTYPE, ENCODING, LAYERS, POSITION, REWIND, ROUTE, SESSION, SHAPE,
    WIRE_VERSION_HEADER,
};
use meshnet_wire::return_address::{RETURN_TICKET, RETURN_TO};
use meshnet_wire::{ActivationFrame, Encoding, Limits};

const NAMES: [&str; 14] = [
    WIRE_VERSION_HEADER,
    "content-type",
    DTYPE,
    SHAPE,
    SESSION,
    CHUNK_INDEX,
    CHUNK_TOTAL,
    POSITION,
    LAYERS,
    ROUTE,
    ENCODING,
    RETURN_TO,
    RETURN_TICKET,
    REWIND,
];

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let (head, body) = data.split_at(split);
    let body = body.get(1..).unwrap_or(&[]);
    let mut headers = HeaderMap::new();
    for (name, line) in NAMES.iter().zip(head.split(|&b| b == b'\n')) {
        if let Ok(value) = HeaderValue::from_bytes(line) {
            if !line.is_empty() {
                headers.insert(*name, value);
            }
        }
    }
    let limits = Limits { max_frame_bytes: 1 << 20 };
    if let Ok(frame) = ActivationFrame::decode(&headers, body, &limits) {
        let encoding = Encoding::from_headers(&headers).unwrap_or_default();
        let again = frame.encode(encoding);
        let back = ActivationFrame::decode(&again.headers, &again.body, &limits)
            .expect("a decoded frame re-encodes to a valid frame");
        assert_eq!(back.meta, frame.meta);
        let bits = |f: &ActivationFrame| -> Vec<u16> {
            f.activations.values().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(&back), bits(&frame));
    }
});
