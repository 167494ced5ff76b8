//! Kernel images, functions, their attributes and launches.
//!
//! An image of the stand-in names what it stands for instead of holding SASS:
//!
//! ```text
//! CUDA-STUB-IMAGE 1 <length>\n<JSON of that many bytes>
//! ```
//!
//! with the JSON `{"family", "tactic", "sm", "kernels": {name: {"registers",
//! "static_smem_bytes", "stack_bytes"}}}` — the compile gate's manifest entry of the cubin it
//! replaces (`cuda-stub-images` writes one per entry, at the cubin's path). Loading it finds
//! the host execution layer's build of that (family, tactic); a launch runs it there. A real
//! cubin is refused (`CUDA_ERROR_NO_BINARY_FOR_GPU`), PTX too (there is no JIT:
//! `CUDA_ERROR_JIT_COMPILER_NOT_FOUND`), and an image for another SM than the device's as on a
//! GPU.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cuda_host::{KernelParams, LaunchConfig, LaunchOptions, Schedule};
use cudarc::driver::sys::CUfunction_attribute as F;
use cudarc::driver::sys::CUresult as E;
use serde::Deserialize;

use crate::context::{self, Context};
use crate::error::{CUresult, R, api, note, put, refuse};
use crate::handles::Registry;
use crate::stream;
use crate::work::{Failure, Work};

pub const MAGIC: &str = "CUDA-STUB-IMAGE 1 ";

/// The figures of one kernel, from the compile gate's manifest.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct KernelFacts {
    #[serde(default)]
    pub registers: Option<u32>,
    #[serde(default)]
    pub static_smem_bytes: u32,
    #[serde(default)]
    pub stack_bytes: u32,
}

#[derive(Debug, Deserialize)]
pub struct Image {
    pub family: String,
    pub tactic: String,
    pub sm: String,
    #[serde(default)]
    pub kernels: HashMap<String, KernelFacts>,
}

pub struct Module {
    pub ctx: u64,
    image: Image,
    host: cuda_host::Module,
}

pub struct Function {
    pub ctx: u64,
    module: Arc<Module>,
    host: cuda_host::Function,
    facts: KernelFacts,
    max_threads: u32,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`: 48 KB minus the static size until a
    /// caller opts into more.
    max_dynamic: Mutex<u32>,
}

fn modules() -> &'static Registry<Module> {
    static M: OnceLock<Registry<Module>> = OnceLock::new();
    M.get_or_init(Registry::default)
}

fn functions() -> &'static Registry<Function> {
    static F: OnceLock<Registry<Function>> = OnceLock::new();
    F.get_or_init(Registry::default)
}

pub fn forget_context(ctx: u64) {
    functions().remove_where(|f| f.ctx == ctx);
    modules().remove_where(|m| m.ctx == ctx);
}

/// Reads an image from the bytes at `data` (whose length the driver learns from its header).
///
/// # Safety
/// `data` points at a loadable image: a stand-in header and its JSON, or a cubin or PTX whose
/// first bytes are readable.
unsafe fn parse(data: *const u8) -> R<Image> {
    if data.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: every image format has at least 4 readable bytes (the ELF magic, a PTX
    // directive, our header).
    let head = unsafe { std::slice::from_raw_parts(data, 4) };
    if head == b"\x7fELF" {
        return refuse(E::CUDA_ERROR_NO_BINARY_FOR_GPU, || {
            "a cubin cannot run on the stand-in driver: point the kernel images at the \
             stand-in's (scripts/stub-driver.sh sets KIMI_PTX_DIR)"
                .into()
        });
    }
    let mut header = Vec::new();
    for i in 0..64 {
        // SAFETY: the header is read up to its newline, which a stand-in image has within
        // 64 bytes; a PTX text is NUL-terminated, and we stop at the NUL.
        let b = unsafe { *data.add(i) };
        if b == b'\n' || b == 0 {
            break;
        }
        header.push(b);
    }
    let header = String::from_utf8_lossy(&header).into_owned();
    let Some(len) = header
        .strip_prefix(MAGIC)
        .and_then(|n| n.trim().parse::<usize>().ok())
    else {
        return refuse(E::CUDA_ERROR_JIT_COMPILER_NOT_FOUND, || {
            format!(
                "the image starting {:?} is not a stand-in image; the stand-in has no PTX JIT",
                header.chars().take(24).collect::<String>()
            )
        });
    };
    // SAFETY: the header says `len` bytes of JSON follow its newline.
    let json = unsafe { std::slice::from_raw_parts(data.add(header.len() + 1), len) };
    serde_json::from_slice(json).map_err(|e| {
        note(|| format!("stand-in image: {e}"));
        E::CUDA_ERROR_INVALID_IMAGE
    })
}

/// The image written as the stand-in reads it.
pub fn encode(image_json: &str) -> Vec<u8> {
    let mut out = format!("{MAGIC}{}\n", image_json.len()).into_bytes();
    out.extend_from_slice(image_json.as_bytes());
    out
}

fn load(out: *mut *mut c_void, image: Image) -> R {
    let ctx = context::current()?;
    let kind = crate::device::kind();
    if image.sm != kind.arch() {
        return refuse(E::CUDA_ERROR_NO_BINARY_FOR_GPU, || {
            format!(
                "{}/{} is built for {}, the device is {} ({})",
                image.family,
                image.tactic,
                image.sm,
                kind.arch(),
                kind.name
            )
        });
    }
    let host = cuda_host::Module::find(&image.family, &image.tactic).map_err(|e| {
        note(|| format!("image {}/{}: {e}", image.family, image.tactic));
        E::CUDA_ERROR_INVALID_IMAGE
    })?;
    let m = Arc::new(Module {
        ctx: ctx.id,
        image,
        host,
    });
    // SAFETY: the caller's out-pointer.
    unsafe { put(out, modules().insert(m)) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) -> CUresult {
    api("cuModuleLoadData", || {
        context::current()?;
        // SAFETY: the caller's image.
        let image = unsafe { parse(image.cast()) }?;
        load(out, image)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    out: *mut *mut c_void,
    image: *const c_void,
    _n: u32,
    _options: *mut c_void,
    _values: *mut *mut c_void,
) -> CUresult {
    // SAFETY: same contract; JIT options mean nothing without a JIT.
    unsafe { cuModuleLoadData(out, image) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(out: *mut *mut c_void, path: *const c_char) -> CUresult {
    api("cuModuleLoad", || {
        context::current()?;
        if path.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated path, the API's contract.
        let path = unsafe { CStr::from_ptr(path) }
            .to_string_lossy()
            .into_owned();
        let mut bytes = std::fs::read(&path).map_err(|_| E::CUDA_ERROR_FILE_NOT_FOUND)?;
        bytes.extend_from_slice(&[0; 4]);
        // SAFETY: the file's bytes, padded so that the 4-byte magic check stays inside.
        let image = unsafe { parse(bytes.as_ptr()) }?;
        load(out, image)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(m: *mut c_void) -> CUresult {
    api("cuModuleUnload", || {
        crate::initialized()?;
        let m = modules().remove(m).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        functions().remove_where(|f| Arc::ptr_eq(&f.module, &m));
        Ok(())
    })
}

/// Threads per block the register file allows: 64 K registers, allocated per warp in units of
/// 256, at most 1024 threads.
fn max_threads(registers: Option<u32>) -> u32 {
    let Some(r) = registers.filter(|&r| r > 0) else {
        return 1024;
    };
    let per_warp = (r * 32).div_ceil(256) * 256;
    (65536 / per_warp * 32).min(1024)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    out: *mut *mut c_void,
    m: *mut c_void,
    name: *const c_char,
) -> CUresult {
    api("cuModuleGetFunction", || {
        crate::initialized()?;
        let m = modules().get(m).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        if name.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated name, the API's contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let host = m.host.function(&name).map_err(|e| {
            note(|| e.to_string());
            E::CUDA_ERROR_NOT_FOUND
        })?;
        let facts = m.image.kernels.get(&name).cloned().unwrap_or_default();
        let f = Arc::new(Function {
            ctx: m.ctx,
            max_threads: max_threads(facts.registers),
            max_dynamic: Mutex::new((48u32 << 10).saturating_sub(facts.static_smem_bytes)),
            facts,
            module: m,
            host,
        });
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, functions().insert(f)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(
    _out: *mut u64,
    _bytes: *mut usize,
    m: *mut c_void,
    _name: *const c_char,
) -> CUresult {
    api("cuModuleGetGlobal_v2", || {
        crate::initialized()?;
        modules().get(m).ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        // The kernels here have no `__device__` variables to look up.
        Err(E::CUDA_ERROR_NOT_FOUND)
    })
}

fn function(f: *mut c_void) -> R<Arc<Function>> {
    crate::initialized()?;
    functions().get(f).ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetAttribute(
    out: *mut c_int,
    attr: u32,
    f: *mut c_void,
) -> CUresult {
    api("cuFuncGetAttribute", || {
        let f = function(f)?;
        let is = |a: F| a as u32 == attr;
        let arch = {
            let k = crate::device::kind();
            k.major * 10 + k.minor
        };
        let v = if is(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK) {
            f.max_threads as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) {
            f.facts.static_smem_bytes as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES) {
            0
        } else if is(F::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) {
            f.facts.stack_bytes as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_NUM_REGS) {
            f.facts.registers.unwrap_or(0) as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_PTX_VERSION) || is(F::CU_FUNC_ATTRIBUTE_BINARY_VERSION) {
            arch
        } else if is(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
            *f.max_dynamic.lock().unwrap() as c_int
        } else if is(F::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
            -1
        } else if attr < F::CU_FUNC_ATTRIBUTE_MAX as u32 {
            0
        } else {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        };
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetAttribute(f: *mut c_void, attr: u32, value: c_int) -> CUresult {
    api("cuFuncSetAttribute", || {
        let f = function(f)?;
        if attr == F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as u32 {
            let limit = crate::device::kind().smem_optin as u32 - f.facts.static_smem_bytes;
            if value < 0 || value as u32 > limit {
                return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
                    format!(
                        "{}: {value} B of dynamic shared memory > the {limit} B the device allows \
                         beside {} B static",
                        f.host.name(),
                        f.facts.static_smem_bytes
                    )
                });
            }
            *f.max_dynamic.lock().unwrap() = value as u32;
            Ok(())
        } else if attr == F::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT as u32 {
            if !(-1..=100).contains(&value) {
                return Err(E::CUDA_ERROR_INVALID_VALUE);
            }
            Ok(())
        } else if attr < F::CU_FUNC_ATTRIBUTE_MAX as u32 {
            // Cluster and scheduling preferences: accepted, and nothing here depends on them.
            Ok(())
        } else {
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncSetCacheConfig(f: *mut c_void, _config: u32) -> CUresult {
    api("cuFuncSetCacheConfig", || function(f).map(|_| ()))
}

/// One launch: the function, its geometry and a copy of its parameters (taken when issued,
/// as the driver copies them).
pub struct Launch {
    func: Arc<Function>,
    cfg: LaunchConfig,
    /// Each parameter at a 16-byte aligned offset of one buffer.
    params: Vec<u128>,
    offsets: Vec<(usize, usize)>,
}

impl Launch {
    pub fn context(&self) -> u64 {
        self.func.ctx
    }

    /// `kernel (family/tactic)`.
    pub fn name(&self) -> String {
        format!(
            "{} ({}/{})",
            self.func.host.name(),
            self.func.module.image.family,
            self.func.module.image.tactic
        )
    }

    /// Every aligned 8-byte word of the parameters: the device addresses among them are the
    /// memory the kernel may touch.
    pub fn pointer_words(&self) -> Vec<u64> {
        let mut words = Vec::new();
        for &(at, n) in &self.offsets {
            let first = at / 16;
            for w in 0..n / 8 {
                let v = self.params[first + w / 2];
                words.push(if w % 2 == 0 {
                    v as u64
                } else {
                    (v >> 64) as u64
                });
            }
        }
        words.retain(|&w| w != 0);
        words
    }

    pub fn run(&self, ctx: &Context) -> Result<(), Failure> {
        let bytes: &[u8] = {
            let p = &self.params;
            // SAFETY: u128s are plain bytes.
            unsafe { std::slice::from_raw_parts(p.as_ptr().cast::<u8>(), p.len() * 16) }
        };
        let mut args = KernelParams::new();
        for &(at, n) in &self.offsets {
            args.arg_bytes(&bytes[at..at + n]);
        }
        let family = self.func.module.image.family.as_str();
        let opts = LaunchOptions {
            // The all-reduce's blocks wait on each other's flags: all of them run at once, as
            // a grid this small does on a GPU.
            co_resident: family == "allreduce" && self.blocks() <= 256,
            schedule: schedule(),
            timeout: Some(timeout()),
            max_dynamic_shared: crate::device::kind().smem_optin as u32,
            ..LaunchOptions::default()
        };
        // SAFETY: the parameters have the kernel's sizes (checked when issued); the addresses
        // in them are the caller's, as on a GPU: a bad one faults in the host layer, which
        // reports it as this launch's error.
        let r = unsafe { cuda_host::launch(&self.func.host, self.cfg, &args, &opts) };
        r.map(|_| ()).map_err(|e| {
            let msg = e.to_string();
            let code = if msg.contains("SIGSEGV") || msg.contains("out of bounds") {
                E::CUDA_ERROR_ILLEGAL_ADDRESS
            } else if msg.contains("misaligned") {
                E::CUDA_ERROR_MISALIGNED_ADDRESS
            } else if msg.contains("time limit") {
                E::CUDA_ERROR_LAUNCH_TIMEOUT
            } else if msg.contains("SIGILL") {
                E::CUDA_ERROR_ILLEGAL_INSTRUCTION
            } else {
                E::CUDA_ERROR_LAUNCH_FAILED
            };
            (code, format!("device {}: {msg}", ctx.device))
        })
    }

    fn blocks(&self) -> u64 {
        let (x, y, z) = self.cfg.grid_dim;
        u64::from(x) * u64::from(y) * u64::from(z)
    }
}

/// `CUDA_STUB_SCHEDULE`: `forward` (default), `reverse` or `shuffled:SEED`: the order of a
/// launch's blocks and fibers, to shake out ordering assumptions.
fn schedule() -> Schedule {
    static S: OnceLock<Schedule> = OnceLock::new();
    *S.get_or_init(|| match std::env::var("CUDA_STUB_SCHEDULE").as_deref() {
        Ok("reverse") => Schedule::Reverse,
        Ok(s) if s.starts_with("shuffled:") => {
            Schedule::Shuffled(s["shuffled:".len()..].parse().unwrap_or(1))
        }
        _ => Schedule::Forward,
    })
}

/// `CUDA_STUB_LAUNCH_TIMEOUT_S`: the longest a launch may run (default 600 s).
fn timeout() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| {
        let s = std::env::var("CUDA_STUB_LAUNCH_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(600);
        Duration::from_secs(s)
    })
}

/// Checks a launch as the driver does, and copies its parameters.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, each to a value of the parameter's size.
unsafe fn prepare(
    f: &Arc<Function>,
    ctx: &Context,
    cfg: LaunchConfig,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> R<Launch> {
    let name = f.host.name();
    if f.ctx != ctx.id {
        return refuse(E::CUDA_ERROR_INVALID_HANDLE, || {
            format!("{name} was loaded in another context than the current one")
        });
    }
    let (g, b) = (cfg.grid_dim, cfg.block_dim);
    if g.0 == 0 || g.1 == 0 || g.2 == 0 || g.0 > i32::MAX as u32 || g.1 > 65535 || g.2 > 65535 {
        return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
            format!("{name}: grid {g:?}")
        });
    }
    let threads = u64::from(b.0) * u64::from(b.1) * u64::from(b.2);
    if b.0 == 0 || b.1 == 0 || b.2 == 0 || b.0 > 1024 || b.1 > 1024 || b.2 > 64 || threads > 1024 {
        return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
            format!("{name}: block {b:?}")
        });
    }
    if threads > u64::from(f.max_threads) {
        return refuse(E::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, || {
            format!(
                "{name}: {threads} threads per block, its {} registers allow {}",
                f.facts.registers.unwrap_or(0),
                f.max_threads
            )
        });
    }
    let allowed = *f.max_dynamic.lock().unwrap();
    if cfg.shared_mem_bytes > allowed {
        return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
            format!(
                "{name}: launch with {} B of dynamic shared memory, the function allows {allowed} B \
                 (above 48 KB, set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first)",
                cfg.shared_mem_bytes
            )
        });
    }
    let sizes = f.host.param_sizes();
    if !extra.is_null() {
        return refuse(E::CUDA_ERROR_NOT_SUPPORTED, || {
            format!("{name}: parameters through `extra` are not modelled; use kernelParams")
        });
    }
    if params.is_null() && !sizes.is_empty() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut at = 0usize;
    for &n in sizes {
        offsets.push((at, n as usize));
        at += (n as usize).div_ceil(16) * 16;
    }
    let mut buf = vec![0u128; at / 16];
    let base = buf.as_mut_ptr().cast::<u8>();
    for (i, &(off, n)) in offsets.iter().enumerate() {
        // SAFETY: the caller's pointer array holds one pointer per parameter, each to `n`
        // readable bytes; the buffer has room at `off`.
        unsafe {
            let p = *params.add(i);
            if p.is_null() {
                return Err(E::CUDA_ERROR_INVALID_VALUE);
            }
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), base.add(off), n);
        }
    }
    Ok(Launch {
        func: f.clone(),
        cfg,
        params: buf,
        offsets,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shared: u32,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    api("cuLaunchKernel", || {
        let ctx = context::current()?;
        let f = function(f)?;
        let s = stream::resolve_for_work(stream)?;
        let cfg = LaunchConfig {
            grid_dim: (gx, gy, gz),
            block_dim: (bx, by, bz),
            shared_mem_bytes: shared,
        };
        // SAFETY: the caller's parameter array, per the API's contract.
        let launch = unsafe { prepare(&f, &ctx, cfg, params, extra) }?;
        stream::submit(&s, Work::Launch(Arc::new(launch)), Vec::new()).map(|_| ())
    })
}

/// Blocks of `f` that fit on one multiprocessor at once (registers, shared memory, threads).
fn occupancy(f: &Function, block: u32, dynamic: u32) -> u32 {
    let k = crate::device::kind();
    let warps = block.div_ceil(32).max(1);
    let by_threads = k.threads_per_sm as u32 / (warps * 32);
    let regs = f.facts.registers.unwrap_or(32).max(1);
    let by_regs = 65536 / ((regs * 32).div_ceil(256) * 256 * warps);
    let smem = f.facts.static_smem_bytes + dynamic + 1024;
    let by_smem = k.smem_per_sm as u32 / smem;
    by_threads
        .min(by_regs)
        .min(by_smem)
        .min(k.blocks_per_sm as u32)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    out: *mut c_int,
    f: *mut c_void,
    block: c_int,
    dynamic: usize,
) -> CUresult {
    api("cuOccupancyMaxActiveBlocksPerMultiprocessor", || {
        let f = function(f)?;
        if block <= 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, occupancy(&f, block as u32, dynamic as u32) as c_int) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    out: *mut c_int,
    f: *mut c_void,
    block: c_int,
    dynamic: usize,
    _flags: u32,
) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuOccupancyMaxActiveBlocksPerMultiprocessor(out, f, block, dynamic) }
}
