//! The correct stage: every tactic that passed the static stage runs against the goldens, on
//! the device when there is one, else through the host execution layer (`cuda-host`: the
//! unmodified `.cu` sources compiled for the CPU). The harnesses are the ones the tests and
//! the GPU checks use (`moe_gemm::check`, `mla::check`, `project_tests::allreduce_host`,
//! `project_tests::layer_checks`); the stage only keeps it affordable: one or two golden
//! cases per tactic.

use std::panic::{AssertUnwindSafe, catch_unwind};

use cuda_host::{HostDevice, Module};
use kernels::allreduce::cpu::default_islands;
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::allreduce::{DType, Element};
use kernels::arch::Sm;
use kernels::device::Device;
use kernels::layers::LayerKernels;
use kernels::mla::check::{Golden, build_cache, check_decode, load_golden};
use kernels::mla::launch::{DecodeBatch, DeviceCache, MlaKernels};
use kernels::mla::{KvCacheDtype, MlaSplitTactic};
use kernels::moe_gemm::MoeGemmTactic;
use kernels::moe_gemm::check::{self, check_case_with};
use kernels::moe_gemm::launch::{GroupedRouting, MoeDeviceRouting, MoeDeviceWeights, MoeKernels};
use kernels::moe_gemm::tactic::check_problem;
use project_tests::{allreduce_host, golden_path, layer_checks, moe_goldens};

/// The goldens the stage runs, loaded once.
pub struct Goldens {
    /// One MoE case: `kernel_tiles` (several token tiles per expert, every tactic takes it).
    pub moe: Vec<check::Case>,
    /// One MLA case per cache dtype and built cache width (`*_pages`: several requests across
    /// page boundaries).
    pub mla: Vec<Golden>,
}

impl Goldens {
    pub fn load() -> Result<Goldens, String> {
        let mut moe = moe_goldens::kernel_golden_cases();
        moe.truncate(1);
        let mla = [
            "bf16_pages",
            "fp8_pages",
            "l64r16_bf16_pages",
            "l64r16_fp8_pages",
        ]
        .iter()
        .map(|n| load_golden(&golden_path(&format!("mla/{n}.safetensors"))))
        .collect::<Result<Vec<_>, _>>()?;
        Ok(Goldens { moe, mla })
    }
}

/// Runs `f`, turning a panic (the shared harnesses assert) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(format!(
            "{what}: {}",
            p.downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("panicked")
        )),
    }
}

/// The MoE tactic on every golden case: both kernels, two runs on poisoned buffers.
pub fn moe<D: Device>(dev: &D, t: MoeGemmTactic, g: &Goldens) -> Result<String, String> {
    guarded(&t.id(), || {
        let k = MoeKernels::load(dev, t).map_err(|e| e.to_string())?;
        let mut detail = Vec::new();
        for case in &g.moe {
            check_problem(&t, case.hidden, case.inter).map_err(|e| e.to_string())?;
            let w = MoeDeviceWeights::upload(dev, &case.weights, &[t.scale_load])
                .map_err(|e| e.to_string())?;
            let r = GroupedRouting::new(&case.routing, case.experts())
                .and_then(|g| MoeDeviceRouting::upload(dev, g))
                .map_err(|e| e.to_string())?;
            let c = check_case_with(dev, &k, &(w, r), case, |_| {})?;
            let line = format!("{}: rel L2 {:.1e}", case.name, c.rel_l2);
            if !c.passed() {
                return Err(format!("{line}, failed ({c:?})"));
            }
            detail.push(line);
        }
        Ok(detail.join("; "))
    })
}

/// The MLA tactic on the golden of its cache dtype and widths, with its split count (more than
/// one adds `mla_combine`; splits past a short request's tiles are empty, which the kernel
/// handles).
pub fn mla<D: Device>(dev: &D, st: MlaSplitTactic, g: &Goldens) -> Result<String, String> {
    let t = st.kernel;
    guarded(&st.id(), || {
        let k = MlaKernels::load(dev, t).map_err(|e| e.to_string())?;
        let mut detail = Vec::new();
        for golden in g
            .mla
            .iter()
            .filter(|x| (x.dtype != KvCacheDtype::Bf16) == t.kind.is_fp8() && x.dims == t.dims)
        {
            let (cache, queries) = build_cache(
                golden.dims,
                golden.dtype,
                golden.static_scale,
                &golden.lens,
                &golden.seeds,
            );
            let want = golden.expected(t.kind, &cache, &queries)?;
            let dcache = DeviceCache::upload(dev, &cache, 0).map_err(|e| e.to_string())?;
            let mut batch = DecodeBatch::upload(
                dev,
                &cache,
                &queries,
                golden.heads,
                &golden.q_abs,
                &golden.q_pe,
                t.max_splits as usize,
            )
            .map_err(|e| e.to_string())?;
            {
                let splits = st.splits;
                let c = check_decode(dev, &k, golden, &dcache, &mut batch, splits, &want, |_| {})?;
                let line = format!("{} splits {splits}: row err {:.1e}", golden.name, c.row_err);
                if !c.passed() {
                    return Err(format!("{line}, failed ({c:?})"));
                }
                detail.push(line);
            }
        }
        if detail.is_empty() {
            return Err("no golden of its cache dtype and widths".into());
        }
        Ok(detail.join("; "))
    })
}

/// The all-reduce tactic's image with its block count: 4 ranks as threads, a 1003-element
/// message with the fused residual, three calls, bit for bit against `reference_reduce`.
pub fn allreduce(t: &AllReduceTactic) -> Result<String, String> {
    guarded(&t.id(), || {
        let function = Module::find("allreduce", &t.image_id())
            .and_then(|m| m.function("allreduce"))
            .map_err(|e| e.to_string())?;
        match t.dtype {
            DType::Bf16 => allreduce_typed::<half::bf16>(t, &function),
            DType::F32 => allreduce_typed::<f32>(t, &function),
        }
    })
}

fn allreduce_typed<T: Element>(
    t: &AllReduceTactic,
    function: &cuda_host::Function,
) -> Result<String, String> {
    let (world, n) = (4, 1003);
    let islands = default_islands(world);
    let o = allreduce_host::run_case::<T>(function, t, world, &islands, n, true, t.blocks, None);
    let want = allreduce_host::expected::<T>(t.algorithm, world, &islands, n, true);
    for rank in 0..world {
        if o.status[rank] != Some(0) {
            return Err(format!("rank {rank}: status {:?}", o.status[rank]));
        }
        if o.outputs[rank].as_ref() != Some(&want) {
            return Err(format!("rank {rank}: differs from reference_reduce"));
        }
    }
    Ok(format!("{world} ranks × {n} elements: bit-exact"))
}

/// The layers image: its BF16 decode product against a double-precision product, and the
/// router against the CPU router (the kernels the step-time model counts).
pub fn layers<D: Device>(dev: &D) -> Result<String, String> {
    guarded("layers default", || {
        let k = LayerKernels::load(dev).map_err(|e| e.to_string())?;
        layer_checks::dense_bf16_matches_a_double_precision_product(dev, &k);
        layer_checks::router_matches_the_cpu_router_kimi_and_grouped(dev, &k);
        Ok("dense_bf16, route_noaux_tc: match".into())
    })
}

/// The host execution layer emulating `sm`.
pub fn host_device(sm: Sm) -> HostDevice {
    HostDevice::new(sm)
}
