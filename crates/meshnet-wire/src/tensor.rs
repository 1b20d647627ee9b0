//! Conversions between [`Activations`] and candle tensors.

use candle_core::{DType, Device, Tensor};
use half::bf16;

use crate::{Activations, Shape, WireError};

impl Activations {
    /// Reads a tensor of any float dtype, casting to bfloat16 (the wire dtype) first.
    pub fn from_tensor(tensor: &Tensor) -> Result<Self, WireError> {
        let shape = Shape::new(tensor.dims())?;
        let values: Vec<bf16> = tensor
            .to_dtype(DType::BF16)?
            .flatten_all()?
            .to_vec1::<bf16>()?;
        Activations::new(shape, values)
    }

    /// Turns the activations into a bfloat16 tensor on `device`, moving the values (no copy on
    /// the CPU).
    pub fn into_tensor(self, device: &Device) -> Result<Tensor, WireError> {
        let (shape, values) = self.into_parts();
        Ok(Tensor::from_vec(values, shape.dims(), device)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_round_trip_keeps_shape_and_bits() {
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 4.0).collect();
        let tensor = Tensor::from_vec(values.clone(), (2, 3, 4), &Device::Cpu).unwrap();
        let activations = Activations::from_tensor(&tensor).unwrap();
        assert_eq!(activations.shape().dims(), &[2, 3, 4]);
        let expected: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(activations.values(), expected.as_slice());

        let back = activations.into_tensor(&Device::Cpu).unwrap();
        assert_eq!(back.dtype(), DType::BF16);
        assert_eq!(back.dims(), &[2, 3, 4]);
        let back_values = back.flatten_all().unwrap().to_vec1::<bf16>().unwrap();
        assert_eq!(back_values, expected);
    }
}
