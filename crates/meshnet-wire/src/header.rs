//! The `X-Meshnet-*` header mapping of an activation frame's metadata.

use std::fmt;

use http::{HeaderMap, HeaderValue, header};
use meshnet_types::LayerSpan;
use uuid::Uuid;

use crate::error::quote;
use crate::return_address::{RETURN_TICKET, RETURN_TO, ReturnAddress, ReturnTicket};
use crate::{Endpoint, Shape, WIRE_VERSION, WireError};

/// `X-Meshnet-Shape`: comma-separated dimensions, outermost first.
pub const SHAPE: &str = "x-meshnet-shape";
/// `X-Meshnet-Dtype`: always `bfloat16`.
pub const DTYPE: &str = "x-meshnet-dtype";
/// `X-Meshnet-Session`: the session's UUID.
pub const SESSION: &str = "x-meshnet-session";
/// `X-Meshnet-Chunk-Index`: the zero-based index of this prefill chunk.
pub const CHUNK_INDEX: &str = "x-meshnet-chunk-index";
/// `X-Meshnet-Chunk-Total`: how many chunks the prefill was split into (1 for a decode step).
pub const CHUNK_TOTAL: &str = "x-meshnet-chunk-total";
/// `X-Meshnet-Encoding`: `zstd`, or absent (or `identity`) for raw bytes.
pub const ENCODING: &str = "x-meshnet-encoding";
/// `X-Meshnet-Wire-Version`: the wire format version, [`WIRE_VERSION`].
pub const WIRE_VERSION_HEADER: &str = "x-meshnet-wire-version";
/// `X-Meshnet-Position`: the absolute token position of the frame's first token (ADR-0010).
pub const POSITION: &str = "x-meshnet-position";
/// `X-Meshnet-Layers`: the half-open layer range `start-end` the receiver runs (ADR-0011).
pub const LAYERS: &str = "x-meshnet-layers";
/// `X-Meshnet-Route`: the hops after the receiver, `start-end@endpoint` comma-separated (ADR-0011).
pub const ROUTE: &str = "x-meshnet-route";
/// `X-Meshnet-Fork-From`: the UUID of a session whose first `position` cached positions a new
/// session starts from (several continuations sharing one prompt's prefill).
pub const FORK_FROM: &str = "x-meshnet-fork-from";
/// `X-Meshnet-Rewind`: `1` when the receiver first drops its cached positions of the session
/// from `position` on (a speculative step whose drafts were rejected; ADR-0032).
pub const REWIND: &str = "x-meshnet-rewind";
/// `X-Meshnet-Grant`: the tracker's signed grant for the session and route (the `grant`
/// module reads and checks it).
pub const GRANT_HEADER: &str = "x-meshnet-grant";

/// The only content type of an activation body.
pub const OCTET_STREAM: &str = "application/octet-stream";
/// The only dtype on the wire.
pub const BFLOAT16: &str = "bfloat16";

/// The most hops a route may list.
pub const MAX_ROUTE_HOPS: usize = 64;
/// The longest endpoint string a hop may carry.
pub const MAX_ENDPOINT_LEN: usize = 512;

/// How the body bytes are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Encoding {
    /// Raw little-endian bfloat16 bytes (no `X-Meshnet-Encoding` header).
    #[default]
    Raw,
    /// zstd-compressed (level 1) little-endian bfloat16 bytes.
    Zstd,
}

impl Encoding {
    /// Every encoding this build understands, as listed in error messages.
    pub const KNOWN: &'static str = "zstd, identity (or no header)";

    /// The header value for this encoding; `None` means "omit the header".
    pub fn header_value(self) -> Option<&'static str> {
        match self {
            Encoding::Raw => None,
            Encoding::Zstd => Some("zstd"),
        }
    }

    /// Reads `X-Meshnet-Encoding` from a header map (absent means raw).
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, WireError> {
        let Some(value) = optional_str(headers, ENCODING, "zstd or identity")? else {
            return Ok(Encoding::Raw);
        };
        match value.trim().to_ascii_lowercase().as_str() {
            "zstd" => Ok(Encoding::Zstd),
            "identity" | "raw" => Ok(Encoding::Raw),
            _ => Err(WireError::UnsupportedEncoding {
                expected: Encoding::KNOWN,
                got: quote(value),
            }),
        }
    }
}

/// Parses a header's layer span, written `start-end`; the span must hold at least one layer.
pub(crate) fn parse_layers(text: &str, field: &'static str) -> Result<LayerSpan, WireError> {
    let invalid = || WireError::InvalidHeader {
        name: field,
        expected: "a layer range start-end with start < end",
        got: quote(text),
    };
    let (start, end) = text.trim().split_once('-').ok_or_else(invalid)?;
    let start = parse_decimal::<u32>(start).ok_or_else(invalid)?;
    let end = parse_decimal::<u32>(end).ok_or_else(invalid)?;
    LayerSpan::non_empty(start, end).ok_or_else(invalid)
}

/// A layer span as headers write it: `start-end`.
fn layers_text(layers: LayerSpan) -> String {
    format!("{}-{}", layers.start, layers.end)
}

/// One hop of a source route: the layers that hop runs and where to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Hop {
    /// The layers the hop runs.
    pub layers: LayerSpan,
    /// How to reach the hop: an HTTP base URL such as `http://10.0.0.7:8081`, or
    /// `/p2p/<peer id>` for a member reached over libp2p streams.
    pub endpoint: Endpoint,
}

impl Hop {
    /// Builds a hop, checking that it runs at least one layer and that the endpoint can travel
    /// in a header (visible ASCII, no comma, no `@`, at most [`MAX_ENDPOINT_LEN`] bytes) and
    /// is an [`Endpoint`]: an `http(s)://` URL or `/p2p/<peer id>`.
    pub fn new(layers: LayerSpan, endpoint: impl Into<String>) -> Result<Self, WireError> {
        let endpoint = endpoint.into();
        if layers.is_empty() {
            return Err(WireError::InvalidHeader {
                name: "X-Meshnet-Route",
                expected: "a hop that runs at least one layer",
                got: quote(&layers_text(layers)),
            });
        }
        if !valid_endpoint(&endpoint) {
            return Err(WireError::InvalidHeader {
                name: "X-Meshnet-Route",
                expected: "an endpoint of 1 to 512 visible ASCII characters without ',' or '@'",
                got: quote(&endpoint),
            });
        }
        let endpoint = endpoint
            .parse::<Endpoint>()
            .map_err(|_| WireError::InvalidHeader {
                name: "X-Meshnet-Route",
                expected: "an endpoint that is an http:// or https:// URL or /p2p/<peer id>",
                got: quote(&endpoint),
            })?;
        Ok(Hop { layers, endpoint })
    }
}

fn valid_endpoint(endpoint: &str) -> bool {
    !endpoint.is_empty()
        && endpoint.len() <= MAX_ENDPOINT_LEN
        && endpoint
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b',' && b != b'@')
}

/// The remaining hops after the receiver, in order; empty at the last hop.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Route {
    hops: Vec<Hop>,
}

impl Route {
    /// Builds a route of at most [`MAX_ROUTE_HOPS`] hops.
    pub fn new(hops: Vec<Hop>) -> Result<Self, WireError> {
        if hops.len() > MAX_ROUTE_HOPS {
            return Err(WireError::InvalidHeader {
                name: "X-Meshnet-Route",
                expected: "at most 64 hops",
                got: format!("{} hops", hops.len()),
            });
        }
        Ok(Route { hops })
    }

    /// The hops, next first.
    pub fn hops(&self) -> &[Hop] {
        &self.hops
    }

    /// Whether no hop follows the receiver.
    pub fn is_empty(&self) -> bool {
        self.hops.is_empty()
    }

    /// Splits off the next hop, returning it and the route that hop must forward along.
    pub fn pop_next(&self) -> Option<(Hop, Route)> {
        let (next, rest) = self.hops.split_first()?;
        Some((
            next.clone(),
            Route {
                hops: rest.to_vec(),
            },
        ))
    }

    /// Parses the `X-Meshnet-Route` syntax (`start-end@endpoint`, comma-separated).
    pub fn parse(text: &str) -> Result<Self, WireError> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Route::default());
        }
        let parts: Vec<&str> = text.split(',').collect();
        if parts.len() > MAX_ROUTE_HOPS {
            return Err(WireError::InvalidHeader {
                name: "X-Meshnet-Route",
                expected: "at most 64 hops",
                got: format!("{} hops", parts.len()),
            });
        }
        let hops = parts
            .into_iter()
            .map(|part| {
                let part = part.trim();
                let (layers, endpoint) = part.split_once('@').ok_or(WireError::InvalidHeader {
                    name: "X-Meshnet-Route",
                    expected: "comma-separated hops of the form start-end@endpoint",
                    got: quote(part),
                })?;
                Hop::new(parse_layers(layers, ROUTE)?, endpoint)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Route { hops })
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, hop) in self.hops.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}@{}", layers_text(hop.layers), hop.endpoint)?;
        }
        Ok(())
    }
}

/// Everything a frame carries besides its tensor: who it belongs to, where its tokens sit, which
/// layers the receiver runs and where the result goes next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameMeta {
    /// The generation session the frame belongs to (selects the KV cache).
    pub session: Uuid,
    /// The zero-based index of this chunk within its prefill (0 for a decode step).
    pub chunk_index: u32,
    /// How many chunks the prefill has (1 for a decode step).
    pub chunk_total: u32,
    /// The absolute token position of the frame's first token.
    pub position: u64,
    /// The layers the receiver runs (in a response: the layers that were run).
    pub layers: LayerSpan,
    /// The hops after the receiver (empty in a response and at the last hop).
    pub route: Route,
    /// The tracker's grant for the session and route (`X-Meshnet-Grant`, checked by the
    /// `grant` module), passed on unchanged from hop to hop; `None` in a response.
    pub grant: Option<std::sync::Arc<str>>,
    /// `X-Meshnet-Fork-From`: when the frame's session is not known to a hop yet, it starts as
    /// a copy of this session's first `position` cached positions; passed on from hop to hop.
    /// `None` in a response and for ordinary frames.
    pub fork_from: Option<Uuid>,
    /// `X-Meshnet-Return-To` and `X-Meshnet-Return-Ticket`: where the last hop posts the
    /// route's output directly (see [`crate::return_address`]); passed on from hop to hop.
    /// `None` in a response and when the output is to travel back along the route.
    pub return_to: Option<ReturnAddress>,
    /// `X-Meshnet-Rewind`: every hop drops the session's cached positions from `position` on
    /// before it runs the frame (drafted tokens the entry rejected); passed on from hop to
    /// hop. `false` in a response and for ordinary frames.
    pub rewind: bool,
}

impl FrameMeta {
    /// Checks that the chunk index is below the chunk total.
    pub fn validate(&self) -> Result<(), WireError> {
        if self.fork_from == Some(self.session) {
            return Err(WireError::InvalidHeader {
                name: "X-Meshnet-Fork-From",
                expected: "another session than X-Meshnet-Session",
                got: self.session.to_string(),
            });
        }
        if self.chunk_index >= self.chunk_total {
            return Err(WireError::ChunkOutOfRange {
                index: self.chunk_index,
                total: self.chunk_total,
            });
        }
        Ok(())
    }
}

/// Checks `X-Meshnet-Wire-Version` alone, so that a version mismatch is reported before anything
/// else about the request.
pub fn check_wire_version(headers: &HeaderMap) -> Result<(), WireError> {
    let value = required_str(headers, WIRE_VERSION_HEADER, "the wire version number")?;
    match parse_decimal::<u32>(value) {
        Some(v) if v == WIRE_VERSION => Ok(()),
        _ => Err(WireError::version_mismatch(value)),
    }
}

/// Checks `Content-Type`, `X-Meshnet-Dtype` and `X-Meshnet-Encoding`, returning the encoding.
pub fn check_media(headers: &HeaderMap) -> Result<Encoding, WireError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let essence = content_type.as_deref().map(|ct| {
        ct.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    if essence.as_deref() != Some(OCTET_STREAM) {
        return Err(WireError::UnsupportedContentType {
            got: content_type.map_or_else(|| "(none)".to_owned(), |ct| quote(&ct)),
        });
    }
    let dtype = required_str(headers, DTYPE, "bfloat16")?;
    if !dtype.trim().eq_ignore_ascii_case(BFLOAT16) {
        return Err(WireError::UnsupportedDtype { got: quote(dtype) });
    }
    Encoding::from_headers(headers)
}

/// Reads the shape and the frame metadata from the headers (version and media are checked by
/// [`check_wire_version`] and [`check_media`]).
pub fn read_meta(headers: &HeaderMap) -> Result<(Shape, FrameMeta), WireError> {
    let shape = Shape::parse(
        required_str(headers, SHAPE, "comma-separated dimensions")?,
        "X-Meshnet-Shape",
    )?;
    let session = parse_uuid(
        required_str(headers, SESSION, "a UUID")?,
        "X-Meshnet-Session",
    )?;
    let fork_from = match optional_str(headers, FORK_FROM, "a UUID")? {
        Some(text) => Some(parse_uuid(text, "X-Meshnet-Fork-From")?),
        None => None,
    };
    let meta = FrameMeta {
        session,
        chunk_index: required_number(headers, CHUNK_INDEX, "X-Meshnet-Chunk-Index")?,
        chunk_total: required_number(headers, CHUNK_TOTAL, "X-Meshnet-Chunk-Total")?,
        position: required_number(headers, POSITION, "X-Meshnet-Position")?,
        layers: parse_layers(
            required_str(headers, LAYERS, "a layer range start-end")?,
            "X-Meshnet-Layers",
        )?,
        route: match optional_str(headers, ROUTE, "start-end@endpoint hops")? {
            Some(text) => Route::parse(text)?,
            None => Route::default(),
        },
        grant: optional_str(headers, GRANT_HEADER, "a grant")?.map(Into::into),
        fork_from,
        return_to: read_return_address(headers)?,
        rewind: read_rewind(headers)?,
    };
    meta.validate()?;
    Ok((shape, meta))
}

/// `X-Meshnet-Rewind`: absent (no rewind) or `1`.
fn read_rewind(headers: &HeaderMap) -> Result<bool, WireError> {
    match optional_str(headers, REWIND, "1")? {
        None => Ok(false),
        Some(text) if text.trim() == "1" => Ok(true),
        Some(text) => Err(WireError::InvalidHeader {
            name: "X-Meshnet-Rewind",
            expected: "1",
            got: quote(text),
        }),
    }
}

/// A session id header's value.
fn parse_uuid(text: &str, name: &'static str) -> Result<Uuid, WireError> {
    Uuid::try_parse(text.trim()).map_err(|_| WireError::InvalidHeader {
        name,
        expected: "a UUID",
        got: quote(text),
    })
}

/// Writes every header of a frame: version, content type, dtype, shape, metadata and encoding.
pub fn write_headers(shape: &Shape, meta: &FrameMeta, encoding: Encoding) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(12);
    let mut put = |name: &'static str, value: String| {
        // Every value written here is built from digits, UUIDs, validated endpoints and fixed
        // names, all of which are valid header characters.
        if let Ok(value) = HeaderValue::try_from(value) {
            headers.insert(name, value);
        }
    };
    put(WIRE_VERSION_HEADER, WIRE_VERSION.to_string());
    put(header::CONTENT_TYPE.as_str(), OCTET_STREAM.to_owned());
    put(DTYPE, BFLOAT16.to_owned());
    put(SHAPE, shape.to_string());
    put(SESSION, meta.session.to_string());
    put(CHUNK_INDEX, meta.chunk_index.to_string());
    put(CHUNK_TOTAL, meta.chunk_total.to_string());
    put(POSITION, meta.position.to_string());
    put(LAYERS, layers_text(meta.layers));
    if !meta.route.is_empty() {
        put(ROUTE, meta.route.to_string());
    }
    if let Some(grant) = &meta.grant {
        put(GRANT_HEADER, grant.to_string());
    }
    if let Some(parent) = meta.fork_from {
        put(FORK_FROM, parent.to_string());
    }
    if meta.rewind {
        put(REWIND, "1".to_owned());
    }
    if let Some(address) = &meta.return_to {
        put(RETURN_TO, address.endpoint.to_string());
        put(RETURN_TICKET, address.ticket.to_string());
    }
    if let Some(value) = encoding.header_value() {
        put(ENCODING, value.to_owned());
    }
    headers
}

/// Parses a decimal number of digits only (no sign, no spaces inside).
fn parse_decimal<T: std::str::FromStr>(text: &str) -> Option<T> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn display_name(name: &'static str) -> &'static str {
    match name {
        SHAPE => "X-Meshnet-Shape",
        DTYPE => "X-Meshnet-Dtype",
        SESSION => "X-Meshnet-Session",
        CHUNK_INDEX => "X-Meshnet-Chunk-Index",
        CHUNK_TOTAL => "X-Meshnet-Chunk-Total",
        ENCODING => "X-Meshnet-Encoding",
        WIRE_VERSION_HEADER => "X-Meshnet-Wire-Version",
        REWIND => "X-Meshnet-Rewind",
        POSITION => "X-Meshnet-Position",
        LAYERS => "X-Meshnet-Layers",
        ROUTE => "X-Meshnet-Route",
        RETURN_TO => "X-Meshnet-Return-To",
        RETURN_TICKET => "X-Meshnet-Return-Ticket",
        other => other,
    }
}

pub(crate) fn optional_str<'h>(
    headers: &'h HeaderMap,
    name: &'static str,
    expected: &'static str,
) -> Result<Option<&'h str>, WireError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(WireError::InvalidHeader {
            name: display_name(name),
            expected: "the header exactly once",
            got: "several values".to_owned(),
        });
    }
    value
        .to_str()
        .map(Some)
        .map_err(|_| WireError::InvalidHeader {
            name: display_name(name),
            expected,
            got: quote(&String::from_utf8_lossy(value.as_bytes())),
        })
}

fn required_str<'h>(
    headers: &'h HeaderMap,
    name: &'static str,
    expected: &'static str,
) -> Result<&'h str, WireError> {
    optional_str(headers, name, expected)?.ok_or(WireError::MissingHeader {
        name: display_name(name),
    })
}

fn required_number<T: std::str::FromStr>(
    headers: &HeaderMap,
    name: &'static str,
    display: &'static str,
) -> Result<T, WireError> {
    let text = required_str(headers, name, "a non-negative decimal integer")?;
    parse_decimal(text).ok_or_else(|| WireError::InvalidHeader {
        name: display,
        expected: "a non-negative decimal integer",
        got: quote(text),
    })
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

    fn meta() -> FrameMeta {
        FrameMeta {
            session: Uuid::from_u128(0x1234),
            chunk_index: 1,
            chunk_total: 3,
            position: 128,
            layers: LayerSpan::new(10, 20),
            route: Route::new(vec![
                Hop::new(LayerSpan::new(20, 25), "http://127.0.0.1:8082").unwrap(),
                Hop::new(LayerSpan::new(25, 30), "http://[::1]:8083").unwrap(),
            ])
            .unwrap(),
            grant: None,
            fork_from: None,
            return_to: None,
            rewind: false,
        }
    }

    #[test]
    fn a_rewind_round_trips_and_only_1_means_rewind() {
        let shape = Shape::new(&[1, 3, 576]).unwrap();
        let rewound = FrameMeta {
            rewind: true,
            ..meta()
        };
        let mut headers = write_headers(&shape, &rewound, Encoding::Raw);
        assert_eq!(headers[REWIND], "1");
        assert_eq!(read_meta(&headers).unwrap().1, rewound);
        assert!(
            write_headers(&shape, &meta(), Encoding::Raw)
                .get(REWIND)
                .is_none()
        );
        for bad in ["0", "true", "yes", ""] {
            headers.insert(REWIND, HeaderValue::from_static(bad));
            let error = read_meta(&headers).unwrap_err().to_string();
            assert!(error.contains("X-Meshnet-Rewind"), "{bad}: {error}");
        }
    }

    #[test]
    fn a_fork_source_round_trips_and_must_name_another_session() {
        let shape = Shape::new(&[1, 1, 576]).unwrap();
        let forked = FrameMeta {
            fork_from: Some(Uuid::from_u128(0x99)),
            return_to: None,
            ..meta()
        };
        let mut headers = write_headers(&shape, &forked, Encoding::Raw);
        assert_eq!(headers[FORK_FROM], Uuid::from_u128(0x99).to_string());
        assert_eq!(read_meta(&headers).unwrap().1, forked);
        assert!(
            write_headers(&shape, &meta(), Encoding::Raw)
                .get(FORK_FROM)
                .is_none()
        );

        headers.insert(FORK_FROM, HeaderValue::from_static("not-a-uuid"));
        let error = read_meta(&headers).unwrap_err().to_string();
        assert!(
            error.contains("X-Meshnet-Fork-From") && error.contains("a UUID"),
            "{error}"
        );
        let own = Uuid::from_u128(0x1234).to_string();
        headers.insert(FORK_FROM, HeaderValue::try_from(own).unwrap());
        let error = read_meta(&headers).unwrap_err().to_string();
        assert!(error.contains("another session"), "{error}");
    }

    #[test]
    fn headers_round_trip() {
        let shape = Shape::new(&[1, 128, 576]).unwrap();
        let headers = write_headers(&shape, &meta(), Encoding::Zstd);
        assert_eq!(headers[SHAPE], "1,128,576");
        assert_eq!(
            headers[ROUTE],
            "20-25@http://127.0.0.1:8082,25-30@http://[::1]:8083"
        );
        check_wire_version(&headers).unwrap();
        assert_eq!(check_media(&headers).unwrap(), Encoding::Zstd);
        let (read_shape, read) = read_meta(&headers).unwrap();
        assert_eq!(read_shape, shape);
        assert_eq!(read, meta());
    }

    #[test]
    fn raw_encoding_omits_the_header() {
        let shape = Shape::new(&[4]).unwrap();
        let headers = write_headers(&shape, &meta(), Encoding::Raw);
        assert!(headers.get(ENCODING).is_none());
        assert_eq!(check_media(&headers).unwrap(), Encoding::Raw);
    }

    #[test]
    fn pop_next_walks_the_route() {
        let (next, rest) = meta().route.pop_next().unwrap();
        assert_eq!(next.layers, LayerSpan::new(20, 25));
        let (last, empty) = rest.pop_next().unwrap();
        assert_eq!(last.endpoint, Endpoint::Http("http://[::1]:8083".into()));
        assert!(empty.is_empty() && empty.pop_next().is_none());
    }

    #[test]
    fn rejects_bad_routes_and_ranges() {
        let no_hop = "comma-separated hops of the form start-end@endpoint";
        let bad_range = "a layer range start-end with start < end";
        let bad_endpoint = "an endpoint of 1 to 512 visible ASCII characters without ',' or '@'";
        let expected_of = |result: Result<Route, WireError>| match result {
            Err(WireError::InvalidHeader { name, expected, .. }) => (name, expected),
            other => panic!("not an invalid header: {other:?}"),
        };
        // The range's own parser names the header as sent on the wire, in lower case.
        let not_an_endpoint = "an endpoint that is an http:// or https:// URL or /p2p/<peer id>";
        for (route, name, why) in [
            ("20-25", "X-Meshnet-Route", no_hop),
            ("25-20@http://x", ROUTE, bad_range),
            ("a-b@/p2p/x", ROUTE, bad_range),
            ("1-2@", "X-Meshnet-Route", bad_endpoint),
            ("1-2@a b", "X-Meshnet-Route", bad_endpoint),
            ("1-2@x", "X-Meshnet-Route", not_an_endpoint),
            ("1-2@ftp://x", "X-Meshnet-Route", not_an_endpoint),
            ("1-2@/p2p/x-y", "X-Meshnet-Route", not_an_endpoint),
            ("1-2@http://x,,3-4@http://y", "X-Meshnet-Route", no_hop),
        ] {
            assert_eq!(expected_of(Route::parse(route)), (name, why), "{route:?}");
        }
        let too_long = vec!["1-2@/p2p/x"; MAX_ROUTE_HOPS + 1].join(",");
        assert_eq!(
            expected_of(Route::parse(&too_long)),
            ("X-Meshnet-Route", "at most 64 hops")
        );
        assert!(matches!(
            parse_layers("3-3", LAYERS),
            Err(WireError::InvalidHeader { name: LAYERS, expected, .. }) if expected == bad_range
        ));
        assert!(matches!(
            Hop::new(LayerSpan::new(3, 3), "http://a"),
            Err(WireError::InvalidHeader {
                expected: "a hop that runs at least one layer",
                ..
            })
        ));
    }

    #[test]
    fn version_is_checked_first_and_named() {
        let mut headers = HeaderMap::new();
        assert!(matches!(
            check_wire_version(&headers),
            Err(WireError::MissingHeader {
                name: "X-Meshnet-Wire-Version"
            })
        ));
        headers.insert(WIRE_VERSION_HEADER, HeaderValue::from_static("2"));
        let err = check_wire_version(&headers).unwrap_err();
        assert_eq!(err.class(), crate::ErrorClass::VersionMismatch);
        assert!(err.to_string().contains("expected 1, got \"2\""), "{err}");
    }
}

#[cfg(test)]
mod return_address_tests {
    use super::*;
    use crate::return_address::ReturnTicket;

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
