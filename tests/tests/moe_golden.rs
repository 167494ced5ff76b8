//! The routed-expert block (NVFP4 W4A4 grouped GEMM) against PyTorch + ModelOpt, on the
//! goldens written by `golden/gen_moe.py`: the CPU reference and the fast CPU path (every
//! instruction set this CPU has).
//!
//! `small.safetensors` stores small cases in full. `kimi.safetensors` stores Kimi-shaped cases
//! (hidden 7168, intermediate 256 = 2048/TP8 and 2048) without their weights: both sides derive
//! weights and inputs from the same closed-form integer hash, exact in bf16; our NVFP4
//! quantization of them must reproduce ModelOpt's `weight_scale_2` bit for bit and its packed
//! codes and block scales up to a checksum stored in the file.
//!
//! Tolerance: relative L2 ≤ 1e-5 over each case's output, and max abs ≤ 1e-5 · max |golden|
//! (torch sums float32 products in another order; with the same quantized operands that is a
//! few ulps). A larger error means different quantized values, i.e. different semantics.

use kernels::formats::nvfp4::{Nvfp4Matrix, amax, global_scale_for_amax};
use kernels::matrix::MatrixView;
use kernels::moe_gemm::cpu::moe_cpu_with;
use kernels::moe_gemm::cpu_simd::Isa;
use kernels::moe_gemm::golden_data::{checksum, hashed_values};
use kernels::moe_gemm::reference::{ExpertView, Routing, moe_reference};
use model::nvfp4_file::read_nvfp4;
use model::tensor_file::TensorFile;
use project_tests::golden_path;
use safetensors::tensor::TensorView;

const REL_L2: f64 = 1e-5;
const MAX_ABS_REL: f64 = 1e-5;
const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

struct Expert {
    /// gate, up, down
    mats: [Nvfp4Matrix; 3],
    gate_up_input_scale: f32,
    down_input_scale: f32,
}

struct Case {
    name: String,
    hidden: usize,
    x: Vec<f32>,
    routing: Routing,
    experts: Vec<Expert>,
    out: Vec<f32>,
}

impl Case {
    fn views(&self) -> Vec<ExpertView<'_>> {
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
enum WeightSource {
    /// Stored in the file (ModelOpt's bytes).
    Stored,
    /// Recomputed from the hash, checked against the stored checksums and `weight_scale_2`.
    Hashed { stream: u32 },
}

fn case_names(file: &TensorFile) -> Vec<String> {
    file.names()
        .filter_map(|n| n.strip_suffix(".routing"))
        .map(str::to_string)
        .collect()
}

/// Reads and validates one case; every inconsistency is an error naming the tensor.
fn load_case(file: &TensorFile, name: &str, source: WeightSource) -> Result<Case, String> {
    let err = |e: model::tensor_file::TensorFileError| e.to_string();
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

/// Quantizes the hashed expert as ModelOpt's fused export does (gate and up share
/// `weight_scale_2`) and checks the result against the file.
fn hashed_expert(
    file: &TensorFile,
    prefix: &str,
    stream: u32,
    e: usize,
    hidden: usize,
    inter: usize,
) -> Result<[Nvfp4Matrix; 3], String> {
    let base = stream + 1000 * (e as u32 + 1);
    let gate = hashed_values(inter * hidden, base + 1, 12);
    let up = hashed_values(inter * hidden, base + 2, 12);
    let down = hashed_values(hidden * inter, base + 3, 10);
    let shared = global_scale_for_amax(amax(&gate).max(amax(&up)));
    let q = |v: &[f32], r, c, g| {
        Nvfp4Matrix::quantize_with_global_scale(v, r, c, g).map_err(|e| e.to_string())
    };
    let down_global = global_scale_for_amax(amax(&down));
    let mats = [
        q(&gate, inter, hidden, shared)?,
        q(&up, inter, hidden, shared)?,
        q(&down, hidden, inter, down_global)?,
    ];
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

fn load_file(path: &str, source: impl Fn(&str) -> WeightSource) -> Vec<Case> {
    let file = TensorFile::open(golden_path(path)).unwrap();
    let cases: Vec<Case> = case_names(&file)
        .iter()
        .map(|name| load_case(&file, name, source(name)).unwrap())
        .collect();
    assert!(!cases.is_empty(), "{path}: no cases");
    cases
}

fn kimi_stream(name: &str) -> WeightSource {
    // gen_moe.py's stream of each case.
    WeightSource::Hashed {
        stream: if name.ends_with("_i2048") { 100_000 } else { 0 },
    }
}

/// Relative L2 distance and max abs difference relative to the golden's max magnitude.
fn distance(ours: &[f32], golden: &[f32]) -> (f64, f64) {
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

fn check(case: &Case, what: &str, ours: &[f32]) {
    assert!(
        ours.iter().all(|v| v.is_finite()),
        "{}: {what}: non-finite",
        case.name
    );
    let (rel, max) = distance(ours, &case.out);
    println!(
        "{}: {what}: rel L2 {rel:.2e}, max abs / max {max:.2e}",
        case.name
    );
    assert!(
        rel <= REL_L2 && max <= MAX_ABS_REL,
        "{}: {what}: rel L2 {rel:e}, max abs / max {max:e}",
        case.name
    );
}

fn run_all(cases: &[Case]) {
    for case in cases {
        let experts = case.views();
        let tokens = case.routing.tokens();
        let mut out = vec![0.0f32; tokens * case.hidden];
        moe_reference(
            &case.x,
            case.hidden,
            &case.routing,
            &experts,
            &mut out,
            None,
        );
        check(case, "reference", &out);
        for isa in Isa::all_supported() {
            out.fill(f32::NAN);
            moe_cpu_with(
                isa,
                &case.x,
                case.hidden,
                &case.routing,
                &experts,
                &mut out,
                None,
            );
            check(case, &format!("fast {isa:?}"), &out);
        }
    }
}

#[test]
fn small_cases_match_modelopt_and_torch() {
    let cases = load_file("moe/small.safetensors", |_| WeightSource::Stored);
    assert!(cases.len() >= 5, "{} cases", cases.len());
    // The goldens themselves must cover what they claim: an empty expert, an expert with more
    // tokens than a kernel group, a TP split whose ranks sum to the whole.
    let counts = |c: &Case| {
        let mut n = vec![0; c.experts.len()];
        c.routing.experts.iter().for_each(|&e| n[e as usize] += 1);
        n
    };
    assert!(cases.iter().any(|c| counts(c).contains(&0)));
    assert!(cases.iter().any(|c| counts(c).iter().any(|&n| n > 16)));
    let find = |p: &str| cases.iter().find(|c| c.name.starts_with(p)).unwrap();
    let (whole, r0, r1) = (find("tp1_"), find("tp2_rank0"), find("tp2_rank1"));
    let sum: Vec<f32> = r0.out.iter().zip(&r1.out).map(|(a, b)| a + b).collect();
    let (rel, _) = distance(&sum, &whole.out);
    assert!(rel <= REL_L2, "TP ranks sum to the whole within {rel:e}");
    run_all(&cases);
}

#[test]
fn kimi_shaped_cases_match_modelopt_and_torch() {
    let cases = load_file("moe/kimi.safetensors", kimi_stream);
    assert!(
        cases
            .iter()
            .any(|c| c.hidden == 7168 && c.experts[0].mats[0].rows == 256)
    );
    assert!(cases.iter().any(|c| c.experts[0].mats[0].rows == 2048));
    run_all(&cases);
}

/// Rewrites `src` into a temporary file with `edit` applied to the (name, dtype, shape,
/// bytes) list, and returns the error loading `case` from it.
fn load_edited(
    src: &str,
    case: &str,
    source: WeightSource,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> String {
    let file = TensorFile::open(golden_path(src)).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = file
        .names()
        .map(|n| {
            let info = file.info(n).unwrap();
            let bytes = file.bytes(n, &[info.dtype]).unwrap().to_vec();
            (n.to_string(), info.dtype, info.shape.clone(), bytes)
        })
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edited.safetensors");
    safetensors::tensor::serialize_to_file(views, None, &path).unwrap();
    let edited = TensorFile::open(&path).unwrap();
    match load_case(&edited, case, source) {
        Ok(_) => panic!("{case}: the edited file loaded"),
        Err(e) => e,
    }
}

fn set(
    tensors: &mut [(String, safetensors::Dtype, Vec<usize>, Vec<u8>)],
    name: &str,
    f: impl FnOnce(&mut (String, safetensors::Dtype, Vec<usize>, Vec<u8>)),
) {
    f(tensors.iter_mut().find(|t| t.0 == name).unwrap());
}

#[test]
fn malformed_golden_files_are_errors_not_panics() {
    let small = "moe/small.safetensors";
    let case = "decode_h64_i32";
    // An expert id past the last expert.
    let e = load_edited(small, case, WeightSource::Stored, |t| {
        set(t, &format!("{case}.routing"), |t| {
            t.3[..8].copy_from_slice(&99i64.to_le_bytes())
        })
    });
    assert!(e.contains("expert 99"), "{e}");
    // Block scales of the wrong shape.
    let e = load_edited(small, case, WeightSource::Stored, |t| {
        set(t, &format!("{case}.experts.1.up_proj.weight_scale"), |t| {
            t.2 = vec![t.2[0] / 2, t.2[1] * 2]
        })
    });
    assert!(e.contains("weight_scale"), "{e}");
    // A missing output.
    let e = load_edited(small, case, WeightSource::Stored, |t| {
        t.retain(|t| t.0 != format!("{case}.out"))
    });
    assert!(e.contains("out") && e.contains("missing"), "{e}");
    // A non-positive input scale.
    let e = load_edited(small, case, WeightSource::Stored, |t| {
        set(t, &format!("{case}.experts.0.down_proj.input_scale"), |t| {
            t.3 = (-1.0f32).to_le_bytes().to_vec()
        })
    });
    assert!(e.contains("input_scale"), "{e}");
    // Gate and up with different weight_scale_2 (not a fused export).
    let e = load_edited(small, case, WeightSource::Stored, |t| {
        set(
            t,
            &format!("{case}.experts.0.up_proj.weight_scale_2"),
            |t| t.3 = 0.5f32.to_le_bytes().to_vec(),
        )
    });
    assert!(e.contains("share weight_scale_2"), "{e}");
    // A checksum that our quantization does not reproduce.
    let kimi = "kimi_tp8_h7168_i256";
    let e = load_edited("moe/kimi.safetensors", kimi, kimi_stream(kimi), |t| {
        set(
            t,
            &format!("{kimi}.experts.0.down_proj.weight_checksum"),
            |t| t.3[0] ^= 1,
        )
    });
    assert!(e.contains("checksums"), "{e}");
}
