//! The MoE goldens of `golden/gen_moe.py` (PyTorch + ModelOpt), loaded and validated: shared
//! by the CPU tests (`tests/moe_golden.rs`) and the host-executed CUDA kernels
//! (`tests/host_moe.rs`).
//!
//! `small.safetensors` stores small cases in full. `kimi.safetensors` (hidden 7168,
//! intermediate 256 = 2048/TP8 and 2048) and `kernel_tiles.safetensors` (a shape every CUDA
//! tactic takes, with several token tiles per expert) store no weights: both sides derive
//! weights and inputs from the same closed-form integer hash, exact in bf16; our NVFP4
//! quantization of them must reproduce ModelOpt's `weight_scale_2` bit for bit and its packed
//! codes and block scales up to a checksum stored in the file.

use half::bf16;
use kernels::formats::nvfp4::Nvfp4Matrix;
use kernels::matrix::MatrixView;
use kernels::moe_gemm::check;
use kernels::moe_gemm::golden_data::{self, checksum};
use kernels::moe_gemm::launch::{ExpertWeights, MoeWeightsHost};
use kernels::moe_gemm::reference::{ExpertView, Routing};
use model::checkpoint::nvfp4_file::read_nvfp4;
use model::checkpoint::tensor_file::TensorFile;

use crate::golden_path;

const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

pub struct Expert {
    /// gate, up, down
    pub mats: [Nvfp4Matrix; 3],
    pub gate_up_input_scale: f32,
    pub down_input_scale: f32,
}

pub struct Case {
    pub name: String,
    pub hidden: usize,
    pub x: Vec<f32>,
    pub routing: Routing,
    pub experts: Vec<Expert>,
    pub out: Vec<f32>,
}

impl Case {
    pub fn views(&self) -> Vec<ExpertView<'_>> {
        self.experts
            .iter()
            .map(|e| ExpertView {
                gate: MatrixView::Nvfp4(e.mats[0].view()),
                up: MatrixView::Nvfp4(e.mats[1].view()),
                down: MatrixView::Nvfp4(e.mats[2].view()),
                gate_up_input_scale: Some(e.gate_up_input_scale),
                down_input_scale: Some(e.down_input_scale),
            })
            .collect()
    }
}

/// Where a case's expert weights come from.
pub enum WeightSource {
    /// Stored in the file (ModelOpt's bytes).
    Stored,
    /// Recomputed from the hash, checked against the stored checksums and `weight_scale_2`.
    Hashed { stream: u32 },
}

pub fn case_names(file: &TensorFile) -> Vec<String> {
    file.names()
        .filter_map(|n| n.strip_suffix(".routing"))
        .map(str::to_string)
        .collect()
}

/// Reads and validates one case; every inconsistency is an error naming the tensor.
pub fn load_case(file: &TensorFile, name: &str, source: WeightSource) -> Result<Case, String> {
    let err = |e: model::checkpoint::tensor_file::TensorFileError| e.to_string();
    let rinfo = file.info(&format!("{name}.routing")).map_err(err)?.clone();
    let [tokens, top_k] = rinfo.shape[..] else {
        return Err(format!(
            "{name}.routing: shape {:?} is not 2-D",
            rinfo.shape
        ));
    };
    let xinfo = file.info(&format!("{name}.x")).map_err(err)?.clone();
    let [x_tokens, hidden] = xinfo.shape[..] else {
        return Err(format!("{name}.x: shape {:?} is not 2-D", xinfo.shape));
    };
    if x_tokens != tokens {
        return Err(format!("{name}: x has {x_tokens} tokens, routing {tokens}"));
    }
    file.expect_shape(&format!("{name}.weights"), &[tokens, top_k])
        .map_err(err)?;
    file.expect_shape(&format!("{name}.out"), &[tokens, hidden])
        .map_err(err)?;
    let num_experts = (0..)
        .take_while(|e| file.contains(&format!("{name}.experts.{e}.gate_up_proj.input_scale")))
        .count();
    let ids = file.i64_values(&format!("{name}.routing")).map_err(err)?;
    let experts_ids = ids
        .iter()
        .map(|&e| {
            u32::try_from(e)
                .ok()
                .filter(|&e| (e as usize) < num_experts)
                .ok_or_else(|| format!("{name}.routing: expert {e} of {num_experts}"))
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let x = file.f32_values(&format!("{name}.x")).map_err(err)?;

    let mut experts = Vec::with_capacity(num_experts);
    for e in 0..num_experts {
        let prefix = format!("{name}.experts.{e}");
        let mats = match source {
            WeightSource::Stored => {
                let read = |p: &str| read_nvfp4(file, &format!("{prefix}.{p}.weight")).map_err(err);
                [read("gate_proj")?, read("up_proj")?, read("down_proj")?]
            }
            WeightSource::Hashed { stream } => {
                let inter = file
                    .info(&format!("{name}.experts.{e}.gate_proj.weight_checksum"))
                    .map_err(err)
                    .map(|_| ())
                    .and_then(|_| intermediate_from_name(name))?;
                hashed_expert(file, &prefix, stream, e, hidden, inter)?
            }
        };
        let inter = mats[0].rows;
        for (p, m, rows, cols) in [
            ("gate_proj", &mats[0], inter, hidden),
            ("up_proj", &mats[1], inter, hidden),
            ("down_proj", &mats[2], hidden, inter),
        ] {
            if (m.rows, m.cols) != (rows, cols) {
                return Err(format!(
                    "{prefix}.{p}: [{}, {}], expected [{rows}, {cols}]",
                    m.rows, m.cols
                ));
            }
        }
        if mats[0].global_scale.to_bits() != mats[1].global_scale.to_bits() {
            return Err(format!("{prefix}: gate and up must share weight_scale_2"));
        }
        let scale = |s: &str| file.positive_scale(&format!("{prefix}.{s}.input_scale"));
        experts.push(Expert {
            mats,
            gate_up_input_scale: scale("gate_up_proj").map_err(err)?,
            down_input_scale: scale("down_proj").map_err(err)?,
        });
    }
    Ok(Case {
        name: name.to_string(),
        hidden,
        x,
        routing: Routing {
            top_k,
            experts: experts_ids,
            weights: file.f32_values(&format!("{name}.weights")).map_err(err)?,
        },
        experts,
        out: file.f32_values(&format!("{name}.out")).map_err(err)?,
    })
}

/// `…_i256` → 256: the Kimi cases carry their intermediate size in their names, since no
/// weight tensor is stored to read it from.
fn intermediate_from_name(name: &str) -> Result<usize, String> {
    name.rsplit_once("_i")
        .and_then(|(_, i)| i.parse().ok())
        .ok_or_else(|| format!("{name}: no intermediate size in the case name"))
}

/// The hashed expert, quantized as ModelOpt's fused export does, checked against the file.
fn hashed_expert(
    file: &TensorFile,
    prefix: &str,
    stream: u32,
    e: usize,
    hidden: usize,
    inter: usize,
) -> Result<[Nvfp4Matrix; 3], String> {
    let mats = golden_data::hashed_expert(stream, e, hidden, inter)?;
    for (p, m) in PROJECTIONS.iter().zip(&mats) {
        let golden_scale = file
            .f32_scalar(&format!("{prefix}.{p}.weight_scale_2"))
            .map_err(|e| e.to_string())?;
        if golden_scale.to_bits() != m.global_scale.to_bits() {
            return Err(format!(
                "{prefix}.{p}: weight_scale_2 {} vs ModelOpt {golden_scale}",
                m.global_scale
            ));
        }
        let sums = file
            .i64_values(&format!("{prefix}.{p}.weight_checksum"))
            .map_err(|e| e.to_string())?;
        let ours = [checksum(&m.packed), checksum(&m.block_scales)];
        if sums != ours {
            return Err(format!(
                "{prefix}.{p}: checksums of packed codes and block scales {ours:?} vs ModelOpt {sums:?}"
            ));
        }
    }
    Ok(mats)
}

pub fn load_file(path: &str, source: impl Fn(&str) -> WeightSource) -> Vec<Case> {
    let file = TensorFile::open(golden_path(path)).unwrap();
    let cases: Vec<Case> = case_names(&file)
        .iter()
        .map(|name| load_case(&file, name, source(name)).unwrap())
        .collect();
    assert!(!cases.is_empty(), "{path}: no cases");
    cases
}

/// Where the weights of a case without stored weights come from (gen_moe.py's hash stream).
pub fn hashed_source(name: &str) -> WeightSource {
    WeightSource::Hashed {
        stream: golden_data::case_stream(name),
    }
}

/// Relative L2 distance and max abs difference relative to the golden's max magnitude.
pub fn distance(ours: &[f32], golden: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max_diff, mut max_val) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&a, &b) in ours.iter().zip(golden) {
        let d = (a - b) as f64;
        num += d * d;
        den += (b as f64).powi(2);
        max_diff = max_diff.max(d.abs());
        max_val = max_val.max((b as f64).abs());
    }
    ((num / den).sqrt(), max_diff / max_val)
}

/// A golden case in the kernels' layout.
pub fn kernel_case(g: &Case) -> check::Case {
    let experts: Vec<ExpertWeights> = g
        .experts
        .iter()
        .map(|e| ExpertWeights {
            gate: e.mats[0].view(),
            up: e.mats[1].view(),
            down: e.mats[2].view(),
            gate_up_input_scale: e.gate_up_input_scale,
            down_input_scale: e.down_input_scale,
        })
        .collect();
    let x_bf16: Vec<u16> =
        g.x.iter()
            .map(|&v| {
                let b = bf16::from_f32(v);
                assert_eq!(b.to_f32(), v, "{}: x must be exact in BF16", g.name);
                b.to_bits()
            })
            .collect();
    check::Case {
        name: g.name.clone(),
        hidden: g.hidden,
        inter: g.experts[0].mats[0].rows,
        weights: MoeWeightsHost::from_experts(&experts).unwrap(),
        routing: g.routing.clone(),
        x_bf16,
        reference: g.out.clone(),
    }
}

/// The goldens every CUDA tactic takes: `kernel_tiles` (several token tiles per expert) and
/// Kimi's TP8 shapes, in the kernels' layout (`tests/host_moe.rs`, `autotune`'s correct stage).
pub fn kernel_golden_cases() -> Vec<check::Case> {
    let mut cases: Vec<check::Case> = load_file("moe/kernel_tiles.safetensors", hashed_source)
        .iter()
        .map(kernel_case)
        .collect();
    cases.extend(
        load_file("moe/kimi.safetensors", hashed_source)
            .iter()
            .filter(|c| c.name.contains("tp8"))
            .map(kernel_case),
    );
    cases
}
