//! `model inspect` (a checkpoint folder or one safetensors file) and `model quantize` of one
//! file.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Result, bail};
use kernels::formats::NVFP4_BLOCK;
use kernels::formats::nvfp4::Nvfp4Matrix;
use safetensors::Dtype;

use crate::checkpoint::Checkpoint;
use crate::checkpoint::nvfp4_file::{nvfp4_weight_names, read_nvfp4};
use crate::checkpoint::tensor_file::TensorFile;
use crate::checkpoint::writer::{OutputKind, OwnedTensor, StagedOutput, write_file};
use crate::input::InvalidInput;

pub fn inspect_checkpoint(dir: &Path) -> Result<()> {
    let checkpoint = Checkpoint::open(dir)?;
    let c = checkpoint.model_config();
    println!(
        "{}: model_type {} (prefix `{}`)",
        dir.display(),
        checkpoint.config.model_type,
        checkpoint.prefix
    );
    println!(
        "  {} layers ({} dense), hidden {}, heads {}, q_lora {}, kv_lora {}, experts {} (top-{}, {} shared, groups {}/{}), vocab {}",
        c.num_hidden_layers,
        c.first_k_dense_replace,
        c.hidden_size,
        c.num_attention_heads,
        or_none(c.q_lora_rank),
        c.kv_lora_rank,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.n_shared_experts,
        c.n_group,
        c.topk_group,
        c.vocab_size
    );
    match &checkpoint.config.quant {
        Some(q) => println!(
            "  quantization {} group {} (producer {}), KV cache {}, {} exclude patterns",
            q.quant_algo,
            q.group_size,
            q.producer.as_deref().unwrap_or("unknown"),
            or_none(q.kv_cache_quant_algo),
            q.exclude_modules.len()
        ),
        None => println!("  not quantized"),
    }
    let mut by_dtype: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (name, file) in checkpoint.tensor_names() {
        let info = file.info(name)?;
        let e = by_dtype.entry(info.dtype.to_string()).or_default();
        e.0 += 1;
        e.1 += info.numel() * info.dtype.bitsize() / 8;
    }
    println!("  {} shards", checkpoint.shards().len());
    for (dtype, (count, bytes)) in by_dtype {
        println!(
            "  {dtype:>8}: {count:>6} tensors, {:>10.3} MiB",
            bytes as f64 / (1 << 20) as f64
        );
    }
    let weights = checkpoint.load_weights()?;
    println!("  all {} layers load and validate", weights.layers.len());
    let non_finite = checkpoint.non_finite_tensors()?;
    refuse_non_finite(
        non_finite
            .iter()
            .map(|(name, file, i)| (name.as_str(), file.as_path(), *i)),
    )?;
    println!("  every floating-point weight is finite");
    Ok(())
}

/// An optional value as plain text: the value, or `none`.
fn or_none<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "none".to_string(), |v| v.to_string())
}

/// Fails naming each tensor that holds NaN or Inf (`(tensor, file, first element)`).
fn refuse_non_finite<'a>(found: impl Iterator<Item = (&'a str, &'a Path, usize)>) -> Result<()> {
    let found: Vec<String> = found
        .map(|(name, file, i)| format!("`{name}` ({}) at element {i}", file.display()))
        .collect();
    if found.is_empty() {
        return Ok(());
    }
    bail!(InvalidInput(format!(
        "{} tensor(s) hold NaN or Inf: {}",
        found.len(),
        found.join(", ")
    )))
}

pub fn inspect_file(path: &Path) -> Result<()> {
    let file = TensorFile::open(path)?;
    println!("{}: {} tensors", path.display(), file.names().count());
    for (key, value) in file.metadata() {
        println!("  metadata {key} = {value}");
    }
    let mut by_dtype: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for name in file.names() {
        let info = file.info(name)?;
        let entry = by_dtype.entry(info.dtype.to_string()).or_default();
        entry.0 += 1;
        entry.1 += info.numel() * info.dtype.bitsize() / 8;
    }
    for (dtype, (count, bytes)) in &by_dtype {
        println!("  {dtype:>8}: {count:>5} tensors, {bytes:>12} bytes");
    }
    let mut non_finite = Vec::new();
    for name in file.names() {
        if let Some(i) = file.first_non_finite(name)? {
            non_finite.push((name, path, i));
        }
    }
    refuse_non_finite(non_finite.into_iter())?;
    let nvfp4 = nvfp4_weight_names(&file);
    if !nvfp4.is_empty() {
        println!("\n  NVFP4 weights ({}):", nvfp4.len());
        println!(
            "  {:<48} {:>12} {:>12} {:>10} {:>10}",
            "tensor", "shape", "scale_2", "|w| max", "zero blks"
        );
    }
    for name in &nvfp4 {
        let matrix = read_nvfp4(&file, name)?;
        let values = matrix.dequantize();
        let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let zero_blocks = values
            .chunks(NVFP4_BLOCK)
            .filter(|b| b.iter().all(|&v| v == 0.0))
            .count();
        println!(
            "  {:<48} {:>12} {:>12.4e} {:>10.4e} {:>10}",
            name,
            format!("{}x{}", matrix.rows, matrix.cols),
            matrix.global_scale,
            max,
            zero_blocks
        );
    }
    Ok(())
}

pub fn quantize_file(input: &Path, output: &Path, force: bool) -> Result<()> {
    let file = TensorFile::open(input)?;
    let stage = StagedOutput::new(output, &[input], OutputKind::File, force)?;
    let mut out = Vec::new();
    for name in file.names() {
        let info = file.info(name)?;
        let is_float = matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
        if !(name.ends_with("weight") && is_float && info.shape.len() == 2) {
            continue;
        }
        let (rows, cols) = (info.shape[0], info.shape[1]);
        let matrix = Nvfp4Matrix::quantize_weight(&file.f32_values(name)?, rows, cols)
            .map_err(|e| InvalidInput(format!("{}: tensor `{name}`: {e}", input.display())))?;
        out.push(OwnedTensor::new(
            name,
            Dtype::U8,
            vec![rows, cols / 2],
            matrix.packed,
        ));
        out.push(OwnedTensor::new(
            format!("{name}_scale"),
            Dtype::F8_E4M3,
            vec![rows, cols / NVFP4_BLOCK],
            matrix.block_scales,
        ));
        out.push(OwnedTensor::f32_scalar(
            format!("{name}_scale_2"),
            matrix.global_scale,
        ));
        println!("quantized {name} [{rows}, {cols}]");
    }
    if out.is_empty() {
        bail!(InvalidInput(format!(
            "{}: no 2-D floating-point `*.weight` tensor to quantize",
            input.display()
        )));
    }
    write_file(stage.path(), &out)?;
    stage.commit()?;
    println!("wrote {}", output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::KvCacheQuant;

    #[test]
    fn optional_values_print_as_plain_text() {
        assert_eq!(or_none(Some(64)), "64");
        assert_eq!(or_none(None::<usize>), "none");
        assert_eq!(or_none(Some(KvCacheQuant::Fp8)), "fp8");
    }
}
