#![allow(clippy::unwrap_used)]
//! Property tests of the control message encoding: every message round-trips,
//! and arbitrary bytes never make a decoder panic.

use meshnet_p2p::{
    CoverageMessage, DirectiveMessage, P2pError, PeerAnnouncement, SpanStatus, TrackerRecord,
    decode, encode,
};
use meshnet_planner::{CoverageMap, Directive, SpanHolding};
use meshnet_types::{LayerSpan, PeerId as PlannerPeerId, Quantization, SpanState};
use proptest::prelude::*;

fn quantization() -> impl Strategy<Value = Quantization> {
    prop_oneof![
        Just(Quantization::Nf4),
        Just(Quantization::Q4_1),
        Just(Quantization::Int8),
        Just(Quantization::Q8_0),
        Just(Quantization::Bf16),
    ]
}

fn span() -> impl Strategy<Value = LayerSpan> {
    (any::<u32>(), any::<u32>()).prop_map(|(a, b)| LayerSpan::new(a.min(b), a.max(b)))
}

fn span_status() -> impl Strategy<Value = SpanStatus> {
    (
        span(),
        quantization(),
        prop_oneof![
            Just(SpanState::Loading),
            Just(SpanState::Ready),
            Just(SpanState::Draining)
        ],
    )
        .prop_map(|(layers, quantization, state)| SpanStatus {
            layers,
            quantization,
            state,
        })
}

fn planner_peer() -> impl Strategy<Value = PlannerPeerId> {
    "[1-9A-Za-z]{0,52}".prop_map(PlannerPeerId::new)
}

fn directive() -> impl Strategy<Value = Directive> {
    (planner_peer(), span(), quantization(), any::<bool>()).prop_map(
        |(peer, layers, quantization, load)| {
            if load {
                Directive::LoadShard {
                    peer,
                    layers,
                    quantization,
                }
            } else {
                Directive::DropShard {
                    peer,
                    layers,
                    quantization,
                }
            }
        },
    )
}

fn coverage_map() -> impl Strategy<Value = CoverageMap> {
    let holding = (planner_peer(), span(), quantization(), any::<bool>()).prop_map(
        |(peer, layers, quantization, ready)| SpanHolding {
            peer,
            layers,
            quantization,
            state: if ready {
                SpanState::Ready
            } else {
                SpanState::Loading
            },
        },
    );
    (any::<u64>(), prop::collection::vec(holding, 0..8))
        .prop_map(|(epoch, holdings)| CoverageMap { epoch, holdings })
}

fn announcement() -> impl Strategy<Value = PeerAnnouncement> {
    (
        (
            ".{0,60}",
            ".{0,20}",
            ".{0,12}",
            any::<u32>(),
            prop::collection::vec(".{0,40}", 0..4),
            any::<u64>(),
            prop::collection::vec(quantization(), 0..5),
        ),
        (
            // Finite throughputs: NaN never equals itself.
            -1e12f64..1e12,
            any::<u64>(),
            prop::option::of(span_status()),
            any::<u64>(),
            any::<u32>(),
            any::<bool>(),
            any::<u64>(),
        ),
        (
            0.0f64..1e6,
            any::<bool>(),
            any::<bool>(),
            prop::option::of(any::<u64>()),
            prop::collection::vec(".{0,40}", 0..3),
        ),
    )
        .prop_map(
            |(
                (
                    peer,
                    model_id,
                    software_version,
                    wire_version,
                    http_endpoints,
                    memory_bytes,
                    quantizations,
                ),
                (
                    throughput,
                    kv_tokens,
                    span,
                    free_kv_tokens,
                    active_sessions,
                    is_tracker,
                    sent_at_unix_ms,
                ),
                (forward_latency_ms, leaving, tracker_capable, tracker_silent_ms, p2p_addresses),
            )| PeerAnnouncement {
                peer: PlannerPeerId::new(peer),
                model_id,
                software_version,
                wire_version,
                http_endpoints,
                p2p_addresses,
                memory_bytes,
                quantizations,
                throughput,
                kv_tokens,
                span,
                free_kv_tokens,
                active_sessions,
                is_tracker,
                forward_latency_ms,
                leaving,
                tracker_capable,
                sent_at_unix_ms,
                tracker_silent_ms,
                rtt_ms: (0..sent_at_unix_ms % 4)
                    .map(|i| meshnet_p2p::PeerRtt {
                        peer: PlannerPeerId::new(format!("near-{i}")),
                        ms: (free_kv_tokens % 1000) as f32 / 7.0 + i as f32,
                    })
                    .collect(),
            },
        )
}

fn coverage() -> impl Strategy<Value = CoverageMessage> {
    (
        ".{0,20}",
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        coverage_map(),
        (
            any::<u64>(),
            prop::collection::vec(".{0,52}", 0..4),
            ".{0,40}",
        ),
    )
        .prop_map(
            |(model_id, epoch, sequence, num_layers, map, (term, succession, tracker_http))| {
                CoverageMessage {
                    model_id,
                    term,
                    succession: succession.into_iter().map(PlannerPeerId::new).collect(),
                    tracker_http,
                    epoch,
                    sequence,
                    num_layers,
                    map,
                    announce_interval_ms: sequence.rotate_left(7),
                }
            },
        )
}

fn directive_message() -> impl Strategy<Value = DirectiveMessage> {
    (
        ".{0,20}",
        ".{0,52}",
        any::<u64>(),
        any::<u64>(),
        prop::collection::vec(directive(), 0..6),
        prop::option::of(span_status()),
        any::<u64>(),
    )
        .prop_map(
            |(model_id, target, epoch, sequence, directives, span_after, term)| DirectiveMessage {
                model_id,
                target: PlannerPeerId::new(target),
                term,
                epoch,
                sequence,
                directives,
                span_after,
            },
        )
}

fn tracker_record() -> impl Strategy<Value = TrackerRecord> {
    (
        ".{0,52}",
        prop::collection::vec(".{0,40}", 0..4),
        ".{0,40}",
        any::<u64>(),
        ".{0,20}",
        any::<u64>(),
    )
        .prop_map(
            |(peer, addresses, http_endpoint, epoch, model_id, term)| TrackerRecord {
                peer: PlannerPeerId::new(peer),
                addresses,
                http_endpoint,
                epoch,
                term,
                model_id,
            },
        )
}

/// Decodes `bytes` as every message type; only errors, never panics, are allowed.
fn decode_as_everything(bytes: &[u8]) {
    let _ = decode::<PeerAnnouncement>(bytes);
    let _ = decode::<CoverageMessage>(bytes);
    let _ = decode::<DirectiveMessage>(bytes);
    let _ = decode::<TrackerRecord>(bytes);
}

proptest! {
    #[test]
    fn announcements_round_trip(message in announcement()) {
        prop_assert_eq!(decode::<PeerAnnouncement>(&encode(&message).unwrap()).unwrap(), message);
    }

    #[test]
    fn coverage_messages_round_trip(message in coverage()) {
        prop_assert_eq!(decode::<CoverageMessage>(&encode(&message).unwrap()).unwrap(), message);
    }

    #[test]
    fn directive_messages_round_trip(message in directive_message()) {
        prop_assert_eq!(decode::<DirectiveMessage>(&encode(&message).unwrap()).unwrap(), message);
    }

    #[test]
    fn tracker_records_round_trip(message in tracker_record()) {
        prop_assert_eq!(decode::<TrackerRecord>(&encode(&message).unwrap()).unwrap(), message);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        decode_as_everything(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic(
        message in directive_message(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = encode(&message).unwrap();
        for (index, value) in flips {
            let at = index.index(bytes.len());
            bytes[at] = value;
        }
        decode_as_everything(&bytes);
    }

    #[test]
    fn a_message_never_decodes_with_extra_bytes(message in tracker_record(), extra in prop::collection::vec(any::<u8>(), 1..16)) {
        let mut bytes = encode(&message).unwrap();
        bytes.extend_from_slice(&extra);
        let is_trailing = matches!(
            decode::<TrackerRecord>(&bytes),
            Err(P2pError::TrailingBytes { .. })
        );
        prop_assert!(is_trailing);
    }
}

/// One realistic message of each kind: what the fuzz target's seeds encode.
fn seed_messages() -> Vec<(&'static str, Vec<u8>)> {
    let holder = PlannerPeerId::from("12D3KooWHolder");
    let span = SpanStatus {
        layers: LayerSpan::new(10, 20),
        quantization: Quantization::Q4_1,
        state: SpanState::Ready,
    };
    let announcement = PeerAnnouncement {
        peer: holder.clone(),
        model_id: "smollm2-135m-instruct".into(),
        software_version: "0.1.0".into(),
        wire_version: 1,
        http_endpoints: vec!["http://10.0.0.2:8080".into()],
        p2p_addresses: vec!["/ip4/10.0.0.2/tcp/4001".into()],
        memory_bytes: 1 << 30,
        quantizations: vec![Quantization::Q4_1, Quantization::Q8_0],
        throughput: 120.5,
        kv_tokens: 2048,
        span: Some(span.clone()),
        free_kv_tokens: 1900,
        active_sessions: 2,
        is_tracker: false,
        forward_latency_ms: 3.25,
        leaving: false,
        tracker_capable: true,
        sent_at_unix_ms: 1_796_000_000_000,
        tracker_silent_ms: Some(400),
        rtt_ms: vec![
            meshnet_p2p::PeerRtt {
                peer: PlannerPeerId::from("12D3KooWTracker"),
                ms: 21.5,
            },
            meshnet_p2p::PeerRtt {
                peer: PlannerPeerId::from("12D3KooWFar"),
                ms: 301.0,
            },
        ],
    };
    let coverage = CoverageMessage {
        model_id: "smollm2-135m-instruct".into(),
        term: 2,
        succession: vec![holder.clone()],
        tracker_http: "http://10.0.0.1:8080".into(),
        epoch: 7,
        sequence: 42,
        num_layers: 30,
        map: CoverageMap {
            epoch: 7,
            holdings: vec![SpanHolding {
                peer: holder.clone(),
                layers: span.layers,
                quantization: span.quantization,
                state: SpanState::Ready,
            }],
        },
        announce_interval_ms: 2000,
    };
    let directive = DirectiveMessage {
        model_id: "smollm2-135m-instruct".into(),
        target: holder.clone(),
        term: 2,
        epoch: 7,
        sequence: 43,
        directives: vec![Directive::LoadShard {
            peer: holder.clone(),
            layers: span.layers,
            quantization: span.quantization,
        }],
        span_after: Some(span),
    };
    let record = TrackerRecord {
        peer: PlannerPeerId::from("12D3KooWTracker"),
        addresses: vec!["/ip4/10.0.0.1/tcp/4001".into()],
        http_endpoint: "http://10.0.0.1:8080".into(),
        epoch: 7,
        term: 2,
        model_id: "smollm2-135m-instruct".into(),
    };
    vec![
        ("announcement", encode(&announcement).unwrap()),
        ("coverage", encode(&coverage).unwrap()),
        ("directive", encode(&directive).unwrap()),
        ("tracker_record", encode(&record).unwrap()),
    ]
}

/// The fuzz target's seeds are messages of the current schema, so the fuzzer starts from inputs
/// that decode all the way. `MESHNET_WRITE_FUZZ_SEEDS=1` rewrites them after a schema change.
#[test]
fn the_fuzz_seeds_are_current_messages() {
    let seeds =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/control_decode");
    let rewrite = std::env::var_os("MESHNET_WRITE_FUZZ_SEEDS").is_some();
    for (name, bytes) in seed_messages() {
        if rewrite {
            std::fs::write(seeds.join(name), &bytes).unwrap();
        }
        let stored = std::fs::read(seeds.join(name)).unwrap();
        assert_eq!(
            stored, bytes,
            "fuzz/seeds/control_decode/{name} is out of date"
        );
    }
    let read = |name: &str| std::fs::read(seeds.join(name)).unwrap();
    decode::<PeerAnnouncement>(&read("announcement")).unwrap();
    decode::<CoverageMessage>(&read("coverage")).unwrap();
    decode::<DirectiveMessage>(&read("directive")).unwrap();
    decode::<TrackerRecord>(&read("tracker_record")).unwrap();
}
