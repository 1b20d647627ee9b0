//! Fuzzes control message decoding: the input is decoded as every control message type.
//!
//! Decoding must never panic and never allocate past the message limit, and every message
//! that decodes must re-encode to bytes that decode and re-encode to the same bytes (byte
//! comparison, so a NaN throughput does not count as a mismatch).

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshnet_p2p::{
    CoverageMessage, DirectiveMessage, PeerAnnouncement, TrackerRecord, decode, encode,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

fn check<T: Serialize + DeserializeOwned>(data: &[u8]) {
    let Ok(message) = decode::<T>(data) else {
        return;
    };
    let encoded = encode(&message).expect("a decoded message re-encodes");
    let again = decode::<T>(&encoded).expect("a re-encoded message decodes");
    let encoded_again = encode(&again).expect("a decoded message re-encodes");
    assert_eq!(encoded, encoded_again);
}

fuzz_target!(|data: &[u8]| {
    check::<PeerAnnouncement>(data);
    check::<CoverageMessage>(data);
    check::<DirectiveMessage>(data);
    check::<TrackerRecord>(data);
});
