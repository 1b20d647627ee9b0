//! The `X-Meshnet-Route` response header: which members serve a generation (an extension to
//! OpenAI's API that its clients ignore).

use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;

use crate::engine::RouteMember;

/// The header naming the members a generation runs on, set on every answer of a completion
/// that started (whole or streamed, also one that failed midway) whose engine names its route.
pub const ROUTE_HEADER: &str = "x-meshnet-route";

/// The header's value: each member as `<peer id>:<start>..<end>` (its layers, end exclusive),
/// in the order the activations pass through them, separated by `", "`. `None` for an empty
/// route or one that cannot be written in a header (a peer id with other than visible ASCII
/// or holding `,` or `:`).
pub(crate) fn route_header_value(route: &[RouteMember]) -> Option<HeaderValue> {
    let fits = |peer: &str| {
        !peer.is_empty()
            && peer
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b',' && b != b':')
    };
    if route.is_empty() || !route.iter().all(|member| fits(&member.peer)) {
        return None;
    }
    let text = route
        .iter()
        .map(|member| {
            format!(
                "{}:{}..{}",
                member.peer, member.layers.start, member.layers.end
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    HeaderValue::from_str(&text).ok()
}

/// Sets the route header on `response` when the route can be written as one.
pub(crate) fn with_route(mut response: Response, route: &[RouteMember]) -> Response {
    match route_header_value(route) {
        Some(value) => {
            response
                .headers_mut()
                .insert(HeaderName::from_static(ROUTE_HEADER), value);
        }
        None if !route.is_empty() => {
            tracing::warn!(?route, "a route that cannot be written as a header");
        }
        None => {}
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(peer: &str, layers: std::ops::Range<u32>) -> RouteMember {
        RouteMember {
            peer: peer.to_owned(),
            layers,
        }
    }

    #[test]
    fn members_are_listed_in_route_order_with_their_layers() {
        let route = [
            member("12D3KooWEntry", 0..10),
            member("12D3KooWMiddle", 10..20),
            member("12D3KooWLast", 20..30),
        ];
        assert_eq!(
            route_header_value(&route),
            Some(HeaderValue::from_static(
                "12D3KooWEntry:0..10, 12D3KooWMiddle:10..20, 12D3KooWLast:20..30"
            ))
        );
    }

    #[test]
    fn an_empty_route_or_an_unwritable_peer_id_sets_no_header() {
        assert_eq!(route_header_value(&[]), None);
        for bad in ["", "a,b", "a:b", "a b", "pèer", "a\nb"] {
            assert_eq!(
                route_header_value(&[member("12D3KooWOk", 0..1), member(bad, 1..2)]),
                None,
                "{bad:?}"
            );
        }
    }
}
