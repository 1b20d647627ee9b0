//! Weight formats.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::TypesError;

/// A weight format a peer can hold a layer in.
///
/// Variants are declared from the lowest to the highest quality, so the derived `Ord` means
/// "better quality": `Quantization::Bf16 > Quantization::Nf4`. Quality follows the effective
/// bits per weight of each format. Activations cross the wire in bfloat16 whatever the format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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
}

impl Quantization {
    /// Every quantization, from the lowest to the highest quality.
    pub const ALL: [Quantization; 6] = [
        Quantization::Nf4,
        Quantization::Q4KM,
        Quantization::Q4_1,
        Quantization::Int8,
        Quantization::Q8_0,
        Quantization::Bf16,
    ];

    /// The conventional lowercase name (`"bf16"`, `"q8_0"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Quantization::Nf4 => "nf4",
            Quantization::Q4KM => "q4_k_m",
            Quantization::Q4_1 => "q4_1",
            Quantization::Int8 => "int8",
            Quantization::Q8_0 => "q8_0",
            Quantization::Bf16 => "bf16",
        }
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
        assert!(Quantization::Bf16 > Quantization::Q4_1);
    }
}
