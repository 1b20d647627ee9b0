//! Pieces shared by every model family's spans, attention and embedding.

use candle_core::{Device, Tensor};
use meshnet_types::LayerSpan;

use crate::error::{ModelError, Result};

/// An additive mask `[tokens, position + tokens]`: 0 where a query may attend, −∞ for keys
/// after it. `None` for a single token, which may attend to everything cached.
pub(crate) fn causal_mask(position: usize, tokens: usize) -> Result<Option<Tensor>> {
    if tokens == 1 {
        return Ok(None);
    }
    let known = position + tokens;
    let values: Vec<f32> = (0..tokens)
        .flat_map(|row| {
            (0..known).map(move |column| {
                if column > position + row {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(
        values,
        (tokens, known),
        &Device::Cpu,
    )?))
}

/// The token count of hidden states shaped `[1, tokens, width]` (tokens ≥ 1), or an error
/// naming the shape that arrived.
pub(crate) fn hidden_tokens(hidden: &Tensor, width: usize) -> Result<usize> {
    match hidden.dims() {
        [1, tokens, actual] if *tokens > 0 && *actual == width => Ok(*tokens),
        dims => Err(ModelError::HiddenShape {
            actual: dims.to_vec(),
            hidden: width,
        }),
    }
}

/// Refuses token ids outside a vocabulary of `vocab_size` entries.
pub(crate) fn check_token_ids(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        Some(&bad) => Err(ModelError::InvalidSpan(format!(
            "token id {bad} is outside the vocabulary of {vocab_size}"
        ))),
        None => Ok(()),
    }
}

/// Refuses `layers` unless it lies within `span` (a span runs only its own layers).
pub(crate) fn check_sub_span(span: LayerSpan, layers: LayerSpan) -> Result<()> {
    if span.covers(layers) {
        Ok(())
    } else {
        Err(ModelError::InvalidSpan(format!(
            "layers {layers} are not within this span's {span}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_lets_each_token_see_the_cache_and_its_past() {
        assert!(causal_mask(7, 1).unwrap().is_none());
        let mask = causal_mask(2, 3)
            .unwrap()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        // Row r may see columns 0..=2+r.
        for (row, values) in mask.iter().enumerate() {
            for (column, &value) in values.iter().enumerate() {
                assert_eq!(value == 0.0, column <= 2 + row, "row {row} column {column}");
            }
        }
    }

    #[test]
    fn token_ids_past_the_vocabulary_are_refused() {
        assert!(check_token_ids(&[0, 9], 10).is_ok());
        let err = check_token_ids(&[3, 10], 10).unwrap_err();
        assert!(err.to_string().contains("token id 10"), "{err}");
    }
}
