//! A member that lies, for tests and benchmarks only (cargo feature `faulty-member`, which
//! debug builds alone accept): it corrupts a chosen fraction of the output frames of its
//! spans, so that checks of members' honesty (ADR-0026) can be run against a known liar.

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use half::bf16;
use meshnet_wire::{Activations, WireError};

use crate::error::PeerError;

/// How many values of a corrupted frame are changed.
const VALUES_PER_CORRUPTION: usize = 4;

/// How a corrupted frame is changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorruptionMode {
    /// A few values move by a few percent of their size (plus a little): the kind of error a
    /// failing CPU makes, and one that rarely changes a greedy token.
    Noise,
    /// A few values change sign.
    SignFlip,
}

impl FromStr for CorruptionMode {
    type Err = PeerError;

    fn from_str(text: &str) -> Result<Self, PeerError> {
        match text {
            "noise" => Ok(CorruptionMode::Noise),
            "sign" => Ok(CorruptionMode::SignFlip),
            other => Err(PeerError::Config(format!(
                "corruption mode {other:?}: expected noise or sign"
            ))),
        }
    }
}

/// Corrupts a fraction of the frames passed through it, chosen by a seeded sequence, so a
/// run is repeatable.
#[derive(Debug)]
pub struct FaultyFrames {
    fraction: f64,
    mode: CorruptionMode,
    seed: u64,
    /// Frames passed through untouched before any is corrupted.
    honest_frames: AtomicU64,
    seen: AtomicU64,
    corrupted: AtomicU64,
}

impl FaultyFrames {
    /// Corrupts `fraction` (0 to 1) of the frames, in `mode`, choosing them with `seed`.
    pub fn new(fraction: f64, mode: CorruptionMode, seed: u64) -> Result<Self, PeerError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(PeerError::Config(format!(
                "corrupt-frames {fraction}: expected a fraction from 0 to 1"
            )));
        }
        Ok(FaultyFrames {
            fraction,
            mode,
            seed,
            honest_frames: AtomicU64::new(0),
            seen: AtomicU64::new(0),
            corrupted: AtomicU64::new(0),
        })
    }

    /// Leaves the first `frames` frames untouched: a member that lies only once it has
    /// earned trust.
    pub fn honest_first(self, frames: u64) -> Self {
        self.honest_frames.store(frames, Ordering::Relaxed);
        self
    }

    /// Corrupts from the next frame on, whatever [`FaultyFrames::honest_first`] said: a member
    /// that turns liar when the caller decides (say, once it passed its probation).
    pub fn lie_from_now(&self) {
        self.honest_frames
            .store(self.seen.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// How many frames were corrupted so far.
    pub fn corrupted(&self) -> u64 {
        self.corrupted.load(Ordering::Relaxed)
    }

    /// `frame`, corrupted when its turn in the sequence falls within the fraction.
    pub fn apply(&self, frame: Activations) -> Result<Activations, WireError> {
        let turn = self.seen.fetch_add(1, Ordering::Relaxed);
        let draw = mix(self.seed ^ turn.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        if turn < self.honest_frames.load(Ordering::Relaxed)
            || unit(draw) >= self.fraction
            || frame.values().is_empty()
        {
            return Ok(frame);
        }
        let (shape, mut values) = frame.into_parts();
        for k in 0..VALUES_PER_CORRUPTION as u64 {
            let pick = mix(draw.wrapping_add(k + 1));
            let index = (pick % values.len() as u64) as usize;
            values[index] = corrupt_value(values[index], self.mode, pick);
        }
        self.corrupted.fetch_add(1, Ordering::Relaxed);
        Activations::new(shape, values)
    }
}

/// One value corrupted in `mode`; `draw` sets the noise.
fn corrupt_value(value: bf16, mode: CorruptionMode, draw: u64) -> bf16 {
    match mode {
        CorruptionMode::SignFlip if value.to_bits() & 0x7fff != 0 => -value,
        // A zero has no sign worth flipping: give it a value instead.
        CorruptionMode::SignFlip => bf16::from_f32(0.5),
        CorruptionMode::Noise => {
            let x = value.to_f32();
            let sign = if draw & 1 == 0 { 1.0 } else { -1.0 };
            let changed = bf16::from_f32(x + sign * (0.05 * x.abs() + 0.01));
            if changed == value {
                bf16::from_f32(x + 0.125)
            } else {
                changed
            }
        }
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit value from any input.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `bits` as a fraction in [0, 1).
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshnet_wire::Shape;

    fn frame(values: &[f32]) -> Activations {
        let values: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        Activations::new(Shape::new(&[1, values.len()]).unwrap(), values).unwrap()
    }

    fn differing(a: &Activations, b: &Activations) -> usize {
        a.values()
            .iter()
            .zip(b.values())
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    }

    #[test]
    fn every_frame_changes_at_fraction_one_and_none_at_zero() {
        let input: Vec<f32> = (0..64).map(|i| i as f32 / 7.0 - 3.0).collect();
        for mode in [CorruptionMode::Noise, CorruptionMode::SignFlip] {
            let always = FaultyFrames::new(1.0, mode, 3).unwrap();
            let never = FaultyFrames::new(0.0, mode, 3).unwrap();
            for _ in 0..50 {
                let changed = differing(&always.apply(frame(&input)).unwrap(), &frame(&input));
                assert!(
                    (1..=VALUES_PER_CORRUPTION).contains(&changed),
                    "{mode:?}: {changed}"
                );
                assert_eq!(
                    differing(&never.apply(frame(&input)).unwrap(), &frame(&input)),
                    0
                );
            }
            assert_eq!((always.corrupted(), never.corrupted()), (50, 0));
        }
    }

    #[test]
    fn a_member_honest_at_first_lies_only_after_its_honest_frames() {
        let input: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
        let faulty = FaultyFrames::new(1.0, CorruptionMode::SignFlip, 5)
            .unwrap()
            .honest_first(3);
        let changed: Vec<bool> = (0..5)
            .map(|_| differing(&faulty.apply(frame(&input)).unwrap(), &frame(&input)) > 0)
            .collect();
        assert_eq!(changed, [false, false, false, true, true]);
        assert_eq!(faulty.corrupted(), 2);
    }

    #[test]
    fn a_member_honest_until_told_lies_from_the_next_frame() {
        let input: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
        let faulty = FaultyFrames::new(1.0, CorruptionMode::Noise, 5)
            .unwrap()
            .honest_first(u64::MAX);
        let mut changed = Vec::new();
        for turn in 0..6 {
            if turn == 4 {
                faulty.lie_from_now();
            }
            changed.push(differing(&faulty.apply(frame(&input)).unwrap(), &frame(&input)) > 0);
        }
        assert_eq!(changed, [false, false, false, false, true, true]);
    }

    #[test]
    fn the_fraction_of_corrupted_frames_is_the_one_asked_for() {
        let faulty = FaultyFrames::new(0.1, CorruptionMode::SignFlip, 11).unwrap();
        let input = frame(&[1.0; 16]);
        for _ in 0..10_000 {
            faulty.apply(input.clone()).unwrap();
        }
        let corrupted = faulty.corrupted();
        assert!((900..=1100).contains(&corrupted), "{corrupted} of 10000");
    }

    #[test]
    fn the_same_seed_corrupts_the_same_frames_the_same_way() {
        let input: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let a = FaultyFrames::new(0.5, CorruptionMode::Noise, 42).unwrap();
        let b = FaultyFrames::new(0.5, CorruptionMode::Noise, 42).unwrap();
        for _ in 0..100 {
            let (x, y) = (
                a.apply(frame(&input)).unwrap(),
                b.apply(frame(&input)).unwrap(),
            );
            assert_eq!(differing(&x, &y), 0);
        }
    }

    #[test]
    fn sign_flips_change_signs_and_noise_stays_small() {
        let input: Vec<f32> = (1..=64).map(|i| i as f32).collect();
        let flips = FaultyFrames::new(1.0, CorruptionMode::SignFlip, 5).unwrap();
        let noise = FaultyFrames::new(1.0, CorruptionMode::Noise, 5).unwrap();
        let flipped = flips.apply(frame(&input)).unwrap();
        let noisy = noise.apply(frame(&input)).unwrap();
        for ((&x, f), n) in input.iter().zip(flipped.values()).zip(noisy.values()) {
            assert!(f.to_f32() == x || f.to_f32() == -x);
            assert!((n.to_f32() - x).abs() <= 0.06 * x + 0.02, "{x} -> {n}");
        }
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for fraction in [-0.1, 1.5, f64::NAN] {
            let error = FaultyFrames::new(fraction, CorruptionMode::Noise, 0).unwrap_err();
            assert!(error.to_string().contains("corrupt-frames"), "{error}");
        }
        let error = "flip".parse::<CorruptionMode>().unwrap_err();
        assert!(error.to_string().contains("noise or sign"), "{error}");
    }
}
