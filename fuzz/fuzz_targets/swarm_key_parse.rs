//! Fuzzes swarm key file parsing (`--swarm-key FILE`, a file an operator may get wrong).
//!
//! Parsing must never panic, and every key that parses must write back to a file that
//! parses to the same key.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshnet_p2p::SwarmKey;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = SwarmKey::parse(data) else {
        return;
    };
    let again = SwarmKey::parse(key.to_file_text().as_bytes()).expect("a written key parses");
    assert_eq!(again, key);
});
