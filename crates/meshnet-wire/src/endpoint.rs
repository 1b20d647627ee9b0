//! Where a hop of a route is reached: an HTTP base URL, or a member reached over libp2p
//! streams by its peer id (`/p2p/<id>`). Parsed once, where an endpoint enters (a route
//! header, an announcement), so nothing downstream guesses from a string's prefix.

use std::fmt;
use std::str::FromStr;

use meshnet_types::PeerId;

/// The prefix of an endpoint that names a member by its libp2p peer id.
pub const PEER_ENDPOINT_PREFIX: &str = "/p2p/";

/// Where a member's activation plane is reached.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// An `http://` or `https://` base URL the member announced: requests go to paths under it.
    Http(String),
    /// A member others cannot dial, reached over libp2p streams to its peer id.
    Peer(PeerId),
}

/// Why a text is not an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not an http:// or https:// URL nor /p2p/<peer id>")]
pub struct NotAnEndpoint {
    /// The text given.
    pub text: String,
}

impl Endpoint {
    /// The endpoint that names `peer` by its id.
    pub fn peer(peer: PeerId) -> Self {
        Endpoint::Peer(peer)
    }

    /// The member's peer id when it is reached over libp2p streams.
    pub fn as_peer(&self) -> Option<&PeerId> {
        match self {
            Endpoint::Peer(peer) => Some(peer),
            Endpoint::Http(_) => None,
        }
    }
}

impl FromStr for Endpoint {
    type Err = NotAnEndpoint;

    /// `/p2p/` followed by letters and digits names a peer; `http://` or `https://` followed
    /// by a host is a URL. Anything else is refused.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let refused = || NotAnEndpoint {
            text: text.to_owned(),
        };
        if let Some(peer) = text.strip_prefix(PEER_ENDPOINT_PREFIX) {
            let valid = !peer.is_empty() && peer.chars().all(|c| c.is_ascii_alphanumeric());
            return valid
                .then(|| Endpoint::Peer(PeerId::new(peer)))
                .ok_or_else(refused);
        }
        let after_scheme = text
            .strip_prefix("http://")
            .or_else(|| text.strip_prefix("https://"))
            .ok_or_else(refused)?;
        let host = after_scheme.split('/').next().unwrap_or_default();
        if host.is_empty() || text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(refused());
        }
        Ok(Endpoint::Http(text.to_owned()))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Http(url) => f.write_str(url),
            Endpoint::Peer(peer) => write!(f, "{PEER_ENDPOINT_PREFIX}{peer}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn urls_and_peer_ids_parse_and_print_as_given() {
        for text in [
            "http://127.0.0.1:8081",
            "https://mesh.example/v",
            "http://[::1]:8083",
            "/p2p/12D3KooWAbc",
        ] {
            let endpoint: Endpoint = text.parse().unwrap();
            assert_eq!(endpoint.to_string(), text);
        }
        assert_eq!(
            "/p2p/12D3KooWAbc".parse::<Endpoint>().unwrap().as_peer(),
            Some(&PeerId::new("12D3KooWAbc"))
        );
        assert_eq!(
            "http://h:1".parse::<Endpoint>().unwrap(),
            Endpoint::Http("http://h:1".into())
        );
    }

    #[test]
    fn anything_else_is_refused_naming_the_text() {
        for text in [
            "",
            "a",
            "ftp://h",
            "http://",
            "https:///x",
            "/p2p/",
            "/p2p/a-b",
            "/p2p/x/y",
            "/p2p/../etc",
            "http://h x",
            "127.0.0.1:8080",
        ] {
            assert_eq!(
                text.parse::<Endpoint>(),
                Err(NotAnEndpoint {
                    text: text.to_owned()
                }),
                "{text:?}"
            );
        }
    }
}
