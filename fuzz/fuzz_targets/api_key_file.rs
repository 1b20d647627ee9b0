//! Fuzzes reading an `--api-keys` file (operator input, but read at start with no second
//! chance: it must never panic, only name a line).
//!
//! The input, as UTF-8, is the file. Reading it may not panic; a problem names a line the
//! file has; a file read whole, written back with every key as its `sha256:` form and its
//! settings, reads back as the same keys; and every id is 1 to 64 of `A-Z a-z 0-9 _ . -`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshnet_apikeys::{ApiKeysError, parse_key_file};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let entries = match parse_key_file(text) {
        Ok(entries) => entries,
        Err(ApiKeysError::Line { line, .. }) => {
            assert!(
                line >= 1 && line <= text.lines().count(),
                "line {line} of {text:?}"
            );
            return;
        }
        Err(ApiKeysError::NoKeys) => return,
    };
    let mut written = String::new();
    for entry in &entries {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
        assert!(!entry.id.is_empty() && entry.id.len() <= 64 && entry.id.chars().all(allowed));
        written.push_str(&format!("sha256:{} id={}", entry.hash.to_hex(), entry.id));
        if let Some(rpm) = entry.limits.rpm {
            written.push_str(&format!(" rpm={rpm}"));
        }
        if let Some(tpm) = entry.limits.tpm {
            written.push_str(&format!(" tpm={tpm}"));
        }
        written.push('\n');
    }
    assert_eq!(parse_key_file(&written).as_ref(), Ok(&entries));
});
