//! Direct return (ADR-0031): the entry of a route names, in every frame it sends, where the
//! last hop is to post the route's output (`X-Meshnet-Return-To`) and the ticket that lets it
//! (`X-Meshnet-Return-Ticket`). Every hop passes both on unchanged; the last hop posts its
//! output to `{return-to}/return` with the ticket and answers its sender `202 Accepted` with no
//! body, which unwinds up the route while the entry already has the result. A decode step
//! through N hops then costs N + 1 one-way delays instead of 2N.
//!
//! The ticket is 128 random bits the entry draws per frame and accepts once, for the session,
//! chunk and position it sent: only the route's own hops ever see it.

use std::fmt;

use http::HeaderMap;

use crate::Endpoint;
use crate::error::WireError;
use crate::error::quote;
use crate::header::{MAX_ENDPOINT_LEN, optional_str};

/// The header naming where the last hop posts the route's output.
pub const RETURN_TO: &str = "x-meshnet-return-to";

/// The header carrying the ticket the entry accepts that output with.
pub const RETURN_TICKET: &str = "x-meshnet-return-ticket";

/// The entry's one-time permission to post one frame's output to it: 128 bits, written as
/// 32 lowercase hexadecimal digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReturnTicket(u128);

impl ReturnTicket {
    /// The ticket of these bits (draw them at random: the ticket is the only credential).
    pub fn from_bits(bits: u128) -> Self {
        ReturnTicket(bits)
    }

    /// Parses 32 hexadecimal digits.
    pub fn parse(text: &str) -> Result<Self, WireError> {
        let text = text.trim();
        let digits = text.len() == 32 && text.bytes().all(|b| b.is_ascii_hexdigit());
        digits
            .then(|| u128::from_str_radix(text, 16).ok())
            .flatten()
            .map(ReturnTicket)
            .ok_or_else(|| WireError::InvalidHeader {
                name: "X-Meshnet-Return-Ticket",
                expected: "32 hexadecimal digits",
                got: quote(text),
            })
    }
}

impl fmt::Display for ReturnTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Where, and with which ticket, the last hop of a route posts the route's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnAddress {
    /// The entry's activation plane.
    pub endpoint: Endpoint,
    /// The ticket the entry accepts the output with.
    pub ticket: ReturnTicket,
}

/// Reads the return address of a frame: both headers or neither.
pub(crate) fn read_return_address(headers: &HeaderMap) -> Result<Option<ReturnAddress>, WireError> {
    let endpoint = optional_str(headers, RETURN_TO, "an http(s) URL or /p2p/<peer id>")?;
    let ticket = optional_str(headers, RETURN_TICKET, "32 hexadecimal digits")?;
    match (endpoint, ticket) {
        (None, None) => Ok(None),
        (Some(endpoint), Some(ticket)) => Ok(Some(ReturnAddress {
            endpoint: parse_return_endpoint(endpoint)?,
            ticket: ReturnTicket::parse(ticket)?,
        })),
        (Some(_), None) => Err(WireError::MissingHeader {
            name: "X-Meshnet-Return-Ticket",
        }),
        (None, Some(_)) => Err(WireError::MissingHeader {
            name: "X-Meshnet-Return-To",
        }),
    }
}

/// Reads the ticket of a `POST /return`: missing is [`WireError::ReturnTicketMissing`] (401),
/// malformed is [`WireError::ReturnRefused`] (403).
pub fn read_return_ticket(headers: &HeaderMap) -> Result<ReturnTicket, WireError> {
    let text = optional_str(headers, RETURN_TICKET, "32 hexadecimal digits")
        .map_err(|e| WireError::ReturnRefused {
            reason: e.to_string(),
        })?
        .ok_or(WireError::ReturnTicketMissing)?;
    ReturnTicket::parse(text).map_err(|e| WireError::ReturnRefused {
        reason: e.to_string(),
    })
}

/// The endpoint of `X-Meshnet-Return-To`, no longer than a route's endpoints may be.
fn parse_return_endpoint(text: &str) -> Result<Endpoint, WireError> {
    let invalid = || WireError::InvalidHeader {
        name: "X-Meshnet-Return-To",
        expected: "an http(s) URL or /p2p/<peer id> of at most 512 bytes",
        got: quote(text),
    };
    if text.len() > MAX_ENDPOINT_LEN || text.contains(',') {
        return Err(invalid());
    }
    text.trim().parse().map_err(|_| invalid())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::try_from(*value).unwrap());
        }
        headers
    }

    #[test]
    fn a_ticket_reads_back_from_its_text() {
        let ticket = ReturnTicket::from_bits(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(ticket.to_string(), "0123456789abcdef0011223344556677");
        assert_eq!(ReturnTicket::parse(&ticket.to_string()).unwrap(), ticket);
        assert_eq!(
            ReturnTicket::parse("0123456789ABCDEF0011223344556677").unwrap(),
            ticket
        );
    }

    #[test]
    fn malformed_tickets_are_refused() {
        for text in [
            "",
            "12",
            "0123456789abcdef001122334455667",
            "+123456789abcdef0011223344556677",
            "0123456789abcdef00112233445566778",
            "0123456789abcdef001122334455667g",
        ] {
            assert!(ReturnTicket::parse(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn a_return_address_needs_both_headers() {
        let ticket = "00000000000000000000000000000001";
        assert_eq!(read_return_address(&HeaderMap::new()).unwrap(), None);
        let both = headers(&[(RETURN_TO, "http://10.0.0.1:8080"), (RETURN_TICKET, ticket)]);
        assert_eq!(
            read_return_address(&both).unwrap(),
            Some(ReturnAddress {
                endpoint: Endpoint::Http("http://10.0.0.1:8080".to_owned()),
                ticket: ReturnTicket::from_bits(1),
            })
        );
        let to_only = headers(&[(RETURN_TO, "http://10.0.0.1:8080")]);
        assert!(matches!(
            read_return_address(&to_only),
            Err(WireError::MissingHeader {
                name: "X-Meshnet-Return-Ticket"
            })
        ));
        let ticket_only = headers(&[(RETURN_TICKET, ticket)]);
        assert!(matches!(
            read_return_address(&ticket_only),
            Err(WireError::MissingHeader {
                name: "X-Meshnet-Return-To"
            })
        ));
        let not_an_endpoint = headers(&[(RETURN_TO, "ftp://x"), (RETURN_TICKET, ticket)]);
        assert!(read_return_address(&not_an_endpoint).is_err());
        let long = format!("http://{}", "a".repeat(MAX_ENDPOINT_LEN));
        let too_long = headers(&[(RETURN_TO, &long), (RETURN_TICKET, ticket)]);
        assert!(read_return_address(&too_long).is_err());
    }

    #[test]
    fn a_return_without_a_ticket_is_unauthenticated_and_a_bad_one_forbidden() {
        assert!(matches!(
            read_return_ticket(&HeaderMap::new()),
            Err(WireError::ReturnTicketMissing)
        ));
        let bad = headers(&[(RETURN_TICKET, "nope")]);
        assert!(matches!(
            read_return_ticket(&bad),
            Err(WireError::ReturnRefused { .. })
        ));
        let twice = headers(&[
            (RETURN_TICKET, "00000000000000000000000000000001"),
            (RETURN_TICKET, "00000000000000000000000000000002"),
        ]);
        assert!(matches!(
            read_return_ticket(&twice),
            Err(WireError::ReturnRefused { .. })
        ));
    }
}
