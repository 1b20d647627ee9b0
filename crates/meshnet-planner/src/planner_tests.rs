use std::collections::BTreeMap;

use super::*;

const NF4: u64 = 100;
const INT8: u64 = 200;
const BF16: u64 = 400;
const EXTRAS: u64 = 1000;

fn toy_model(num_layers: u32) -> ModelShape {
    ModelShape {
        name: "toy".into(),
        num_layers,
        layer_bytes: BTreeMap::from([
            (Quantization::Nf4, NF4),
            (Quantization::Int8, INT8),
            (Quantization::Bf16, BF16),
        ]),
        embedding_bytes: EXTRAS / 2,
        head_bytes: EXTRAS / 2,
        kv_bytes_per_token_per_layer: 1,
    }
}

/// A volunteer whose memory holds exactly `nf4_layers` layers in nf4.
fn volunteer(id: &str, nf4_layers: u64, throughput: f64) -> PeerCapacity {
    PeerCapacity {
        peer: PeerId::from(id),
        memory_bytes: nf4_layers * NF4,
        quantizations: vec![Quantization::Nf4, Quantization::Int8, Quantization::Bf16],
        throughput,
        kv_tokens: 0,
        is_tracker: false,
    }
}

fn tracker(nf4_layers: u64) -> PeerCapacity {
    PeerCapacity {
        memory_bytes: EXTRAS + nf4_layers * NF4,
        is_tracker: true,
        ..volunteer("tracker", 0, 10.0)
    }
}

fn holding(peer: &str, start: u32, end: u32) -> SpanHolding {
    SpanHolding {
        peer: PeerId::from(peer),
        layers: LayerSpan::new(start, end),
        quantization: Quantization::Nf4,
        state: SpanState::Ready,
    }
}

fn planner(num_layers: u32, tracker_layers: Option<u32>) -> Planner {
    Planner::new(
        toy_model(num_layers),
        PlannerConfig {
            tracker_layers,
            ..PlannerConfig::default()
        },
    )
}

fn directives_for<'p>(plan: &'p Plan, peer: &str) -> Vec<&'p Directive> {
    plan.directives
        .iter()
        .filter(|d| d.peer().as_str() == peer)
        .collect()
}

fn loaded_layers(directives: &[&Directive]) -> u32 {
    directives
        .iter()
        .map(|d| match d {
            Directive::LoadShard { layers, .. } => layers.len(),
            Directive::DropShard { .. } => 0,
        })
        .sum()
}

fn dropped_layers(directives: &[&Directive]) -> u32 {
    directives
        .iter()
        .map(|d| match d {
            Directive::DropShard { layers, .. } => layers.len(),
            Directive::LoadShard { .. } => 0,
        })
        .sum()
}

#[test]
fn fresh_mesh_is_covered_within_every_budget() {
    let planner = planner(12, None);
    let model = planner.model().clone();
    let peers = vec![
        tracker(3),
        volunteer("a", 4, 10.0),
        volunteer("b", 2, 5.0),
        volunteer("c", 5, 20.0),
        volunteer("d", 3, 1.0),
    ];
    let plan = planner.plan(&CoverageMap::empty(0), &peers).unwrap();
    assert_eq!(plan.tracker_layers, 3);
    assert!(plan.report.is_complete(), "{:?}", plan.report);
    assert_eq!(plan.map.epoch, 1);
    for holding in &plan.map.holdings {
        let capacity = peers.iter().find(|p| p.peer == holding.peer).unwrap();
        let span = holding.layers;
        assert!(
            capacity.memory_needed(&model, holding.quantization, span.len())
                <= capacity.memory_bytes
        );
        assert_eq!(holding.state, SpanState::Loading);
    }
    let tracker_holding = plan.map.holding_of(&PeerId::from("tracker")).unwrap();
    assert_eq!(tracker_holding.layers, LayerSpan::new(0, 3));
}

#[test]
fn replanning_an_unchanged_mesh_gives_no_directives() {
    let planner = planner(12, None);
    let peers = vec![
        tracker(3),
        volunteer("a", 4, 10.0),
        volunteer("b", 2, 5.0),
        volunteer("c", 5, 20.0),
        volunteer("d", 3, 1.0),
        volunteer("e", 9, 7.0),
    ];
    let first = planner.plan(&CoverageMap::empty(4), &peers).unwrap();
    assert!(!first.directives.is_empty());
    let mut map = first.map.clone();
    map.mark_all_ready();
    let second = planner.plan(&map, &peers).unwrap();
    assert!(second.directives.is_empty(), "{:?}", second.directives);
    assert_eq!(second.map.epoch, map.epoch);
    assert_eq!(second.map, map);
    // Loading holders count as holders too: replanning before the loads finish is also quiet.
    let third = planner.plan(&first.map, &peers).unwrap();
    assert!(third.directives.is_empty(), "{:?}", third.directives);
}

#[test]
fn a_departure_moves_only_what_closing_the_gap_needs() {
    let planner = planner(10, Some(2));
    let peers = vec![
        tracker(2),
        volunteer("a", 5, 10.0),
        volunteer("c", 4, 10.0),
        volunteer("d", 3, 10.0),
    ];
    let map = CoverageMap {
        epoch: 7,
        holdings: vec![
            holding("tracker", 0, 2),
            holding("a", 2, 5),
            holding("b", 5, 8),
            holding("c", 8, 10),
            holding("d", 2, 5),
        ],
    };
    // "b" is absent from the capacity list: it has departed.
    let plan = planner.plan(&map, &peers).unwrap();
    assert!(plan.report.is_complete());
    assert_eq!(plan.map.epoch, 8);
    assert!(directives_for(&plan, "tracker").is_empty());
    assert!(directives_for(&plan, "d").is_empty());
    assert!(directives_for(&plan, "b").is_empty());
    let a = directives_for(&plan, "a");
    let c = directives_for(&plan, "c");
    assert_eq!(dropped_layers(&a) + dropped_layers(&c), 0, "{a:?} {c:?}");
    assert_eq!(loaded_layers(&a) + loaded_layers(&c), 3, "{a:?} {c:?}");
    assert!(plan.map.holding_of(&PeerId::from("b")).is_none());
}

#[test]
fn hysteresis_suppresses_small_improvements() {
    let peers = vec![
        tracker(2),
        volunteer("a", 4, 10.0),
        volunteer("b", 2, 1.0),
        volunteer("c", 2, 1.0),
    ];
    let map = CoverageMap {
        epoch: 1,
        holdings: vec![
            holding("tracker", 0, 2),
            holding("a", 2, 6),
            holding("b", 2, 4),
            holding("c", 2, 4),
        ],
    };
    // Moving b or c to [4, 6) lifts the weakest layer from 10 to 11 tokens/s: +10 %.
    let quiet = planner(6, Some(2)).plan(&map, &peers).unwrap();
    assert!(quiet.directives.is_empty(), "{:?}", quiet.directives);

    let eager = Planner::new(
        toy_model(6),
        PlannerConfig {
            tracker_layers: Some(2),
            hysteresis: 0.05,
        },
    )
    .plan(&map, &peers)
    .unwrap();
    let movers: std::collections::BTreeSet<&str> =
        eager.directives.iter().map(|d| d.peer().as_str()).collect();
    assert_eq!(movers.len(), 1, "{:?}", eager.directives);
    let weakest = eager.report.throughput_per_layer[2..]
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min);
    assert!((weakest - 11.0).abs() < 1e-9, "{:?}", eager.report);
}

#[test]
fn growing_a_span_is_preferred_to_moving_it() {
    // Volunteers serve [2, 14); [5, 8) is the weakest stretch (10 tokens/s,
    // 20 elsewhere). b's memory grew from 3 to 6 layers. Growing b to [2, 8)
    // and moving it to [5, 11) both lift the weakest layer to 20, but growing
    // loads 3 layers and drops none, while the move loads 6 and drops 3.
    let peers = vec![
        tracker(2),
        volunteer("a", 12, 10.0),
        volunteer("b", 6, 10.0),
        volunteer("c", 6, 10.0),
        volunteer("d", 3, 10.0),
    ];
    let map = CoverageMap {
        epoch: 1,
        holdings: vec![
            holding("tracker", 0, 2),
            holding("a", 2, 14),
            holding("b", 2, 5),
            holding("c", 8, 14),
            holding("d", 2, 5),
        ],
    };
    let plan = planner(14, Some(2)).plan(&map, &peers).unwrap();
    let b = directives_for(&plan, "b");
    assert_eq!(dropped_layers(&b), 0, "{b:?}");
    assert_eq!(loaded_layers(&b), 3, "{b:?}");
    for other in ["a", "c", "d", "tracker"] {
        assert!(directives_for(&plan, other).is_empty(), "{other} moved");
    }
    let b_layers: Vec<LayerSpan> = plan
        .map
        .holdings
        .iter()
        .filter(|h| h.peer.as_str() == "b")
        .map(|h| h.layers)
        .collect();
    assert_eq!(b_layers, vec![LayerSpan::new(2, 5), LayerSpan::new(5, 8)]);
    let weakest = plan.report.throughput_per_layer[2..]
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min);
    assert!((weakest - 20.0).abs() < 1e-9, "{:?}", plan.report);
}

#[test]
fn a_shrinking_budget_shrinks_the_span_instead_of_moving_it() {
    // a's memory dropped from 6 to 4 layers.
    let peers = vec![tracker(2), volunteer("a", 4, 10.0), volunteer("b", 6, 10.0)];
    let map = CoverageMap {
        epoch: 1,
        holdings: vec![
            holding("tracker", 0, 2),
            holding("a", 2, 8),
            holding("b", 2, 8),
        ],
    };
    let plan = planner(8, Some(2)).plan(&map, &peers).unwrap();
    let a = directives_for(&plan, "a");
    assert_eq!(loaded_layers(&a), 0, "{a:?}");
    assert_eq!(dropped_layers(&a), 2, "{a:?}");
    assert!(directives_for(&plan, "b").is_empty());
    let kept = plan.map.holding_of(&PeerId::from("a")).unwrap().layers;
    assert_eq!(kept.len(), 4);
    assert!(kept.start >= 2 && kept.end <= 8);
}

#[test]
fn an_uncoverable_mesh_reports_the_gap_and_the_missing_memory() {
    let planner = planner(10, Some(2));
    let peers = vec![tracker(2), volunteer("a", 3, 10.0), volunteer("b", 2, 10.0)];
    let plan = planner.plan(&CoverageMap::empty(0), &peers).unwrap();
    assert!(!plan.report.is_complete());
    let uncovered: u32 = plan.report.uncovered.iter().map(|s| s.len()).sum();
    assert_eq!(uncovered, 3);
    for span in &plan.report.uncovered {
        for layer in span.start..span.end {
            assert_eq!(plan.report.holders_per_layer[layer as usize], 0);
        }
    }
    for layer in 0..10u32 {
        let in_gap = plan.report.uncovered.iter().any(|s| s.contains(layer));
        assert_eq!(in_gap, plan.report.holders_per_layer[layer as usize] == 0);
    }
    assert_eq!(plan.report.missing_memory_bytes, 3 * NF4);

    // Adding exactly the reported memory closes the gap.
    let mut grown = peers.clone();
    grown.push(PeerCapacity {
        memory_bytes: plan.report.missing_memory_bytes,
        ..volunteer("z", 0, 1.0)
    });
    let mut map = plan.map.clone();
    map.mark_all_ready();
    let repaired = planner.plan(&map, &grown).unwrap();
    assert!(repaired.report.is_complete(), "{:?}", repaired.report);
    assert_eq!(repaired.report.missing_memory_bytes, 0);
}

#[test]
fn spans_use_the_best_quantization_their_length_allows() {
    // Four volunteer layers; "a" fits four layers in bf16, so it needs nothing lower.
    let peers = vec![tracker(2), volunteer("a", 16, 10.0)];
    let plan = planner(6, Some(2))
        .plan(&CoverageMap::empty(0), &peers)
        .unwrap();
    let a = plan.map.holding_of(&PeerId::from("a")).unwrap();
    assert_eq!(a.layers, LayerSpan::new(2, 6));
    assert_eq!(a.quantization, Quantization::Bf16);
    // The tracker, sized by its memory, runs the cheapest format for its k.
    let tracker_holding = plan.map.holding_of(&PeerId::from("tracker")).unwrap();
    assert_eq!(tracker_holding.quantization, Quantization::Nf4);
}

#[test]
fn kv_reservation_shortens_the_span() {
    let planner = planner(20, Some(2));
    let mut peer = volunteer("a", 10, 1.0);
    let without_kv = planner
        .plan(&CoverageMap::empty(0), &[tracker(2), peer.clone()])
        .unwrap();
    peer.kv_tokens = NF4; // doubles the per-layer cost
    let with_kv = planner
        .plan(&CoverageMap::empty(0), &[tracker(2), peer])
        .unwrap();
    let length = |plan: &Plan| {
        plan.map
            .holding_of(&PeerId::from("a"))
            .unwrap()
            .layers
            .len()
    };
    assert_eq!(length(&without_kv), 10);
    assert_eq!(length(&with_kv), 5);
}

#[test]
fn the_plan_does_not_depend_on_input_order() {
    let planner = planner(16, None);
    let mut peers = vec![tracker(4)];
    for (i, (layers, throughput)) in [(3, 4.0), (5, 9.0), (2, 1.5), (7, 3.0), (4, 8.0), (6, 2.0)]
        .into_iter()
        .enumerate()
    {
        peers.push(volunteer(&format!("p{i}"), layers, throughput));
    }
    let map = CoverageMap {
        epoch: 2,
        holdings: vec![
            holding("p3", 5, 9),
            holding("p1", 9, 14),
            holding("gone", 14, 16),
        ],
    };
    let forward = planner.plan(&map, &peers).unwrap();
    peers.reverse();
    let reversed = planner.plan(&map, &peers).unwrap();
    assert_eq!(forward, reversed);
    assert_eq!(forward, planner.plan(&map, &peers).unwrap());
}

#[test]
fn invalid_meshes_are_rejected() {
    let planner = planner(8, None);
    let empty = CoverageMap::empty(0);
    assert_eq!(
        planner.plan(&empty, &[volunteer("a", 3, 1.0)]),
        Err(PlanError::NoTracker)
    );
    let second_tracker = PeerCapacity {
        peer: PeerId::from("other"),
        ..tracker(2)
    };
    assert!(matches!(
        planner.plan(&empty, &[tracker(2), second_tracker]),
        Err(PlanError::MultipleTrackers { .. })
    ));
    assert_eq!(
        planner.plan(
            &empty,
            &[tracker(2), volunteer("a", 1, 1.0), volunteer("a", 2, 1.0)]
        ),
        Err(PlanError::DuplicatePeer(PeerId::from("a")))
    );
    let starving = PeerCapacity {
        memory_bytes: EXTRAS - 1,
        ..tracker(0)
    };
    assert!(matches!(
        planner.plan(&empty, &[starving]),
        Err(PlanError::TrackerCannotHoldEmbeddings { .. })
    ));
    assert_eq!(
        self::planner(8, Some(5)).plan(&empty, &[tracker(2)]),
        Err(PlanError::TrackerSpanDoesNotFit {
            requested: 5,
            max: 2
        })
    );
    assert!(matches!(
        planner.plan(&empty, &[tracker(2), volunteer("a", 1, f64::NAN)]),
        Err(PlanError::InvalidThroughput(_))
    ));
}

#[test]
fn stray_and_departed_holdings_are_cleaned_up() {
    let planner = planner(8, Some(2));
    let peers = vec![tracker(2), volunteer("a", 6, 10.0)];
    let map = CoverageMap {
        epoch: 3,
        holdings: vec![
            holding("tracker", 0, 2),
            holding("a", 2, 4),
            holding("a", 4, 8),
            SpanHolding {
                quantization: Quantization::Int8,
                ..holding("a", 0, 1)
            },
            holding("ghost", 0, 8),
        ],
    };
    let plan = planner.plan(&map, &peers).unwrap();
    let a = directives_for(&plan, "a");
    assert_eq!(
        a,
        vec![&Directive::DropShard {
            peer: PeerId::from("a"),
            layers: LayerSpan::new(0, 1),
            quantization: Quantization::Int8,
        }]
    );
    assert!(directives_for(&plan, "ghost").is_empty());
    assert_eq!(
        plan.map.holding_of(&PeerId::from("a")).unwrap().layers,
        LayerSpan::new(2, 8)
    );
}

#[test]
fn plans_round_trip_through_json() {
    let planner = planner(12, None);
    let peers = vec![tracker(3), volunteer("a", 4, 10.0), volunteer("b", 6, 2.5)];
    let plan = planner.plan(&CoverageMap::empty(0), &peers).unwrap();
    let json = serde_json::to_string(&plan).unwrap();
    let back: Plan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, plan);
    let peers_json = serde_json::to_string(&peers).unwrap();
    let peers_back: Vec<PeerCapacity> = serde_json::from_str(&peers_json).unwrap();
    assert_eq!(peers_back, peers);
}

#[test]
fn an_exhausted_epoch_is_an_error_not_an_overflow() {
    let planner = planner(6, Some(2));
    let peers = vec![tracker(2), volunteer("a", 4, 1.0)];
    assert_eq!(
        planner.plan(&CoverageMap::empty(u64::MAX), &peers),
        Err(PlanError::EpochOverflow(u64::MAX))
    );
    // A plan without directives keeps the epoch, so it still succeeds.
    let mut settled = planner.plan(&CoverageMap::empty(3), &peers).unwrap().map;
    settled.epoch = u64::MAX;
    let quiet = planner.plan(&settled, &peers).unwrap();
    assert!(quiet.directives.is_empty());
    assert_eq!(quiet.map.epoch, u64::MAX);
}

#[test]
fn hysteresis_must_be_positive_and_finite() {
    let peers = vec![tracker(2), volunteer("a", 4, 1.0)];
    for hysteresis in [0.0, -0.1, 0.0005, f64::NAN, f64::INFINITY] {
        let planner = Planner::new(
            toy_model(6),
            PlannerConfig {
                hysteresis,
                ..PlannerConfig::default()
            },
        );
        assert!(
            matches!(
                planner.plan(&CoverageMap::empty(0), &peers),
                Err(PlanError::InvalidConfig(_))
            ),
            "hysteresis {hysteresis} accepted"
        );
    }
}

/// 90 one-layer volunteers whose throughputs rise in 21 % steps, plus 90
/// strong spare peers all stacked on the last layer. Each rebalancing move
/// takes a spare to the weakest layer and lifts the weakest throughput by
/// 21 %, so a plan takes 89 moves to settle.
fn rising_mesh() -> (Vec<PeerCapacity>, CoverageMap) {
    let mut peers = vec![tracker(0)];
    let mut map = CoverageMap::empty(1);
    for layer in 0..90u32 {
        let id = format!("holder-{layer:02}");
        peers.push(volunteer(&id, 1, 1.21f64.powi(layer as i32)));
        map.holdings.push(holding(&id, layer, layer + 1));
        let spare = format!("spare-{layer:02}");
        peers.push(volunteer(&spare, 1, 1e6));
        map.holdings.push(holding(&spare, 89, 90));
    }
    (peers, map)
}

#[test]
fn a_plan_is_a_fixed_point_even_after_many_rebalancing_moves() {
    let (peers, map) = rising_mesh();
    for hysteresis in [0.01, 0.2] {
        let planner = Planner::new(
            toy_model(90),
            PlannerConfig {
                tracker_layers: Some(0),
                hysteresis,
            },
        );
        let first = planner.plan(&map, &peers).unwrap();
        assert!(first.report.is_complete());
        // Every move drops the last layer and loads another: far more than
        // the 64 moves a capped rebalancing loop would stop after.
        assert!(
            first.directives.len() > 2 * 64,
            "{} directives at {hysteresis}",
            first.directives.len()
        );
        let again = planner.plan(&first.map, &peers).unwrap();
        assert!(
            again.directives.is_empty(),
            "replan at {hysteresis} gave {} directives",
            again.directives.len()
        );
        let mut ready = first.map.clone();
        ready.mark_all_ready();
        assert!(planner.plan(&ready, &peers).unwrap().directives.is_empty());
    }
}

#[test]
fn a_gap_is_filled_by_the_repair_that_loads_least() {
    // a holds [0, 10) and could reach 50 layers; the departed peer held
    // [49, 50). Growing a would load [10, 50); the free peer e loads one layer.
    let planner = planner(60, Some(0));
    let peers = vec![
        tracker(0),
        volunteer("a", 50, 1.0),
        volunteer("c", 39, 1.0),
        volunteer("d", 10, 1.0),
        volunteer("e", 1, 1.0),
    ];
    let map = CoverageMap {
        epoch: 1,
        holdings: vec![
            holding("a", 0, 10),
            holding("c", 10, 49),
            holding("gone", 49, 50),
            holding("d", 50, 60),
        ],
    };
    let plan = planner.plan(&map, &peers).unwrap();
    assert!(plan.report.is_complete());
    let loaded: u64 = plan
        .directives
        .iter()
        .map(|d| d.bytes_loaded(planner.model()))
        .sum();
    assert_eq!(loaded, NF4);
    assert_eq!(
        plan.directives,
        vec![Directive::LoadShard {
            peer: PeerId::from("e"),
            layers: LayerSpan::new(49, 50),
            quantization: Quantization::Nf4,
        }]
    );
}

#[test]
fn stale_pieces_get_a_drop_for_their_own_format() {
    let planner = planner(8, Some(2));
    let peers = vec![tracker(2), volunteer("a", 6, 10.0), volunteer("b", 6, 10.0)];
    let map = CoverageMap {
        epoch: 3,
        holdings: vec![
            holding("tracker", 0, 2),
            // Past the model's end: [8, 12) does not exist.
            holding("a", 2, 12),
            holding("b", 2, 8),
            // b also holds part of its span in another format.
            SpanHolding {
                quantization: Quantization::Int8,
                ..holding("b", 4, 6)
            },
        ],
    };
    let plan = planner.plan(&map, &peers).unwrap();
    assert_eq!(
        directives_for(&plan, "a"),
        vec![&Directive::DropShard {
            peer: PeerId::from("a"),
            layers: LayerSpan::new(8, 12),
            quantization: Quantization::Nf4,
        }]
    );
    assert_eq!(
        directives_for(&plan, "b"),
        vec![&Directive::DropShard {
            peer: PeerId::from("b"),
            layers: LayerSpan::new(4, 6),
            quantization: Quantization::Int8,
        }]
    );
    assert_eq!(
        plan.map.holding_of(&PeerId::from("a")).map(|h| h.layers),
        Some(LayerSpan::new(2, 8))
    );
    // A peer holding only layers past the end drops them all.
    let beyond = CoverageMap {
        epoch: 3,
        holdings: vec![holding("tracker", 0, 2), holding("a", 9, 20)],
    };
    let plan = planner.plan(&beyond, &peers).unwrap();
    assert!(directives_for(&plan, "a").contains(&&Directive::DropShard {
        peer: PeerId::from("a"),
        layers: LayerSpan::new(9, 20),
        quantization: Quantization::Nf4,
    }));
}

#[test]
fn missing_memory_does_not_depend_on_where_spans_sit() {
    // Two peers of reach 3 on 10 layers leave 4 layers short wherever they sit.
    let planner = planner(10, Some(0));
    let peers = vec![tracker(0), volunteer("a", 3, 1.0), volunteer("b", 3, 1.0)];
    let overlapping = CoverageMap {
        epoch: 1,
        holdings: vec![holding("a", 0, 3), holding("b", 2, 5)],
    };
    let kept = planner.plan(&overlapping, &peers).unwrap();
    let fresh = planner.plan(&CoverageMap::empty(0), &peers).unwrap();
    let uncovered = |plan: &Plan| plan.report.uncovered.iter().map(|s| s.len()).sum::<u32>();
    assert_eq!(uncovered(&kept), 5);
    assert_eq!(uncovered(&fresh), 4);
    assert_eq!(kept.report.missing_memory_bytes, 4 * NF4);
    assert_eq!(fresh.report.missing_memory_bytes, 4 * NF4);
    // That much memory more does make the model coverable.
    let mut grown = peers.clone();
    grown.push(volunteer("z", 4, 1.0));
    assert!(
        planner
            .plan(&kept.map, &grown)
            .unwrap()
            .report
            .is_complete()
    );
}
