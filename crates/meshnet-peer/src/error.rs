//! The peer library's error type.

/// Everything that can fail while running a peer.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The configuration or the model cannot be used as asked.
    #[error("{0}")]
    Config(String),
    /// A setting of [`crate::PeerConfig`] is outside what it can mean.
    #[error("{setting}{} {reason}", .flag.map(|flag| format!(" (--{flag})")).unwrap_or_default())]
    InvalidSetting {
        /// The field of the configuration.
        setting: &'static str,
        /// The command-line flag that sets it, if one does.
        flag: Option<&'static str>,
        /// What is wrong with its value.
        reason: String,
    },
    /// Reading or writing a file or socket failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] meshnet_model::ModelError),
    /// The control plane failed.
    #[error(transparent)]
    P2p(#[from] meshnet_p2p::P2pError),
    /// The planner rejected its input.
    #[error(transparent)]
    Plan(#[from] meshnet_planner::PlanError),
    /// A background task ended unexpectedly.
    #[error("internal error: {0}")]
    Internal(String),
}
