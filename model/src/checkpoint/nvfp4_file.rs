//! NVFP4 weights as ModelOpt stores them in a safetensors file: for a linear layer `X`,
//! `X.weight` (U8 `[out, in/2]`), `X.weight_scale` (F8_E4M3 `[out, in/16]`),
//! `X.weight_scale_2` (F32 scalar) and, for W4A4 layers, `X.input_scale` (F32 scalar).

use kernels::formats::nvfp4::{NVFP4_BLOCK, Nvfp4Matrix};
use safetensors::Dtype;

use crate::arch::names::Tensor;
use crate::checkpoint::tensor_file::{TensorFile, TensorFileError};

/// Reads the NVFP4 triple whose packed weight is `weight_name` (ending in `.weight`), checking
/// dtypes, shapes and that the global scale is positive and finite.
pub fn read_nvfp4(file: &TensorFile, weight_name: &str) -> Result<Nvfp4Matrix, TensorFileError> {
    let tensor = Tensor::of_weight(weight_name).ok_or_else(|| {
        file.bad_value(
            weight_name,
            "an NVFP4 weight's name ends in `.weight`".into(),
        )
    })?;
    let (scale_name, scale2_name) = (tensor.weight_scale(), tensor.weight_scale_2());
    let info = file.info(weight_name)?;
    if info.shape.len() != 2 {
        return Err(file.bad_value(
            weight_name,
            format!("NVFP4 weight must be 2-D, got shape {:?}", info.shape),
        ));
    }
    let (rows, cols) = (info.shape[0], info.shape[1] * 2);
    let packed = file.u8_values(weight_name, &[Dtype::U8])?.to_vec();
    file.expect_shape(&scale_name, &[rows, cols / NVFP4_BLOCK])?;
    let scales = file.u8_values(&scale_name, &[Dtype::F8_E4M3])?.to_vec();
    if let Some(i) = scales.iter().position(|&c| c & 0x7F == 0x7F) {
        return Err(file.bad_value(
            &scale_name,
            format!("block scale {i} (row {}) is NaN", i / (cols / NVFP4_BLOCK)),
        ));
    }
    let global = file.positive_scale(&scale2_name)?;
    Nvfp4Matrix::from_parts(rows, cols, packed, scales, global)
        .map_err(|e| file.bad_value(weight_name, e.to_string()))
}

/// Names `X.weight` in the file that have a `X.weight_scale` beside them.
pub fn nvfp4_weight_names(file: &TensorFile) -> Vec<String> {
    file.names()
        .filter(|n| Tensor::of_weight(n).is_some_and(|t| file.contains(&t.weight_scale())))
        .map(str::to_string)
        .collect()
}
