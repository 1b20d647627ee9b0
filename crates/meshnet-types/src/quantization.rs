//! Weight formats.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::TypesError;

/// A weight format a peer can hold a layer in.
///
/// `Ord` means "better quality", following the effective bits per weight of each format
/// ([`Quantization::ALL`]'s order): `Quantization::Bf16 > Quantization::Nf4`. The declaration
/// order is the wire encoding's (a variant's index), so new formats are appended, never
/// inserted. Activations cross the wire in bfloat16 whatever the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantization {
    /// 4-bit NormalFloat with a 16-bit scale per 64 weights (about 4.25 bits per weight).
    Nf4,
    /// A GGUF "Q4_K_M" file: mostly 4-bit K-quant blocks of 256 weights, a few tensors in
    /// 5-, 6- and 8-bit formats (about 4.9 bits per weight), as the file holds them.
    #[serde(rename = "q4_k_m")]
    Q4KM,
    /// GGUF 4-bit blocks of 32 weights with a 16-bit scale and minimum (5 bits per weight).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// 8-bit integers with a 16-bit scale per output row (slightly over 8 bits per weight).
    Int8,
    /// GGUF 8-bit blocks of 32 weights with a 16-bit scale (8.5 bits per weight).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 16- or 32-bit floats, the unquantized reference (counted at 16 bits per weight).
    Bf16,
    /// A GGUF "Q2_K" file: mostly 2-bit K-quant blocks of 256 weights (about 2.6 bits).
    #[serde(rename = "q2_k")]
    Q2K,
    /// A GGUF "Q3_K_S" file: 3-bit K-quant blocks throughout (about 3.4 bits).
    #[serde(rename = "q3_k_s")]
    Q3KS,
    /// A GGUF "Q3_K_M" file: 3-bit K-quants with some 4- and 5-bit tensors (about 3.9 bits).
    #[serde(rename = "q3_k_m")]
    Q3KM,
    /// A GGUF "Q3_K_L" file: 3-bit K-quants with more 5-bit tensors (about 4.3 bits).
    #[serde(rename = "q3_k_l")]
    Q3KL,
    /// GGUF 4-bit blocks of 32 weights with a 16-bit scale (4.5 bits per weight).
    #[serde(rename = "q4_0")]
    Q4_0,
    /// A GGUF "Q4_K_S" file: 4-bit K-quant blocks throughout (about 4.6 bits).
    #[serde(rename = "q4_k_s")]
    Q4KS,
    /// GGUF 5-bit blocks of 32 weights with a 16-bit scale (5.5 bits per weight).
    #[serde(rename = "q5_0")]
    Q5_0,
    /// A GGUF "Q5_K_S" file: 5-bit K-quant blocks throughout (about 5.5 bits).
    #[serde(rename = "q5_k_s")]
    Q5KS,
    /// A GGUF "Q5_K_M" file: mostly 5-bit K-quants with some 6-bit tensors (about 5.7 bits).
    #[serde(rename = "q5_k_m")]
    Q5KM,
    /// GGUF 5-bit blocks of 32 weights with a 16-bit scale and minimum (6 bits per weight).
    #[serde(rename = "q5_1")]
    Q5_1,
    /// A GGUF "Q6_K" file: 6-bit K-quant blocks of 256 weights (about 6.6 bits).
    #[serde(rename = "q6_k")]
    Q6K,
}

impl Quantization {
    /// Every quantization, from the lowest to the highest quality.
    pub const ALL: [Quantization; 17] = [
        Quantization::Q2K,
        Quantization::Q3KS,
        Quantization::Q3KM,
        Quantization::Q3KL,
        Quantization::Nf4,
        Quantization::Q4_0,
        Quantization::Q4KS,
        Quantization::Q4KM,
        Quantization::Q4_1,
        Quantization::Q5_0,
        Quantization::Q5KS,
        Quantization::Q5KM,
        Quantization::Q5_1,
        Quantization::Q6K,
        Quantization::Int8,
        Quantization::Q8_0,
        Quantization::Bf16,
    ];

    /// The conventional lowercase name (`"bf16"`, `"q8_0"`, `"q4_k_m"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Quantization::Q2K => "q2_k",
            Quantization::Q3KS => "q3_k_s",
            Quantization::Q3KM => "q3_k_m",
            Quantization::Q3KL => "q3_k_l",
            Quantization::Nf4 => "nf4",
            Quantization::Q4_0 => "q4_0",
            Quantization::Q4KS => "q4_k_s",
            Quantization::Q4KM => "q4_k_m",
            Quantization::Q4_1 => "q4_1",
            Quantization::Q5_0 => "q5_0",
            Quantization::Q5KS => "q5_k_s",
            Quantization::Q5KM => "q5_k_m",
            Quantization::Q5_1 => "q5_1",
            Quantization::Q6K => "q6_k",
            Quantization::Int8 => "int8",
            Quantization::Q8_0 => "q8_0",
            Quantization::Bf16 => "bf16",
        }
    }

    /// The quantization llama.cpp's `general.file_type` names (`LLAMA_FTYPE_MOSTLY_*`: 2 is
    /// Q4_0, 15 Q4_K_M, …), for the presets of `llama-quantize`; F32, F16 and BF16 files are
    /// [`Quantization::Bf16`].
    pub fn from_gguf_file_type(file_type: u64) -> Option<Self> {
        Some(match file_type {
            0 | 1 | 32 => Quantization::Bf16,
            2 => Quantization::Q4_0,
            3 => Quantization::Q4_1,
            7 => Quantization::Q8_0,
            8 => Quantization::Q5_0,
            9 => Quantization::Q5_1,
            10 => Quantization::Q2K,
            11 => Quantization::Q3KS,
            12 => Quantization::Q3KM,
            13 => Quantization::Q3KL,
            14 => Quantization::Q4KS,
            15 => Quantization::Q4KM,
            16 => Quantization::Q5KS,
            17 => Quantization::Q5KM,
            18 => Quantization::Q6K,
            _ => return None,
        })
    }

    /// Average bytes per 256 weights of the format's matrices (a mix counted at its main type
    /// with a share of the larger ones); `None` for the formats whose size is not per block.
    pub fn bytes_per_256(self) -> Option<u64> {
        Some(match self {
            Quantization::Q2K => 84,
            Quantization::Q3KS => 110,
            Quantization::Q3KM => 124,
            Quantization::Q3KL => 135,
            Quantization::Q4_0 => 144,
            Quantization::Q4KS => 146,
            Quantization::Q4KM => 156,
            Quantization::Q4_1 => 160,
            Quantization::Q5_0 => 176,
            Quantization::Q5KS => 178,
            Quantization::Q5KM => 184,
            Quantization::Q5_1 => 192,
            Quantization::Q6K => 210,
            Quantization::Q8_0 => 272,
            Quantization::Nf4 | Quantization::Int8 | Quantization::Bf16 => return None,
        })
    }
}

impl Quantization {
    /// The place in [`Quantization::ALL`]: 0 for the lowest quality.
    fn quality_rank(self) -> usize {
        Quantization::ALL
            .iter()
            .position(|quantization| *quantization == self)
            .unwrap_or(usize::MAX)
    }
}

impl Ord for Quantization {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.quality_rank().cmp(&other.quality_rank())
    }
}

impl PartialOrd for Quantization {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Quantization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Quantization {
    type Err = TypesError;

    /// Parses a name, ignoring case, with `-` accepted for `_` (`q8-0`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wanted = text.trim().to_ascii_lowercase().replace('-', "_");
        Quantization::ALL
            .into_iter()
            .find(|q| q.name() == wanted)
            .ok_or_else(|| TypesError::Quantization(text.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_text_and_json() {
        for q in Quantization::ALL {
            assert_eq!(q.to_string().parse::<Quantization>(), Ok(q));
            let json = serde_json::to_string(&q).unwrap();
            assert_eq!(json, format!("\"{}\"", q.name()));
            assert_eq!(serde_json::from_str::<Quantization>(&json).unwrap(), q);
        }
        assert_eq!("Q8-0".parse::<Quantization>(), Ok(Quantization::Q8_0));
        assert!("q5_k".parse::<Quantization>().is_err());
        assert_eq!("Q4_K_M".parse::<Quantization>(), Ok(Quantization::Q4KM));
        assert!(Quantization::Bf16 > Quantization::Q4_1);
    }

    #[test]
    fn every_variant_has_a_quality_rank_and_the_first_six_keep_their_wire_index() {
        let mut ranks: Vec<usize> = Quantization::ALL.iter().map(|q| q.quality_rank()).collect();
        ranks.sort_unstable();
        assert_eq!(ranks, (0..Quantization::ALL.len()).collect::<Vec<_>>());
        // Schema 4's messages encode a variant by its declaration index.
        let declared = [
            Quantization::Nf4,
            Quantization::Q4KM,
            Quantization::Q4_1,
            Quantization::Int8,
            Quantization::Q8_0,
            Quantization::Bf16,
        ];
        for (index, quantization) in declared.into_iter().enumerate() {
            assert_eq!(quantization as usize, index, "{quantization}");
        }
        assert!(Quantization::Q6K > Quantization::Q5KM && Quantization::Q6K < Quantization::Int8);
    }

    #[test]
    fn the_order_follows_the_bytes_per_weight() {
        let sized: Vec<u64> = Quantization::ALL
            .into_iter()
            .filter_map(Quantization::bytes_per_256)
            .collect();
        assert_eq!(sized.len(), 14);
        assert!(sized.windows(2).all(|pair| pair[0] < pair[1]), "{sized:?}");
    }

    #[test]
    fn llama_cpp_file_types_name_their_preset() {
        assert_eq!(
            Quantization::from_gguf_file_type(15),
            Some(Quantization::Q4KM)
        );
        assert_eq!(
            Quantization::from_gguf_file_type(17),
            Some(Quantization::Q5KM)
        );
        assert_eq!(
            Quantization::from_gguf_file_type(18),
            Some(Quantization::Q6K)
        );
        assert_eq!(
            Quantization::from_gguf_file_type(2),
            Some(Quantization::Q4_0)
        );
        assert_eq!(
            Quantization::from_gguf_file_type(32),
            Some(Quantization::Bf16)
        );
        // Q4_0_4_4 and the IQ presets have no name here.
        assert_eq!(Quantization::from_gguf_file_type(19), None);
        assert_eq!(Quantization::from_gguf_file_type(33), None);
    }
}
