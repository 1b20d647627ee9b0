//! The node's persistent libp2p identity.

use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use libp2p::identity::Keypair;

use crate::P2pError;

/// File name of the identity key inside the data directory.
pub const IDENTITY_FILE_NAME: &str = "identity.key";

/// Loads the ed25519 identity from `<data_dir>/identity.key`, creating it if absent.
///
/// The file holds the protobuf encoding of the keypair and is created with mode
/// `0600`; the directory is created if missing. A file that exists but does not
/// decode is reported as [`P2pError::CorruptIdentity`] and left untouched.
pub fn load_or_create_identity(data_dir: &Path) -> Result<Keypair, P2pError> {
    let path = data_dir.join(IDENTITY_FILE_NAME);
    let io_error = |source| P2pError::IdentityIo {
        path: path.clone(),
        source,
    };
    match std::fs::read(&path) {
        Ok(bytes) => {
            return Keypair::from_protobuf_encoding(&bytes).map_err(|error| {
                P2pError::CorruptIdentity {
                    path: path.clone(),
                    reason: error.to_string(),
                }
            });
        }
        Err(error) if error.kind() == ErrorKind::NotFound => {}
        Err(error) => return Err(io_error(error)),
    }
    std::fs::create_dir_all(data_dir).map_err(io_error)?;
    let keypair = Keypair::generate_ed25519();
    let encoded = keypair
        .to_protobuf_encoding()
        .map_err(|error| P2pError::CorruptIdentity {
            path: path.clone(),
            reason: error.to_string(),
        })?;
    // `create_new` so that a concurrent creator never has its key overwritten.
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io_error)?;
    file.write_all(&encoded).map_err(io_error)?;
    file.sync_all().map_err(io_error)?;
    Ok(keypair)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    use super::*;

    fn scratch_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "meshnet-p2p-{name}-{}-{}",
            std::process::id(),
            Keypair::generate_ed25519().public().to_peer_id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn identity_is_stable_across_loads() {
        let dir = scratch_dir("stable").join("nested");
        let first = load_or_create_identity(&dir).unwrap();
        let second = load_or_create_identity(&dir).unwrap();
        assert_eq!(first.public().to_peer_id(), second.public().to_peer_id());
        let mode = std::fs::metadata(dir.join(IDENTITY_FILE_NAME))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }

    #[test]
    fn corrupt_identity_is_an_error_and_left_in_place() {
        let dir = scratch_dir("corrupt");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(IDENTITY_FILE_NAME);
        std::fs::write(&path, b"not a key").unwrap();
        let error = load_or_create_identity(&dir).unwrap_err();
        assert!(matches!(error, P2pError::CorruptIdentity { .. }), "{error}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a key");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
