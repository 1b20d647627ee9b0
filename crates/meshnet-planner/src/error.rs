//! The crate's single error type.

use thiserror::Error;

use meshnet_types::PeerId;

/// Why a plan could not be computed.
///
/// A mesh that is merely too small to cover the model is not an error: the
/// plan then reports the uncovered layers and the missing memory instead.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    /// The model shape cannot be planned (no layers, no quantization, ...).
    #[error("invalid model shape: {0}")]
    InvalidModel(String),
    /// The planner configuration is out of range.
    #[error("invalid planner configuration: {0}")]
    InvalidConfig(String),
    /// No peer in the capacity list is marked as the tracker.
    #[error("no peer is marked as the tracker")]
    NoTracker,
    /// More than one peer is marked as the tracker.
    #[error("peers {first} and {second} are both marked as the tracker")]
    MultipleTrackers {
        /// The first tracker, in peer-id order.
        first: PeerId,
        /// The second tracker, in peer-id order.
        second: PeerId,
    },
    /// The same peer id appears twice in the capacity list.
    #[error("peer {0} appears more than once in the capacity list")]
    DuplicatePeer(PeerId),
    /// A peer reported a throughput that is negative, infinite or NaN.
    #[error("peer {0} reported an invalid throughput")]
    InvalidThroughput(PeerId),
    /// The tracker cannot even hold the embedding and LM head.
    #[error("the tracker has {available} bytes but the embedding and head need {required}")]
    TrackerCannotHoldEmbeddings {
        /// The tracker's memory budget in bytes.
        available: u64,
        /// Bytes of embedding plus LM head.
        required: u64,
    },
    /// The map's epoch is already `u64::MAX`, so a changed map cannot get a newer one.
    #[error("the coverage map's epoch {0} cannot be incremented")]
    EpochOverflow(u64),
    /// The configured tracker span does not fit the tracker's memory.
    #[error("the tracker is configured for {requested} layers but fits at most {max}")]
    TrackerSpanDoesNotFit {
        /// Layers requested by configuration.
        requested: u32,
        /// Layers the tracker's memory allows.
        max: u32,
    },
}
