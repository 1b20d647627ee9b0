//! Planner benchmarks: one plan for 10,000 volunteers × 80 layers (Llama 70B
//! shapes), from an empty map, on a settled mesh, right after a crash, and
//! from a map where every span sits at a random place.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use meshnet_planner::scenario::{self, MeshProfile};
use meshnet_planner::{CoverageMap, ModelShape, PeerCapacity, Planner, PlannerConfig, SpanHolding};
use meshnet_types::{LayerSpan, Quantization, SpanState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VOLUNTEERS: usize = 10_000;

fn setup() -> (Planner, Vec<PeerCapacity>, CoverageMap) {
    let model = ModelShape::llama_70b();
    assert_eq!(model.num_layers, 80);
    let peers = scenario::mesh(
        &mut StdRng::seed_from_u64(7),
        VOLUNTEERS,
        &MeshProfile::default(),
    );
    let planner = Planner::new(model, PlannerConfig::default());
    let mut settled = planner
        .plan(&CoverageMap::empty(0), &peers)
        .expect("the synthetic mesh is valid")
        .map;
    settled.mark_all_ready();
    (planner, peers, settled)
}

fn bench_planner(c: &mut Criterion) {
    let (planner, peers, settled) = setup();
    let mut group = c.benchmark_group("plan_10k_peers_80_layers");

    group.bench_function("from_empty_map", |b| {
        let empty = CoverageMap::empty(0);
        b.iter(|| planner.plan(black_box(&empty), black_box(&peers)))
    });

    group.bench_function("settled_mesh", |b| {
        b.iter(|| planner.plan(black_box(&settled), black_box(&peers)))
    });

    // The first volunteer crashes: its holding disappears with it.
    let survivors: Vec<PeerCapacity> = peers
        .iter()
        .filter(|p| p.peer != peers[1].peer)
        .cloned()
        .collect();
    let mut after_crash = settled.clone();
    after_crash.remove_peer(&peers[1].peer);
    group.bench_function("after_a_crash", |b| {
        b.iter(|| planner.plan(black_box(&after_crash), black_box(&survivors)))
    });

    // Every volunteer claims a random span: shrinks, repairs and rebalancing
    // all have work to do.
    let mut rng = StdRng::seed_from_u64(11);
    let scrambled = CoverageMap {
        epoch: 1,
        holdings: peers
            .iter()
            .filter(|p| !p.is_tracker)
            .map(|p| {
                let start = rng.random_range(0..80);
                let end = rng.random_range(start + 1..=80.min(start + 30));
                SpanHolding {
                    peer: p.peer.clone(),
                    layers: LayerSpan::new(start, end),
                    quantization: Quantization::Nf4,
                    state: SpanState::Ready,
                }
            })
            .collect(),
    };
    group.bench_function("from_scrambled_map", |b| {
        b.iter(|| planner.plan(black_box(&scrambled), black_box(&peers)))
    });

    group.finish();
}

criterion_group!(benches, bench_planner);
criterion_main!(benches);
