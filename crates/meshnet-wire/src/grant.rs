//! Grants: the tracker's signed permission for one session to travel one route
//! (`X-Meshnet-Grant`). A member serves a `/forward` over HTTP only with a grant that the
//! tracker it follows signed, that has not expired, that names the frame's session, and whose
//! route the frame is travelling: its own layers followed by exactly the hops still ahead.
//!
//! The header value is `<payload>.<signature>`, both base64url without padding. The payload is
//! UTF-8 text, one field per line:
//!
//! ```text
//! meshnet-grant/1
//! <tracker peer id>
//! <session uuid>
//! <expiry, milliseconds since the Unix epoch>
//! <route: start-end@endpoint hops, comma-separated, first hop first>
//! ```
//!
//! The signature is the tracker's signature of the payload bytes with its libp2p identity key.
//! This module parses and checks everything but the signature, which the caller verifies
//! with the tracker's key (no cryptography here).

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::HeaderMap;
use meshnet_types::LayerSpan;
use uuid::Uuid;

use crate::error::WireError;
use crate::header::{Route, parse_layers};

/// The header that carries a grant (named with the others in [`crate::header`]).
pub use crate::header::GRANT_HEADER;

/// The first line of every grant payload.
const GRANT_MAGIC: &str = "meshnet-grant/1";

/// The longest grant header value accepted (a route of 64 hops with long endpoints fits).
pub const MAX_GRANT_LEN: usize = 48 * 1024;

/// What a grant permits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The tracker that signed it (its libp2p peer id).
    pub tracker: String,
    /// The session it is for.
    pub session: Uuid,
    /// When it expires, in milliseconds since the Unix epoch.
    pub expires_unix_ms: u64,
    /// Every hop of the route after the entry, first first.
    pub route: Route,
}

/// A grant as received: what it says, the exact bytes that were signed, and the signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedGrant {
    /// What it permits.
    pub grant: Grant,
    /// The payload bytes the signature covers.
    pub payload: Vec<u8>,
    /// The signature.
    pub signature: Vec<u8>,
}

fn refused(reason: impl Into<String>) -> WireError {
    WireError::GrantRefused {
        reason: reason.into(),
    }
}

impl Grant {
    /// The payload to sign.
    pub fn payload(&self) -> Vec<u8> {
        format!(
            "{GRANT_MAGIC}\n{}\n{}\n{}\n{}",
            self.tracker, self.session, self.expires_unix_ms, self.route
        )
        .into_bytes()
    }

    /// The header value carrying this grant with `signature` (of [`Grant::payload`]).
    pub fn header_value(&self, signature: &[u8]) -> String {
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(self.payload()),
            URL_SAFE_NO_PAD.encode(signature)
        )
    }

    /// Whether a frame of `session` for `layers`, with `ahead` the hops after the receiver,
    /// travels this grant's route: some hop of it runs exactly `layers` and the hops after it
    /// are exactly `ahead`.
    pub fn covers(&self, session: Uuid, layers: LayerSpan, ahead: &Route) -> bool {
        if session != self.session {
            return false;
        }
        let hops = self.route.hops();
        hops.iter()
            .enumerate()
            .any(|(index, hop)| hop.layers == layers && hops[index + 1..] == *ahead.hops())
    }
}

impl SignedGrant {
    /// Parses a header value (untrusted input): never panics, and refuses anything that is
    /// not a well-formed grant with [`WireError::GrantRefused`].
    pub fn parse(value: &str) -> Result<Self, WireError> {
        if value.len() > MAX_GRANT_LEN {
            return Err(refused(format!(
                "the grant is {} bytes, the limit is {MAX_GRANT_LEN}",
                value.len()
            )));
        }
        let (payload, signature) = value
            .trim()
            .split_once('.')
            .ok_or_else(|| refused("a grant is <payload>.<signature>"))?;
        let payload = URL_SAFE_NO_PAD
            .decode(payload)
            .map_err(|_| refused("the payload is not base64url"))?;
        let signature = URL_SAFE_NO_PAD
            .decode(signature)
            .map_err(|_| refused("the signature is not base64url"))?;
        let text =
            std::str::from_utf8(&payload).map_err(|_| refused("the payload is not UTF-8"))?;
        let mut lines = text.split('\n');
        let mut field = |name: &str| {
            lines
                .next()
                .ok_or_else(|| refused(format!("the payload has no {name}")))
        };
        if field("version")? != GRANT_MAGIC {
            return Err(refused(format!(
                "the payload does not start with {GRANT_MAGIC}"
            )));
        }
        let tracker = field("tracker")?.to_owned();
        let session =
            Uuid::try_parse(field("session")?).map_err(|_| refused("the session is not a UUID"))?;
        let expires_unix_ms = field("expiry")?
            .parse()
            .map_err(|_| refused("the expiry is not a number"))?;
        let route = Route::parse(field("route")?)
            .map_err(|error| refused(format!("the route does not parse: {error}")))?;
        if lines.next().is_some() {
            return Err(refused("the payload has extra lines"));
        }
        Ok(SignedGrant {
            grant: Grant {
                tracker,
                session,
                expires_unix_ms,
                route,
            },
            payload,
            signature,
        })
    }
}

/// What a `/forward` request's headers say about its frame, for the grant check before the
/// body is read: the grant header (`None` when absent), session, layers and the hops ahead.
#[derive(Debug)]
pub struct GrantedFrame<'a> {
    /// The grant header's value, when present.
    pub grant: Option<&'a str>,
    /// The frame's session.
    pub session: Uuid,
    /// The layers the receiver is asked to run.
    pub layers: LayerSpan,
    /// The hops after the receiver.
    pub ahead: Route,
}

impl<'a> GrantedFrame<'a> {
    /// Reads the grant, session, layers and route headers; a header that does not parse is
    /// the usual 400 ([`WireError::InvalidHeader`] or [`WireError::MissingHeader`]).
    pub fn from_headers(headers: &'a HeaderMap) -> Result<Self, WireError> {
        let text = |name: &'static str| -> Result<Option<&'a str>, WireError> {
            headers
                .get(name)
                .map(|value| {
                    value.to_str().map_err(|_| WireError::InvalidHeader {
                        name,
                        expected: "visible ASCII",
                        got: "non-ASCII bytes".to_owned(),
                    })
                })
                .transpose()
        };
        let required = |name: &'static str| text(name)?.ok_or(WireError::MissingHeader { name });
        let session_text = required(crate::header::SESSION)?;
        let session =
            Uuid::try_parse(session_text.trim()).map_err(|_| WireError::InvalidHeader {
                name: "X-Meshnet-Session",
                expected: "a UUID",
                got: session_text.chars().take(64).collect(),
            })?;
        let layers = parse_layers(required(crate::header::LAYERS)?, "X-Meshnet-Layers")?;
        let ahead = match text(crate::header::ROUTE)? {
            Some(route) => Route::parse(route)?,
            None => Route::default(),
        };
        Ok(GrantedFrame {
            grant: text(GRANT_HEADER)?,
            session,
            layers,
            ahead,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::header::Hop;

    fn route(hops: &[(u32, u32, &str)]) -> Route {
        Route::new(
            hops.iter()
                .map(|(start, end, endpoint)| {
                    Hop::new(LayerSpan::new(*start, *end), *endpoint).unwrap()
                })
                .collect(),
        )
        .unwrap()
    }

    fn grant() -> Grant {
        Grant {
            tracker: "12D3KooWTracker".to_owned(),
            session: Uuid::from_u128(7),
            expires_unix_ms: 1_700_000_000_000,
            route: route(&[
                (10, 20, "http://10.0.0.2:8080"),
                (20, 25, "/p2p/12D3KooWB"),
                (25, 30, "http://10.0.0.4:8080"),
            ]),
        }
    }

    #[test]
    fn a_grant_survives_its_header_and_keeps_the_signed_bytes() {
        let value = grant().header_value(b"sig-bytes");
        let parsed = SignedGrant::parse(&value).unwrap();
        assert_eq!(parsed.grant, grant());
        assert_eq!(parsed.payload, grant().payload());
        assert_eq!(parsed.signature, b"sig-bytes");
    }

    #[test]
    fn a_grant_covers_each_hop_of_its_route_and_nothing_else() {
        let g = grant();
        let session = g.session;
        let all = g.route.clone();
        let (_, after_first) = all.pop_next().unwrap();
        let (_, after_second) = after_first.pop_next().unwrap();
        assert!(g.covers(session, LayerSpan::new(10, 20), &after_first));
        assert!(g.covers(session, LayerSpan::new(20, 25), &after_second));
        assert!(g.covers(session, LayerSpan::new(25, 30), &Route::default()));
        // Another session, other layers, a hop redirected or left out: refused.
        assert!(!g.covers(Uuid::from_u128(8), LayerSpan::new(10, 20), &after_first));
        assert!(!g.covers(session, LayerSpan::new(10, 21), &after_first));
        let redirected = route(&[
            (20, 25, "http://attacker:1"),
            (25, 30, "http://10.0.0.4:8080"),
        ]);
        assert!(!g.covers(session, LayerSpan::new(10, 20), &redirected));
        assert!(!g.covers(session, LayerSpan::new(10, 20), &after_second));
    }

    #[test]
    fn malformed_grants_are_refused_with_a_reason() {
        let good = grant().header_value(b"s");
        let (payload, _) = good.split_once('.').unwrap();
        for bad in [
            "",
            "no-dot",
            "!!.AA",
            &format!("{payload}.!!"),
            &format!(
                "{}.AA",
                URL_SAFE_NO_PAD.encode("meshnet-grant/2\nt\nx\n1\n0-1@a")
            ),
            &format!(
                "{}.AA",
                URL_SAFE_NO_PAD.encode("meshnet-grant/1\nt\nnot-a-uuid\n1\n0-1@a")
            ),
            &format!(
                "{}.AA",
                URL_SAFE_NO_PAD.encode(format!("meshnet-grant/1\nt\n{}\nsoon\n0-1@a", Uuid::nil()))
            ),
            &format!(
                "{}.AA",
                URL_SAFE_NO_PAD.encode(format!(
                    "meshnet-grant/1\nt\n{}\n1\n0-1@a\nmore",
                    Uuid::nil()
                ))
            ),
            &"A".repeat(MAX_GRANT_LEN + 1),
        ] {
            assert!(
                matches!(SignedGrant::parse(bad), Err(WireError::GrantRefused { .. })),
                "{bad:?} was not refused"
            );
        }
    }
}
