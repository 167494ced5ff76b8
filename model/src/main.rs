//! `model`: the command-line front end.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kernels::formats::nvfp4::{NVFP4_BLOCK, Nvfp4Matrix};
use model::nvfp4_file::{nvfp4_weight_names, read_nvfp4};
use model::tensor_file::TensorFile;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

#[derive(Parser)]
#[command(
    name = "model",
    version,
    about = "Kimi-K2.5-NVFP4 on CPU and GPU: inspect, quantize, run"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Summarize a safetensors file: dtypes, shapes, and every NVFP4 weight decoded.
    Inspect {
        /// A `.safetensors` file.
        path: PathBuf,
    },
    /// Quantize every 2-D floating-point `*.weight` tensor of a safetensors file to NVFP4,
    /// written in the ModelOpt layout (`weight`, `weight_scale`, `weight_scale_2`).
    Quantize {
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        output: PathBuf,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Inspect { path } => inspect(&path),
        Command::Quantize { input, output } => quantize(&input, &output),
    }
}

fn inspect(path: &std::path::Path) -> Result<()> {
    let file = TensorFile::open(path)?;
    println!("{}: {} tensors", path.display(), file.names().count());
    for (key, value) in file.metadata() {
        println!("  metadata {key} = {value}");
    }
    let mut by_dtype: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for name in file.names() {
        let info = file.info(name)?;
        let entry = by_dtype.entry(format!("{:?}", info.dtype)).or_default();
        entry.0 += 1;
        entry.1 += info.numel() * info.dtype.bitsize() / 8;
    }
    for (dtype, (count, bytes)) in &by_dtype {
        println!("  {dtype:>8}: {count:>5} tensors, {bytes:>12} bytes");
    }
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

fn quantize(input: &std::path::Path, output: &std::path::Path) -> Result<()> {
    let file = TensorFile::open(input)?;
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in file.names() {
        let info = file.info(name)?;
        let is_float = matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
        if !(name.ends_with("weight") && is_float && info.shape.len() == 2) {
            continue;
        }
        let (rows, cols) = (info.shape[0], info.shape[1]);
        let values = file.f32_values(name)?;
        let matrix = Nvfp4Matrix::quantize_weight(&values, rows, cols)
            .with_context(|| format!("{}: tensor `{name}`", input.display()))?;
        out.push((
            name.to_string(),
            Dtype::U8,
            vec![rows, cols / 2],
            matrix.packed,
        ));
        out.push((
            format!("{name}_scale"),
            Dtype::F8_E4M3,
            vec![rows, cols / NVFP4_BLOCK],
            matrix.block_scales,
        ));
        out.push((
            format!("{name}_scale_2"),
            Dtype::F32,
            vec![],
            matrix.global_scale.to_le_bytes().to_vec(),
        ));
        println!("quantized {name} [{rows}, {cols}]");
    }
    if out.is_empty() {
        bail!(
            "{}: no 2-D floating-point `*.weight` tensor to quantize",
            input.display()
        );
    }
    let views = out
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, output)
        .with_context(|| format!("writing {}", output.display()))?;
    println!("wrote {}", output.display());
    Ok(())
}
