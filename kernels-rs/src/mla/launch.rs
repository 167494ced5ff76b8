//! Launching the MLA kernels (`mla_decode`, `mla_combine`, `mla_append` of `mla_decode.cu`)
//! on any [`Device`]: a GPU (`cuda::GpuContext`, cubins of the compile gate) or the host
//! execution layer (`cuda_host::HostDevice`). The GPU check is `bin/mla-gpu-check.rs`; the
//! host tests are `tests/tests/host_mla.rs`.
//!
//! Device layouts (the kernel's, see the .cu header), for the tactic's widths L (latent) and R
//! (RoPE): the cache exactly as [`PagedLatentCache::raw_layer`] stores it; queries
//! `[B][H][L]` / `[B][H][R]` BF16; block tables `[B][max_pages]` i32; outputs `[B][H][L]` and
//! `[B][H]` f32.

use half::bf16;

use super::cache::{KvCacheDtype, LatentCacheShape, PAGE_TOKENS, PagedLatentCache, RawLayer};
use super::reference::AttentionQuery;
use super::tactic::{MlaDims, MlaTactic};
use crate::device::{
    Device, DeviceError, DeviceExt, DeviceMemory, KernelParams, LaunchConfig, Result,
};

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

/// Names of the three kernels in every MLA image.
pub const DECODE_KERNEL: &str = "mla_decode";
pub const COMBINE_KERNEL: &str = "mla_combine";
pub const APPEND_KERNEL: &str = "mla_append";
/// Threads of `mla_combine` and `mla_append` (their `__launch_bounds__`).
const AUX_THREADS: u32 = 128;

/// One layer of the cache on a device.
pub struct DeviceCache<D: Device> {
    pub fp8: bool,
    /// Latent and RoPE values per token.
    pub dims: MlaDims,
    /// BF16 `kv [slots][L + R]` (as bytes) or FP8 codes `[slots][L]`.
    kv: D::Memory,
    scale: D::Memory,
    rope: D::Memory,
    pub slots: usize,
    pub bytes_per_token: usize,
}

impl<D: Device> DeviceCache<D> {
    /// Uploads `layer` of `cache` (BF16 or FP8; the F32 reference dtype has no kernel).
    pub fn upload(dev: &D, cache: &PagedLatentCache, layer: usize) -> Result<Self> {
        let shape = cache.shape();
        let dims = MlaDims {
            latent: shape.latent_dim,
            rope: shape.rope_dim,
        };
        dims.validate()
            .map_err(|why| DeviceError::Invalid(format!("mla kernels: cache {why}")))?;
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        let bytes_per_token = cache.dtype().bytes_per_token(&shape);
        match cache.raw_layer(layer) {
            RawLayer::Bf16 { values } => Ok(Self {
                fp8: false,
                dims,
                slots: values.len() / dims.row(),
                kv: dev.upload(&bits(values))?,
                // Unused by BF16 kernels; one element keeps the pointers valid.
                scale: dev.alloc_elements::<f32>(1)?,
                rope: dev.alloc_elements::<u16>(1)?,
                bytes_per_token,
            }),
            RawLayer::Fp8 {
                latent,
                scales,
                rope,
            } => Ok(Self {
                fp8: true,
                dims,
                slots: scales.len(),
                kv: dev.upload(latent)?,
                scale: dev.upload(scales)?,
                rope: dev.upload(&bits(rope))?,
                bytes_per_token,
            }),
            RawLayer::F32 { .. } => Err(DeviceError::Invalid(
                "the F32 cache is the CPU reference's; the kernels read BF16 or FP8".into(),
            )),
        }
    }

    /// An empty (zeroed) cache layer of `slots` token slots on the device: BF16
    /// `[slots][L + R]`, or FP8 codes `[slots][L]` with per-slot scales and BF16 rope
    /// `[slots][R]`.
    pub fn alloc(dev: &D, dtype: KvCacheDtype, dims: MlaDims, slots: usize) -> Result<Self> {
        dims.validate()
            .map_err(|why| DeviceError::Invalid(format!("mla kernels: cache {why}")))?;
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: dims.latent,
            rope_dim: dims.rope,
        };
        let bytes_per_token = dtype.bytes_per_token(&shape);
        match dtype {
            KvCacheDtype::Bf16 => Ok(Self {
                fp8: false,
                dims,
                kv: dev.alloc_elements::<u16>(slots * dims.row())?,
                scale: dev.alloc_elements::<f32>(1)?,
                rope: dev.alloc_elements::<u16>(1)?,
                slots,
                bytes_per_token,
            }),
            KvCacheDtype::Fp8E4m3 => Ok(Self {
                fp8: true,
                dims,
                kv: dev.alloc_elements::<u8>(slots * dims.latent)?,
                scale: dev.alloc_elements::<f32>(slots)?,
                rope: dev.alloc_elements::<u16>(slots * dims.rope)?,
                slots,
                bytes_per_token,
            }),
            KvCacheDtype::F32 => Err(DeviceError::Invalid(
                "the F32 cache is the CPU reference's; the kernels read BF16 or FP8".into(),
            )),
        }
    }

    /// Device bytes the layer occupies.
    pub fn device_bytes(&self) -> usize {
        self.kv.len() + self.scale.len() + self.rope.len()
    }

    /// `(kv or codes, scales, rope)` as downloaded host vectors (the append check).
    pub fn download(&self, dev: &D) -> Result<(Vec<u8>, Vec<f32>, Vec<u16>)> {
        Ok((
            dev.download_bytes(&self.kv)?,
            dev.download(&self.scale)?,
            dev.download(&self.rope)?,
        ))
    }
}

/// Queries, block tables and outputs of one decode step.
pub struct DecodeBatch<D: Device> {
    pub batch: usize,
    pub heads: usize,
    pub dims: MlaDims,
    pub max_pages: usize,
    pub max_len: usize,
    q_abs: D::Memory,
    q_pe: D::Memory,
    block_table: D::Memory,
    seq_lens: D::Memory,
    out: D::Memory,
    lse: D::Memory,
    part_out: D::Memory,
    part_lse: D::Memory,
    max_splits: usize,
}

impl<D: Device> DecodeBatch<D> {
    /// `q_abs [rows][heads][L]`, `q_pe [rows][heads][R]` (rounded to BF16 here) for the cache's
    /// widths; one row per query, attending to its sequence's first `context` tokens.
    pub fn upload(
        dev: &D,
        cache: &PagedLatentCache,
        queries: &[AttentionQuery],
        heads: usize,
        q_abs: &[f32],
        q_pe: &[f32],
        max_splits: usize,
    ) -> Result<Self> {
        let b = queries.len();
        let shape = cache.shape();
        let dims = MlaDims {
            latent: shape.latent_dim,
            rope: shape.rope_dim,
        };
        if b == 0
            || heads == 0
            || q_abs.len() != b * heads * dims.latent
            || q_pe.len() != b * heads * dims.rope
        {
            return Err(DeviceError::Invalid(format!(
                "decode batch: {b} rows × {heads} heads vs q_abs {} / q_pe {} values",
                q_abs.len(),
                q_pe.len()
            )));
        }
        let tables: Vec<&[u32]> = queries
            .iter()
            .map(|q| cache.block_table(q.seq))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| DeviceError::Invalid(e.to_string()))?;
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
        let mut batch = Self {
            batch: b,
            heads,
            dims,
            max_pages,
            max_len: queries.iter().map(|q| q.context).max().unwrap_or(0),
            q_abs: dev.upload(&bf(q_abs))?,
            q_pe: dev.upload(&bf(q_pe))?,
            block_table: dev.upload(&table)?,
            seq_lens: dev.upload(&lens)?,
            out: dev.alloc_elements::<f32>(b * heads * dims.latent)?,
            lse: dev.alloc_elements::<f32>(b * heads)?,
            part_out: dev.alloc_elements::<f32>(b * heads * max_splits * dims.latent)?,
            part_lse: dev.alloc_elements::<f32>(b * heads * max_splits)?,
            max_splits,
        };
        batch.poison(dev)?;
        Ok(batch)
    }

    /// Fills outputs and split workspaces with NaN (0xFF bytes), so anything the kernels
    /// leave unwritten fails a check.
    pub fn poison(&mut self, dev: &D) -> Result<()> {
        for buf in [
            &mut self.out,
            &mut self.lse,
            &mut self.part_out,
            &mut self.part_lse,
        ] {
            dev.fill(buf, 0xFF)?;
        }
        Ok(())
    }

    /// `(out [B][H][L], lse [B][H])`, after every launch has finished.
    pub fn read(&self, dev: &D) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((dev.download(&self.out)?, dev.download(&self.lse)?))
    }
}

/// The three kernels of one tactic, loaded for the device.
pub struct MlaKernels<D: Device> {
    pub tactic: MlaTactic,
    pub decode: D::Kernel,
    pub combine: D::Kernel,
    pub append: D::Kernel,
}

impl<D: Device> MlaKernels<D> {
    pub fn load(dev: &D, tactic: MlaTactic) -> Result<Self> {
        let sm = dev.sm()?;
        let id = tactic.id();
        let not_runnable = |why: String| DeviceError::TacticNotRunnable {
            tactic: id.clone(),
            sm: sm.to_string(),
            why,
        };
        tactic.validate().map_err(|e| not_runnable(e.to_string()))?;
        let smem = tactic.smem().total;
        let limit = dev.max_dynamic_shared();
        if smem > limit {
            return Err(not_runnable(format!(
                "needs {smem} B of shared memory, the device allows {limit} B per block"
            )));
        }
        Ok(Self {
            tactic,
            decode: dev.load_kernel(FAMILY, &id, DECODE_KERNEL, smem)?,
            combine: dev.load_kernel(FAMILY, &id, COMBINE_KERNEL, 0)?,
            append: dev.load_kernel(FAMILY, &id, APPEND_KERNEL, 0)?,
        })
    }

    /// Launch geometry of `mla_decode` for a batch and a split count.
    pub fn decode_config(&self, batch: usize, heads: usize, splits: u32) -> LaunchConfig {
        let t = &self.tactic;
        LaunchConfig {
            grid_dim: (
                heads.div_ceil(t.heads_per_block as usize) as u32,
                splits,
                batch as u32,
            ),
            block_dim: (t.threads(), 1, 1),
            shared_mem_bytes: t.smem().total as u32,
        }
    }

    /// Runs `mla_decode` with `splits` KV splits (then `mla_combine` when `splits > 1`).
    pub fn decode(
        &self,
        dev: &D,
        cache: &DeviceCache<D>,
        batch: &mut DecodeBatch<D>,
        splits: u32,
        softmax_scale: f32,
    ) -> Result<()> {
        let io = DecodeIo {
            rows: batch.batch,
            heads: batch.heads,
            max_pages: batch.max_pages,
            max_splits: batch.max_splits,
            q_abs: &batch.q_abs,
            q_pe: &batch.q_pe,
            block_table: &batch.block_table,
            seq_lens: &batch.seq_lens,
            out: &batch.out,
            lse: &batch.lse,
            part_out: &batch.part_out,
            part_lse: &batch.part_lse,
            cached_tokens: batch.batch * batch.max_len,
        };
        self.decode_io(dev, cache, &io, splits, softmax_scale)
    }

    /// [`decode`](Self::decode) over device buffers the caller owns (an executor's step
    /// workspace): nothing is uploaded or read back.
    pub fn decode_io(
        &self,
        dev: &D,
        cache: &DeviceCache<D>,
        io: &DecodeIo<'_, D>,
        splits: u32,
        softmax_scale: f32,
    ) -> Result<()> {
        let t = &self.tactic;
        if cache.fp8 != t.kind.is_fp8() {
            return Err(DeviceError::Shape {
                tactic: t.id(),
                why: format!("cache is {}", if cache.fp8 { "FP8" } else { "BF16" }),
            });
        }
        if cache.dims != t.dims {
            return Err(DeviceError::Shape {
                tactic: t.id(),
                why: format!("cache rows are {}, the kernel's {}", cache.dims, t.dims),
            });
        }
        if splits == 0 || splits as usize > io.max_splits {
            return Err(DeviceError::Shape {
                tactic: t.id(),
                why: format!("{splits} splits, workspace holds {}", io.max_splits),
            });
        }
        io.check(t.dims, splits)?;
        let args = DecodeArgs {
            q_abs: io.q_abs.device_ptr(),
            q_pe: io.q_pe.device_ptr(),
            kv: cache.kv.device_ptr(),
            kv_scale: cache.scale.device_ptr(),
            kv_rope: cache.rope.device_ptr(),
            block_table: io.block_table.device_ptr(),
            seq_lens: io.seq_lens.device_ptr(),
            out: io.out.device_ptr(),
            lse: io.lse.device_ptr(),
            part_out: io.part_out.device_ptr(),
            part_lse: io.part_lse.device_ptr(),
            heads: io.heads as i32,
            max_pages: io.max_pages as i32,
            softmax_scale,
        };
        let cfg = self.decode_config(io.rows, io.heads, splits);
        let (rows, heads, latent) = (io.rows, io.heads, t.dims.latent);
        let query_bytes = rows * heads * t.dims.row() * 2;
        let result_bytes = if splits > 1 {
            rows * heads * splits as usize * (latent + 1) * 4
        } else {
            rows * heads * (latent + 1) * 4
        };
        let mut params = KernelParams::new();
        params.arg(&args).traffic(
            io.cached_tokens * cache.bytes_per_token
                + query_bytes
                + (io.cached_tokens.div_ceil(PAGE_TOKENS) + rows) * 4,
            result_bytes,
        );
        // SAFETY: `args` mirrors the kernel's by-value `DecodeArgs`; every buffer was checked
        // by `DecodeIo::check` for this grid, and the block table only holds pages of the
        // cache (the caller's page tables hand out no others); the dynamic shared memory was
        // opted into at load.
        unsafe { dev.launch(&self.decode, cfg, &params) }?;
        if splits > 1 {
            let (part_out, part_lse, out, lse) = (
                io.part_out.device_ptr(),
                io.part_lse.device_ptr(),
                io.out.device_ptr(),
                io.lse.device_ptr(),
            );
            let split_count = splits as i32;
            let mut params = KernelParams::new();
            params
                .arg(&part_out)
                .arg(&part_lse)
                .arg(&out)
                .arg(&lse)
                .arg(&split_count)
                .traffic(result_bytes, rows * heads * (latent + 1) * 4);
            let cfg = LaunchConfig {
                grid_dim: ((io.rows * io.heads) as u32, 1, 1),
                block_dim: (AUX_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the workspace holds rows × heads × splits partials (checked above).
            unsafe { dev.launch(&self.combine, cfg, &params) }?;
        }
        Ok(())
    }

    /// Runs `mla_append`: `latent [n][L]` (pre-RMSNorm) and `rope [n][R]` (RoPE'd) into
    /// `slots` of `cache`; `static_scale` 0 selects per-token FP8 scales.
    #[allow(clippy::too_many_arguments)]
    pub fn append(
        &self,
        dev: &D,
        cache: &mut DeviceCache<D>,
        latent: &[f32],
        rope: &[f32],
        norm_weight: &[f32],
        eps: f32,
        slots: &[i32],
        static_scale: f32,
    ) -> Result<()> {
        let n = slots.len();
        let MlaDims { latent: l, rope: r } = self.tactic.dims;
        if n == 0
            || latent.len() != n * l
            || rope.len() != n * r
            || norm_weight.len() != l
            || slots.iter().any(|&s| s >= cache.slots as i32)
        {
            return Err(DeviceError::Invalid(
                "mla_append: inconsistent inputs".into(),
            ));
        }
        let w: Vec<u16> = norm_weight
            .iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect();
        let d_latent = dev.upload(latent)?;
        let d_rope = dev.upload(rope)?;
        let d_w = dev.upload(&w)?;
        let d_slots = dev.upload(slots)?;
        self.append_io(
            dev,
            cache,
            &d_latent,
            &d_rope,
            &d_w,
            eps,
            &d_slots,
            n,
            static_scale,
        )?;
        dev.synchronize()
    }

    /// [`append`](Self::append) from device buffers: `latent [n][L]` and `rope [n][R]`
    /// FP32, the BF16 `norm_weight [L]`, `slots [n]` i32 (a negative slot skips its row).
    /// Slots must lie inside `cache` (the caller's page tables guarantee it).
    #[allow(clippy::too_many_arguments)]
    pub fn append_io(
        &self,
        dev: &D,
        cache: &mut DeviceCache<D>,
        latent: &D::Memory,
        rope: &D::Memory,
        norm_weight: &D::Memory,
        eps: f32,
        slots: &D::Memory,
        n: usize,
        static_scale: f32,
    ) -> Result<()> {
        let MlaDims { latent: l, rope: r } = self.tactic.dims;
        if cache.dims != self.tactic.dims || cache.fp8 != self.tactic.kind.is_fp8() {
            return Err(DeviceError::Shape {
                tactic: self.tactic.id(),
                why: format!(
                    "mla_append into a {} cache of {}",
                    if cache.fp8 { "FP8" } else { "BF16" },
                    cache.dims
                ),
            });
        }
        if n == 0
            || latent.len() < n * l * 4
            || rope.len() < n * r * 4
            || norm_weight.len() < l * 2
            || slots.len() < n * 4
        {
            return Err(DeviceError::Invalid(format!(
                "mla_append: {n} rows need latent {} B, rope {} B, weight {} B, slots {} B; \
                 got {}, {}, {}, {}",
                n * l * 4,
                n * r * 4,
                l * 2,
                n * 4,
                latent.len(),
                rope.len(),
                norm_weight.len(),
                slots.len()
            )));
        }
        let ptrs = [
            latent.device_ptr(),
            rope.device_ptr(),
            norm_weight.device_ptr(),
            slots.device_ptr(),
            cache.kv.device_ptr(),
            cache.scale.device_ptr(),
            cache.rope.device_ptr(),
        ];
        let mut params = KernelParams::new();
        params
            .arg(&ptrs[0])
            .arg(&ptrs[1])
            .arg(&ptrs[2])
            .arg(&eps)
            .arg(&ptrs[3])
            .arg(&ptrs[4])
            .arg(&ptrs[5])
            .arg(&ptrs[6])
            .arg(&static_scale)
            .traffic(n * ((l + r) * 4 + 4) + l * 2, n * cache.bytes_per_token);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (AUX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one CTA per row of the inputs (sizes checked above); the slots lie inside the
        // cache (the caller's contract).
        unsafe { dev.launch(&self.append, cfg, &params) }
    }
}

/// Device buffers of one `mla_decode` launch, owned by the caller: `q_abs [rows][heads][L]`
/// and `q_pe [rows][heads][R]` BF16, `block_table [rows][max_pages]` and `seq_lens [rows]`
/// i32, `out [rows][heads][L]` and `lse [rows][heads]` FP32, and the split workspace for up
/// to `max_splits` splits.
pub struct DecodeIo<'a, D: Device> {
    pub rows: usize,
    pub heads: usize,
    pub max_pages: usize,
    pub max_splits: usize,
    pub q_abs: &'a D::Memory,
    pub q_pe: &'a D::Memory,
    pub block_table: &'a D::Memory,
    pub seq_lens: &'a D::Memory,
    pub out: &'a D::Memory,
    pub lse: &'a D::Memory,
    pub part_out: &'a D::Memory,
    pub part_lse: &'a D::Memory,
    /// Tokens the rows attend over in total (the sum of `seq_lens`, as the host knows it when
    /// it issues the launch): launch traffic accounting only.
    pub cached_tokens: usize,
}

impl<D: Device> DecodeIo<'_, D> {
    /// Buffer sizes for a launch with `splits` splits over a cache of `dims` (the split
    /// workspace only matters when there are several).
    fn check(&self, dims: MlaDims, splits: u32) -> Result<()> {
        let (r, h, latent) = (self.rows, self.heads, dims.latent);
        let s = if splits > 1 { self.max_splits } else { 0 };
        let sizes = [
            ("q_abs", self.q_abs.len(), r * h * latent * 2),
            ("q_pe", self.q_pe.len(), r * h * dims.rope * 2),
            (
                "block_table",
                self.block_table.len(),
                r * self.max_pages * 4,
            ),
            ("seq_lens", self.seq_lens.len(), r * 4),
            ("out", self.out.len(), r * h * latent * 4),
            ("lse", self.lse.len(), r * h * 4),
            ("part_out", self.part_out.len(), r * h * s * latent * 4),
            ("part_lse", self.part_lse.len(), r * h * s * 4),
        ];
        if r == 0 || h == 0 || self.max_pages == 0 {
            return Err(DeviceError::Invalid(format!(
                "mla_decode: {r} rows × {h} heads, {} pages",
                self.max_pages
            )));
        }
        for (name, have, want) in sizes {
            if have < want {
                return Err(DeviceError::Invalid(format!(
                    "mla_decode: {name} holds {have} B, the launch needs {want} B"
                )));
            }
        }
        Ok(())
    }
}
