//! Direct return (ADR-0031): the entry of a route names, in every frame it sends, where the
//! last hop is to post the route's output (`X-Meshnet-Return-To`) and the ticket that lets it
//! (`X-Meshnet-Return-Ticket`). Every hop passes both on unchanged; the last hop posts its
//! output to `{return-to}/return` with the ticket and answers its sender `202 Accepted` with no
//! body, which unwinds up the route while the entry already has the result. A decode step
//! through N hops then costs N + 1 one-way delays instead of 2N.
//!
//! The ticket is 128 random bits the entry draws per frame and accepts once, for the session,
//! chunk and position it sent: only the route's own hops ever see it. The headers are read with
//! the frame's other headers, and a `POST /return`'s ticket by `read_return_ticket` beside them.

use std::fmt;

use crate::Endpoint;
use crate::error::{WireError, quote};

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
