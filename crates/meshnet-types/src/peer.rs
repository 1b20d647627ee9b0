//! A member's identity.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::TypesError;

/// A member's identity: the text form of its libp2p peer id (base58), or any short label in
/// tests and simulations. Only `meshnet-p2p` converts it to and from libp2p's type.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PeerId(String);

impl PeerId {
    /// Wraps an id.
    pub fn new(id: impl Into<String>) -> Self {
        PeerId(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for PeerId {
    type Err = TypesError;

    /// Accepts any non-empty text without white space.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.is_empty() || text.chars().any(char::is_whitespace) {
            return Err(TypesError::PeerId(text.to_owned()));
        }
        Ok(PeerId(text.to_owned()))
    }
}

impl From<&str> for PeerId {
    fn from(id: &str) -> Self {
        PeerId(id.to_owned())
    }
}

impl PartialEq<str> for PeerId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for PeerId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// Whether a claim to be the tracker of `term` by `claimant` beats the claim of `other_term`
/// by `other`: the higher term wins; of equal terms (two successors elected at once), the
/// lower peer id. Exactly one of two different claims wins, so any set of claims has one
/// winner. Every member applies this one rule.
pub fn claim_beats(claimant: &PeerId, term: u64, other: &PeerId, other_term: u64) -> bool {
    term > other_term || (term == other_term && claimant < other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms() {
        let id: PeerId = "12D3KooWabc".parse().unwrap();
        assert_eq!(id.to_string(), "12D3KooWabc");
        assert_eq!(id, "12D3KooWabc");
        assert!("".parse::<PeerId>().is_err());
        assert!("a b".parse::<PeerId>().is_err());
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"12D3KooWabc\"");
    }
}
