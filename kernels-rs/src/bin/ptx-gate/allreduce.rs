//! The all-reduce family of the compile gate: one image per (algorithm, dtype, threads) of
//! `AllReduceTactic::images`, for sm_90a and sm_120a. Kept in its own file so that other
//! families can be added to `ptx-gate.rs` without touching this one.
//!
//! Checks per image: no spills, static shared memory within the SM's limit, the system-scope
//! acquire load and release store in the SASS (`tactic::REQUIRED_SASS`), and at most
//! `MAX_GLOBAL_ATOMICS` global atomics (the control block's done counter) and no `RED`: an
//! atomic anywhere else could land on peer memory, which PCIe does not support.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

pub use kernels::allreduce::tactic::FAMILY;
use kernels::allreduce::tactic::{AllReduceTactic, KERNEL, MAX_GLOBAL_ATOMICS, REQUIRED_SASS};
use kernels::moe_gemm::Sm;
use serde_json::{Value, json};

use super::{KernelReport, Toolchain, count_sass, parse_ptxas, rel};

pub const SOURCE: &str = "kernels-rs/src/allreduce/allreduce.cu";

pub struct ArBuild {
    pub image: AllReduceTactic,
    pub sm: Sm,
    pub kernel: KernelReport,
    pub cubin: String,
    pub ptx: String,
    pub compile_s: f64,
    pub failures: Vec<String>,
}

/// Count of SASS instructions whose full mnemonic starts with `prefix`.
fn sass_count(k: &KernelReport, prefix: &str) -> u32 {
    k.sass
        .iter()
        .filter(|(op, _)| {
            op.strip_prefix("op:")
                .is_some_and(|o| o.starts_with(prefix))
        })
        .map(|(_, n)| n)
        .sum()
}

fn build(tc: &Toolchain, root: &Path, out: &Path, image: AllReduceTactic, sm: Sm) -> ArBuild {
    let start = Instant::now();
    let src = root.join(SOURCE);
    let dir = out.join(FAMILY).join(sm.arch());
    std::fs::create_dir_all(&dir).expect("create output dir");
    let cubin = dir.join(format!("{}.cubin", image.image_id()));
    let ptx = dir.join(format!("{}.ptx", image.image_id()));
    let mut b = ArBuild {
        image,
        sm,
        kernel: KernelReport::default(),
        cubin: rel(root, &cubin),
        ptx: rel(root, &ptx),
        compile_s: 0.0,
        failures: Vec::new(),
    };
    let common = |c: &mut Command| {
        c.arg(format!("-arch={}", sm.arch()))
            .args(["-std=c++17", "-O3", "-lineinfo"])
            .args(image.nvcc_defines())
            .arg(&src);
    };
    let mut c = Command::new(&tc.nvcc);
    c.args(["-cubin", "-Xptxas", "-v", "-o"]).arg(&cubin);
    common(&mut c);
    let log = match c.output() {
        Ok(r) if r.status.success() => String::from_utf8_lossy(&r.stderr).to_string(),
        Ok(r) => {
            b.failures.push(format!(
                "nvcc -cubin failed:\n{}",
                String::from_utf8_lossy(&r.stderr)
            ));
            return b;
        }
        Err(e) => {
            b.failures.push(format!("nvcc did not run: {e}"));
            return b;
        }
    };
    if log.contains("warning") {
        b.failures.push(format!("nvcc warnings:\n{log}"));
    }
    let mut reports = parse_ptxas(&log);
    let mut c = Command::new(&tc.nvcc);
    c.args(["-ptx", "-o"]).arg(&ptx);
    common(&mut c);
    match c.output() {
        Ok(r) if r.status.success() => {}
        Ok(r) => b.failures.push(format!(
            "nvcc -ptx failed: {}",
            String::from_utf8_lossy(&r.stderr)
        )),
        Err(e) => b.failures.push(format!("nvcc -ptx did not run: {e}")),
    }
    match Command::new(&tc.cuobjdump)
        .arg("-sass")
        .arg(&cubin)
        .output()
    {
        Ok(r) if r.status.success() => {
            count_sass(&String::from_utf8_lossy(&r.stdout), &[], &mut reports)
        }
        _ => b.failures.push("cuobjdump -sass failed".into()),
    }
    b.compile_s = start.elapsed().as_secs_f64();
    match reports.remove(KERNEL) {
        Some(k) => b.kernel = k,
        None => b.failures.push(format!("{KERNEL}: missing from the cubin")),
    }
    let k = &b.kernel;
    if k.spill_stores > 0 || k.spill_loads > 0 {
        b.failures.push(format!(
            "spills ({} B stores, {} B loads)",
            k.spill_stores, k.spill_loads
        ));
    }
    if k.static_smem as usize > sm.smem_optin_per_block() {
        b.failures
            .push(format!("{} B static shared memory", k.static_smem));
    }
    for required in REQUIRED_SASS {
        if sass_count(k, required) == 0 {
            b.failures.push(format!("no {required} in the SASS"));
        }
    }
    let atomics = sass_count(k, "ATOMG") + sass_count(k, "ATOM.");
    if atomics > MAX_GLOBAL_ATOMICS || sass_count(k, "RED") > 0 {
        b.failures.push(format!(
            "{atomics} global atomics (+{} RED): at most {MAX_GLOBAL_ATOMICS}, on the local control block",
            sass_count(k, "RED")
        ));
    }
    b
}

/// Builds every all-reduce image for every SM on `jobs` threads.
pub fn run(tc: &Toolchain, root: &Path, out: &Path, jobs: usize) -> Vec<ArBuild> {
    let work: Vec<(AllReduceTactic, Sm)> = Sm::ALL
        .into_iter()
        .flat_map(|sm| AllReduceTactic::images().into_iter().map(move |t| (t, sm)))
        .collect();
    eprintln!("ptx-gate: {FAMILY}: {} builds", work.len());
    let queue = Mutex::new(work.into_iter().enumerate().collect::<Vec<_>>());
    let results = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| {
                loop {
                    let Some((i, (t, sm))) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    let b = build(tc, root, out, t, sm);
                    results.lock().unwrap().push((i, b));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, b)| b).collect()
}

pub fn print_table(builds: &[ArBuild]) {
    if builds.is_empty() {
        return;
    }
    println!(
        "{:<36} {:<8} {:>5} {:>5} {:>6} {:>6} {:>7} {:>7} {:>6}  {:<6} {:>5}",
        "allreduce image",
        "sm",
        "regs",
        "smem",
        "spill",
        "stack",
        "ldg.sys",
        "stg.sys",
        "atomg",
        "status",
        "secs"
    );
    for b in builds {
        let k = &b.kernel;
        println!(
            "{:<36} {:<8} {:>5} {:>5} {:>6} {:>6} {:>7} {:>7} {:>6}  {:<6} {:>5.1}",
            b.image.image_id(),
            b.sm.arch(),
            k.regs,
            k.static_smem,
            k.spill_stores + k.spill_loads,
            k.stack,
            sass_count(k, REQUIRED_SASS[0]),
            sass_count(k, REQUIRED_SASS[1]),
            sass_count(k, "ATOMG"),
            if b.failures.is_empty() { "ok" } else { "FAIL" },
            b.compile_s
        );
    }
    for b in builds {
        for f in &b.failures {
            eprintln!("FAIL {} {}: {f}", b.image.image_id(), b.sm.arch());
        }
    }
}

pub fn manifest_entry(b: &ArBuild) -> Value {
    let k = &b.kernel;
    let counted = [
        REQUIRED_SASS[0],
        REQUIRED_SASS[1],
        "MEMBAR.ALL.SYS",
        "ATOMG",
        "LDG.E.128",
        "STG.E.128",
    ];
    let sass: BTreeMap<&str, u32> = counted.iter().map(|&op| (op, sass_count(k, op))).collect();
    json!({
        "family": FAMILY,
        "tactic": b.image.image_id(),
        "sm": b.sm.arch(),
        "variant": b.image.algorithm.id(),
        "dtype": b.image.dtype.id(),
        "threads": b.image.threads,
        "smem_limit_bytes": b.sm.smem_optin_per_block(),
        "required_sass": REQUIRED_SASS,
        "cubin": b.cubin,
        "ptx": b.ptx,
        "kernels": {
            KERNEL: {
                "registers": k.regs,
                "stack_bytes": k.stack,
                "spill_store_bytes": k.spill_stores,
                "spill_load_bytes": k.spill_loads,
                "static_smem_bytes": k.static_smem,
                "dynamic_smem_bytes": 0,
                "sass_counts": sass,
            }
        },
        "ok": b.failures.is_empty(),
    })
}
