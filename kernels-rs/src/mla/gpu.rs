//! CUDA launcher of the MLA kernels (`mla_decode`, `mla_combine`, `mla_append` of
//! `mla_decode.cu`), on the runtime of [`crate::cuda`]. Cubins come from the compile gate
//! (`ptx/mla/<sm>/<tactic>.cubin`). The checks that use it are in `bin/mla-gpu-check.rs`.
//!
//! Device layouts (the kernel's, see the .cu header): the cache exactly as
//! [`PagedLatentCache::raw_layer`] stores it; queries `[B][H][512]` / `[B][H][64]` BF16;
//! block tables `[B][max_pages]` i32; outputs `[B][H][512]` and `[B][H]` f32.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use super::cache::{PagedLatentCache, RawLayer};
use super::reference::AttentionQuery;
use super::tactic::{LATENT, MlaTactic, ROPE};
use crate::cuda::{Context, CudaError, GpuContext, Result, find_kernel_image};

pub const FAMILY: &str = "mla";

/// `struct DecodeArgs` of `mla_decode.cu`, passed by value: 11 device pointers, two `int`s and
/// a `float` (100 bytes, padded to 104 by the pointers' alignment on both sides).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeArgs {
    pub q_abs: u64,
    pub q_pe: u64,
    pub kv: u64,
    pub kv_scale: u64,
    pub kv_rope: u64,
    pub block_table: u64,
    pub seq_lens: u64,
    pub out: u64,
    pub lse: u64,
    pub part_out: u64,
    pub part_lse: u64,
    pub heads: i32,
    pub max_pages: i32,
    pub softmax_scale: f32,
}

const _: () = {
    assert!(std::mem::size_of::<DecodeArgs>() == 104);
    assert!(std::mem::offset_of!(DecodeArgs, heads) == 88);
    assert!(std::mem::offset_of!(DecodeArgs, softmax_scale) == 96);
};

// SAFETY: plain-old-data with the CUDA struct's layout (asserted above).
unsafe impl DeviceRepr for DecodeArgs {}

/// One layer of the cache on the device.
pub struct DeviceCache {
    pub fp8: bool,
    /// BF16 `kv [slots][576]` (as bytes) or FP8 codes `[slots][512]`.
    kv: CudaSlice<u8>,
    scale: CudaSlice<f32>,
    rope: CudaSlice<u16>,
    pub slots: usize,
    pub bytes_per_token: usize,
}

impl DeviceCache {
    /// Uploads `layer` of `cache` (BF16 or FP8; the F32 reference dtype has no kernel).
    pub fn upload(gpu: &GpuContext, cache: &PagedLatentCache, layer: usize) -> Result<Self> {
        let s = gpu.stream();
        let shape = cache.shape();
        if (shape.latent_dim, shape.rope_dim) != (LATENT, ROPE) {
            return Err(CudaError::Invalid(format!(
                "mla kernels need 512 + 64 cache values, not {} + {}",
                shape.latent_dim, shape.rope_dim
            )));
        }
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        let bytes_per_token = cache.dtype().bytes_per_token(&shape);
        match cache.raw_layer(layer) {
            RawLayer::Bf16 { values } => {
                let bytes: Vec<u8> = values
                    .iter()
                    .flat_map(|x| x.to_bits().to_le_bytes())
                    .collect();
                Ok(Self {
                    fp8: false,
                    slots: values.len() / (LATENT + ROPE),
                    kv: s.clone_htod(&bytes).during(|| "upload kv".into())?,
                    // Unused by BF16 kernels; one element keeps the pointers valid.
                    scale: s.alloc_zeros(1).during(|| "alloc".into())?,
                    rope: s.alloc_zeros(1).during(|| "alloc".into())?,
                    bytes_per_token,
                })
            }
            RawLayer::Fp8 {
                latent,
                scales,
                rope,
            } => Ok(Self {
                fp8: true,
                slots: scales.len(),
                kv: s.clone_htod(latent).during(|| "upload codes".into())?,
                scale: s.clone_htod(scales).during(|| "upload scales".into())?,
                rope: s.clone_htod(&bits(rope)).during(|| "upload rope".into())?,
                bytes_per_token,
            }),
            RawLayer::F32 { .. } => Err(CudaError::Invalid(
                "the F32 cache is the CPU reference's; the kernels read BF16 or FP8".into(),
            )),
        }
    }

    /// `(kv or codes, scales, rope)` as downloaded host vectors (the append check).
    pub fn download(&self, gpu: &GpuContext) -> Result<(Vec<u8>, Vec<f32>, Vec<u16>)> {
        gpu.synchronize()?;
        let s = gpu.stream();
        let out = (
            s.clone_dtoh(&self.kv).during(|| "download kv".into())?,
            s.clone_dtoh(&self.scale)
                .during(|| "download scales".into())?,
            s.clone_dtoh(&self.rope).during(|| "download rope".into())?,
        );
        gpu.synchronize()?;
        Ok(out)
    }
}

/// Queries, block tables and outputs of one decode step.
pub struct DecodeBatch {
    pub batch: usize,
    pub heads: usize,
    pub max_pages: usize,
    pub max_len: usize,
    q_abs: CudaSlice<u16>,
    q_pe: CudaSlice<u16>,
    block_table: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    part_out: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    max_splits: usize,
}

impl DecodeBatch {
    /// `q_abs [rows][heads][512]`, `q_pe [rows][heads][64]` (rounded to BF16 here); one row per
    /// query, attending to its sequence's first `context` tokens.
    pub fn upload(
        gpu: &GpuContext,
        cache: &PagedLatentCache,
        queries: &[AttentionQuery],
        heads: usize,
        q_abs: &[f32],
        q_pe: &[f32],
        max_splits: usize,
    ) -> Result<Self> {
        let s = gpu.stream();
        let b = queries.len();
        if b == 0
            || heads == 0
            || q_abs.len() != b * heads * LATENT
            || q_pe.len() != b * heads * ROPE
        {
            return Err(CudaError::Invalid(format!(
                "decode batch: {b} rows × {heads} heads vs q_abs {} / q_pe {} values",
                q_abs.len(),
                q_pe.len()
            )));
        }
        let tables: Vec<&[u32]> = queries
            .iter()
            .map(|q| cache.block_table(q.seq))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| CudaError::Invalid(e.to_string()))?;
        let max_pages = tables.iter().map(|t| t.len()).max().unwrap_or(0).max(1);
        let mut table = vec![0i32; b * max_pages];
        for (row, t) in tables.iter().enumerate() {
            for (i, &p) in t.iter().enumerate() {
                table[row * max_pages + i] = p as i32;
            }
        }
        let lens: Vec<i32> = queries.iter().map(|q| q.context as i32).collect();
        let bf = |v: &[f32]| {
            v.iter()
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect::<Vec<u16>>()
        };
        let max_splits = max_splits.max(1);
        Ok(Self {
            batch: b,
            heads,
            max_pages,
            max_len: queries.iter().map(|q| q.context).max().unwrap_or(0),
            q_abs: s.clone_htod(&bf(q_abs)).during(|| "upload q_abs".into())?,
            q_pe: s.clone_htod(&bf(q_pe)).during(|| "upload q_pe".into())?,
            block_table: s
                .clone_htod(&table)
                .during(|| "upload block table".into())?,
            seq_lens: s.clone_htod(&lens).during(|| "upload seq lens".into())?,
            out: s
                .alloc_zeros(b * heads * LATENT)
                .during(|| "alloc out".into())?,
            lse: s.alloc_zeros(b * heads).during(|| "alloc lse".into())?,
            part_out: s
                .alloc_zeros(b * heads * max_splits * LATENT)
                .during(|| "alloc part_out".into())?,
            part_lse: s
                .alloc_zeros(b * heads * max_splits)
                .during(|| "alloc part_lse".into())?,
            max_splits,
        })
    }

    /// Fills `out` and `lse` with NaN, so anything the kernels leave unwritten fails a check.
    pub fn poison(&mut self, gpu: &GpuContext) -> Result<()> {
        let s = gpu.stream();
        for buf in [&mut self.out, &mut self.lse] {
            let n = 4 * buf.len();
            let (ptr, _sync) = buf.device_ptr_mut(s);
            // SAFETY: a live allocation of n bytes on this stream's context; 0xFFFFFFFF is NaN.
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, n, s.cu_stream()) }
                .during(|| "poison outputs".into())?;
        }
        Ok(())
    }

    /// `(out [B][H][512], lse [B][H])`, after every launch has finished.
    pub fn read(&self, gpu: &GpuContext) -> Result<(Vec<f32>, Vec<f32>)> {
        gpu.synchronize()?;
        let s = gpu.stream();
        let out = s.clone_dtoh(&self.out).during(|| "download out".into())?;
        let lse = s.clone_dtoh(&self.lse).during(|| "download lse".into())?;
        gpu.synchronize()?;
        Ok((out, lse))
    }
}

/// The three kernels of one tactic, loaded for the device's SM.
pub struct MlaKernels {
    pub tactic: MlaTactic,
    pub image: PathBuf,
    /// Registers per thread of `mla_decode` as the driver reports them.
    pub registers: i32,
    decode: CudaFunction,
    combine: CudaFunction,
    append: CudaFunction,
    _module: Arc<CudaModule>,
}

impl MlaKernels {
    pub fn load(gpu: &GpuContext, tactic: MlaTactic) -> Result<Self> {
        let sm = gpu.sm()?;
        let id = tactic.id();
        let not_runnable = |why: String| CudaError::TacticNotRunnable {
            tactic: id.clone(),
            sm: sm.to_string(),
            why,
        };
        tactic.validate().map_err(|e| not_runnable(e.to_string()))?;
        let smem = tactic.smem().total;
        let limit = gpu.info().smem_optin_per_block;
        if smem > limit {
            return Err(not_runnable(format!(
                "needs {smem} B of shared memory, the device allows {limit} B per block"
            )));
        }
        let image = find_kernel_image(gpu.ptx_dir(), FAMILY, sm, &id)?;
        let bytes = std::fs::read(&image).map_err(|e| CudaError::LoadImage {
            path: image.clone(),
            detail: e.to_string(),
        })?;
        let ptx = if image.extension().is_some_and(|e| e == "ptx") {
            Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
        } else {
            Ptx::from_binary(bytes)
        };
        let module = gpu
            .context()
            .load_module(ptx)
            .map_err(|e| CudaError::LoadImage {
                path: image.clone(),
                detail: format!("cuModuleLoadData: {e}"),
            })?;
        let function = |name: &str| -> Result<CudaFunction> {
            module
                .load_function(name)
                .map_err(|e| CudaError::LoadImage {
                    path: image.clone(),
                    detail: format!("kernel {name} of tactic {id}: {e}"),
                })
        };
        let decode = function("mla_decode")?;
        // Above 48 KiB the dynamic size must be opted into per function.
        decode
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .during(|| format!("mla_decode ({id}): set max dynamic shared memory {smem} B"))?;
        let registers = decode.num_regs().during(|| "num_regs".into())?;
        let combine = function("mla_combine")?;
        let append = function("mla_append")?;
        Ok(Self {
            tactic,
            image,
            registers,
            decode,
            combine,
            append,
            _module: module,
        })
    }

    /// Runs `mla_decode` with `splits` KV splits (then `mla_combine` when `splits > 1`).
    pub fn decode(
        &self,
        gpu: &GpuContext,
        cache: &DeviceCache,
        batch: &mut DecodeBatch,
        splits: u32,
        softmax_scale: f32,
    ) -> Result<()> {
        let t = &self.tactic;
        if cache.fp8 != t.kind.is_fp8() {
            return Err(CudaError::Shape {
                tactic: t.id(),
                why: format!("cache is {}", if cache.fp8 { "FP8" } else { "BF16" }),
            });
        }
        if splits == 0 || splits as usize > batch.max_splits {
            return Err(CudaError::Shape {
                tactic: t.id(),
                why: format!("{splits} splits, workspace holds {}", batch.max_splits),
            });
        }
        let s = gpu.stream();
        let args = DecodeArgs {
            q_abs: batch.q_abs.device_ptr(s).0,
            q_pe: batch.q_pe.device_ptr(s).0,
            kv: cache.kv.device_ptr(s).0,
            kv_scale: cache.scale.device_ptr(s).0,
            kv_rope: cache.rope.device_ptr(s).0,
            block_table: batch.block_table.device_ptr(s).0,
            seq_lens: batch.seq_lens.device_ptr(s).0,
            out: batch.out.device_ptr_mut(s).0,
            lse: batch.lse.device_ptr_mut(s).0,
            part_out: batch.part_out.device_ptr_mut(s).0,
            part_lse: batch.part_lse.device_ptr_mut(s).0,
            heads: batch.heads as i32,
            max_pages: batch.max_pages as i32,
            softmax_scale,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                batch.heads.div_ceil(t.heads_per_block as usize) as u32,
                splits,
                batch.batch as u32,
            ),
            block_dim: (t.threads(), 1, 1),
            shared_mem_bytes: t.smem().total as u32,
        };
        let mut builder = s.launch_builder(&self.decode);
        builder.arg(&args);
        // SAFETY: `args` mirrors the kernel's by-value `DecodeArgs`; every buffer was sized by
        // `DecodeBatch::upload` / `DeviceCache::upload` for this grid, and the block table only
        // holds pages of the uploaded cache; the dynamic shared memory was opted into at load.
        unsafe { builder.launch(cfg) }
            .during(|| format!("launch mla_decode of {t} (grid {:?})", cfg.grid_dim))?;
        if splits > 1 {
            let mut builder = s.launch_builder(&self.combine);
            let split_count = splits as i32;
            builder
                .arg(&batch.part_out)
                .arg(&batch.part_lse)
                .arg(&mut batch.out)
                .arg(&mut batch.lse)
                .arg(&split_count);
            let cfg = LaunchConfig {
                grid_dim: ((batch.batch * batch.heads) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the workspace holds batch × heads × splits partials (checked above).
            unsafe { builder.launch(cfg) }.during(|| format!("launch mla_combine of {t}"))?;
        }
        Ok(())
    }

    /// Runs `mla_append`: `latent [n][512]` (pre-RMSNorm) and `rope [n][64]` (RoPE'd) into
    /// `slots` of `cache`; `static_scale` 0 selects per-token FP8 scales.
    #[allow(clippy::too_many_arguments)]
    pub fn append(
        &self,
        gpu: &GpuContext,
        cache: &mut DeviceCache,
        latent: &[f32],
        rope: &[f32],
        norm_weight: &[f32],
        eps: f32,
        slots: &[i32],
        static_scale: f32,
    ) -> Result<()> {
        let n = slots.len();
        if n == 0
            || latent.len() != n * LATENT
            || rope.len() != n * ROPE
            || norm_weight.len() != LATENT
            || slots.iter().any(|&s| s >= cache.slots as i32)
        {
            return Err(CudaError::Invalid("mla_append: inconsistent inputs".into()));
        }
        let s = gpu.stream();
        let w: Vec<u16> = norm_weight
            .iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect();
        let d_latent = s.clone_htod(latent).during(|| "upload latent".into())?;
        let d_rope = s.clone_htod(rope).during(|| "upload rope".into())?;
        let d_w = s.clone_htod(&w).during(|| "upload norm weight".into())?;
        let d_slots = s.clone_htod(slots).during(|| "upload slots".into())?;
        let mut builder = s.launch_builder(&self.append);
        builder
            .arg(&d_latent)
            .arg(&d_rope)
            .arg(&d_w)
            .arg(&eps)
            .arg(&d_slots)
            .arg(&mut cache.kv)
            .arg(&mut cache.scale)
            .arg(&mut cache.rope)
            .arg(&static_scale);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one CTA per row of the uploaded inputs; slots are checked against the cache.
        unsafe { builder.launch(cfg) }.during(|| "launch mla_append".into())?;
        gpu.synchronize()
    }
}
