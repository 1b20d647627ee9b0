//! Tensor shapes as they travel in `X-Meshnet-Shape`: 1 to 4 positive dimensions.

use std::fmt;
use std::str::FromStr;

use crate::WireError;
use crate::error::quote;

/// The most dimensions a frame's shape may have.
pub const MAX_DIMS: usize = 4;

/// The shape of an activation tensor: 1 to [`MAX_DIMS`] dimensions, each at least 1, whose
/// bfloat16 byte size fits in `isize` (the largest buffer a program can hold).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: Vec<usize>,
}

impl Shape {
    /// Builds a shape, checking the number of dimensions, that none is zero and that the element
    /// count does not overflow.
    pub fn new(dims: &[usize]) -> Result<Self, WireError> {
        Self::checked(dims, "shape")
    }

    fn checked(dims: &[usize], field: &'static str) -> Result<Self, WireError> {
        let got = || {
            dims.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(WireError::InvalidShape {
                field,
                reason: "expected 1 to 4 comma-separated dimensions",
                got: got(),
            });
        }
        if dims.contains(&0) {
            return Err(WireError::InvalidShape {
                field,
                reason: "every dimension must be at least 1",
                got: got(),
            });
        }
        let elements = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        // No buffer can be larger than isize::MAX bytes.
        let fits = elements
            .and_then(|e| e.checked_mul(2))
            .is_some_and(|bytes| bytes <= isize::MAX as usize);
        if !fits {
            return Err(WireError::FrameTooLarge {
                shape: got(),
                declared_bytes: declared_bytes(dims),
                limit: usize::MAX,
            });
        }
        Ok(Shape {
            dims: dims.to_vec(),
        })
    }

    /// Parses the text form used in `X-Meshnet-Shape`, for example `1,128,16384`.
    ///
    /// `field` names the header in error messages.
    pub fn parse(text: &str, field: &'static str) -> Result<Self, WireError> {
        let invalid = |reason| WireError::InvalidShape {
            field,
            reason,
            got: quote(text),
        };
        let parts: Vec<&str> = text.split(',').map(str::trim).collect();
        if parts.len() > MAX_DIMS {
            return Err(invalid("expected 1 to 4 comma-separated dimensions"));
        }
        let mut dims = Vec::with_capacity(parts.len());
        for part in parts {
            if part.is_empty() {
                return Err(invalid("expected 1 to 4 comma-separated dimensions"));
            }
            if part.starts_with('-') {
                return Err(invalid("every dimension must be at least 1"));
            }
            if !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid("dimensions must be decimal integers"));
            }
            match part.parse::<usize>() {
                Ok(d) => dims.push(d),
                // All digits, yet unparsable: the number itself overflows.
                Err(_) => {
                    return Err(WireError::FrameTooLarge {
                        shape: quote(text),
                        declared_bytes: u128::MAX,
                        limit: usize::MAX,
                    });
                }
            }
        }
        Self::checked(&dims, field)
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The number of elements (the product of the dimensions).
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// The number of payload bytes at two bytes per bfloat16 element.
    pub fn byte_len(&self) -> usize {
        self.elements() * 2
    }

    /// The size of the last dimension (the hidden size of an activation).
    pub fn last_dim(&self) -> usize {
        self.dims[self.dims.len() - 1]
    }
}

/// Bytes a list of dimensions would need, saturating instead of overflowing.
fn declared_bytes(dims: &[usize]) -> u128 {
    dims.iter()
        .try_fold(2u128, |acc, &d| acc.checked_mul(d as u128))
        .unwrap_or(u128::MAX)
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

impl FromStr for Shape {
    type Err = WireError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Shape::parse(s, "shape")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_the_adr_example() {
        let shape = Shape::parse("1,128,16384", "X-Meshnet-Shape").unwrap();
        assert_eq!(shape.dims(), &[1, 128, 16384]);
        assert_eq!(shape.elements(), 128 * 16384);
        assert_eq!(shape.byte_len(), 128 * 16384 * 2);
        assert_eq!(shape.to_string(), "1,128,16384");
    }

    #[test]
    fn tolerates_spaces_around_dimensions() {
        let shape = Shape::parse(" 2, 3 ,4", "X-Meshnet-Shape").unwrap();
        assert_eq!(shape.dims(), &[2, 3, 4]);
    }

    #[test]
    fn rejects_bad_shapes_by_reason() {
        let cases = [
            ("", "expected 1 to 4"),
            ("1,,2", "expected 1 to 4"),
            ("1,2,3,4,5", "expected 1 to 4"),
            ("0,4", "at least 1"),
            ("-1,4", "at least 1"),
            ("1.5,4", "decimal integers"),
            ("abc", "decimal integers"),
            ("+3", "decimal integers"),
        ];
        for (text, reason) in cases {
            let err = Shape::parse(text, "X-Meshnet-Shape").unwrap_err();
            let message = err.to_string();
            assert!(
                message.contains(reason) && message.contains("X-Meshnet-Shape"),
                "{text:?}: {message}"
            );
        }
    }

    #[test]
    fn overflowing_products_are_too_large_not_a_panic() {
        for text in [
            "4294967296,4294967296,4294967296",
            "99999999999999999999999,1",
            "9223372036854775807,1",
        ] {
            let err = Shape::parse(text, "X-Meshnet-Shape").unwrap_err();
            assert!(
                matches!(err, WireError::FrameTooLarge { .. }),
                "{text}: {err}"
            );
        }
    }
}
