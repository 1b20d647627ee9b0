//! Round trips and malformed inputs for the activation frame codec.

#![allow(clippy::unwrap_used)]

use half::bf16;
use http::{HeaderMap, HeaderValue};
use meshnet_types::LayerSpan;
use meshnet_wire::header::{
    CHUNK_INDEX, CHUNK_TOTAL, DTYPE, ENCODING, LAYERS, POSITION, ROUTE, SESSION, SHAPE,
    WIRE_VERSION_HEADER,
};
use meshnet_wire::{
    ActivationFrame, Activations, Encoding, Endpoint, ErrorClass, FrameMeta, Hop, Limits,
    ReturnAddress, ReturnTicket, Route, Shape, WireError,
};
use proptest::prelude::*;
use uuid::Uuid;

/// A hop's endpoint: an HTTP base URL or a peer reached over libp2p streams.
fn endpoint() -> impl Strategy<Value = String> {
    prop_oneof![
        "https?://[a-z0-9.-]{1,20}(:[0-9]{1,5})?(/[a-z0-9./-]{0,10})?",
        "http://\\[[0-9a-f:]{2,12}\\]:[0-9]{1,5}",
        "/p2p/[A-Za-z0-9]{1,52}",
    ]
}

fn meta(route: Route) -> FrameMeta {
    FrameMeta {
        session: Uuid::from_u128(0xfeed_beef),
        chunk_index: 0,
        chunk_total: 1,
        position: 0,
        layers: LayerSpan::new(0, 10),
        route,
        grant: None,
        fork_from: None,
        return_to: None,
        rewind: false,
    }
}

fn frame_of(dims: &[usize], bits: impl Fn(usize) -> u16) -> ActivationFrame {
    let shape = Shape::new(dims).unwrap();
    let values = (0..shape.elements())
        .map(|i| bf16::from_bits(bits(i)))
        .collect();
    ActivationFrame {
        meta: meta(Route::default()),
        activations: Activations::new(shape, values).unwrap(),
    }
}

fn bits(frame: &ActivationFrame) -> Vec<u16> {
    frame
        .activations
        .values()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn arb_dims() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..12, 1..=4)
}

/// Any bit pattern, with the special values (NaN, ±Inf, ±0, subnormals) drawn often.
fn arb_bf16_bits() -> impl Strategy<Value = u16> {
    prop_oneof![
        any::<u16>(),
        Just(0x7FC0), // NaN
        Just(0xFFC1), // negative NaN with payload
        Just(0x7F80), // +Inf
        Just(0xFF80), // -Inf
        Just(0x0000),
        Just(0x8000),        // -0
        (1u16..0x0080),      // positive subnormals
        (0x8001u16..0x8080), // negative subnormals
    ]
}

fn arb_frame() -> impl Strategy<Value = ActivationFrame> {
    (
        arb_dims(),
        any::<u128>(),
        0u32..1000,
        any::<u64>(),
        0u32..100,
        1u32..50,
    )
        .prop_flat_map(|(dims, session, total_minus, position, start, len)| {
            let elements: usize = dims.iter().product();
            (
                Just(dims),
                prop::collection::vec(arb_bf16_bits(), elements),
                Just((session, total_minus, position, start, len)),
                prop::collection::vec((0u32..200, 1u32..20, endpoint()), 0..4),
            )
        })
        .prop_map(
            |(dims, values, (session, total, position, start, len), hops)| {
                let route = Route::new(
                    hops.into_iter()
                        .map(|(s, l, endpoint)| {
                            Hop::new(LayerSpan::new(s, s + l), endpoint).unwrap()
                        })
                        .collect(),
                )
                .unwrap();
                ActivationFrame {
                    meta: FrameMeta {
                        session: Uuid::from_u128(session),
                        chunk_index: total / 2,
                        chunk_total: total + 1,
                        position,
                        layers: LayerSpan::new(start, start + len),
                        route,
                        grant: (session % 2 == 0).then(|| format!("grant-{session}.sig").into()),
                        fork_from: (session % 3 == 1).then(|| Uuid::from_u128(!session)),
                        return_to: (session % 5 == 2).then(|| ReturnAddress {
                            endpoint: Endpoint::Http(format!("http://10.0.0.{}:80", session % 250)),
                            ticket: ReturnTicket::from_bits(session.rotate_left(7)),
                        }),
                        rewind: session % 7 == 3,
                    },
                    activations: Activations::new(
                        Shape::new(&dims).unwrap(),
                        values.into_iter().map(bf16::from_bits).collect(),
                    )
                    .unwrap(),
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn round_trips_bit_exactly(frame in arb_frame(), zstd in any::<bool>()) {
        let encoding = if zstd { Encoding::Zstd } else { Encoding::Raw };
        let encoded = frame.encode(encoding);
        let decoded = ActivationFrame::decode(&encoded.headers, &encoded.body, &Limits::default()).unwrap();
        prop_assert_eq!(&decoded.meta, &frame.meta);
        prop_assert_eq!(decoded.activations.shape(), frame.activations.shape());
        prop_assert_eq!(bits(&decoded), bits(&frame));
    }

    /// Arbitrary header values and bodies never panic, and every failure has a 4xx class.
    #[test]
    fn arbitrary_headers_and_bodies_never_panic(
        shape in prop_oneof!["[0-9,\\- ]{0,40}", "\\PC{0,40}"],
        version in prop_oneof![Just("1".to_owned()), "\\PC{0,6}"],
        encoding in prop_oneof![Just("zstd".to_owned()), Just("identity".to_owned()), "\\PC{0,8}"],
        numbers in prop::collection::vec(prop_oneof!["[0-9]{1,25}", "\\PC{0,12}"], 3),
        layers in prop_oneof!["[0-9]{1,3}-[0-9]{1,3}", "\\PC{0,12}"],
        route in "\\PC{0,80}",
        body in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut headers = HeaderMap::new();
        let mut put = |name: &'static str, value: &str| {
            if let Ok(v) = HeaderValue::from_str(value) { headers.insert(name, v); }
        };
        put(WIRE_VERSION_HEADER, &version);
        put("content-type", "application/octet-stream");
        put(DTYPE, "bfloat16");
        put(SHAPE, &shape);
        put(SESSION, "67e55044-10b1-426f-9247-bb680e5fe0c8");
        put(CHUNK_INDEX, &numbers[0]);
        put(CHUNK_TOTAL, &numbers[1]);
        put(POSITION, &numbers[2]);
        put(LAYERS, &layers);
        put(ROUTE, &route);
        put(ENCODING, &encoding);
        let limits = Limits { max_frame_bytes: 1 << 20 };
        if let Err(err) = ActivationFrame::decode(&headers, &body, &limits) {
            prop_assert_ne!(err.class(), ErrorClass::Internal, "{}", err);
            prop_assert!(!err.to_string().is_empty());
        }
    }

    /// Random bytes labelled zstd are rejected cleanly, whatever they decompress to.
    #[test]
    fn random_zstd_bodies_are_rejected_cleanly(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let encoded = frame_of(&[1, 4, 8], |i| i as u16).encode(Encoding::Zstd);
        let limits = Limits::default();
        if let Err(err) = ActivationFrame::decode(&encoded.headers, &body, &limits) {
            prop_assert!(matches!(err.class(), ErrorClass::Malformed | ErrorClass::LengthMismatch), "{}", err);
        }
    }
}

/// A valid frame's headers and body, to be broken one field at a time.
fn valid(encoding: Encoding) -> (HeaderMap, Vec<u8>) {
    let encoded = frame_of(&[1, 4, 8], |i| 0x3F80 + i as u16).encode(encoding);
    (encoded.headers, encoded.body.to_vec())
}

fn set(headers: &mut HeaderMap, name: &'static str, value: &str) {
    headers.insert(name, HeaderValue::from_str(value).unwrap());
}

#[test]
fn malformed_inputs_get_their_class_and_name_the_field() {
    type Breaker = Box<dyn Fn(&mut HeaderMap, &mut Vec<u8>)>;
    let raw = Encoding::Raw;
    let zstd = Encoding::Zstd;
    let cases: Vec<(&str, Encoding, Breaker, ErrorClass, &str)> = vec![
        (
            "bad shape syntax",
            raw,
            Box::new(|h, _| set(h, SHAPE, "1;4;8")),
            ErrorClass::Malformed,
            "X-Meshnet-Shape",
        ),
        (
            "zero dimension",
            raw,
            Box::new(|h, _| set(h, SHAPE, "1,0,8")),
            ErrorClass::Malformed,
            "at least 1",
        ),
        (
            "negative dimension",
            raw,
            Box::new(|h, _| set(h, SHAPE, "1,-4,8")),
            ErrorClass::Malformed,
            "at least 1",
        ),
        (
            "five dimensions",
            raw,
            Box::new(|h, _| set(h, SHAPE, "1,1,1,4,8")),
            ErrorClass::Malformed,
            "1 to 4",
        ),
        (
            "overflowing product",
            raw,
            Box::new(|h, _| set(h, SHAPE, "4294967296,4294967296,4")),
            ErrorClass::TooLarge,
            "too large",
        ),
        (
            "10^12 elements",
            raw,
            Box::new(|h, _| set(h, SHAPE, "1000000,1000000")),
            ErrorClass::TooLarge,
            "limit",
        ),
        (
            "body shorter than shape",
            raw,
            Box::new(|_, b| {
                b.pop();
                b.pop();
            }),
            ErrorClass::LengthMismatch,
            "expected 64 bytes, got 62",
        ),
        (
            "body longer than shape",
            raw,
            Box::new(|_, b| b.extend_from_slice(&[0, 0])),
            ErrorClass::LengthMismatch,
            "expected 64 bytes, got 66",
        ),
        (
            "odd body length",
            raw,
            Box::new(|_, b| {
                b.pop();
            }),
            ErrorClass::LengthMismatch,
            "got 63",
        ),
        (
            "truncated zstd",
            zstd,
            Box::new(|_, b| {
                let n = b.len();
                b.truncate(n / 2);
            }),
            ErrorClass::Malformed,
            "corrupt zstd",
        ),
        (
            "corrupt zstd",
            zstd,
            Box::new(|_, b| b.iter_mut().for_each(|x| *x ^= 0x5A)),
            ErrorClass::Malformed,
            "corrupt zstd",
        ),
        (
            "zstd inflates past the shape",
            zstd,
            Box::new(|_, b| *b = zstd::bulk::compress(&[7u8; 66], 1).unwrap()),
            ErrorClass::LengthMismatch,
            "inflates past",
        ),
        (
            "zstd inflates short of the shape",
            zstd,
            Box::new(|_, b| *b = zstd::bulk::compress(&[7u8; 10], 1).unwrap()),
            ErrorClass::LengthMismatch,
            "got 10",
        ),
        (
            "unknown version",
            raw,
            Box::new(|h, _| set(h, WIRE_VERSION_HEADER, "2")),
            ErrorClass::VersionMismatch,
            "X-Meshnet-Wire-Version",
        ),
        (
            "non-numeric version",
            raw,
            Box::new(|h, _| set(h, WIRE_VERSION_HEADER, "v1")),
            ErrorClass::VersionMismatch,
            "expected 1",
        ),
        (
            "missing version",
            raw,
            Box::new(|h, _| {
                h.remove(WIRE_VERSION_HEADER);
            }),
            ErrorClass::Malformed,
            "missing header X-Meshnet-Wire-Version",
        ),
        (
            "missing shape",
            raw,
            Box::new(|h, _| {
                h.remove(SHAPE);
            }),
            ErrorClass::Malformed,
            "missing header X-Meshnet-Shape",
        ),
        (
            "missing session",
            raw,
            Box::new(|h, _| {
                h.remove(SESSION);
            }),
            ErrorClass::Malformed,
            "missing header X-Meshnet-Session",
        ),
        (
            "missing chunk index",
            raw,
            Box::new(|h, _| {
                h.remove(CHUNK_INDEX);
            }),
            ErrorClass::Malformed,
            "X-Meshnet-Chunk-Index",
        ),
        (
            "missing chunk total",
            raw,
            Box::new(|h, _| {
                h.remove(CHUNK_TOTAL);
            }),
            ErrorClass::Malformed,
            "X-Meshnet-Chunk-Total",
        ),
        (
            "missing position",
            raw,
            Box::new(|h, _| {
                h.remove(POSITION);
            }),
            ErrorClass::Malformed,
            "X-Meshnet-Position",
        ),
        (
            "missing layers",
            raw,
            Box::new(|h, _| {
                h.remove(LAYERS);
            }),
            ErrorClass::Malformed,
            "X-Meshnet-Layers",
        ),
        (
            "missing dtype",
            raw,
            Box::new(|h, _| {
                h.remove(DTYPE);
            }),
            ErrorClass::Malformed,
            "X-Meshnet-Dtype",
        ),
        (
            "bad session",
            raw,
            Box::new(|h, _| set(h, SESSION, "not-a-uuid")),
            ErrorClass::Malformed,
            "expected a UUID",
        ),
        (
            "negative position",
            raw,
            Box::new(|h, _| set(h, POSITION, "-1")),
            ErrorClass::Malformed,
            "X-Meshnet-Position",
        ),
        (
            "chunk index past total",
            raw,
            Box::new(|h, _| set(h, CHUNK_INDEX, "1")),
            ErrorClass::Malformed,
            "below X-Meshnet-Chunk-Total",
        ),
        (
            "empty layer range",
            raw,
            Box::new(|h, _| set(h, LAYERS, "5-5")),
            ErrorClass::Malformed,
            "X-Meshnet-Layers",
        ),
        (
            "route without endpoint",
            raw,
            Box::new(|h, _| set(h, ROUTE, "10-20")),
            ErrorClass::Malformed,
            "X-Meshnet-Route",
        ),
        (
            "unknown encoding",
            raw,
            Box::new(|h, _| set(h, ENCODING, "gzip")),
            ErrorClass::Unsupported,
            "got \"gzip\"",
        ),
        (
            "unknown dtype",
            raw,
            Box::new(|h, _| set(h, DTYPE, "float16")),
            ErrorClass::Unsupported,
            "expected bfloat16, got \"float16\"",
        ),
        (
            "wrong content type",
            raw,
            Box::new(|h, _| set(h, "content-type", "application/json")),
            ErrorClass::Unsupported,
            "Content-Type",
        ),
        (
            "missing content type",
            raw,
            Box::new(|h, _| {
                h.remove("content-type");
            }),
            ErrorClass::Unsupported,
            "(none)",
        ),
    ];
    for (name, encoding, breaker, class, needle) in cases {
        let (mut headers, mut body) = valid(encoding);
        breaker(&mut headers, &mut body);
        let err = ActivationFrame::decode(&headers, &body, &Limits::default()).expect_err(name);
        assert_eq!(err.class(), class, "{name}: {err}");
        assert!(
            err.to_string().contains(needle),
            "{name}: {err:?} lacks {needle:?}"
        );
    }
}

#[test]
fn the_frame_limit_is_enforced_before_allocation() {
    let (headers, body) = valid(Encoding::Raw);
    let tight = Limits {
        max_frame_bytes: 63,
    };
    let err = ActivationFrame::decode(&headers, &body, &tight).unwrap_err();
    assert!(
        matches!(err, WireError::FrameTooLarge { limit: 63, .. }),
        "{err}"
    );
    // A huge body is refused by size even when the shape is small.
    let huge = vec![0u8; tight.max_body_bytes() + 1];
    let small = frame_of(&[1, 2, 2], |_| 0).encode(Encoding::Raw);
    let err = ActivationFrame::decode(&small.headers, &huge, &tight).unwrap_err();
    assert!(matches!(err, WireError::BodyTooLarge { .. }), "{err}");
}

#[test]
fn a_zstd_bomb_is_cut_off_at_the_declared_size() {
    // 64 MiB of zeros compresses to a few kilobytes; the declared shape allows 64 bytes.
    let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..64 {
        std::io::Write::write_all(&mut encoder, &zeros).unwrap();
    }
    let bomb = encoder.finish().unwrap();
    assert!(bomb.len() < 64 * 1024, "bomb is {} bytes", bomb.len());
    let (headers, _) = valid(Encoding::Zstd);
    let err = ActivationFrame::decode(&headers, &bomb, &Limits::default()).unwrap_err();
    assert!(
        matches!(err, WireError::DecompressedTooLarge { expected: 64, .. }),
        "{err}"
    );
}

/// The window the memory test's bomb is compressed with: zstd's decoder keeps a buffer of
/// about this size while it inflates, whatever the declared shape.
const BOMB_WINDOW_LOG: u32 = 21;

/// Set in the child process of [`decoding_a_zstd_bomb_stays_within_the_declared_frame`]: the
/// bomb to decode, in hex.
const BOMB_CHILD_ENV: &str = "MESHNET_WIRE_TEST_BOMB_HEX";

/// A kB line of `/proc/self/status` (`VmHWM`, `VmRSS`), in bytes.
#[cfg(target_os = "linux")]
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|line| line.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kilobytes: u64 = line
        .trim_start_matches(field)
        .trim_start_matches(':')
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kilobytes * 1024
}

/// Measures memory, not just the error: a child process (this test binary, running only this
/// test) decodes the bomb and reports how far its peak resident memory rose while decoding.
/// The decoder may hold the declared frame plus zstd's window and decoder state; inflating the
/// bomb (64 MiB) would blow far past that.
#[cfg(target_os = "linux")]
#[test]
fn decoding_a_zstd_bomb_stays_within_the_declared_frame() {
    const NAME: &str = "decoding_a_zstd_bomb_stays_within_the_declared_frame";
    let (headers, _) = valid(Encoding::Zstd);
    if let Ok(hex) = std::env::var(BOMB_CHILD_ENV) {
        let bomb: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        // Resets the peak to the current resident size (Linux 4.0+), so only decoding counts.
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
        let before = status_bytes("VmHWM");
        let err = ActivationFrame::decode(&headers, &bomb, &Limits::default()).unwrap_err();
        let after = status_bytes("VmHWM");
        assert!(
            matches!(err, WireError::DecompressedTooLarge { expected: 64, .. }),
            "{err}"
        );
        println!("peak-growth-bytes {}", after.saturating_sub(before));
        return;
    }
    let inflated = 64usize << 20;
    let mut encoder = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    encoder.window_log(BOMB_WINDOW_LOG).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..inflated >> 20 {
        std::io::Write::write_all(&mut encoder, &zeros).unwrap();
    }
    let bomb = encoder.finish().unwrap();
    let hex: String = bomb.iter().map(|byte| format!("{byte:02x}")).collect();
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(BOMB_CHILD_ENV, hex)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let growth: usize = stdout
        .lines()
        .find_map(|line| line.split("peak-growth-bytes ").nth(1))
        .unwrap_or_else(|| panic!("child reported nothing: {stdout}"))
        .parse()
        .unwrap();
    // The declared frame (64 bytes), zstd's window, and 1 MiB for the decoder's context, its
    // block buffers and the allocator's rounding.
    let declared = 64;
    let allowed = declared + (1 << BOMB_WINDOW_LOG) + (1 << 20);
    println!("decoding a {inflated}-byte bomb raised peak memory by {growth} bytes");
    assert!(
        growth <= allowed,
        "decoding the bomb raised peak memory by {growth} bytes, more than the {allowed} the \
         declared {declared}-byte frame allows (the bomb inflates to {inflated})"
    );
}

#[test]
fn zstd_shrinks_compressible_activations() {
    let frame = frame_of(&[1, 128, 576], |i| if i % 7 == 0 { 0x3F80 } else { 0 });
    let raw = frame.encode(Encoding::Raw);
    let zstd = frame.encode(Encoding::Zstd);
    assert_eq!(raw.body.len(), 128 * 576 * 2);
    assert!(
        zstd.body.len() * 4 < raw.body.len(),
        "zstd {} vs raw {}",
        zstd.body.len(),
        raw.body.len()
    );
}
