//! Compile gate for the kernel families: builds, with the pinned toolchain
//! (`scripts/cuda-toolchain.sh`), one image per distinct image id of each gated family's
//! tactic space on each SM — `Tactic::space` of `MoeGemmTactic` (NVFP4 MoE GEMM), `MlaTactic`
//! (MLA decode) and `AllReduceTactic` (one image per algorithm × dtype × threads) — reads
//! ptxas's resource report and the SASS, writes `ptx/manifest.json` and the cubins/PTX under
//! `ptx/<family>/`, prints a table per family, and exits non-zero if any kernel spills, exceeds
//! its SM's shared memory, or lacks the instructions its variant exists for.
//!
//! The build, the checks and the manifest are written once, generic over the families through
//! the [`Tactic`] trait plus what compiling needs of them (`Gated`: defines, kernels, required
//! SASS, the manifest entry); the all-reduce's own checks live in `ptx-gate/allreduce.rs`.
//!
//! Usage: `cargo run --release -p kernels --bin ptx-gate -- [--out DIR] [--jobs N] [--check]
//! [--family moe_gemm|mla|allreduce]...` (`--family` restricts the build; other families' manifest entries
//! are kept as they are).
//! `--check` additionally fails if the committed manifest differs from the one just built,
//! so a change to the kernel or the tactic space cannot land without its new numbers.

#[path = "ptx-gate/allreduce.rs"]
mod allreduce;

use kernels::arch::Sm;
use kernels::mla::MlaTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::{KernelFamily, Tactic};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Mutex;
use std::time::Instant;

/// The gated families, in the order they are built and listed in the manifest.
const FAMILIES: [KernelFamily; 3] = [
    KernelFamily::MoeGemm,
    KernelFamily::MlaDecode,
    KernelFamily::AllReduce,
];
/// SASS mnemonics counted for every kernel of a family (the manifest records them all; the
/// gate checks the variant's required ones).
const MOE_COUNTED: [&str; 6] = ["OMMA", "HMMA", "SHFL", "LDGSTS", "LDS", "RED"];
const MLA_COUNTED: [&str; 8] = [
    "HMMA", "QMMA", "HMUL2", "LDSM", "LDGSTS", "F2FP", "MUFU", "SHFL",
];

/// What the gate needs of a family beyond the shared [`Tactic`] trait (whose `space`, ids
/// and family it enumerates by): how an image is compiled, which kernels it holds, and what
/// each must show in its resources and SASS. One image per distinct
/// [`image_id`](Tactic::image_id) of the family's space on an SM.
trait Gated: Tactic + Copy + Send + Sync {
    /// Kernels of one image.
    const KERNELS: &'static [&'static str];
    /// Base mnemonics counted per kernel (`op:` full mnemonics are always recorded).
    const COUNTED: &'static [&'static str];
    fn defines(&self) -> Vec<String>;
    /// Dynamic shared memory the launcher requests for `kernel`.
    fn dynamic_smem(&self, kernel: &str) -> usize;
    /// SASS mnemonic prefixes `kernel` must contain on `sm`.
    fn required(&self, sm: Sm, kernel: &str) -> Vec<&'static str>;
    /// Failures beyond spills, shared memory and the required SASS (the ptxas log is given).
    fn extra_failures(&self, _log: &str, _kernels: &BTreeMap<String, KernelReport>) -> Vec<String> {
        Vec::new()
    }
    fn manifest_entry(b: &Build<Self>) -> Value;
}

impl Gated for MoeGemmTactic {
    const KERNELS: &'static [&'static str] = &["moe_gate_up", "moe_down"];
    const COUNTED: &'static [&'static str] = &MOE_COUNTED;

    fn defines(&self) -> Vec<String> {
        self.nvcc_defines()
    }

    fn dynamic_smem(&self, kernel: &str) -> usize {
        if kernel == "moe_gate_up" {
            self.smem().gate_up
        } else {
            self.smem().down
        }
    }

    fn required(&self, _sm: Sm, _kernel: &str) -> Vec<&'static str> {
        vec![self.variant.required_sass()]
    }

    fn manifest_entry(b: &Build<Self>) -> Value {
        let t = b.tactic;
        json!({
            "family": Self::FAMILY.id(),
            "tactic": t.image_id(),
            "sm": b.sm.arch(),
            "variant": format!("{:?}", t.variant),
            "threads": t.threads(),
            "smem_limit_bytes": b.sm.smem_optin_per_block(),
            "required_sass": t.variant.required_sass(),
            "cubin": b.cubin,
            "ptx": b.ptx,
            "kernels": kernel_entries(b, false),
            "ok": b.failures.is_empty(),
        })
    }
}

impl Gated for MlaTactic {
    const KERNELS: &'static [&'static str] = &["mla_decode", "mla_combine", "mla_append"];
    const COUNTED: &'static [&'static str] = &MLA_COUNTED;

    fn defines(&self) -> Vec<String> {
        self.nvcc_defines()
    }

    fn dynamic_smem(&self, kernel: &str) -> usize {
        // Combine and append use only their small static arrays.
        if kernel == "mla_decode" {
            self.smem().total
        } else {
            0
        }
    }

    fn required(&self, sm: Sm, kernel: &str) -> Vec<&'static str> {
        if kernel == "mla_decode" {
            self.kind.required_sass(sm)
        } else {
            Vec::new()
        }
    }

    fn manifest_entry(b: &Build<Self>) -> Value {
        let t = b.tactic;
        json!({
            "family": Self::FAMILY.id(),
            "tactic": t.image_id(),
            "sm": b.sm.arch(),
            "variant": format!("{:?}", t.kind),
            "threads": t.threads(),
            "smem_limit_bytes": b.sm.smem_optin_per_block(),
            "cubin": b.cubin,
            "ptx": b.ptx,
            // MLA records its required instructions per kernel, with their static counts.
            "kernels": kernel_entries(b, true),
            "ok": b.failures.is_empty(),
        })
    }
}

/// The manifest's `kernels` object of a MoE or MLA image: every kernel in the cubin with its
/// resources and counted SASS (and, when `with_required`, its required instructions' counts).
fn kernel_entries<T: Gated>(b: &Build<T>, with_required: bool) -> serde_json::Map<String, Value> {
    b.kernels
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
                "dynamic_smem_bytes": b.tactic.dynamic_smem(name),
                "sass_counts": sass,
            });
            if with_required {
                let required: BTreeMap<&str, u32> = b
                    .tactic
                    .required(b.sm, name)
                    .into_iter()
                    .map(|r| (r, key_count(k, r)))
                    .collect();
                entry["required_sass"] = json!(required);
            }
            (name.clone(), entry)
        })
        .collect()
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

/// One image of family `T` built for one SM.
struct Build<T> {
    tactic: T,
    sm: Sm,
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

fn build<T: Gated>(tc: &Toolchain, root: &Path, out: &Path, tactic: T, sm: Sm) -> Build<T> {
    let start = Instant::now();
    let src = root.join(source_path(T::FAMILY));
    let dir = out.join(T::FAMILY.id()).join(sm.arch());
    std::fs::create_dir_all(&dir).expect("create output dir");
    let id = tactic.image_id();
    let cubin = dir.join(format!("{id}.cubin"));
    let ptx = dir.join(format!("{id}.ptx"));
    let mut b = Build {
        tactic,
        sm,
        kernels: BTreeMap::new(),
        cubin: rel(root, &cubin),
        ptx: rel(root, &ptx),
        compile_s: 0.0,
        failures: Vec::new(),
    };
    let image = Image {
        src: &src,
        sm,
        defines: tactic.defines(),
        cubin: &cubin,
        ptx: &ptx,
    };
    match compile_image(tc, &image, T::COUNTED) {
        Ok(compiled) => {
            b.failures
                .extend(tactic.extra_failures(&compiled.log, &compiled.kernels));
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

fn source_path(family: KernelFamily) -> &'static str {
    family
        .source_path()
        .expect("every gated family has a CUDA source")
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

fn check<T: Gated>(b: &mut Build<T>) {
    let sm = b.sm;
    let limit = sm.smem_optin_per_block();
    for &name in T::KERNELS {
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
        let total = b.tactic.dynamic_smem(name) + k.static_smem as usize;
        if total > limit {
            b.failures.push(format!(
                "{name}: {total} B shared memory > {limit} B on {sm}"
            ));
        }
        for required in b.tactic.required(sm, name) {
            if key_count(k, required) == 0 {
                b.failures
                    .push(format!("{name}: no {required} in the SASS"));
            }
        }
    }
}

/// The images of `T` for every SM: one per distinct image id of the family's space, in the
/// space's order.
fn images<T: Gated>() -> Vec<(T, Sm)> {
    let mut out = Vec::new();
    for sm in Sm::ALL {
        let mut seen = std::collections::HashSet::new();
        for t in T::space(sm) {
            if seen.insert(t.image_id()) {
                out.push((t, sm));
            }
        }
    }
    out
}

/// Builds every image of `T` on `jobs` threads, prints its table, and returns the builds.
fn gate_family<T: Gated>(tc: &Toolchain, root: &Path, out: &Path, jobs: usize) -> Vec<Build<T>> {
    let work = images::<T>();
    eprintln!("ptx-gate: {}: {} builds", T::FAMILY, work.len());
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
    let builds: Vec<Build<T>> = results.into_iter().map(|(_, b)| b).collect();
    print_table(&builds);
    builds
}

fn print_table<T: Gated>(builds: &[Build<T>]) {
    if builds.is_empty() {
        return;
    }
    println!(
        "{:<42} {:<8} {:<12} {:>5} {:>7} {:>6} {:>6} {:>6}  {:<6} {:>6}",
        format!("{} image", T::FAMILY),
        "sm",
        "kernel",
        "regs",
        "smem",
        "spill",
        "stack",
        "key",
        "status",
        "secs"
    );
    for b in builds {
        for &name in T::KERNELS {
            let k = b.kernels.get(name).cloned().unwrap_or_default();
            // The scarcest required instruction: 0 means one is missing.
            let key = b
                .tactic
                .required(b.sm, name)
                .iter()
                .map(|r| key_count(&k, r))
                .min();
            println!(
                "{:<42} {:<8} {:<12} {:>5} {:>7} {:>6} {:>6} {:>6}  {:<6} {:>6.1}",
                b.tactic.image_id(),
                b.sm.arch(),
                name,
                k.regs,
                b.tactic.dynamic_smem(name) + k.static_smem as usize,
                k.spill_stores + k.spill_loads,
                k.stack,
                key.map_or("-".to_string(), |n| n.to_string()),
                if b.failures.is_empty() { "ok" } else { "FAIL" },
                b.compile_s
            );
        }
    }
    for b in builds {
        for f in &b.failures {
            eprintln!("FAIL {} {}: {f}", b.tactic.image_id(), b.sm.arch());
        }
    }
}

/// A gated family's results, type-erased for the manifest: entries and failure count.
struct FamilyResult {
    family: KernelFamily,
    entries: Vec<Value>,
    failed: usize,
}

fn run_family<T: Gated>(tc: &Toolchain, root: &Path, out: &Path, jobs: usize) -> FamilyResult {
    let builds = gate_family::<T>(tc, root, out, jobs);
    FamilyResult {
        family: T::FAMILY,
        entries: builds.iter().map(T::manifest_entry).collect(),
        failed: builds.iter().filter(|b| !b.failures.is_empty()).count(),
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

const USAGE: &str =
    "usage: ptx-gate [--out DIR] [--jobs N] [--check] [--family moe_gemm|mla|allreduce]...
Compile gate of the kernel families with the pinned toolchain: writes ptx/manifest.json and
the images under ptx/<family>/ (or under --out DIR); --check also fails if the committed
manifest differs from the one built.";

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let mut args = std::env::args().skip(1);
    let root = repo_root();
    let mut out = root.join("ptx");
    let mut jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut check_fresh = false;
    let mut families: Vec<KernelFamily> = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--out" => out = PathBuf::from(args.next().expect("--out DIR")),
            "--jobs" => jobs = args.next().and_then(|j| j.parse().ok()).expect("--jobs N"),
            "--check" => check_fresh = true,
            "--family" => {
                let f = args.next().unwrap_or_default();
                let Some(f) = FAMILIES.into_iter().find(|k| k.id() == f) else {
                    let ids: Vec<&str> = FAMILIES.iter().map(|f| f.id()).collect();
                    eprintln!("ptx-gate: unknown family {f} (one of {ids:?})");
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
    // In the manifest's order, whatever the order of the arguments.
    families = FAMILIES
        .into_iter()
        .filter(|f| families.is_empty() || families.contains(f))
        .collect();
    let tc = match find_toolchain(&root) {
        Ok(tc) => tc,
        Err(e) => {
            eprintln!("ptx-gate: {e}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "ptx-gate: {} on {jobs} jobs with {}",
        families
            .iter()
            .map(|f| f.id())
            .collect::<Vec<_>>()
            .join(", "),
        tc.version
    );
    let start = Instant::now();
    let results: Vec<FamilyResult> = families
        .iter()
        .map(|f| match f {
            KernelFamily::MoeGemm => run_family::<MoeGemmTactic>(&tc, &root, &out, jobs),
            KernelFamily::MlaDecode => run_family::<MlaTactic>(&tc, &root, &out, jobs),
            KernelFamily::AllReduce => {
                run_family::<kernels::allreduce::tactic::AllReduceTactic>(&tc, &root, &out, jobs)
            }
            other => unreachable!("{other} is not a gated family"),
        })
        .collect();
    let builds: usize = results.iter().map(|r| r.entries.len()).sum();
    let failed: usize = results.iter().map(|r| r.failed).sum();
    eprintln!(
        "ptx-gate: {builds} builds, {failed} failed, {:.1} s wall",
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
                        .is_none_or(|f| !families.iter().any(|b| b.id() == f))
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    entries.extend(results.iter().flat_map(|r| r.entries.iter().cloned()));
    let mut sources = previous
        .as_ref()
        .and_then(|m| m.get("sources"))
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    for r in &results {
        let path = source_path(r.family);
        let src = std::fs::read(root.join(path)).unwrap_or_default();
        sources.insert(
            r.family.id().to_string(),
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
    if failed == 0 && !stale {
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
    fn mla_images_gate_the_decode_kernel_on_its_datapath() {
        use kernels::mla::MlaKind;
        for (t, sm) in images::<MlaTactic>() {
            assert_eq!(
                <MlaTactic as Gated>::KERNELS,
                ["mla_decode", "mla_combine", "mla_append"]
            );
            assert_eq!(t.dynamic_smem("mla_decode"), t.smem().total);
            assert_eq!(t.dynamic_smem("mla_append"), 0);
            assert!(t.required(sm, "mla_combine").is_empty());
            let required = t.required(sm, "mla_decode");
            assert!(required.contains(&"HMMA.16816.F32.BF16"));
            if t.kind == MlaKind::Fp8QkMma && sm == Sm::Sm120 {
                assert!(required.contains(&"QMMA.16832.F32.E4M3.E4M3"));
            }
            assert_eq!(
                source_path(MlaTactic::FAMILY),
                "kernels-rs/src/mla/mla_decode.cu"
            );
        }
    }

    /// The images are the families' tactic spaces, one per image id and SM: every MoE and MLA
    /// tactic, and the all-reduce's one image per (algorithm, dtype, threads).
    #[test]
    fn images_come_from_the_tactic_spaces() {
        let moe = images::<MoeGemmTactic>();
        let want: usize = Sm::ALL
            .iter()
            .map(|&sm| MoeGemmTactic::enumerate(sm).len())
            .sum();
        assert_eq!(moe.len(), want);
        let ar = images::<kernels::allreduce::tactic::AllReduceTactic>();
        let per_sm = kernels::allreduce::tactic::AllReduceTactic::images();
        assert_eq!(ar.len(), per_sm.len() * Sm::ALL.len());
        assert!(ar.iter().all(|(t, _)| t.blocks == 1));
        assert_eq!(
            ar.iter()
                .take(per_sm.len())
                .map(|(t, _)| *t)
                .collect::<Vec<_>>(),
            per_sm
        );
    }
}
