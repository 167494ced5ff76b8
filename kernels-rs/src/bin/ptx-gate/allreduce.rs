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
use std::sync::Mutex;
use std::time::Instant;

pub use kernels::allreduce::tactic::FAMILY;
use kernels::allreduce::tactic::{AllReduceTactic, KERNEL, MAX_GLOBAL_ATOMICS, REQUIRED_SASS};
use kernels::moe_gemm::Sm;
use serde_json::{Value, json};

use super::{Image, KernelReport, Toolchain, compile_image, key_count, rel};

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
    let spec = Image {
        src: &src,
        sm,
        defines: image.nvcc_defines(),
        cubin: &cubin,
        ptx: &ptx,
    };
    let mut reports = match compile_image(tc, &spec, &[]) {
        Ok(compiled) => {
            if compiled.log.contains("warning") {
                b.failures.push(format!("nvcc warnings:\n{}", compiled.log));
            }
            b.failures.extend(compiled.failures);
            compiled.kernels
        }
        Err(failure) => {
            b.failures.push(failure);
            return b;
        }
    };
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
        if key_count(k, required) == 0 {
            b.failures.push(format!("no {required} in the SASS"));
        }
    }
    let atomics = key_count(k, "ATOMG") + key_count(k, "ATOM.");
    if atomics > MAX_GLOBAL_ATOMICS || key_count(k, "RED") > 0 {
        b.failures.push(format!(
            "{atomics} global atomics (+{} RED): at most {MAX_GLOBAL_ATOMICS}, on the local control block",
            key_count(k, "RED")
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
            key_count(k, REQUIRED_SASS[0]),
            key_count(k, REQUIRED_SASS[1]),
            key_count(k, "ATOMG"),
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
    let sass: BTreeMap<&str, u32> = counted.iter().map(|&op| (op, key_count(k, op))).collect();
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
