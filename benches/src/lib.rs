//! Benchmarks for meshnet live in `benches/benches/`; this library is empty on purpose.
//!
//! Run them with `cargo bench -p meshnet-benches`.
