//! Fuzzes grant parsing (`X-Meshnet-Grant`, untrusted header text).
//!
//! Parsing must never panic, and every grant that parses must write back to a header value
//! that parses to the same grant and signature, its payload the grant's canonical one.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshnet_wire::grant::SignedGrant;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(signed) = SignedGrant::parse(text) else {
        return;
    };
    let again = SignedGrant::parse(&signed.grant.header_value(&signed.signature))
        .expect("a parsed grant's header value parses");
    assert_eq!(again.grant, signed.grant);
    assert_eq!(again.signature, signed.signature);
    assert_eq!(again.payload, signed.grant.payload());
});
