//! The `--api-keys` file.
//!
//! One key per line, then optional settings, separated by spaces or tabs:
//!
//! ```text
//! # comment lines and blank lines are skipped; a `#` word starts a comment to the line's end
//! sk-alice-0123456789 id=alice rpm=60 tpm=20000
//! sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 rpm=10
//! ```
//!
//! - the key: any word (kept only as its SHA-256), or `sha256:` and the 64 hex digits of the
//!   SHA-256 of the key's UTF-8 bytes, so that the file holds no plaintext key;
//! - `id=NAME`: the name the key is counted under in metrics (`A-Z a-z 0-9 _ . -`, at most
//!   64); by default the first 8 hex digits of the key's hash; never the key itself;
//! - `rpm=N`: at most N requests in any 60 seconds (N ≥ 1); none: no limit;
//! - `tpm=N`: at most N tokens (prompt and completion) in any 60 seconds (N ≥ 1).

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use crate::ApiKeysError;

/// The prefix of a hashed key in the file.
const HASH_PREFIX: &str = "sha256:";

/// The longest `id=` accepted.
const MAX_ID_LEN: usize = 64;

/// The SHA-256 of a key's UTF-8 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyHash(pub [u8; 32]);

impl KeyHash {
    /// The hash as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }
}

/// The hash of `key` as the file and the book keep it.
pub fn hash_key(key: &str) -> KeyHash {
    KeyHash(Sha256::digest(key.as_bytes()).into())
}

/// A key's per-minute limits; `None` is unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Requests in any [`WINDOW_SECONDS`](crate::WINDOW_SECONDS) seconds.
    pub rpm: Option<u64>,
    /// Prompt and completion tokens in any [`WINDOW_SECONDS`](crate::WINDOW_SECONDS) seconds.
    pub tpm: Option<u64>,
}

/// One key of the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyEntry {
    /// The key's hash.
    pub hash: KeyHash,
    /// The name it is counted under.
    pub id: String,
    /// Its limits.
    pub limits: Limits,
}

/// Reads a key file's text: its keys in file order, or the first problem with its line number.
/// A key or an id given twice is an error, as is a file without keys.
pub fn parse_key_file(text: &str) -> Result<Vec<KeyEntry>, ApiKeysError> {
    let mut entries: Vec<KeyEntry> = Vec::new();
    let mut hashes: HashMap<KeyHash, usize> = HashMap::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let problem = |problem: String| ApiKeysError::Line {
            line: number,
            problem,
        };
        let Some(entry) = parse_line(line).map_err(problem)? else {
            continue;
        };
        if let Some(first) = hashes.insert(entry.hash, number) {
            return Err(problem(format!("the same key is on line {first}")));
        }
        if let Some(first) = ids.insert(entry.id.clone(), number) {
            return Err(problem(format!(
                "the id {:?} is also that of line {first}",
                entry.id
            )));
        }
        entries.push(entry);
    }
    if entries.is_empty() {
        return Err(ApiKeysError::NoKeys);
    }
    Ok(entries)
}

/// One line: `None` for a blank or comment line.
fn parse_line(line: &str) -> Result<Option<KeyEntry>, String> {
    let mut words = line
        .split_whitespace()
        .take_while(|word| !word.starts_with('#'));
    let Some(key) = words.next() else {
        return Ok(None);
    };
    let hash = parse_key(key)?;
    let mut id = None;
    let mut limits = Limits::default();
    for word in words {
        let Some((name, value)) = word.split_once('=') else {
            return Err(format!(
                "{word:?} is not a setting: expected id=NAME, rpm=N or tpm=N"
            ));
        };
        let duplicate = match name {
            "id" => id.replace(parse_id(value)?).is_some(),
            "rpm" => limits.rpm.replace(parse_limit(name, value)?).is_some(),
            "tpm" => limits.tpm.replace(parse_limit(name, value)?).is_some(),
            _ => {
                return Err(format!("unknown setting {name:?}: expected id, rpm or tpm"));
            }
        };
        if duplicate {
            return Err(format!("{name} is given twice"));
        }
    }
    let id = id.unwrap_or_else(|| hash.to_hex()[..8].to_owned());
    Ok(Some(KeyEntry { hash, id, limits }))
}

/// A plaintext key, or `sha256:` and 64 hex digits.
fn parse_key(word: &str) -> Result<KeyHash, String> {
    let Some(hex) = word.strip_prefix(HASH_PREFIX) else {
        return Ok(hash_key(word));
    };
    if hex.len() != 64 {
        return Err(format!(
            "a hashed key is sha256: and 64 hex digits, this one has {} characters after sha256:",
            hex.chars().count()
        ));
    }
    let mut bytes = [0u8; 32];
    for (byte, pair) in bytes.iter_mut().zip(hex.as_bytes().chunks(2)) {
        let digits = std::str::from_utf8(pair).ok();
        *byte = digits
            .and_then(|digits| u8::from_str_radix(digits, 16).ok())
            .ok_or_else(|| "a hashed key is sha256: and 64 hex digits (0-9, a-f)".to_owned())?;
    }
    Ok(KeyHash(bytes))
}

fn parse_id(value: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    if value.is_empty() || value.len() > MAX_ID_LEN || !value.chars().all(allowed) {
        return Err(format!(
            "id {value:?}: an id is 1 to {MAX_ID_LEN} of A-Z a-z 0-9 _ . -"
        ));
    }
    Ok(value.to_owned())
}

fn parse_limit(name: &str, value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(limit) if limit >= 1 => Ok(limit),
        _ => Err(format!(
            "{name}={value}: a limit is a whole number from 1 to {}",
            u64::MAX
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The SHA-256 of "test".
    const TEST_HASH: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn line_error(text: &str) -> (usize, String) {
        match parse_key_file(text) {
            Err(ApiKeysError::Line { line, problem }) => (line, problem),
            other => panic!("expected a line error for {text:?}, got {other:?}"),
        }
    }

    #[test]
    fn reads_keys_hashes_ids_and_limits() {
        let text = format!(
            "# keys of the mesh\n\n  first id=alice rpm=60 tpm=20000  # alice's\n\
             sha256:{} \t rpm=5\r\nsk-other\n",
            TEST_HASH.to_uppercase()
        );
        let entries = parse_key_file(&text).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].hash, hash_key("first"));
        assert_eq!(entries[0].id, "alice");
        assert_eq!(
            entries[0].limits,
            Limits {
                rpm: Some(60),
                tpm: Some(20000)
            }
        );
        assert_eq!(entries[1].hash, hash_key("test"));
        assert_eq!(entries[1].hash.to_hex(), TEST_HASH);
        assert_eq!(entries[1].id, "9f86d081");
        assert_eq!(
            entries[1].limits,
            Limits {
                rpm: Some(5),
                tpm: None
            }
        );
        assert_eq!(entries[2].id, hash_key("sk-other").to_hex()[..8]);
        assert_eq!(entries[2].limits, Limits::default());
    }

    #[test]
    fn a_plaintext_key_and_its_hash_are_the_same_key() {
        let text = format!("test\nsha256:{TEST_HASH}\n");
        assert_eq!(
            line_error(&text),
            (2, "the same key is on line 1".to_owned())
        );
    }

    #[test]
    fn malformed_lines_name_their_line_and_problem() {
        let cases: [(&str, usize, &str); 10] = [
            ("k1\nk2 rpm=0\n", 2, "rpm=0: a limit is a whole number"),
            ("k1 tpm=-3\n", 1, "tpm=-3: a limit is a whole number"),
            ("k1 rpm=ten\n", 1, "rpm=ten: a limit is a whole number"),
            ("\n\nk1 burst=3\n", 3, "unknown setting \"burst\""),
            ("k1 60\n", 1, "\"60\" is not a setting"),
            ("k1 rpm=1 rpm=2\n", 1, "rpm is given twice"),
            (
                "k1 id=a\nk2 id=a\n",
                2,
                "the id \"a\" is also that of line 1",
            ),
            ("k1 id=al/ice\n", 1, "id \"al/ice\": an id is 1 to 64"),
            (
                "sha256:abc\n",
                1,
                "a hashed key is sha256: and 64 hex digits, this one has 3 characters",
            ),
            ("k1 id=\n", 1, "id \"\": an id is 1 to 64"),
        ];
        for (text, line, start) in cases {
            let (got_line, problem) = line_error(text);
            assert_eq!(got_line, line, "{text:?}");
            assert!(problem.starts_with(start), "{text:?}: {problem}");
        }
        let not_hex = format!("sha256:{}zz\n", &TEST_HASH[..62]);
        assert_eq!(
            line_error(&not_hex),
            (
                1,
                "a hashed key is sha256: and 64 hex digits (0-9, a-f)".to_owned()
            )
        );
    }

    #[test]
    fn a_file_without_keys_is_refused() {
        assert_eq!(parse_key_file(""), Err(ApiKeysError::NoKeys));
        assert_eq!(
            parse_key_file("# only\n\n   \n# comments\n"),
            Err(ApiKeysError::NoKeys)
        );
    }

    #[test]
    fn errors_never_hold_the_key() {
        let (_, problem) = line_error("sk-secret-value rpm=x\n");
        assert!(!problem.contains("sk-secret-value"), "{problem}");
    }

    proptest::proptest! {
        /// Keys written back as their hashes with their settings read back as the same keys.
        #[test]
        fn keys_read_back_from_their_hashes(
            keys in proptest::collection::vec(
                ("[!-~&&[^#]][!-~]{0,20}", proptest::option::of("[a-z0-9_.-]{1,10}"),
                 proptest::option::of(1u64..1000), proptest::option::of(1u64..100_000)),
                1..6,
            ),
        ) {
            let text: String = keys
                .iter()
                .map(|(key, id, rpm, tpm)| {
                    let id = id.as_ref().map_or(String::new(), |id| format!(" id={id}"));
                    let rpm = rpm.map_or(String::new(), |rpm| format!(" rpm={rpm}"));
                    let tpm = tpm.map_or(String::new(), |tpm| format!(" tpm={tpm}"));
                    format!("{key}{id}{rpm}{tpm}\n")
                })
                .collect();
            let Ok(entries) = parse_key_file(&text) else {
                // Two equal keys or ids: refused, which is not what this checks.
                return Ok(());
            };
            let written: String = entries
                .iter()
                .map(|entry| {
                    let mut line = format!("sha256:{} id={}", entry.hash.to_hex(), entry.id);
                    if let Some(rpm) = entry.limits.rpm {
                        line.push_str(&format!(" rpm={rpm}"));
                    }
                    if let Some(tpm) = entry.limits.tpm {
                        line.push_str(&format!(" tpm={tpm}"));
                    }
                    line + "\n"
                })
                .collect();
            proptest::prop_assert_eq!(parse_key_file(&written), Ok(entries.clone()));
            for (entry, (key, ..)) in entries.iter().zip(&keys) {
                if !key.starts_with(HASH_PREFIX) {
                    proptest::prop_assert_eq!(entry.hash, hash_key(key));
                }
            }
        }

        #[test]
        fn any_text_parses_or_names_a_line_without_panicking(text in "\\PC*(\n\\PC*){0,4}") {
            if let Err(ApiKeysError::Line { line, .. }) = parse_key_file(&text) {
                proptest::prop_assert!(line >= 1 && line <= text.lines().count());
            }
        }
    }
}
