//! Writes tensors as sharded safetensors with `model.safetensors.index.json`, the layout
//! Hugging Face checkpoints (and NVIDIA's NVFP4 releases) use.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;

use crate::checkpoint::INDEX_FILE;

/// One tensor to write.
pub struct OwnedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl OwnedTensor {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> Self {
        let tensor = Self {
            name: name.into(),
            dtype,
            shape,
            bytes,
        };
        debug_assert_eq!(
            tensor.bytes.len() * 8,
            tensor.shape.iter().product::<usize>() * tensor.dtype.bitsize(),
            "{}",
            tensor.name
        );
        tensor
    }

    pub fn f32_scalar(name: impl Into<String>, value: f32) -> Self {
        Self::new(name, Dtype::F32, vec![], value.to_le_bytes().to_vec())
    }

    pub fn bf16(name: impl Into<String>, shape: Vec<usize>, values: &[half::bf16]) -> Self {
        Self::new(
            name,
            Dtype::BF16,
            shape,
            bytemuck::cast_slice(values).to_vec(),
        )
    }

    pub fn f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        Self::new(
            name,
            Dtype::F32,
            shape,
            bytemuck::cast_slice(values).to_vec(),
        )
    }
}

/// Writes `tensors` as one safetensors file.
pub fn write_file(path: &Path, tensors: &[OwnedTensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Splits `tensors` into shards of at most `max_shard_bytes` (in the given order) and writes
/// them with their index into `dir`.
pub fn write_sharded(dir: &Path, tensors: Vec<OwnedTensor>, max_shard_bytes: usize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut shards: Vec<Vec<OwnedTensor>> = vec![Vec::new()];
    let mut current = 0usize;
    for tensor in tensors {
        if current > 0 && current + tensor.bytes.len() > max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += tensor.bytes.len();
        shards.last_mut().expect("one shard").push(tensor);
    }
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0usize;
    let progress = crate::checkpoint::progress_bar(count as u64, "writing shards");
    for (i, shard) in shards.iter().enumerate() {
        let file_name = format!("model-{:05}-of-{:05}.safetensors", i + 1, count);
        let path = dir.join(&file_name);
        write_file(&path, shard)?;
        for t in shard {
            total_size += t.bytes.len();
            weight_map.insert(t.name.clone(), file_name.clone());
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_string_pretty(&index)?)?;
    Ok(())
}
