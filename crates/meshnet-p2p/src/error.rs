//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the meshnet control plane.
#[derive(Debug, thiserror::Error)]
pub enum P2pError {
    /// A control message could not be serialized.
    #[error("failed to encode a control message: {0}")]
    Encode(String),

    /// Bytes received from the network are not a valid control message.
    #[error("failed to decode a control message: {0}")]
    Decode(String),

    /// The message was written with a schema this node does not speak.
    #[error("control message has schema version {found}, this node speaks version {expected}")]
    SchemaVersion {
        /// The version this node speaks ([`crate::SCHEMA_VERSION`]).
        expected: u16,
        /// The version found in the message.
        found: u16,
    },

    /// A control message was followed by bytes that belong to no field.
    #[error("control message is followed by {count} unexpected trailing bytes")]
    TrailingBytes {
        /// How many bytes were left over.
        count: usize,
    },

    /// A control message exceeds the size limit.
    #[error("control message is {size} bytes, the limit is {limit} bytes")]
    MessageTooLarge {
        /// Size of the message in bytes.
        size: usize,
        /// The limit in bytes ([`crate::MAX_MESSAGE_BYTES`]).
        limit: usize,
    },

    /// The identity key file could not be read, created or written.
    #[error("identity key file {path}: {source}")]
    IdentityIo {
        /// The key file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// The identity key file exists but does not hold a valid key.
    #[error(
        "identity key file {path} is corrupt ({reason}); move it away to create a new identity"
    )]
    CorruptIdentity {
        /// The key file.
        path: PathBuf,
        /// Why it could not be used.
        reason: String,
    },

    /// A text that should be a swarm key file is not one.
    #[error("not a swarm key file: {0}")]
    MalformedSwarmKey(crate::swarm_key::SwarmKeyProblem),

    /// The swarm key file is not one.
    #[error("swarm key file {path} is not usable: {problem}")]
    SwarmKeyFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: crate::swarm_key::SwarmKeyProblem,
    },

    /// The swarm key file could not be read or written.
    #[error("swarm key file {path}: {source}")]
    SwarmKeyIo {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// A new swarm key was to be written where a file already is.
    #[error(
        "{path} already exists; a swarm key file is never overwritten (remove it first, or choose another path)"
    )]
    SwarmKeyExists {
        /// The file.
        path: PathBuf,
    },

    /// The other side of a connection holds no swarm key or another one: what it sent does
    /// not decrypt to a libp2p handshake with this node's key.
    #[error("the other side holds no swarm key or another one")]
    SwarmKeyMismatch,

    /// The libp2p transport could not be built.
    #[error("failed to build the libp2p transport: {0}")]
    Transport(String),

    /// A libp2p protocol behaviour could not be configured.
    #[error("failed to configure the libp2p behaviour: {0}")]
    Behaviour(String),

    /// None of the configured listen addresses could be bound.
    #[error("could not listen on any configured address: {0}")]
    Listen(String),

    /// Dialing a peer address failed immediately.
    #[error("failed to dial {address}: {reason}")]
    Dial {
        /// The address that was dialed.
        address: String,
        /// Why the dial failed.
        reason: String,
    },

    /// A gossipsub message could not be published.
    #[error("failed to publish on topic {topic}: {reason}")]
    Publish {
        /// The topic the message was meant for.
        topic: String,
        /// Why publishing failed.
        reason: String,
    },

    /// The tracker record could not be stored in Kademlia.
    #[error("failed to store the tracker record: {0}")]
    RecordStore(String),

    /// A text that should be a libp2p peer id is not one.
    #[error("{0:?} is not a libp2p peer id")]
    InvalidPeerId(String),

    /// No stream to a peer could be opened: no connection could be made, or the peer
    /// refused the protocol.
    #[error("no stream to peer {peer}: {reason}")]
    Stream {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },

    /// The event loop has exited (after `P2pHandle::shutdown` or a fatal error).
    #[error("the p2p event loop has stopped")]
    Stopped,
}
