//! ModelOpt's quantization description of a checkpoint, as `hf_quant_config.json` or the
//! `quantization_config` inside `config.json` gives it: how the routed experts are stored,
//! which modules stay unquantized, and the KV-cache format the checkpoint asks for.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuantAlgo {
    /// ModelOpt NVFP4 (W4A4): E2M1 weights, E4M3 per-16 scales, FP32 global scales.
    Nvfp4,
}

/// The KV-cache quantization a checkpoint asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvCacheQuant {
    Fp8,
}

/// As `hf_quant_config.json` spells it.
impl std::fmt::Display for QuantAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Nvfp4 => "NVFP4",
        })
    }
}

/// As `--kv-dtype` spells it.
impl std::fmt::Display for KvCacheQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Fp8 => "fp8",
        })
    }
}

/// ModelOpt's quantization description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuantConfig {
    pub quant_algo: QuantAlgo,
    pub group_size: usize,
    pub exclude_modules: Vec<String>,
    pub kv_cache_quant_algo: Option<KvCacheQuant>,
    pub producer: Option<String>,
}

impl QuantConfig {
    /// Whether `module` (a dotted name without `.weight`) is excluded from quantization by one
    /// of the `exclude_modules` globs.
    pub fn is_excluded(&self, module: &str) -> bool {
        self.exclude_modules
            .iter()
            .any(|pattern| glob_match(pattern, module))
    }
}

/// Shell-style glob with `*` (any run, dots included, as ModelOpt's fnmatch) and `?`.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0usize, 0usize, None::<usize>, 0usize);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// `q` (ModelOpt's `quantization` object, or an embedded `quantization_config`) read,
/// with who produced it; the error names the value refused.
pub fn parse_quant(q: &Value, producer: Option<String>) -> Result<QuantConfig, String> {
    if let Some(method) = q.get("quant_method").and_then(Value::as_str)
        && method != "modelopt"
    {
        return Err(format!(
            "quant_method `{method}` is not supported (only ModelOpt NVFP4)"
        ));
    }
    let algo = q
        .get("quant_algo")
        .and_then(Value::as_str)
        .ok_or("missing `quant_algo`")?;
    let quant_algo = match algo {
        "NVFP4" => QuantAlgo::Nvfp4,
        other => {
            return Err(format!(
                "quant_algo `{other}` is not supported (only NVFP4)"
            ));
        }
    };
    let group_size = q.get("group_size").and_then(Value::as_u64).unwrap_or(16) as usize;
    if group_size != kernels::formats::NVFP4_BLOCK {
        return Err(format!(
            "group_size {group_size} is not supported (NVFP4 uses 16)"
        ));
    }
    let kv_cache_quant_algo = match q.get("kv_cache_quant_algo") {
        // config.json's embedded form describes the cache as a scheme instead of an algorithm.
        None | Some(Value::Null) => match q.get("kv_cache_scheme") {
            None | Some(Value::Null) => None,
            Some(scheme) => {
                let bits = scheme.get("num_bits").and_then(Value::as_u64);
                let kind = scheme.get("type").and_then(Value::as_str);
                if bits == Some(8) && kind == Some("float") {
                    Some(KvCacheQuant::Fp8)
                } else {
                    return Err(format!(
                        "kv_cache_scheme {scheme} is not supported (only 8-bit float)"
                    ));
                }
            }
        },
        Some(Value::String(s)) if s == "FP8" => Some(KvCacheQuant::Fp8),
        Some(other) => {
            return Err(format!(
                "kv_cache_quant_algo {other} is not supported (only FP8 or null)"
            ));
        }
    };
    let exclude_modules = q
        .get("exclude_modules")
        .or_else(|| q.get("ignore"))
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    Ok(QuantConfig {
        quant_algo,
        group_size,
        exclude_modules,
        kv_cache_quant_algo,
        producer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_fnmatch() {
        assert!(glob_match("*attn*", "model.layers.0.attn.out"));
        assert!(glob_match("head", "head"));
        assert!(!glob_match("head", "prefix.head"));
        assert!(glob_match("*.mlp.gate", "a.mlp.gate"));
        assert!(!glob_match("*.mlp.gate", "a.mlp.gate_up"));
        assert!(glob_match("layers.?.x", "layers.3.x"));
    }
}
