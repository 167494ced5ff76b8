//! Compiles the host execution layer and every kernel module for the CPU.
//!
//! One module per (kernel family, tactic): the family's unmodified `.cu` source compiled with
//! the tactic's `-D` macros (the same `nvcc_defines` the compile gate passes to nvcc), through
//! a generated wrapper that
//! - includes the CUDA host surface (`runtime/include/cuda_host.h`) first;
//! - places the source in an anonymous namespace, so tactics of one family (same names,
//!   different constants) can live in one binary, and renames its `extern "C"` kernels to
//!   unique symbols;
//! - binds `extern __shared__` arrays to the runtime's per-worker dynamic shared memory;
//! - exports a table of the kernels with their parameter sizes.
//!
//! Objects are cached in OUT_DIR by a hash of everything that goes into them, so changing one
//! kernel source recompiles only that family's modules. The compiler is the system C++
//! compiler found by the `cc` crate (g++); without one the build fails.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::Sm;
use kernels::mla::MlaTactic;
use kernels::moe_gemm::MoeGemmTactic;

struct Unit {
    family: &'static str,
    tactic: String,
    source: PathBuf,
    defines: Vec<String>,
}

/// What the wrapper needs to know about a kernel source.
struct SourceFacts {
    includes: Vec<String>,
    namespaces: Vec<String>,
    kernels: Vec<String>,
    /// `(element type, name)` of each `extern __shared__` array.
    dynamic_shared: Vec<(String, String)>,
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let kernels_src = manifest.join("../src").canonicalize().unwrap();
    let kernels_include = manifest.join("../include").canonicalize().unwrap();
    let runtime = manifest.join("runtime");
    let runtime_include = runtime.join("include");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", runtime.display());
    println!("cargo:rerun-if-changed={}", kernels_include.display());

    let mut units = units(&kernels_src);
    // Probe kernels of the PTX helpers themselves (tests/ptx_semantics.rs).
    units.push(Unit {
        family: "ptx_probe",
        tactic: "default".into(),
        source: manifest.join("probes/ptx_probe.cu"),
        defines: Vec::new(),
    });
    for u in &units {
        println!("cargo:rerun-if-changed={}", u.source.display());
    }

    let build = {
        let mut b = cc::Build::new();
        b.cpp(true).opt_level(2).debug(false).warnings(false);
        b
    };
    let compiler = build.get_compiler();
    let version = Command::new(compiler.path())
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| {
            panic!(
                "cuda-host needs a C++20 compiler (g++) to build the kernels for the CPU; {} \
                 could not be run: {e}",
                compiler.path().display()
            )
        });

    // Everything every object depends on besides its own wrapper.
    let mut shared_inputs = String::new();
    shared_inputs.push_str(&version);
    for dir in [&runtime_include, &kernels_include] {
        for path in sorted_files(dir) {
            shared_inputs.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
    // Feature `tsan`: the kernel modules instrumented by ThreadSanitizer, CUDA threads as its
    // fibers (see runtime.cpp); the executables must link the TSan runtime
    // (scripts/tsan-host.sh). The runtime only annotates: its own bookkeeping (the fiber
    // queue, the current thread's view) is shared by the fibers of a block by design, and
    // instrumented it would be reported as the kernels' races.
    let tsan_on = std::env::var_os("CARGO_FEATURE_TSAN").is_some();
    let tsan: &[&str] = if tsan_on {
        &["-fsanitize=thread", "-DCUDA_HOST_TSAN=1"]
    } else {
        &[]
    };
    let tsan_annotations: &[&str] = if tsan_on {
        &["-DCUDA_HOST_TSAN=1"]
    } else {
        &[]
    };
    let flags = |sanitizer: &[&str], extra: &[&str]| -> Vec<String> {
        let mut f: Vec<String> = [
            "-std=c++20",
            "-fno-strict-aliasing",
            "-fno-math-errno",
            "-ftls-model=initial-exec",
            "-DCUDA_HOST_EXECUTION=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        f.push(format!("-I{}", runtime_include.display()));
        f.push(format!("-I{}", kernels_include.display()));
        f.extend(sanitizer.iter().map(|s| s.to_string()));
        f.extend(extra.iter().map(|s| s.to_string()));
        f
    };

    // Feature `gpu-numerics`: the kernel modules with the GPU's contraction and exponential.
    let gpu_numerics = std::env::var_os("CARGO_FEATURE_GPU_NUMERICS").is_some();
    let unit_dir = out.join("units");
    let obj_dir = out.join("obj");
    std::fs::create_dir_all(&unit_dir).unwrap();
    std::fs::create_dir_all(&obj_dir).unwrap();

    let mut jobs: Vec<(PathBuf, Vec<String>, u64)> = Vec::new();
    for name in ["runtime.cpp", "ptx_host.cpp"] {
        let src = runtime.join(name);
        let f = flags(
            tsan_annotations,
            &["-Wall", "-Wextra", "-Wno-unused-parameter"],
        );
        let key = fnv1a(&[
            &shared_inputs,
            &std::fs::read_to_string(&src).unwrap(),
            &f.join(" "),
        ]);
        jobs.push((src, f, key));
    }
    let mut table = String::new();
    let mut facts_cache: BTreeMap<PathBuf, (String, SourceFacts)> = BTreeMap::new();
    for (index, u) in units.iter().enumerate() {
        let (text, facts) = facts_cache.entry(u.source.clone()).or_insert_with(|| {
            let text = std::fs::read_to_string(&u.source)
                .unwrap_or_else(|e| panic!("{}: {e}", u.source.display()));
            let facts = source_facts(&text, &u.source);
            (text, facts)
        });
        let wrapper = wrapper(index, u, facts);
        let path = unit_dir.join(format!("m{index}_{}_{}.cpp", u.family, u.tactic));
        write_if_changed(&path, &wrapper);
        let mut f = flags(tsan, &["-w", "-include", "cuda_host.h"]);
        if gpu_numerics {
            // See runtime/include/cuda_host_gpu_numerics.h.
            f.extend(
                ["-mfma", "-ffp-contract=fast", "-DCUDA_HOST_GPU_NUMERICS=1"].map(String::from),
            );
        }
        f.push(format!("-I{}", u.source.parent().unwrap().display()));
        f.extend(u.defines.iter().cloned());
        let key = fnv1a(&[&shared_inputs, text, &wrapper, &f.join(" ")]);
        jobs.push((path, f, key));
        writeln!(table, "    cuhost_module_{index},").unwrap();
    }

    let objects = compile_all(&compiler, &obj_dir, &jobs);

    let lib = out.join("libcuda_host_kernels.a");
    let _ = std::fs::remove_file(&lib);
    let mut ar = build.get_archiver();
    ar.arg("crs").arg(&lib).args(&objects);
    run(&mut ar, "archive the host kernel objects");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=cuda_host_kernels");
    println!("cargo:rustc-link-lib=dylib=stdc++");

    let mut rs = String::from("// Generated by build.rs: one entry per compiled module.\n");
    rs.push_str("unsafe extern \"C\" {\n");
    for index in 0..units.len() {
        writeln!(
            rs,
            "    fn cuhost_module_{index}() -> *const crate::ffi::RawModule;"
        )
        .unwrap();
    }
    rs.push_str("}\n");
    writeln!(
        rs,
        "pub(crate) static MODULE_TABLE: [unsafe extern \"C\" fn() -> *const crate::ffi::RawModule; {}] = [\n{table}];",
        units.len()
    )
    .unwrap();
    write_if_changed(&out.join("modules.rs"), &rs);
}

/// Every tactic of every family, once (tactics built for several SMs are one host module).
fn units(src: &Path) -> Vec<Unit> {
    let mut moe: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut mla: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for sm in Sm::ALL {
        for t in MoeGemmTactic::enumerate(sm) {
            moe.insert(t.id(), t.nvcc_defines());
        }
        for t in MlaTactic::enumerate(sm) {
            mla.insert(t.id(), t.nvcc_defines());
        }
    }
    let mut out = Vec::new();
    let mut add = |family: &'static str, file: &str, map: BTreeMap<String, Vec<String>>| {
        for (tactic, defines) in map {
            out.push(Unit {
                family,
                tactic,
                source: src.join(file),
                defines,
            });
        }
    };
    add("moe_gemm", "moe_gemm/moe_gemm.cu", moe);
    add("mla", "mla/mla_decode.cu", mla);
    let ar: BTreeMap<String, Vec<String>> = AllReduceTactic::images()
        .into_iter()
        .map(|t| (t.image_id(), t.nvcc_defines()))
        .collect();
    add("allreduce", "allreduce/allreduce.cu", ar);
    add(
        "layers",
        "layers/layers.cu",
        BTreeMap::from([(kernels::layers::IMAGE.to_string(), Vec::new())]),
    );
    out
}

fn source_facts(text: &str, path: &Path) -> SourceFacts {
    let mut facts = SourceFacts {
        includes: Vec::new(),
        namespaces: Vec::new(),
        kernels: Vec::new(),
        dynamic_shared: Vec::new(),
    };
    for line in text.lines() {
        let l = line.trim_start();
        if l.starts_with("#include") {
            facts.includes.push(l.trim_end().to_string());
        }
        if let Some(rest) = l.strip_prefix("namespace ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty()
                && rest[name.len()..].trim_start().starts_with('{')
                && !facts.namespaces.contains(&name)
            {
                facts.namespaces.push(name);
            }
        }
    }
    let mut rest = text;
    while let Some(at) = rest.find("extern \"C\" __global__") {
        let tail = &rest[at + "extern \"C\" __global__".len()..];
        let mut s = tail.trim_start();
        s = s.strip_prefix("void").unwrap_or(s).trim_start();
        if let Some(after) = s.strip_prefix("__launch_bounds__") {
            let close = after.find(')').expect("__launch_bounds__( ... )");
            s = after[close + 1..].trim_start();
        }
        let name: String = s
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        assert!(
            !name.is_empty(),
            "{}: cannot read the kernel name after `extern \"C\" __global__`",
            path.display()
        );
        if !facts.kernels.contains(&name) {
            facts.kernels.push(name);
        }
        rest = tail;
    }
    let mut rest = text;
    while let Some(at) = rest.find("extern __shared__") {
        let tail = &rest[at + "extern __shared__".len()..];
        let decl = &tail[..tail.find(';').expect("`;` after extern __shared__")];
        let mut words: Vec<&str> = decl.split_whitespace().collect();
        words.retain(|w| !w.starts_with("__align__"));
        let last = words.pop().expect("a declarator");
        let name = last.trim_end_matches("[]");
        let ty = words.join(" ");
        assert!(
            !ty.is_empty() && name != last,
            "{}: expected `extern __shared__ T name[]`, found `{decl}`",
            path.display()
        );
        let entry = (ty, name.to_string());
        if let Some((other, _)) = facts
            .dynamic_shared
            .iter()
            .find(|(t, n)| *n == entry.1 && *t != entry.0)
        {
            panic!(
                "{}: `extern __shared__` {} is declared as both {other} and {}",
                path.display(),
                entry.1,
                entry.0
            );
        }
        if !facts.dynamic_shared.contains(&entry) {
            facts.dynamic_shared.push(entry);
        }
        rest = tail;
    }
    facts
}

fn wrapper(index: usize, u: &Unit, f: &SourceFacts) -> String {
    let mut w = String::new();
    writeln!(
        w,
        "// Generated by kernels-rs/cuda-host/build.rs: module {index}, family {}, tactic {}.",
        u.family, u.tactic
    )
    .unwrap();
    // The source's own includes go first, outside the anonymous namespace; inside it they are
    // then no-ops (include guards).
    for inc in &f.includes {
        writeln!(w, "{inc}").unwrap();
    }
    w.push_str("#include \"cuda_host_runtime.h\"\n");
    for k in &f.kernels {
        writeln!(w, "#define {k} cuhost_m{index}_{k}").unwrap();
    }
    w.push_str("namespace {\n");
    let shared_decl = |w: &mut String| {
        for (ty, name) in &f.dynamic_shared {
            writeln!(
                w,
                "extern thread_local {ty} {name}[] __asm__(\"cuhost_dynamic_shared\");"
            )
            .unwrap();
        }
    };
    shared_decl(&mut w);
    for ns in &f.namespaces {
        writeln!(w, "namespace {ns} {{").unwrap();
        shared_decl(&mut w);
        w.push_str("}\n");
    }
    writeln!(w, "#include \"{}\"", u.source.display()).unwrap();
    for ns in &f.namespaces {
        writeln!(w, "using namespace {ns};").unwrap();
    }
    w.push_str("const cuhost_kernel kKernels[] = {\n");
    for k in &f.kernels {
        writeln!(w, "    cuhost::kernel_entry<&{k}>(\"{k}\"),").unwrap();
    }
    w.push_str("};\n}  // namespace\n");
    writeln!(
        w,
        "extern \"C\" const cuhost_module* cuhost_module_{index}(void) {{\n  static const \
         cuhost_module m{{\"{}\", \"{}\", \"{}\", kKernels, {}}};\n  return &m;\n}}",
        u.family,
        u.tactic,
        u.defines.join(" "),
        f.kernels.len()
    )
    .unwrap();
    w
}

fn compile_all(
    compiler: &cc::Tool,
    obj_dir: &Path,
    jobs: &[(PathBuf, Vec<String>, u64)],
) -> Vec<PathBuf> {
    let objects: Vec<PathBuf> = jobs
        .iter()
        .map(|(_, _, key)| obj_dir.join(format!("{key:016x}.o")))
        .collect();
    let todo: Vec<usize> = (0..jobs.len()).filter(|&i| !objects[i].is_file()).collect();
    let threads = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(2)
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::<String>::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&job) = todo.get(i) else { break };
                    let (src, flags, _) = &jobs[job];
                    let tmp = objects[job].with_extension("o.tmp");
                    let mut cmd = compiler.to_command();
                    cmd.args(flags).arg("-c").arg(src).arg("-o").arg(&tmp);
                    match cmd.output() {
                        Ok(o) if o.status.success() => {
                            std::fs::rename(&tmp, &objects[job]).unwrap();
                        }
                        Ok(o) => failures.lock().unwrap().push(format!(
                            "{}:\n{}",
                            src.display(),
                            String::from_utf8_lossy(&o.stderr)
                        )),
                        Err(e) => failures
                            .lock()
                            .unwrap()
                            .push(format!("{}: cannot run the compiler: {e}", src.display())),
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    if !failures.is_empty() {
        panic!(
            "compiling the kernels for the CPU failed ({} of {}):\n{}",
            failures.len(),
            todo.len(),
            failures.join("\n")
        );
    }
    objects
}

fn run(cmd: &mut Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(status.success(), "{what}: {cmd:?} failed with {status}");
}

fn sorted_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap();
    }
}

/// FNV-1a over the parts, with a separator so that moving text between parts changes the key.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0xff)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
