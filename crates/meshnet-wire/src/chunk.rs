//! Prefill chunking: split a long prompt's activations into 128-token chunks and put them back.

use std::ops::Range;

use crate::{Activations, Shape, WireError};

/// Tokens per prefill chunk (ADR-0008).
pub const PREFILL_CHUNK_TOKENS: usize = 128;

/// The token ranges of a prefill of `seq_len` tokens cut into chunks of `chunk_tokens`
/// (the last one shorter); empty when `seq_len` is 0.
///
/// # Panics
/// When `chunk_tokens` is 0.
pub fn chunk_ranges(seq_len: usize, chunk_tokens: usize) -> impl Iterator<Item = Range<usize>> {
    assert!(chunk_tokens > 0, "chunk size must be at least one token");
    (0..seq_len)
        .step_by(chunk_tokens)
        .map(move |start| start..(start + chunk_tokens).min(seq_len))
}

/// One chunk of a prefill.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillChunk {
    /// The chunk's zero-based index.
    pub index: u32,
    /// How many chunks the prefill has.
    pub total: u32,
    /// The offset of the chunk's first token within the prefill.
    pub token_offset: usize,
    /// The chunk's activations: `[tokens, hidden]` or `[batch, tokens, hidden]`.
    pub activations: Activations,
}

/// Where the sequence axis is in a `[seq, hidden]` or `[batch, seq, hidden]` shape.
fn sequence_layout(shape: &Shape) -> Result<(usize, usize, usize), WireError> {
    match *shape.dims() {
        [seq, hidden] => Ok((1, seq, hidden)),
        [batch, seq, hidden] => Ok((batch, seq, hidden)),
        _ => Err(WireError::InvalidShape {
            field: "prefill activations",
            reason: "expected [seq, hidden] or [batch, seq, hidden]",
            got: shape.to_string(),
        }),
    }
}

fn with_seq(shape: &Shape, seq: usize) -> Result<Shape, WireError> {
    let mut dims = shape.dims().to_vec();
    let axis = dims.len() - 2;
    dims[axis] = seq;
    Shape::new(&dims)
}

/// Splits `[seq, hidden]` or `[batch, seq, hidden]` activations into chunks of at most
/// `chunk_tokens` tokens along the sequence axis, never splitting a token's hidden vector.
pub fn split_prefill(
    activations: &Activations,
    chunk_tokens: usize,
) -> Result<Vec<PrefillChunk>, WireError> {
    if chunk_tokens == 0 {
        return Err(WireError::InvalidShape {
            field: "chunk size",
            reason: "a chunk must hold at least one token",
            got: "0".to_owned(),
        });
    }
    let (batch, seq, hidden) = sequence_layout(activations.shape())?;
    let total = seq.div_ceil(chunk_tokens);
    let total_u32 = u32::try_from(total).map_err(|_| WireError::InvalidShape {
        field: "prefill activations",
        reason: "too many chunks",
        got: activations.shape().to_string(),
    })?;
    let values = activations.values();
    chunk_ranges(seq, chunk_tokens)
        .enumerate()
        .map(|(index, tokens)| {
            let mut chunk = Vec::with_capacity(batch * tokens.len() * hidden);
            for b in 0..batch {
                let row = b * seq * hidden;
                chunk.extend_from_slice(
                    &values[row + tokens.start * hidden..row + tokens.end * hidden],
                );
            }
            Ok(PrefillChunk {
                index: index as u32,
                total: total_u32,
                token_offset: tokens.start,
                activations: Activations::new(with_seq(activations.shape(), tokens.len())?, chunk)?,
            })
        })
        .collect()
}

/// Concatenates chunk activations, given in order, back along the sequence axis.
pub fn reassemble(chunks: &[Activations]) -> Result<Activations, WireError> {
    let first = chunks.first().ok_or_else(|| WireError::Reassembly {
        reason: "no chunks".to_owned(),
    })?;
    let (batch, _, hidden) = sequence_layout(first.shape())?;
    let rank = first.shape().dims().len();
    let mut seq_total = 0usize;
    for (i, chunk) in chunks.iter().enumerate() {
        let (b, s, h) = sequence_layout(chunk.shape())?;
        if chunk.shape().dims().len() != rank || b != batch || h != hidden {
            return Err(WireError::Reassembly {
                reason: format!(
                    "chunk {i} has shape {}, which does not continue shape {}",
                    chunk.shape(),
                    first.shape()
                ),
            });
        }
        seq_total += s;
    }
    let mut values = Vec::with_capacity(batch * seq_total * hidden);
    for b in 0..batch {
        for chunk in chunks {
            let s = chunk.shape().dims()[rank - 2];
            values.extend_from_slice(&chunk.values()[b * s * hidden..(b + 1) * s * hidden]);
        }
    }
    Activations::new(with_seq(first.shape(), seq_total)?, values)
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    fn ramp(dims: &[usize]) -> Activations {
        let shape = Shape::new(dims).unwrap();
        let values = (0..shape.elements())
            .map(|i| bf16::from_f32(i as f32))
            .collect();
        Activations::new(shape, values).unwrap()
    }

    #[test]
    fn ranges_cover_the_sequence_with_a_short_tail() {
        let ranges: Vec<_> = chunk_ranges(300, 128).collect();
        assert_eq!(ranges, vec![0..128, 128..256, 256..300]);
        assert_eq!(chunk_ranges(128, 128).count(), 1);
        assert_eq!(chunk_ranges(0, 128).count(), 0);
    }

    #[test]
    fn splits_on_token_boundaries_and_reassembles() {
        let whole = ramp(&[300, 4]);
        let chunks = split_prefill(&whole, 128).unwrap();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[2].activations.shape().dims(), &[44, 4]);
        assert_eq!(chunks[1].token_offset, 128);
        assert!(chunks.iter().all(|c| c.total == 3));
        // The first value of chunk 1 is token 128's first hidden value.
        assert_eq!(chunks[1].activations.values()[0], bf16::from_f32(512.0));
        let parts: Vec<_> = chunks.into_iter().map(|c| c.activations).collect();
        assert_eq!(reassemble(&parts).unwrap(), whole);
    }

    #[test]
    fn batched_activations_split_per_sequence() {
        let whole = ramp(&[2, 5, 3]);
        let chunks = split_prefill(&whole, 2).unwrap();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0].activations.shape().dims(), &[2, 2, 3]);
        // Batch 1 of chunk 0 starts at token 0 of sequence 1: element 15.
        assert_eq!(chunks[0].activations.values()[6], bf16::from_f32(15.0));
        let parts: Vec<_> = chunks.into_iter().map(|c| c.activations).collect();
        assert_eq!(reassemble(&parts).unwrap(), whole);
    }

    #[test]
    fn rejects_other_ranks_and_mismatched_chunks() {
        assert!(matches!(
            split_prefill(&ramp(&[1, 2, 3, 4]), 128),
            Err(WireError::InvalidShape { field: "prefill activations", ref got, .. })
                if got == "1,2,3,4"
        ));
        assert!(matches!(
            split_prefill(&ramp(&[8, 4]), 0),
            Err(WireError::InvalidShape {
                field: "chunk size",
                ..
            })
        ));
        assert!(matches!(
            reassemble(&[]),
            Err(WireError::Reassembly { ref reason }) if reason == "no chunks"
        ));
        assert!(matches!(
            reassemble(&[ramp(&[2, 4]), ramp(&[2, 5])]),
            Err(WireError::Reassembly { ref reason }) if reason.starts_with("chunk 1 has shape")
        ));
    }
}
