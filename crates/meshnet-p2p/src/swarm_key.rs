//! The pre-shared key of a private mesh, in libp2p's `swarm.key` file format.
//!
//! The file is three lines: the key type `/key/swarm/psk/1.0.0/`, the encoding `/base16/`,
//! and the 32 key bytes as 64 hexadecimal digits. It is the format go-libp2p and Kubo read, so
//! a key made by another tool works here and ours works there. Lines may end in `\r\n`;
//! blank lines may follow the key, nothing else may.
//!
//! Parsing is pure (built without the `network` feature, for the fuzz target); reading and
//! writing a key file is here too, since it is only the standard library.

use std::fmt;
use std::fs::OpenOptions;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::P2pError;

/// The first line of a swarm key file: the key type.
pub const SWARM_KEY_TYPE: &str = "/key/swarm/psk/1.0.0/";

/// The second line of a swarm key file: the encoding of the key line.
pub const SWARM_KEY_ENCODING: &str = "/base16/";

/// Bytes in a swarm key.
pub const SWARM_KEY_BYTES: usize = 32;

/// The largest swarm key file read: a valid one is 95 bytes; anything far bigger is the
/// wrong file, and reading stops before it fills memory.
pub const MAX_SWARM_KEY_FILE_BYTES: usize = 4096;

/// The pre-shared key every member of a private mesh holds.
///
/// Its `Debug` form never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct SwarmKey([u8; SWARM_KEY_BYTES]);

/// What is wrong with a text that should be a swarm key file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SwarmKeyProblem {
    /// The file is bigger than [`MAX_SWARM_KEY_FILE_BYTES`].
    TooLarge,
    /// The bytes are not UTF-8 text.
    NotText,
    /// The file has fewer than the three lines of the format.
    MissingLines {
        /// The lines found.
        found: usize,
    },
    /// The first line is not [`SWARM_KEY_TYPE`].
    WrongKeyType,
    /// The second line is not [`SWARM_KEY_ENCODING`].
    WrongEncoding,
    /// The key line does not hold 64 characters.
    WrongLength {
        /// The characters it holds.
        found: usize,
    },
    /// The key line holds a character that is not a hexadecimal digit.
    NotHex {
        /// Its position in the key line, from 0.
        position: usize,
    },
    /// A line that is not blank follows the key line.
    TrailingContent {
        /// Its line number, from 1.
        line: usize,
    },
}

impl fmt::Display for SwarmKeyProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SwarmKeyProblem::TooLarge => write!(
                f,
                "it is larger than {MAX_SWARM_KEY_FILE_BYTES} bytes, not a swarm key file"
            ),
            SwarmKeyProblem::NotText => write!(f, "it is not UTF-8 text"),
            SwarmKeyProblem::MissingLines { found } => write!(
                f,
                "it has {found} line(s); a swarm key file has three: {SWARM_KEY_TYPE}, \
                 {SWARM_KEY_ENCODING} and the key in 64 hexadecimal digits"
            ),
            SwarmKeyProblem::WrongKeyType => {
                write!(f, "its first line is not {SWARM_KEY_TYPE}")
            }
            SwarmKeyProblem::WrongEncoding => write!(
                f,
                "its second line is not {SWARM_KEY_ENCODING} (the only encoding supported)"
            ),
            SwarmKeyProblem::WrongLength { found } => write!(
                f,
                "its key line has {found} characters; a key is {} hexadecimal digits",
                SWARM_KEY_BYTES * 2
            ),
            SwarmKeyProblem::NotHex { position } => write!(
                f,
                "its key line has a character that is not a hexadecimal digit at position \
                 {position}"
            ),
            SwarmKeyProblem::TrailingContent { line } => {
                write!(
                    f,
                    "line {line} follows the key; nothing but blank lines may"
                )
            }
        }
    }
}

impl SwarmKey {
    /// The key made of these bytes.
    pub fn from_bytes(bytes: [u8; SWARM_KEY_BYTES]) -> Self {
        SwarmKey(bytes)
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; SWARM_KEY_BYTES] {
        &self.0
    }

    /// A new random key, from the operating system's generator (through `rand`'s thread
    /// generator, which it seeds).
    #[cfg(feature = "network")]
    pub fn generate() -> Self {
        SwarmKey(rand::random())
    }

    /// Parses the contents of a swarm key file.
    ///
    /// Errors are [`P2pError::MalformedSwarmKey`]; they never quote the key line.
    pub fn parse(bytes: &[u8]) -> Result<Self, P2pError> {
        parse_key(bytes).map_err(P2pError::MalformedSwarmKey)
    }

    /// The key as a swarm key file: three lines, the key in lower-case hexadecimal.
    pub fn to_file_text(&self) -> String {
        let mut text = format!("{SWARM_KEY_TYPE}\n{SWARM_KEY_ENCODING}\n");
        for byte in self.0 {
            text.push_str(&format!("{byte:02x}"));
        }
        text.push('\n');
        text
    }
}

impl fmt::Debug for SwarmKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SwarmKey(<redacted>)")
    }
}

fn parse_key(bytes: &[u8]) -> Result<SwarmKey, SwarmKeyProblem> {
    if bytes.len() > MAX_SWARM_KEY_FILE_BYTES {
        return Err(SwarmKeyProblem::TooLarge);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| SwarmKeyProblem::NotText)?;
    let lines: Vec<&str> = text
        .split('\n')
        .map(|line| line.strip_suffix('\r').unwrap_or(line))
        .collect();
    // A final newline leaves an empty last piece, which is no line.
    let counted = match lines.last() {
        Some(&"") => lines.len() - 1,
        _ => lines.len(),
    };
    if counted < 3 {
        return Err(SwarmKeyProblem::MissingLines { found: counted });
    }
    if lines[0] != SWARM_KEY_TYPE {
        return Err(SwarmKeyProblem::WrongKeyType);
    }
    if lines[1] != SWARM_KEY_ENCODING {
        return Err(SwarmKeyProblem::WrongEncoding);
    }
    if let Some(index) = lines[3..].iter().position(|line| !line.trim().is_empty()) {
        return Err(SwarmKeyProblem::TrailingContent { line: index + 4 });
    }
    decode_hex(lines[2].trim_end_matches([' ', '\t'])).map(SwarmKey)
}

fn decode_hex(line: &str) -> Result<[u8; SWARM_KEY_BYTES], SwarmKeyProblem> {
    if let Some(position) = line.chars().position(|c| !c.is_ascii_hexdigit()) {
        return Err(SwarmKeyProblem::NotHex { position });
    }
    // Only ASCII digits are left: one byte per character.
    if line.len() != SWARM_KEY_BYTES * 2 {
        return Err(SwarmKeyProblem::WrongLength { found: line.len() });
    }
    let mut key = [0u8; SWARM_KEY_BYTES];
    for (byte, pair) in key.iter_mut().zip(line.as_bytes().chunks_exact(2)) {
        *byte = (hex_value(pair[0]) << 4) | hex_value(pair[1]);
    }
    Ok(key)
}

/// The value of an ASCII hexadecimal digit (checked by the caller).
fn hex_value(digit: u8) -> u8 {
    match digit {
        b'0'..=b'9' => digit - b'0',
        b'a'..=b'f' => digit - b'a' + 10,
        _ => digit.to_ascii_lowercase() - b'a' + 10,
    }
}

/// Reads and parses the swarm key file at `path`.
///
/// A file that cannot be read is [`P2pError::SwarmKeyIo`]; one that is not a swarm key file
/// is [`P2pError::SwarmKeyFile`], naming the file and the problem.
pub fn load_swarm_key(path: &Path) -> Result<SwarmKey, P2pError> {
    let io_error = |source| P2pError::SwarmKeyIo {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_SWARM_KEY_FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(io_error)?;
    parse_key(&bytes).map_err(|problem| P2pError::SwarmKeyFile {
        path: path.to_owned(),
        problem,
    })
}

/// Writes `key` to a new file at `path` with mode `0600`.
///
/// An existing file is never overwritten: that is [`P2pError::SwarmKeyExists`].
pub fn write_swarm_key(path: &Path, key: &SwarmKey) -> Result<(), P2pError> {
    let io_error = |source| P2pError::SwarmKeyIo {
        path: path.to_owned(),
        source,
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|error| match error.kind() {
            ErrorKind::AlreadyExists => P2pError::SwarmKeyExists {
                path: path.to_owned(),
            },
            _ => io_error(error),
        })?;
    file.write_all(key.to_file_text().as_bytes())
        .map_err(io_error)?;
    file.sync_all().map_err(io_error)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use proptest::prelude::*;

    use super::*;

    const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn problem(text: &str) -> SwarmKeyProblem {
        parse_key(text.as_bytes()).unwrap_err()
    }

    fn counting_key() -> SwarmKey {
        SwarmKey(std::array::from_fn(|i| i as u8))
    }

    #[test]
    fn a_key_file_parses_to_its_bytes() {
        let text = format!("{SWARM_KEY_TYPE}\n{SWARM_KEY_ENCODING}\n{HEX}\n");
        assert_eq!(parse_key(text.as_bytes()), Ok(counting_key()));
        assert_eq!(counting_key().to_file_text(), text);
    }

    #[test]
    fn crlf_upper_case_and_trailing_blank_lines_are_read() {
        let text = format!(
            "{SWARM_KEY_TYPE}\r\n{SWARM_KEY_ENCODING}\r\n{}\r\n\r\n\n",
            HEX.to_ascii_uppercase()
        );
        assert_eq!(parse_key(text.as_bytes()), Ok(counting_key()));
        let no_final_newline = format!("{SWARM_KEY_TYPE}\n{SWARM_KEY_ENCODING}\n{HEX}");
        assert_eq!(parse_key(no_final_newline.as_bytes()), Ok(counting_key()));
    }

    #[test]
    fn each_problem_is_named() {
        assert_eq!(problem(""), SwarmKeyProblem::MissingLines { found: 0 });
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n{SWARM_KEY_ENCODING}\n")),
            SwarmKeyProblem::MissingLines { found: 2 }
        );
        assert_eq!(
            problem(&format!("/key/swarm/psk/2.0.0/\n/base16/\n{HEX}\n")),
            SwarmKeyProblem::WrongKeyType
        );
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n/base64/\n{HEX}\n")),
            SwarmKeyProblem::WrongEncoding
        );
        let bad_hex = format!("{}g{}", &HEX[..10], &HEX[11..]);
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n/base16/\n{bad_hex}\n")),
            SwarmKeyProblem::NotHex { position: 10 }
        );
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n/base16/\n{}\n", &HEX[..62])),
            SwarmKeyProblem::WrongLength { found: 62 }
        );
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n/base16/\n{HEX}00\n")),
            SwarmKeyProblem::WrongLength { found: 66 }
        );
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n/base16/\n{HEX}\n\nmore\n")),
            SwarmKeyProblem::TrailingContent { line: 5 }
        );
        assert_eq!(
            parse_key(&[0xff, 0xfe, b'\n']),
            Err(SwarmKeyProblem::NotText)
        );
        assert_eq!(
            parse_key(&vec![b'\n'; MAX_SWARM_KEY_FILE_BYTES + 1]),
            Err(SwarmKeyProblem::TooLarge)
        );
    }

    #[test]
    fn a_multibyte_character_in_the_key_line_is_not_hex_not_a_panic() {
        let line = format!("é{}", &HEX[2..]);
        assert_eq!(
            problem(&format!("{SWARM_KEY_TYPE}\n/base16/\n{line}\n")),
            SwarmKeyProblem::NotHex { position: 0 }
        );
    }

    #[test]
    fn debug_never_shows_the_key() {
        assert_eq!(format!("{:?}", counting_key()), "SwarmKey(<redacted>)");
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "meshnet-swarm-key-{name}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[cfg(feature = "network")]
    #[test]
    fn a_written_key_file_is_private_loads_back_and_is_never_overwritten() {
        let dir = scratch("write");
        let path = dir.join("swarm.key");
        let key = SwarmKey::generate();
        write_swarm_key(&path, &key).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_swarm_key(&path).unwrap(), key);
        let again = write_swarm_key(&path, &SwarmKey::generate()).unwrap_err();
        assert!(
            matches!(&again, P2pError::SwarmKeyExists { path: p } if p == &path),
            "{again:?}"
        );
        assert_eq!(load_swarm_key(&path).unwrap(), key);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_bad_or_missing_file_is_an_error_naming_it() {
        let dir = scratch("load");
        let path = dir.join("swarm.key");
        std::fs::write(&path, format!("{SWARM_KEY_TYPE}\n/base16/\nabc\n")).unwrap();
        let error = load_swarm_key(&path).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "swarm key file {} is not usable: its key line has 3 characters; a key is 64 \
                 hexadecimal digits",
                path.display()
            )
        );
        let missing = dir.join("absent.key");
        assert!(matches!(
            load_swarm_key(&missing).unwrap_err(),
            P2pError::SwarmKeyIo { path, .. } if path == missing
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }

    proptest! {
        #[test]
        fn any_key_round_trips_through_its_file(bytes in any::<[u8; 32]>()) {
            let key = SwarmKey::from_bytes(bytes);
            prop_assert_eq!(parse_key(key.to_file_text().as_bytes()), Ok(key));
        }

        #[test]
        fn any_bytes_parse_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_key(&bytes);
        }
    }
}
