//! The one error type of the crate.

use std::io;
use std::net::SocketAddr;

/// Everything that can go wrong while relaying or self-testing.
#[derive(Debug, thiserror::Error)]
pub enum LinkemError {
    /// The relay (or a self-test server) could not listen on its address.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address asked for.
        addr: SocketAddr,
        /// What the operating system said.
        source: io::Error,
    },
    /// Accepting an incoming connection failed.
    #[error("accepting a connection on {addr}: {source}")]
    Accept {
        /// The relay's listening address.
        addr: SocketAddr,
        /// What the operating system said.
        source: io::Error,
    },
    /// The relay could not connect to its target for an accepted connection.
    #[error("cannot connect to the target {target}: {source}")]
    Dial {
        /// The relay's target.
        target: SocketAddr,
        /// What the operating system said.
        source: io::Error,
    },
    /// Reading from or writing to one side of a relayed connection failed.
    #[error("relaying to {target}: {source}")]
    Relay {
        /// The relay's target (names the link).
        target: SocketAddr,
        /// What the operating system said.
        source: io::Error,
    },
    /// The self-test's own traffic failed or came back different from what was sent.
    #[error("self-test: {0}")]
    Selftest(String),
}
