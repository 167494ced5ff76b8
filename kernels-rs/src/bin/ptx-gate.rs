//! Compile gate for the kernel families: builds every (tactic, SM) of
//! `MoeGemmTactic::enumerate` (NVFP4 MoE GEMM) and `MlaTactic::enumerate` (MLA decode) with the
//! pinned toolchain (`scripts/cuda-toolchain.sh`), reads ptxas's resource report and the SASS,
//! writes `ptx/manifest.json` and the cubins/PTX under `ptx/<family>/`, prints a table, and
//! exits non-zero if any kernel spills, exceeds its SM's shared memory, or lacks the
//! instructions its variant exists for.
//!
//! The all-reduce family (`allreduce`, one image per algorithm × dtype × threads) is built by
//! its own module, `ptx-gate/allreduce.rs`.
//!
//! Usage: `cargo run --release -p kernels --bin ptx-gate -- [--out DIR] [--jobs N] [--check]
//! [--family moe_gemm|mla|allreduce]...` (`--family` restricts the build; other families' manifest entries
//! are kept as they are).
//! `--check` additionally fails if the committed manifest differs from the one just built,
//! so a change to the kernel or the tactic space cannot land without its new numbers.

#[path = "ptx-gate/allreduce.rs"]
mod allreduce;

use kernels::mla::MlaTactic;
use kernels::moe_gemm::{MoeGemmTactic, Sm};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Mutex;
use std::time::Instant;

const FAMILIES: [&str; 3] = ["moe_gemm", "mla", allreduce::FAMILY];
/// SASS mnemonics counted for every kernel of a family (the manifest records them all; the
/// gate checks the variant's required ones).
const MOE_COUNTED: [&str; 6] = ["OMMA", "HMMA", "SHFL", "LDGSTS", "LDS", "RED"];
const MLA_COUNTED: [&str; 8] = [
    "HMMA", "QMMA", "HMUL2", "LDSM", "LDGSTS", "F2FP", "MUFU", "SHFL",
];

/// One (tactic, SM) build of one family.
#[derive(Clone, Copy, Debug)]
enum Job {
    Moe(MoeGemmTactic, Sm),
    Mla(MlaTactic, Sm),
}

impl Job {
    fn family(&self) -> &'static str {
        match self {
            Job::Moe(..) => "moe_gemm",
            Job::Mla(..) => "mla",
        }
    }

    fn sm(&self) -> Sm {
        match self {
            Job::Moe(_, sm) | Job::Mla(_, sm) => *sm,
        }
    }

    fn id(&self) -> String {
        match self {
            Job::Moe(t, _) => t.id(),
            Job::Mla(t, _) => t.id(),
        }
    }

    fn source(&self) -> &'static str {
        source_of(self.family())
    }

    fn defines(&self) -> Vec<String> {
        match self {
            Job::Moe(t, _) => t.nvcc_defines(),
            Job::Mla(t, _) => t.nvcc_defines(),
        }
    }

    fn kernels(&self) -> &'static [&'static str] {
        match self {
            Job::Moe(..) => &["moe_gate_up", "moe_down"],
            Job::Mla(..) => &["mla_decode", "mla_combine", "mla_append"],
        }
    }

    fn counted(&self) -> &'static [&'static str] {
        match self {
            Job::Moe(..) => &MOE_COUNTED,
            Job::Mla(..) => &MLA_COUNTED,
        }
    }

    /// Dynamic shared memory the launcher requests for `kernel`.
    fn dynamic_smem(&self, kernel: &str) -> usize {
        match self {
            Job::Moe(t, _) if kernel == "moe_gate_up" => t.smem().gate_up,
            Job::Moe(t, _) => t.smem().down,
            Job::Mla(t, _) if kernel == "mla_decode" => t.smem().total,
            // Combine and append use only their small static arrays.
            Job::Mla(..) => 0,
        }
    }

    /// SASS mnemonic prefixes `kernel` must contain.
    fn required(&self, kernel: &str) -> Vec<&'static str> {
        match self {
            Job::Moe(t, _) => vec![t.variant.required_sass()],
            Job::Mla(t, sm) if kernel == "mla_decode" => t.kind.required_sass(*sm),
            Job::Mla(..) => Vec::new(),
        }
    }
}

fn source_of(family: &str) -> &'static str {
    match family {
        "moe_gemm" => "kernels-rs/src/moe_gemm/moe_gemm.cu",
        allreduce::FAMILY => allreduce::SOURCE,
        _ => "kernels-rs/src/mla/mla_decode.cu",
    }
}

/// The header every kernel source includes for its inline PTX (`ptx_helpers.cuh`).
const SHARED_INCLUDE: &str = "kernels-rs/include";
const PTX_HELPERS: &str = "kernels-rs/include/ptx_helpers.cuh";

struct Toolchain {
    nvcc: PathBuf,
    cuobjdump: PathBuf,
    version: String,
    /// `-I` for the shared headers of the kernel sources.
    include: PathBuf,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("kernels-rs sits in the workspace root")
        .to_path_buf()
}

fn find_toolchain(root: &Path) -> Result<Toolchain, String> {
    let bin = std::env::var_os("CUDA_TOOLCHAIN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".cuda-toolchain/site/nvidia/cu13/bin"));
    let nvcc = bin.join("nvcc");
    let cuobjdump = bin.join("cuobjdump");
    if !nvcc.exists() || !cuobjdump.exists() {
        return Err(format!(
            "no nvcc/cuobjdump in {} — run scripts/cuda-toolchain.sh first",
            bin.display()
        ));
    }
    let out = Command::new(&nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("{}: {e}", nvcc.display()))?;
    let version = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains("release"))
        .unwrap_or("unknown")
        .trim()
        .to_string();
    Ok(Toolchain {
        nvcc,
        cuobjdump,
        version,
        include: root.join(SHARED_INCLUDE),
    })
}

#[derive(Default, Clone, Debug)]
struct KernelReport {
    regs: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    static_smem: u32,
    sass: BTreeMap<String, u32>,
}

struct Build {
    job: Job,
    kernels: BTreeMap<String, KernelReport>,
    cubin: String,
    ptx: String,
    compile_s: f64,
    failures: Vec<String>,
}

fn number_before(line: &str, suffix: &str) -> Option<u32> {
    let idx = line.find(suffix)?;
    line[..idx].split_whitespace().last()?.parse().ok()
}

/// ptxas -v prints, per entry: "Compiling entry function 'X' for 'sm_..'", then
/// "N bytes stack frame, S bytes spill stores, L bytes spill loads" and
/// "Used R registers, ... [Z bytes smem]".
fn parse_ptxas(log: &str) -> BTreeMap<String, KernelReport> {
    let mut out: BTreeMap<String, KernelReport> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let Some(name) = &current else { continue };
        let r = out.get_mut(name).expect("entry inserted above");
        if line.contains("bytes stack frame") {
            r.stack = number_before(line, "bytes stack frame").unwrap_or(0);
            r.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            r.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used") && line.contains("registers") {
            r.regs = number_before(line, "registers").unwrap_or(0);
            r.static_smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// Counts instruction mnemonics per function in `cuobjdump -sass` output.
fn count_sass(sass: &str, counted: &[&str], reports: &mut BTreeMap<String, KernelReport>) {
    let mut current: Option<String> = None;
    for line in sass.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            current = Some(name.trim().to_string());
            continue;
        }
        let Some(name) = &current else { continue };
        // Instruction lines look like "/*0100*/   OMMA.SF.16864... R12, ... ;"
        let Some(code) = line.split("*/").nth(1) else {
            continue;
        };
        let mut words = code.split_whitespace();
        let Some(mut op) = words.next() else { continue };
        if op.starts_with('@') {
            op = words.next().unwrap_or("");
        }
        let report = reports.entry(name.clone()).or_default();
        let base = op.split('.').next().unwrap_or("");
        if counted.contains(&base) {
            *report.sass.entry(base.to_string()).or_default() += 1;
        }
        // The full mnemonic of the variant's key instruction is recorded too.
        *report.sass.entry(format!("op:{op}")).or_default() += 1;
    }
}

/// One image to compile: a source with its tactic's defines, for one SM.
struct Image<'a> {
    src: &'a Path,
    sm: Sm,
    defines: Vec<String>,
    cubin: &'a Path,
    ptx: &'a Path,
}

/// What compiling an image gave: per-kernel resources and SASS counts, the ptxas log, and the
/// failures of the steps after the cubin (PTX, SASS dump).
struct Compiled {
    kernels: BTreeMap<String, KernelReport>,
    log: String,
    failures: Vec<String>,
}

/// The compile step every family shares: `nvcc -cubin` with ptxas's resource report, `nvcc
/// -ptx` for the fallback, and the SASS counts from `cuobjdump -sass`. `Err` when no cubin
/// was made.
fn compile_image(tc: &Toolchain, image: &Image<'_>, counted: &[&str]) -> Result<Compiled, String> {
    let common = |c: &mut Command| {
        c.arg(format!("-arch={}", image.sm.arch()))
            .args(["-std=c++17", "-O3", "-lineinfo"])
            .arg(format!("-I{}", tc.include.display()))
            .args(&image.defines)
            .arg(image.src);
    };
    let mut c = Command::new(&tc.nvcc);
    c.args(["-cubin", "-Xptxas", "-v", "-o"]).arg(image.cubin);
    common(&mut c);
    let res = c.output().map_err(|e| format!("nvcc did not run: {e}"))?;
    let log = String::from_utf8_lossy(&res.stderr).to_string();
    if !res.status.success() {
        return Err(format!("nvcc -cubin failed:\n{log}"));
    }
    let mut compiled = Compiled {
        kernels: parse_ptxas(&log),
        log,
        failures: Vec::new(),
    };
    let mut c = Command::new(&tc.nvcc);
    c.args(["-ptx", "-o"]).arg(image.ptx);
    common(&mut c);
    match c.output() {
        Ok(r) if r.status.success() => {}
        Ok(r) => compiled.failures.push(format!(
            "nvcc -ptx failed: {}",
            String::from_utf8_lossy(&r.stderr)
        )),
        Err(e) => compiled
            .failures
            .push(format!("nvcc -ptx did not run: {e}")),
    }
    match Command::new(&tc.cuobjdump)
        .arg("-sass")
        .arg(image.cubin)
        .output()
    {
        Ok(r) if r.status.success() => count_sass(
            &String::from_utf8_lossy(&r.stdout),
            counted,
            &mut compiled.kernels,
        ),
        _ => compiled.failures.push("cuobjdump -sass failed".into()),
    }
    Ok(compiled)
}

fn build(tc: &Toolchain, root: &Path, out: &Path, job: Job) -> Build {
    let start = Instant::now();
    let sm = job.sm();
    let src = root.join(job.source());
    let dir = out.join(job.family()).join(sm.arch());
    std::fs::create_dir_all(&dir).expect("create output dir");
    let cubin = dir.join(format!("{}.cubin", job.id()));
    let ptx = dir.join(format!("{}.ptx", job.id()));
    let mut b = Build {
        job,
        kernels: BTreeMap::new(),
        cubin: rel(root, &cubin),
        ptx: rel(root, &ptx),
        compile_s: 0.0,
        failures: Vec::new(),
    };
    let image = Image {
        src: &src,
        sm,
        defines: job.defines(),
        cubin: &cubin,
        ptx: &ptx,
    };
    match compile_image(tc, &image, job.counted()) {
        Ok(compiled) => {
            b.kernels = compiled.kernels;
            b.failures.extend(compiled.failures);
        }
        Err(failure) => {
            b.failures.push(failure);
            return b;
        }
    }
    b.compile_s = start.elapsed().as_secs_f64();
    check(&mut b);
    b
}

/// Static count of the instructions in `k` whose full mnemonic starts with `prefix`.
fn key_count(k: &KernelReport, prefix: &str) -> u32 {
    k.sass
        .iter()
        .filter(|(op, _)| {
            op.strip_prefix("op:")
                .is_some_and(|o| o.starts_with(prefix))
        })
        .map(|(_, n)| n)
        .sum()
}

fn check(b: &mut Build) {
    let sm = b.job.sm();
    let limit = sm.smem_optin_per_block();
    for &name in b.job.kernels() {
        let Some(k) = b.kernels.get(name) else {
            b.failures.push(format!("{name}: missing from the cubin"));
            continue;
        };
        if k.spill_stores > 0 || k.spill_loads > 0 {
            b.failures.push(format!(
                "{name}: spills ({} B stores, {} B loads)",
                k.spill_stores, k.spill_loads
            ));
        }
        let total = b.job.dynamic_smem(name) + k.static_smem as usize;
        if total > limit {
            b.failures.push(format!(
                "{name}: {total} B shared memory > {limit} B on {sm}"
            ));
        }
        for required in b.job.required(name) {
            if key_count(k, required) == 0 {
                b.failures
                    .push(format!("{name}: no {required} in the SASS"));
            }
        }
    }
}

fn rel(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap_or(p).display().to_string()
}

/// FNV-1a: enough to notice that the source changed since the manifest was written.
fn fnv1a(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn manifest_entry(b: &Build) -> Value {
    let kernels: serde_json::Map<String, Value> = b
        .kernels
        .iter()
        .map(|(name, k)| {
            let sass: BTreeMap<&str, u32> = k
                .sass
                .iter()
                .filter(|(op, _)| !op.starts_with("op:"))
                .map(|(op, n)| (op.as_str(), *n))
                .collect();
            let mut entry = json!({
                "registers": k.regs,
                "stack_bytes": k.stack,
                "spill_store_bytes": k.spill_stores,
                "spill_load_bytes": k.spill_loads,
                "static_smem_bytes": k.static_smem,
                "dynamic_smem_bytes": b.job.dynamic_smem(name),
                "sass_counts": sass,
            });
            // MLA records its required instructions per kernel, with their static counts.
            if let Job::Mla(..) = b.job {
                let required: BTreeMap<&str, u32> = b
                    .job
                    .required(name)
                    .into_iter()
                    .map(|r| (r, key_count(k, r)))
                    .collect();
                entry["required_sass"] = json!(required);
            }
            (name.clone(), entry)
        })
        .collect();
    let sm = b.job.sm();
    match b.job {
        Job::Moe(t, _) => json!({
            "family": "moe_gemm",
            "tactic": t.id(),
            "sm": sm.arch(),
            "variant": format!("{:?}", t.variant),
            "threads": t.threads(),
            "smem_limit_bytes": sm.smem_optin_per_block(),
            "required_sass": t.variant.required_sass(),
            "cubin": b.cubin,
            "ptx": b.ptx,
            "kernels": kernels,
            "ok": b.failures.is_empty(),
        }),
        Job::Mla(t, _) => json!({
            "family": "mla",
            "tactic": t.id(),
            "sm": sm.arch(),
            "variant": format!("{:?}", t.kind),
            "threads": t.threads(),
            "smem_limit_bytes": sm.smem_optin_per_block(),
            "cubin": b.cubin,
            "ptx": b.ptx,
            "kernels": kernels,
            "ok": b.failures.is_empty(),
        }),
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let root = repo_root();
    let mut out = root.join("ptx");
    let mut jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut check_fresh = false;
    let mut families: Vec<&'static str> = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(args.next().expect("--out DIR")),
            "--jobs" => jobs = args.next().and_then(|j| j.parse().ok()).expect("--jobs N"),
            "--check" => check_fresh = true,
            "--family" => {
                let f = args.next().unwrap_or_default();
                let Some(f) = FAMILIES.into_iter().find(|k| *k == f) else {
                    eprintln!("ptx-gate: unknown family {f} (one of {FAMILIES:?})");
                    return ExitCode::from(2);
                };
                families.push(f);
            }
            other => {
                eprintln!("ptx-gate: unknown argument {other}");
                return ExitCode::from(2);
            }
        }
    }
    if families.is_empty() {
        families = FAMILIES.to_vec();
    }
    let tc = match find_toolchain(&root) {
        Ok(tc) => tc,
        Err(e) => {
            eprintln!("ptx-gate: {e}");
            return ExitCode::from(2);
        }
    };
    let mut work: Vec<Job> = Vec::new();
    if families.contains(&"moe_gemm") {
        for sm in Sm::ALL {
            work.extend(
                MoeGemmTactic::enumerate(sm)
                    .into_iter()
                    .map(|t| Job::Moe(t, sm)),
            );
        }
    }
    if families.contains(&"mla") {
        for sm in Sm::ALL {
            work.extend(
                MlaTactic::enumerate(sm)
                    .into_iter()
                    .map(|t| Job::Mla(t, sm)),
            );
        }
    }
    eprintln!(
        "ptx-gate: {} builds ({}) on {jobs} jobs with {}",
        work.len(),
        families.join(", "),
        tc.version
    );
    let start = Instant::now();
    let queue = Mutex::new(work.into_iter().enumerate().collect::<Vec<_>>());
    let results = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| {
                loop {
                    let Some((i, job)) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    let b = build(&tc, &root, &out, job);
                    results.lock().unwrap().push((i, b));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    let builds: Vec<Build> = results.into_iter().map(|(_, b)| b).collect();

    println!(
        "{:<42} {:<8} {:<12} {:>5} {:>7} {:>6} {:>6} {:>6}  {:<6} {:>6}",
        "tactic", "sm", "kernel", "regs", "smem", "spill", "stack", "key", "status", "secs"
    );
    for b in &builds {
        for &name in b.job.kernels() {
            let k = b.kernels.get(name).cloned().unwrap_or_default();
            // The scarcest required instruction: 0 means one is missing.
            let key = b.job.required(name).iter().map(|r| key_count(&k, r)).min();
            println!(
                "{:<42} {:<8} {:<12} {:>5} {:>7} {:>6} {:>6} {:>6}  {:<6} {:>6.1}",
                b.job.id(),
                b.job.sm().arch(),
                name,
                k.regs,
                b.job.dynamic_smem(name) + k.static_smem as usize,
                k.spill_stores + k.spill_loads,
                k.stack,
                key.map_or("-".to_string(), |n| n.to_string()),
                if b.failures.is_empty() { "ok" } else { "FAIL" },
                b.compile_s
            );
        }
    }
    let ar_builds = if families.contains(&allreduce::FAMILY) {
        allreduce::run(&tc, &root, &out, jobs)
    } else {
        Vec::new()
    };
    allreduce::print_table(&ar_builds);
    let ar_failed = ar_builds.iter().filter(|b| !b.failures.is_empty()).count();
    let failed: Vec<&Build> = builds.iter().filter(|b| !b.failures.is_empty()).collect();
    for b in &failed {
        for f in &b.failures {
            eprintln!("FAIL {} {}: {f}", b.job.id(), b.job.sm().arch());
        }
    }
    eprintln!(
        "ptx-gate: {} builds, {} failed, {:.1} s wall",
        builds.len() + ar_builds.len(),
        failed.len() + ar_failed,
        start.elapsed().as_secs_f64()
    );

    let manifest_path = out.join("manifest.json");
    let previous: Option<Value> = std::fs::read_to_string(&manifest_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    // Entries of families not built in this run are kept; built families are replaced.
    let mut entries: Vec<Value> = previous
        .as_ref()
        .and_then(|m| m.get("entries"))
        .and_then(Value::as_array)
        .map(|e| {
            e.iter()
                .filter(|v| {
                    v.get("family")
                        .and_then(Value::as_str)
                        .is_none_or(|f| !families.contains(&f))
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    entries.extend(builds.iter().map(manifest_entry));
    entries.extend(ar_builds.iter().map(allreduce::manifest_entry));
    let mut sources = previous
        .as_ref()
        .and_then(|m| m.get("sources"))
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for family in &families {
        let path = source_of(family);
        let src = std::fs::read(root.join(path)).unwrap_or_default();
        sources.insert(
            family.to_string(),
            json!({"path": path, "fnv1a64": fnv1a(&src)}),
        );
    }
    // Every family includes the PTX helpers: a change there changes every image.
    let helpers = std::fs::read(root.join(PTX_HELPERS)).unwrap_or_default();
    sources.insert(
        "ptx_helpers".to_string(),
        json!({"path": PTX_HELPERS, "fnv1a64": fnv1a(&helpers)}),
    );
    let manifest = json!({
        "toolchain": tc.version,
        "sources": sources,
        "entries": entries,
    });
    let text = serde_json::to_string_pretty(&manifest).expect("serialize manifest") + "\n";
    let stale = check_fresh
        && std::fs::read_to_string(&manifest_path).ok().as_deref() != Some(text.as_str());
    if let Err(e) = std::fs::write(&manifest_path, &text) {
        eprintln!("ptx-gate: cannot write {}: {e}", manifest_path.display());
        return ExitCode::from(2);
    }
    if stale {
        eprintln!(
            "ptx-gate: {} was stale (now rewritten); commit the new manifest",
            rel(&root, &manifest_path)
        );
    }
    if failed.is_empty() && ar_failed == 0 && !stale {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_resource_lines() {
        let log = "ptxas info    : Compiling entry function 'moe_down' for 'sm_120a'\n\
ptxas info    : Function properties for moe_down\n\
    96 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 80 registers, used 1 barriers, 1024 bytes smem, 96 bytes cumulative stack size\n\
ptxas info    : Compiling entry function 'moe_gate_up' for 'sm_120a'\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 125 registers, used 1 barriers\n";
        let r = parse_ptxas(log);
        let d = &r["moe_down"];
        assert_eq!(
            (
                d.regs,
                d.stack,
                d.spill_stores,
                d.spill_loads,
                d.static_smem
            ),
            (80, 96, 8, 12, 1024)
        );
        assert_eq!(
            (r["moe_gate_up"].regs, r["moe_gate_up"].static_smem),
            (125, 0)
        );
    }

    #[test]
    fn counts_sass_per_function() {
        let sass = "\tFunction : moe_gate_up\n\
        /*0100*/                   OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R12, R12, R4, R16, R0, R11, URZ ;\n\
        /*0110*/               @P0 SHFL.IDX PT, R1, R2, R3, R4 ;\n\
\tFunction : moe_down\n\
        /*0100*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n";
        let mut r = BTreeMap::new();
        count_sass(sass, &MOE_COUNTED, &mut r);
        assert_eq!(r["moe_gate_up"].sass["OMMA"], 1);
        assert_eq!(r["moe_gate_up"].sass["SHFL"], 1);
        assert_eq!(
            r["moe_gate_up"].sass["op:OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"],
            1
        );
        assert_eq!(r["moe_down"].sass["HMMA"], 1);
        assert!(!r["moe_down"].sass.contains_key("OMMA"));
    }

    #[test]
    fn mla_jobs_gate_the_decode_kernel_on_its_datapath() {
        use kernels::mla::MlaKind;
        for sm in Sm::ALL {
            for t in MlaTactic::enumerate(sm) {
                let job = Job::Mla(t, sm);
                assert_eq!(job.kernels(), ["mla_decode", "mla_combine", "mla_append"]);
                assert_eq!(job.dynamic_smem("mla_decode"), t.smem().total);
                assert_eq!(job.dynamic_smem("mla_append"), 0);
                assert!(job.required("mla_combine").is_empty());
                let required = job.required("mla_decode");
                assert!(required.contains(&"HMMA.16816.F32.BF16"));
                if t.kind == MlaKind::Fp8QkMma && sm == Sm::Sm120 {
                    assert!(required.contains(&"QMMA.16832.F32.E4M3.E4M3"));
                }
                assert_eq!(job.source(), "kernels-rs/src/mla/mla_decode.cu");
            }
        }
    }
}
