//! What the subcommands' arguments share: the latent cache's dtype as the command line names
//! it, and the parsers of numbers clap checks.

use kernels::mla::cache::KvCacheDtype;

use crate::arch::config::KvCacheQuant;
use crate::checkpoint::Checkpoint;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum KvDtypeArg {
    /// What the checkpoint asks for (`kv_cache_quant_algo`), else BF16.
    Auto,
    /// Full precision (a reference, not a deployment choice).
    F32,
    /// Half the bytes of F32; what deployments without an FP8 cache use.
    Bf16,
    /// FP8 E4M3 with per-token scales: half the bytes of BF16 (vLLM's `fp8`).
    Fp8,
}

/// `n` and the noun, in the plural unless `n` is 1: `1 token`, `3 tokens`.
pub fn counted(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

pub fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number >= 1".into()),
    }
}

pub fn positive_finite(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err("expected a positive finite number".into()),
    }
}

pub fn non_negative_finite(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err("expected a finite number >= 0".into()),
    }
}

/// A sampling temperature as the sampler holds it (f32): finite and >= 0, 0 = greedy.
pub fn temperature(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err("expected a finite number >= 0 (0 = greedy)".into()),
    }
}

/// A nucleus mass as the sampler holds it (f32): a value that rounds to 0 there (1e-46) would
/// leave an empty nucleus.
pub fn top_p(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(p) if p.is_normal() && p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err("expected a number in (0, 1] that float32 holds (1 = no nucleus cut)".into()),
    }
}

pub fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err("expected a number in (0, 1]".into()),
    }
}

pub fn resolve_kv_dtype(arg: KvDtypeArg, checkpoint: &Checkpoint) -> KvCacheDtype {
    let asked = checkpoint
        .config
        .quant
        .as_ref()
        .and_then(|q| q.kv_cache_quant_algo);
    kv_dtype_for(arg, asked)
}

/// The cache dtype `arg` means: `Auto` follows the checkpoint's `kv_cache_quant_algo`
/// (`asked`), else BF16. Memory estimates made before the weights are loaded pass `None`,
/// which errs on the larger BF16 side.
pub fn kv_dtype_for(arg: KvDtypeArg, asked: Option<KvCacheQuant>) -> KvCacheDtype {
    match arg {
        KvDtypeArg::F32 => KvCacheDtype::F32,
        KvDtypeArg::Bf16 => KvCacheDtype::Bf16,
        KvDtypeArg::Fp8 => KvCacheDtype::Fp8E4m3,
        KvDtypeArg::Auto => match asked {
            Some(KvCacheQuant::Fp8) => KvCacheDtype::Fp8E4m3,
            None => KvCacheDtype::Bf16,
        },
    }
}
