//! Layer spans and the state of a held span.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::TypesError;

/// A half-open range of transformer layers `[start, end)`.
///
/// It may be empty (`start == end`), for example the intersection of two disjoint spans or the
/// layers of a span that holds only the embedding; it is never inverted: constructors clamp
/// `end` to at least `start`, and decoding an inverted pair fails. Its text form is
/// `start..end`; in JSON and bincode it is the pair `[start, end]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LayerSpan {
    /// The first layer of the span.
    pub start: u32,
    /// One past the last layer of the span.
    pub end: u32,
}

impl LayerSpan {
    /// The span `[start, end)`; an `end` below `start` gives the empty span at `start`.
    pub fn new(start: u32, end: u32) -> Self {
        LayerSpan {
            start,
            end: end.max(start),
        }
    }

    /// The span `[start, end)` when it holds at least one layer.
    pub fn non_empty(start: u32, end: u32) -> Option<Self> {
        (start < end).then_some(LayerSpan { start, end })
    }

    /// The span of a `usize` range (as model code indexes layers); `None` when a bound does
    /// not fit `u32` or the range is inverted.
    pub fn from_range(range: Range<usize>) -> Option<Self> {
        let start = u32::try_from(range.start).ok()?;
        let end = u32::try_from(range.end).ok()?;
        (start <= end).then_some(LayerSpan { start, end })
    }

    /// The span as a `usize` range, for indexing layers.
    pub fn as_range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }

    /// Number of layers in the span.
    pub fn len(self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the span holds no layer.
    pub fn is_empty(self) -> bool {
        self.end <= self.start
    }

    /// Whether `layer` lies inside the span.
    pub fn contains(self, layer: u32) -> bool {
        self.start <= layer && layer < self.end
    }

    /// Whether every layer of `other` lies inside this span (an empty `other` lies inside
    /// any span whose bounds enclose it).
    pub fn covers(self, other: LayerSpan) -> bool {
        self.start <= other.start && other.end <= self.end
    }

    /// The layers both spans share (possibly empty).
    pub fn intersection(self, other: LayerSpan) -> LayerSpan {
        LayerSpan::new(self.start.max(other.start), self.end.min(other.end))
    }
}

impl fmt::Display for LayerSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

impl FromStr for LayerSpan {
    type Err = TypesError;

    /// Parses `start..end` (surrounding spaces allowed).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || TypesError::Span(text.to_owned());
        let (start, end) = text.trim().split_once("..").ok_or_else(invalid)?;
        let start: u32 = start.trim().parse().map_err(|_| invalid())?;
        let end: u32 = end.trim().parse().map_err(|_| invalid())?;
        if end < start {
            return Err(invalid());
        }
        Ok(LayerSpan { start, end })
    }
}

impl Serialize for LayerSpan {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        [self.start, self.end].serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for LayerSpan {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let [start, end] = <[u32; 2]>::deserialize(deserializer)?;
        if end < start {
            return Err(serde::de::Error::custom(format!(
                "layer span [{start}, {end}] ends before it starts"
            )));
        }
        Ok(LayerSpan { start, end })
    }
}

/// Whether a held span is loading, serving, or only finishing the sessions it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanState {
    /// The weights are being read or loaded.
    Loading,
    /// The layers are loaded and take new sessions.
    Ready,
    /// The layers still serve running sessions but take no new ones.
    Draining,
}

impl fmt::Display for SpanState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpanState::Loading => "loading",
            SpanState::Ready => "ready",
            SpanState::Draining => "draining",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn constructors_never_invert() {
        assert_eq!(LayerSpan::new(5, 3), LayerSpan::new(5, 5));
        assert!(LayerSpan::new(5, 3).is_empty());
        assert_eq!(LayerSpan::non_empty(3, 3), None);
        let (start, end) = (4, 2);
        assert_eq!(LayerSpan::from_range(start..end), None);
        assert_eq!(LayerSpan::from_range(2..4), Some(LayerSpan::new(2, 4)));
    }

    #[test]
    fn set_operations() {
        let a = LayerSpan::new(0, 10);
        assert!(a.contains(0) && a.contains(9) && !a.contains(10));
        assert!(a.covers(LayerSpan::new(3, 10)));
        assert!(!a.covers(LayerSpan::new(3, 11)));
        assert_eq!(a.intersection(LayerSpan::new(8, 20)), LayerSpan::new(8, 10));
        assert!(a.intersection(LayerSpan::new(12, 20)).is_empty());
        assert_eq!(a.len(), 10);
        assert_eq!(a.as_range(), 0..10);
    }

    #[test]
    fn text_and_json_forms() {
        assert_eq!(LayerSpan::new(10, 20).to_string(), "10..20");
        assert_eq!(
            " 10 .. 20 ".parse::<LayerSpan>(),
            Ok(LayerSpan::new(10, 20))
        );
        for bad in ["", "10", "10-20", "20..10", "a..b", "-1..2"] {
            assert!(bad.parse::<LayerSpan>().is_err(), "{bad:?} parsed");
        }
        let json = serde_json::to_string(&LayerSpan::new(3, 7)).unwrap();
        assert_eq!(json, "[3,7]");
        assert!(serde_json::from_str::<LayerSpan>("[7,3]").is_err());
        assert_eq!(SpanState::Draining.to_string(), "draining");
        assert_eq!(
            serde_json::to_string(&SpanState::Ready).unwrap(),
            "\"ready\""
        );
    }

    proptest! {
        #[test]
        fn text_round_trips(start in 0u32..1000, len in 0u32..1000) {
            let span = LayerSpan::new(start, start + len);
            prop_assert_eq!(span.to_string().parse::<LayerSpan>(), Ok(span));
            let json = serde_json::to_string(&span).unwrap();
            prop_assert_eq!(serde_json::from_str::<LayerSpan>(&json).unwrap(), span);
        }
    }
}
