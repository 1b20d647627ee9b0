//! Catching members that return wrong activations (ADR-0026): the policy that says which
//! sessions the entry checks, the comparison of two holders' outputs, the verdict an arbiter's
//! output gives, and the evidence a conviction keeps.
//!
//! The entry runs a checked session hop by hop: it sends each hop's input to the hop and to a
//! second holder of the same layers (the shadow), and uses the output only when both are equal
//! bit for bit. When they differ, a third holder (the arbiter) is given the hop's recorded
//! inputs and the step; the holder whose output differs from the arbiter's is convicted. The
//! sending itself lives in `remote`; this module holds the decisions, free of I/O.

use std::time::Duration;

use meshnet_types::{LayerSpan, PeerId};
use meshnet_wire::Activations;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The share of sessions checked when `--verify-sample` is not given.
pub const DEFAULT_SAMPLE_RATE: f64 = 0.1;

/// Checked sessions a new (or returning) member must pass before it leaves probation, when
/// `--probation-sessions` is not given.
pub const DEFAULT_PROBATION_SESSIONS: u32 = 3;

/// How long a member caught returning wrong activations stays banned, when `--ban-duration`
/// is not given.
pub const DEFAULT_BAN_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// Which of the tracker's sessions are checked, and what a conviction costs.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyPolicy {
    /// The share of sessions checked on every hop that has a second holder (0 to 1).
    pub sample_rate: f64,
    /// Checked sessions a member must pass before its sessions are only sampled; until then
    /// every session that could use it is checked. 0 turns probation off.
    pub probation_sessions: u32,
    /// How long a convicted member is kept off routes.
    pub ban_duration: Duration,
}

impl Default for VerifyPolicy {
    /// [`DEFAULT_SAMPLE_RATE`], [`DEFAULT_PROBATION_SESSIONS`], [`DEFAULT_BAN_DURATION`].
    fn default() -> Self {
        VerifyPolicy {
            sample_rate: DEFAULT_SAMPLE_RATE,
            probation_sessions: DEFAULT_PROBATION_SESSIONS,
            ban_duration: DEFAULT_BAN_DURATION,
        }
    }
}

impl VerifyPolicy {
    /// No session is ever checked.
    pub const OFF: VerifyPolicy = VerifyPolicy {
        sample_rate: 0.0,
        probation_sessions: 0,
        ban_duration: DEFAULT_BAN_DURATION,
    };

    /// Whether any session may be checked.
    pub fn is_on(&self) -> bool {
        self.sample_rate > 0.0 || self.probation_sessions > 0
    }

    /// Why the policy cannot be used (a sample rate outside 0..=1, a ban of zero length).
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.sample_rate) {
            return Err(format!(
                "the verification sample rate must be between 0 and 1, not {}",
                self.sample_rate
            ));
        }
        if self.ban_duration.is_zero() {
            return Err("the ban duration must be longer than zero".to_owned());
        }
        Ok(())
    }

    /// Whether a member that passed `verified` checked sessions is still on probation.
    pub fn on_probation(&self, verified: u32) -> bool {
        verified < self.probation_sessions
    }

    /// Whether a session drawn as `draw` (uniform in 0..1) is sampled.
    pub fn sampled(&self, draw: f64) -> bool {
        draw < self.sample_rate
    }
}

/// Whether two outputs are the same tensor bit for bit (shape and every value's bits: `-0`
/// and `+0` differ, as do two NaNs with different payloads).
pub fn same_bits(a: &Activations, b: &Activations) -> bool {
    a.shape() == b.shape()
        && a.values().len() == b.values().len()
        && a.values()
            .iter()
            .zip(b.values())
            .all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The SHA-256 of an output's shape and little-endian bytes, as hex: what evidence names.
pub fn output_digest(activations: &Activations) -> String {
    let mut hasher = Sha256::new();
    hasher.update(activations.shape().to_string().as_bytes());
    hasher.update(b"\n");
    hasher.update(activations.to_le_bytes());
    hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Which of the two disagreeing holders an arbiter's output speaks against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The route's own holder computed something else than the arbiter.
    PrimaryWrong,
    /// The shadow computed something else than the arbiter.
    ShadowWrong,
    /// No arbiter, or one agreeing with neither: nobody can be convicted.
    Undecided,
}

/// The verdict of `arbiter` (its output, if one could be had) on the disagreeing `primary`
/// and `shadow` outputs.
pub fn judge(
    primary: &Activations,
    shadow: &Activations,
    arbiter: Option<&Activations>,
) -> Verdict {
    match arbiter {
        Some(arbiter) if same_bits(arbiter, shadow) && !same_bits(arbiter, primary) => {
            Verdict::PrimaryWrong
        }
        Some(arbiter) if same_bits(arbiter, primary) && !same_bits(arbiter, shadow) => {
            Verdict::ShadowWrong
        }
        _ => Verdict::Undecided,
    }
}

/// One member's output and its digest, as evidence lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Testimony {
    /// The member.
    pub peer: PeerId,
    /// [`output_digest`] of what it returned.
    pub output_sha256: String,
}

/// Why a member was convicted: the step two holders disagreed on and what the arbiter said.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evidence {
    /// The session on the hops.
    pub session: String,
    /// The step's first token position.
    pub position: u64,
    /// Tokens in the step.
    pub tokens: u64,
    /// The layers the three members ran.
    pub layers: LayerSpan,
    /// The convicted member and its output.
    pub convicted: Testimony,
    /// The other holder, whose output the arbiter confirmed.
    pub witness: Testimony,
    /// The arbiter, which recomputed the step from the session's recorded inputs.
    pub arbiter: Testimony,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use half::bf16;
    use meshnet_wire::Shape;

    use super::*;

    fn output(values: &[f32]) -> Activations {
        let shape = Shape::new(&[1, 1, values.len()]).unwrap();
        Activations::new(shape, values.iter().map(|&v| bf16::from_f32(v)).collect()).unwrap()
    }

    #[test]
    fn outputs_are_the_same_only_bit_for_bit() {
        assert!(same_bits(&output(&[1.0, -2.5]), &output(&[1.0, -2.5])));
        assert!(!same_bits(&output(&[1.0, -2.5]), &output(&[1.0, 2.5])));
        assert!(!same_bits(&output(&[0.0]), &output(&[-0.0])));
        assert!(!same_bits(&output(&[1.0]), &output(&[1.0, 1.0])));
        let reshaped =
            Activations::new(Shape::new(&[1, 2, 1]).unwrap(), vec![bf16::ONE, bf16::ONE]).unwrap();
        assert!(!same_bits(&output(&[1.0, 1.0]), &reshaped));
    }

    #[test]
    fn the_arbiter_convicts_the_holder_it_contradicts() {
        let honest = output(&[0.5, 1.5]);
        let wrong = output(&[0.5, -1.5]);
        let other = output(&[9.0, 9.0]);
        assert_eq!(judge(&wrong, &honest, Some(&honest)), Verdict::PrimaryWrong);
        assert_eq!(judge(&honest, &wrong, Some(&honest)), Verdict::ShadowWrong);
        assert_eq!(judge(&honest, &wrong, Some(&other)), Verdict::Undecided);
        assert_eq!(judge(&honest, &wrong, None), Verdict::Undecided);
        assert_eq!(judge(&honest, &honest, Some(&honest)), Verdict::Undecided);
    }

    #[test]
    fn digests_name_shape_and_bits() {
        let a = output(&[1.0, 2.0]);
        assert_eq!(output_digest(&a), output_digest(&a.clone()));
        assert_eq!(output_digest(&a).len(), 64);
        assert_ne!(output_digest(&a), output_digest(&output(&[1.0, -2.0])));
        let reshaped =
            Activations::new(Shape::new(&[1, 2, 1]).unwrap(), a.values().to_vec()).unwrap();
        assert_ne!(output_digest(&a), output_digest(&reshaped));
    }

    #[test]
    fn the_policy_checks_its_bounds_and_probation() {
        let policy = VerifyPolicy::default();
        assert!(policy.validate().is_ok());
        assert!(policy.on_probation(2));
        assert!(!policy.on_probation(3));
        assert!(policy.sampled(0.099));
        assert!(!policy.sampled(0.1));
        for rate in [-0.1, 1.5, f64::NAN] {
            let bad = VerifyPolicy {
                sample_rate: rate,
                ..VerifyPolicy::default()
            };
            assert!(
                bad.validate().unwrap_err().contains("sample rate"),
                "{rate}"
            );
        }
        let no_ban = VerifyPolicy {
            ban_duration: Duration::ZERO,
            ..VerifyPolicy::default()
        };
        assert!(no_ban.validate().is_err());
        assert!(!VerifyPolicy::OFF.is_on());
        assert!(!VerifyPolicy::OFF.on_probation(0));
    }
}
