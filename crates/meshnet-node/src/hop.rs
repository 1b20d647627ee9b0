//! Which hop of a route failed, how, and whether sending the frame again may succeed.
//!
//! A hop that fails to reach its next hop answers its sender 502 (or 504) and names the hop that
//! actually failed in the error body (`failed_hop`); every hop further up the chain passes that
//! on unchanged, so the entry learns which hop failed, not merely that the first one answered
//! with an error.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How a hop failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HopFailureKind {
    /// The hop's endpoint is not a usable URL.
    InvalidEndpoint,
    /// The hop could not be reached, or the connection broke (refused, reset, DNS).
    Unreachable,
    /// The hop did not answer in time.
    Timeout,
    /// The hop (or one after it) stopped announcing itself to the mesh while the sender waited
    /// for the answer: it was stopped, cut off or died without closing its connections.
    Silent,
    /// The hop answered with an HTTP error.
    Rejected {
        /// The HTTP status it answered.
        status: u16,
        /// The error code from its JSON body (`unknown` when the body had none).
        code: String,
    },
    /// The hop answered 200 with a frame that does not decode or is too large.
    BadResponse,
    /// The hop answered 200 for another session, chunk or position.
    MismatchedResponse,
    /// The entry's check found the hop's output wrong: another holder of the same layers
    /// computed other bits from the same input, and an arbiter agreed with that holder.
    WrongOutput,
}

impl HopFailureKind {
    /// Whether sending the frame again — to the same peer later, or to another peer serving the
    /// same layers — may succeed.
    ///
    /// Retryable: the hop could not be reached or timed out, answered a 5xx (including 503
    /// `overloaded`), 429 or 408, or sent a broken answer — the fault lies with the hop or the
    /// network, not the frame. Final: an invalid endpoint, or any other 4xx — the hop refused the
    /// request itself (for example `layers_not_served` or `position_conflict`), and the same
    /// request would be refused again.
    pub fn retryable(&self) -> bool {
        match self {
            HopFailureKind::Unreachable
            | HopFailureKind::Timeout
            | HopFailureKind::Silent
            | HopFailureKind::BadResponse
            | HopFailureKind::MismatchedResponse
            | HopFailureKind::WrongOutput => true,
            HopFailureKind::InvalidEndpoint => false,
            HopFailureKind::Rejected { status, .. } => {
                *status >= 500 || *status == 429 || *status == 408
            }
        }
    }

    /// A short, stable code: the hop's own error code when it answered with one, otherwise
    /// `invalid_endpoint`, `unreachable`, `timeout`, `silent`, `bad_response`,
    /// `mismatched_response` or `wrong_output`.
    pub fn code(&self) -> &str {
        match self {
            HopFailureKind::InvalidEndpoint => "invalid_endpoint",
            HopFailureKind::Unreachable => "unreachable",
            HopFailureKind::Timeout => "timeout",
            HopFailureKind::Silent => "silent",
            HopFailureKind::Rejected { code, .. } => code,
            HopFailureKind::BadResponse => "bad_response",
            HopFailureKind::MismatchedResponse => "mismatched_response",
            HopFailureKind::WrongOutput => "wrong_output",
        }
    }

    /// The HTTP status the hop answered, if it answered at all.
    pub fn status(&self) -> Option<u16> {
        match self {
            HopFailureKind::Rejected { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// One hop's failure as the sender of a frame sees it: which hop, how it failed, and what it
/// said.
///
/// On the wire (the `failed_hop` member of an error body) it is
/// `{"endpoint", "status"?, "code", "message"}`; `status` is present when the hop answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "FailedHopWire", into = "FailedHopWire")]
pub struct HopFailure {
    /// The failed hop's activation-plane base URL, as the route names it.
    pub endpoint: String,
    /// The failed hop's peer id, when the sender knows it (the entry does, from its route;
    /// hops in between only know URLs). Not sent on the wire.
    pub peer: Option<meshnet_types::PeerId>,
    /// How it failed.
    pub kind: HopFailureKind,
    /// What the hop said, or what the transport reported.
    pub message: String,
    /// The endpoint of the hop that reported this failure when it is not the failed hop itself
    /// (the first hop, relaying a failure further down the route). Not sent on the wire.
    pub reported_by: Option<String>,
}

impl HopFailure {
    /// A failure of the hop at `endpoint`, peer and reporter not known.
    pub fn new(
        endpoint: impl Into<String>,
        kind: HopFailureKind,
        message: impl Into<String>,
    ) -> Self {
        HopFailure {
            endpoint: endpoint.into(),
            peer: None,
            kind,
            message: message.into(),
            reported_by: None,
        }
    }

    /// Whether sending the frame again may succeed; see [`HopFailureKind::retryable`].
    pub fn retryable(&self) -> bool {
        self.kind.retryable()
    }

    /// The hop's error code, or the transport failure's; see [`HopFailureKind::code`].
    pub fn code(&self) -> &str {
        self.kind.code()
    }

    /// The HTTP status the hop answered, if it answered at all.
    pub fn status(&self) -> Option<u16> {
        self.kind.status()
    }
}

impl fmt::Display for HopFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.peer {
            Some(peer) => write!(f, "peer {peer} at {}", self.endpoint)?,
            None => write!(f, "hop {}", self.endpoint)?,
        }
        match &self.kind {
            HopFailureKind::InvalidEndpoint => write!(f, " has an invalid endpoint")?,
            HopFailureKind::Unreachable => write!(f, " is unreachable")?,
            HopFailureKind::Timeout => write!(f, " timed out")?,
            HopFailureKind::Silent => write!(f, " stopped announcing itself")?,
            HopFailureKind::Rejected { status, code } => write!(f, " answered {status} {code}")?,
            HopFailureKind::BadResponse => write!(f, " sent an invalid frame")?,
            HopFailureKind::MismatchedResponse => write!(f, " answered for the wrong request")?,
            HopFailureKind::WrongOutput => write!(f, " returned wrong activations")?,
        }
        write!(f, ": {}", self.message)?;
        if let Some(reporter) = &self.reported_by {
            write!(f, " (reported by {reporter})")?;
        }
        Ok(())
    }
}

impl std::error::Error for HopFailure {}

/// The wire form of a [`HopFailure`].
#[derive(Serialize, Deserialize)]
struct FailedHopWire {
    endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    code: String,
    message: String,
}

impl From<HopFailure> for FailedHopWire {
    fn from(failure: HopFailure) -> Self {
        FailedHopWire {
            status: failure.status(),
            code: failure.code().to_owned(),
            endpoint: failure.endpoint,
            message: failure.message,
        }
    }
}

impl From<FailedHopWire> for HopFailure {
    /// With a status, the hop answered; without one, the code names the transport failure.
    /// An unknown code without a status (a newer peer's) counts as unreachable.
    fn from(wire: FailedHopWire) -> Self {
        let kind = match (wire.status, wire.code.as_str()) {
            (Some(status), _) => HopFailureKind::Rejected {
                status,
                code: wire.code,
            },
            (None, "invalid_endpoint") => HopFailureKind::InvalidEndpoint,
            (None, "timeout") => HopFailureKind::Timeout,
            (None, "silent") => HopFailureKind::Silent,
            (None, "bad_response") => HopFailureKind::BadResponse,
            (None, "mismatched_response") => HopFailureKind::MismatchedResponse,
            (None, "wrong_output") => HopFailureKind::WrongOutput,
            (None, _) => HopFailureKind::Unreachable,
        };
        HopFailure::new(wire.endpoint, kind, wire.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected(status: u16, code: &str) -> HopFailureKind {
        HopFailureKind::Rejected {
            status,
            code: code.to_owned(),
        }
    }

    #[test]
    fn network_trouble_and_server_errors_are_retryable() {
        for kind in [
            HopFailureKind::Unreachable,
            HopFailureKind::Timeout,
            HopFailureKind::Silent,
            HopFailureKind::BadResponse,
            HopFailureKind::MismatchedResponse,
            HopFailureKind::WrongOutput,
            rejected(500, "compute_failed"),
            rejected(502, "next_hop_unreachable"),
            rejected(503, "overloaded"),
            rejected(504, "next_hop_timeout"),
            rejected(429, "unknown"),
            rejected(408, "unknown"),
        ] {
            assert!(kind.retryable(), "{kind:?}");
        }
    }

    #[test]
    fn refused_requests_are_final() {
        for kind in [
            HopFailureKind::InvalidEndpoint,
            rejected(400, "wire_version_mismatch"),
            rejected(409, "layers_not_served"),
            rejected(409, "position_conflict"),
            rejected(413, "body_too_large"),
            rejected(415, "unsupported_encoding"),
            rejected(422, "bad_activations"),
        ] {
            assert!(!kind.retryable(), "{kind:?}");
        }
    }

    #[test]
    fn the_wire_form_keeps_endpoint_status_code_and_message() {
        for kind in [
            HopFailureKind::InvalidEndpoint,
            HopFailureKind::Unreachable,
            HopFailureKind::Timeout,
            HopFailureKind::Silent,
            rejected(503, "overloaded"),
            HopFailureKind::BadResponse,
            HopFailureKind::MismatchedResponse,
            HopFailureKind::WrongOutput,
        ] {
            let mut failure = HopFailure::new("http://10.0.0.3:8081", kind, "it broke");
            let json = serde_json::to_string(&failure).unwrap();
            // Peer ids and reporters are the entry's knowledge, not the wire's.
            failure.peer = Some("12D3KooW".into());
            failure.reported_by = Some("http://10.0.0.2:8081".to_owned());
            let back: HopFailure = serde_json::from_str(&json).unwrap();
            assert_eq!(back.endpoint, failure.endpoint, "{json}");
            assert_eq!(back.kind, failure.kind, "{json}");
            assert_eq!(back.message, failure.message, "{json}");
            assert_eq!((back.peer, back.reported_by), (None, None));
        }
        let json = serde_json::to_value(HopFailure::new(
            "http://h:1",
            rejected(409, "layers_not_served"),
            "no",
        ))
        .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"endpoint": "http://h:1", "status": 409, "code": "layers_not_served", "message": "no"})
        );
    }

    #[test]
    fn an_unknown_transport_code_counts_as_unreachable() {
        let failure: HopFailure =
            serde_json::from_str(r#"{"endpoint":"http://h:1","code":"tls_failed","message":"x"}"#)
                .unwrap();
        assert_eq!(failure.kind, HopFailureKind::Unreachable);
        assert!(failure.retryable());
    }

    #[test]
    fn the_message_names_the_peer_and_the_code() {
        let mut failure = HopFailure::new(
            "http://10.0.0.3:8081",
            rejected(503, "overloaded"),
            "no capacity for another session; retry later",
        );
        assert_eq!(
            failure.to_string(),
            "hop http://10.0.0.3:8081 answered 503 overloaded: no capacity for another session; \
             retry later"
        );
        failure.peer = Some("12D3KooWPeer".into());
        failure.reported_by = Some("http://10.0.0.2:8081".to_owned());
        failure.kind = rejected(409, "layers_not_served");
        assert_eq!(
            failure.to_string(),
            "peer 12D3KooWPeer at http://10.0.0.3:8081 answered 409 layers_not_served: no \
             capacity for another session; retry later (reported by http://10.0.0.2:8081)"
        );
    }
}
