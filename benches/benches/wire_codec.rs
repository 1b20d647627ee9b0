//! Encode and decode throughput of activation frames, raw and zstd level 1.
//!
//! Frames of 1×128×576 (SmolLM2-135M), 1×128×4096 (a 7B model) and 1×128×16384 (the widest
//! models) filled with normally distributed values. Throughput is reported over the raw
//! (uncompressed) bytes, so raw and zstd figures compare directly.

#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use meshnet_types::LayerSpan;
use meshnet_wire::{ActivationFrame, Activations, Encoding, FrameMeta, Limits, Route, Shape};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

const SHAPES: [[usize; 3]; 3] = [[1, 128, 576], [1, 128, 4096], [1, 128, 16384]];

fn normal_frame(dims: &[usize]) -> ActivationFrame {
    let shape = Shape::new(dims).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let values = (0..shape.elements())
        .map(|_| bf16::from_f32(normal.sample(&mut rng)))
        .collect();
    ActivationFrame {
        meta: FrameMeta {
            session: uuid::Uuid::nil(),
            chunk_index: 0,
            chunk_total: 1,
            position: 0,
            layers: LayerSpan::new(0, 10),
            route: Route::default(),
            grant: None,
            fork_from: None,
            return_to: None,
            rewind: false,
        },
        activations: Activations::new(shape, values).unwrap(),
    }
}

fn codec(c: &mut Criterion) {
    for dims in SHAPES {
        let frame = normal_frame(&dims);
        let raw_bytes = frame.activations.shape().byte_len() as u64;
        let mut group = c.benchmark_group(format!("wire/{}x{}x{}", dims[0], dims[1], dims[2]));
        group.throughput(Throughput::Bytes(raw_bytes));
        group.sample_size(if dims[2] > 4096 { 20 } else { 50 });
        for (name, encoding) in [("raw", Encoding::Raw), ("zstd1", Encoding::Zstd)] {
            group.bench_function(format!("encode/{name}"), |b| {
                b.iter_batched(
                    || frame.clone(),
                    |f| f.into_encoded(encoding),
                    BatchSize::LargeInput,
                )
            });
            let encoded = frame.encode(encoding);
            let limits = Limits::default();
            group.bench_function(format!("decode/{name}"), |b| {
                b.iter(|| {
                    ActivationFrame::decode(&encoded.headers, &encoded.body, &limits).unwrap()
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, codec);
criterion_main!(benches);
