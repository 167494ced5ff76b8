//! The routed-expert block (NVFP4 W4A4 grouped GEMM) against PyTorch + ModelOpt, on the
//! goldens written by `golden/gen_moe.py`: the CPU reference and the fast CPU path (every
//! instruction set this CPU has, with both dot kinds: f32 FMAs and the integer W4A4 block dots,
//! the default).
//!
//! The files and how they are read: `project_tests::moe_goldens`.
//!
//! Tolerance: relative L2 ≤ 1e-5 over each case's output, and max abs ≤ 1e-5 · max |golden|
//! (torch sums float32 products in another order; with the same quantized operands that is a
//! few ulps). A larger error means different quantized values, i.e. different semantics.

use kernels::cpu_tactic::{CpuTactic, MoeDot};
use kernels::isa::Isa;
use kernels::moe_gemm::cpu::{moe_cpu_tuned, moe_cpu_with};
use kernels::moe_gemm::reference::moe_reference;
use model::checkpoint::tensor_file::TensorFile;
use project_tests::golden_path;
use project_tests::moe_goldens::{
    Case, WeightSource, distance, hashed_source, load_case, load_file,
};
use safetensors::tensor::TensorView;

const REL_L2: f64 = 1e-5;
const MAX_ABS_REL: f64 = 1e-5;

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
            // The default tactic (what the model runs), then each dot kind explicitly.
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
            check(case, &format!("fast {isa:?} default"), &out);
            for moe_dot in MoeDot::ALL {
                let tactic = CpuTactic {
                    moe_dot,
                    ..CpuTactic::DEFAULT
                };
                out.fill(f32::NAN);
                moe_cpu_tuned(
                    &tactic,
                    isa,
                    &case.x,
                    case.hidden,
                    &case.routing,
                    &experts,
                    &mut out,
                    None,
                );
                check(case, &format!("fast {isa:?} {}", moe_dot.name()), &out);
            }
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
    let cases = load_file("moe/kimi.safetensors", hashed_source);
    assert!(
        cases
            .iter()
            .any(|c| c.hidden == 7168 && c.experts[0].mats[0].rows == 256)
    );
    assert!(cases.iter().any(|c| c.experts[0].mats[0].rows == 2048));
    run_all(&cases);
}

#[test]
fn kernel_tile_cases_match_modelopt_and_torch() {
    let cases = load_file("moe/kernel_tiles.safetensors", hashed_source);
    // What the file is for: an expert with more tokens than the largest token tile (32).
    let most = cases[0].routing.experts.iter().filter(|&&e| e == 0).count();
    assert!(most > 32, "{most} tokens on expert 0");
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
    let e = load_edited("moe/kimi.safetensors", kimi, hashed_source(kimi), |t| {
        set(
            t,
            &format!("{kimi}.experts.0.down_proj.weight_checksum"),
            |t| t.3[0] ^= 1,
        )
    });
    assert!(e.contains("checksums"), "{e}");
}
