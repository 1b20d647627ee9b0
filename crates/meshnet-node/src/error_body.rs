//! The JSON body of the activation plane's error answers, which the server writes and the
//! client reads back.

use serde::{Deserialize, Serialize};

use crate::hop::HopFailure;

/// The JSON body of every error answer: `{"error":{"code":"...","message":"..."}}`, plus
/// `"failed_hop"` inside `"error"` when a later hop of the route failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error itself.
    pub error: ErrorDetail,
}

/// The code and message of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A short, stable, machine-readable code such as `invalid_shape`.
    pub code: String,
    /// A sentence for people, naming the field at fault.
    pub message: String,
    /// The hop that actually failed, when this peer answers with an error because a later hop
    /// of the route failed: the next hop itself, or the hop it named in turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_hop: Option<HopFailure>,
}
