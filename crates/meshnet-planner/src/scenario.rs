//! Synthetic volunteer meshes for the simulator and the benchmarks.
//!
//! Memory and speed follow the machines volunteers actually bring: consumer
//! GPUs with 4–24 GiB, and a share of CPU-only peers with 2–8 GiB. The
//! generator only draws from the random source it is given, so a seeded
//! source gives the same mesh every time.

use rand::Rng;

use crate::error::PlanError;
use crate::types::PeerCapacity;
use meshnet_types::PeerId;
use meshnet_types::Quantization;

const GIB: u64 = 1 << 30;

/// Consumer GPU memory sizes in GiB, with how common each one is.
const GPU_SIZES: [(u64, u32); 7] = [(4, 1), (6, 2), (8, 3), (10, 1), (12, 3), (16, 2), (24, 2)];

/// Share of device memory a volunteer gives the mesh (the rest is runtime overhead).
const USABLE_PERCENT: u64 = 90;

/// Shape of a synthetic mesh.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeshProfile {
    /// Fraction of volunteers that are CPU-only.
    pub cpu_fraction: f64,
    /// Tracker device memory in GiB.
    pub tracker_gib: u64,
}

impl MeshProfile {
    /// Largest tracker memory accepted, in GiB (1 PiB): keeps byte counts far
    /// from overflowing.
    pub const MAX_TRACKER_GIB: u64 = 1 << 20;

    /// Checks that `cpu_fraction` is a fraction in `[0, 1]` and that the
    /// tracker's memory is at most [`Self::MAX_TRACKER_GIB`].
    pub fn validate(&self) -> Result<(), PlanError> {
        if !(0.0..=1.0).contains(&self.cpu_fraction) {
            return Err(PlanError::InvalidConfig(format!(
                "cpu_fraction must lie in [0, 1], got {}",
                self.cpu_fraction
            )));
        }
        if self.tracker_gib > Self::MAX_TRACKER_GIB {
            return Err(PlanError::InvalidConfig(format!(
                "tracker memory of {} GiB exceeds the supported {} GiB",
                self.tracker_gib,
                Self::MAX_TRACKER_GIB
            )));
        }
        Ok(())
    }
}

impl Default for MeshProfile {
    fn default() -> Self {
        MeshProfile {
            cpu_fraction: 0.2,
            tracker_gib: 12,
        }
    }
}

/// The tracker: a GPU (size from `profile`) that also runs the embedding and head.
/// Memory saturates at `u64::MAX` for an out-of-range `tracker_gib`.
pub fn tracker(profile: &MeshProfile) -> PeerCapacity {
    PeerCapacity {
        peer: PeerId::from("tracker"),
        memory_bytes: usable_bytes(profile.tracker_gib),
        quantizations: vec![Quantization::Nf4, Quantization::Int8, Quantization::Bf16],
        throughput: 40.0,
        kv_tokens: 2048,
        is_tracker: true,
    }
}

/// Bytes a volunteer gives the mesh from a device of `gib` GiB.
fn usable_bytes(gib: u64) -> u64 {
    gib.checked_mul(GIB * USABLE_PERCENT)
        .map_or(u64::MAX, |bytes| bytes / 100)
}

/// One random volunteer named `id`.
///
/// An out-of-range `cpu_fraction` is clamped to `[0, 1]` and NaN counts as 0;
/// use [`MeshProfile::validate`] to reject such profiles instead.
pub fn volunteer(rng: &mut impl Rng, id: PeerId, profile: &MeshProfile) -> PeerCapacity {
    let cpu_fraction = if profile.cpu_fraction.is_nan() {
        0.0
    } else {
        profile.cpu_fraction.clamp(0.0, 1.0)
    };
    if rng.random_bool(cpu_fraction) {
        let gib = rng.random_range(2..=8u64);
        PeerCapacity {
            peer: id,
            memory_bytes: usable_bytes(gib),
            quantizations: vec![Quantization::Q4_1, Quantization::Q8_0],
            throughput: rng.random_range(0.5..4.0),
            kv_tokens: 512,
            is_tracker: false,
        }
    } else {
        let total: u32 = GPU_SIZES.iter().map(|(_, weight)| weight).sum();
        let mut pick = rng.random_range(0..total);
        let gib = GPU_SIZES
            .iter()
            .find(|(_, weight)| {
                if pick < *weight {
                    true
                } else {
                    pick -= weight;
                    false
                }
            })
            .map_or(8, |(gib, _)| *gib);
        // Larger cards tend to be faster ones.
        let base = 10.0 + 2.0 * gib as f64;
        PeerCapacity {
            peer: id,
            memory_bytes: usable_bytes(gib),
            quantizations: vec![Quantization::Nf4, Quantization::Int8, Quantization::Bf16],
            throughput: base * rng.random_range(0.6..1.4),
            kv_tokens: 2048,
            is_tracker: false,
        }
    }
}

/// Name of the `index`-th generated volunteer.
pub fn volunteer_id(index: usize) -> PeerId {
    PeerId::new(format!("peer-{index:07}"))
}

/// The tracker followed by `volunteers` random volunteers.
pub fn mesh(rng: &mut impl Rng, volunteers: usize, profile: &MeshProfile) -> Vec<PeerCapacity> {
    let mut peers = Vec::with_capacity(volunteers + 1);
    peers.push(tracker(profile));
    for index in 0..volunteers {
        peers.push(volunteer(rng, volunteer_id(index), profile));
    }
    peers
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn meshes_are_reproducible_and_within_the_advertised_ranges() {
        let profile = MeshProfile::default();
        let first = mesh(&mut StdRng::seed_from_u64(9), 500, &profile);
        let second = mesh(&mut StdRng::seed_from_u64(9), 500, &profile);
        assert_eq!(first, second);
        assert_eq!(first.iter().filter(|p| p.is_tracker).count(), 1);
        let cpus = first[1..]
            .iter()
            .filter(|p| p.quantizations.contains(&Quantization::Q8_0))
            .count();
        assert!(cpus > 50 && cpus < 150, "{cpus} CPU peers out of 500");
        for peer in &first[1..] {
            assert!(peer.memory_bytes >= 2 * GIB * 9 / 10 && peer.memory_bytes <= 24 * GIB);
            assert!(peer.throughput > 0.0);
        }
    }

    #[test]
    fn bad_profiles_are_rejected_and_never_panic() {
        assert_eq!(MeshProfile::default().validate(), Ok(()));
        for cpu_fraction in [f64::NAN, -0.1, 1.5, f64::INFINITY] {
            let profile = MeshProfile {
                cpu_fraction,
                ..MeshProfile::default()
            };
            assert!(matches!(
                profile.validate(),
                Err(PlanError::InvalidConfig(_))
            ));
            // Generating from it anyway does not panic.
            let peers = mesh(&mut StdRng::seed_from_u64(1), 20, &profile);
            assert_eq!(peers.len(), 21);
        }
        let huge = MeshProfile {
            tracker_gib: u64::MAX,
            ..MeshProfile::default()
        };
        assert!(huge.validate().is_err());
        assert_eq!(tracker(&huge).memory_bytes, u64::MAX);
    }
}
