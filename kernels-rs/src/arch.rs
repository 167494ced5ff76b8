//! The GPUs the kernels are built for: their SM targets, the per-block and per-SM limits the
//! tactics are validated against, and named figures of the reference GPUs for the tuning lab's
//! cost model (`autotune`).
//!
//! Limits are architectural (CUDA programming guide, compute-capability tables). The
//! [`GpuSpec`] figures are vendor or community figures collected in the project's facts sheet,
//! or derived from them where said; none of them is measured by this project. A prediction
//! built on them is labelled `predicted`.

use std::fmt;

/// SM120 (RTX PRO 6000 / RTX 5090): opt-in dynamic shared memory per block. Far below SM100's
/// 232,448: stage counts that fit a B200 overflow here.
pub const SM120_SMEM_OPTIN_PER_BLOCK: usize = 101_376;
/// SM90 (H100/H200): opt-in dynamic shared memory per block.
pub const SM90_SMEM_OPTIN_PER_BLOCK: usize = 232_448;
/// Static `__shared__` arrays may not exceed this on any SM; larger tiles need the opt-in.
pub const STATIC_SMEM_LIMIT: usize = 49_152;
/// Architectural register ceiling per thread (ptxas never exceeds it; it spills instead).
pub const MAX_REGS_PER_THREAD: u32 = 255;
pub const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// Largest block dimensions (x, y, z) a launch may have on every supported SM.
pub const MAX_BLOCK_DIM: (u32, u32, u32) = (1024, 1024, 64);
/// Largest grid dimensions (x, y, z) a launch may have on every supported SM.
pub const MAX_GRID_DIM: (u32, u32, u32) = (i32::MAX as u32, 65_535, 65_535);
pub const WARP_SIZE: u32 = 32;

/// A compile target of the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Sm {
    Sm90,
    Sm120,
}

impl Sm {
    pub const ALL: [Sm; 2] = [Sm::Sm90, Sm::Sm120];

    /// The `a` targets: the block-scaled MMA exists only for sm_120a, and sm_90a keeps the
    /// compiled code off future SMs that would need a rebuild anyway.
    pub fn arch(self) -> &'static str {
        match self {
            Sm::Sm90 => "sm_90a",
            Sm::Sm120 => "sm_120a",
        }
    }

    pub fn compute(self) -> &'static str {
        match self {
            Sm::Sm90 => "compute_90a",
            Sm::Sm120 => "compute_120a",
        }
    }

    pub fn smem_optin_per_block(self) -> usize {
        match self {
            Sm::Sm90 => SM90_SMEM_OPTIN_PER_BLOCK,
            Sm::Sm120 => SM120_SMEM_OPTIN_PER_BLOCK,
        }
    }

    pub fn parse(s: &str) -> Option<Sm> {
        match s {
            "sm_90a" | "sm90" | "90" => Some(Sm::Sm90),
            "sm_120a" | "sm120" | "120" => Some(Sm::Sm120),
            _ => None,
        }
    }

    /// Per-SM resources that bound occupancy.
    pub fn limits(self) -> SmLimits {
        match self {
            // Compute capability 9.0: 64K registers, 2048 threads, 32 blocks, 228 KiB of
            // shared memory per SM (1 KiB of it reserved per resident block).
            Sm::Sm90 => SmLimits {
                registers_per_sm: 65_536,
                max_threads_per_sm: 2048,
                max_blocks_per_sm: 32,
                smem_per_sm: 233_472,
                smem_reserved_per_block: 1024,
                register_alloc_unit: 256,
            },
            // Compute capability 12.0: 64K registers, 1536 threads, 32 blocks, 128 KiB of
            // shared memory + L1 per SM of which 100 KiB can be shared memory (1 KiB reserved
            // per resident block: 99 KiB opt-in per block).
            Sm::Sm120 => SmLimits {
                registers_per_sm: 65_536,
                max_threads_per_sm: 1536,
                max_blocks_per_sm: 32,
                smem_per_sm: 102_400,
                smem_reserved_per_block: 1024,
                register_alloc_unit: 256,
            },
        }
    }

    /// The GPU of this SM the project targets: its figures feed the cost model.
    pub fn reference_gpu(self) -> &'static GpuSpec {
        match self {
            Sm::Sm90 => &H200,
            Sm::Sm120 => &RTX_PRO_6000,
        }
    }
}

impl fmt::Display for Sm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.arch())
    }
}

/// Resources of one SM that limit how many blocks of a kernel are resident at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmLimits {
    pub registers_per_sm: u32,
    pub max_threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub smem_per_sm: usize,
    pub smem_reserved_per_block: usize,
    /// Registers are allocated per warp in units of this many.
    pub register_alloc_unit: u32,
}

impl SmLimits {
    /// Blocks of a kernel resident per SM (0: it cannot launch), from its registers per
    /// thread, threads per block and shared memory per block (static + dynamic).
    pub fn blocks_per_sm(&self, registers: u32, threads: u32, smem: usize) -> u32 {
        if threads == 0 || threads > MAX_THREADS_PER_BLOCK || registers > MAX_REGS_PER_THREAD {
            return 0;
        }
        let warps = threads.div_ceil(WARP_SIZE);
        let regs_per_warp = (registers.max(1) * WARP_SIZE).div_ceil(self.register_alloc_unit)
            * self.register_alloc_unit;
        let by_regs = self.registers_per_sm / (regs_per_warp * warps);
        let by_threads = self.max_threads_per_sm / (warps * WARP_SIZE);
        let by_smem = if smem == 0 {
            self.max_blocks_per_sm
        } else {
            (self.smem_per_sm / (smem + self.smem_reserved_per_block)) as u32
        };
        by_regs
            .min(by_threads)
            .min(by_smem)
            .min(self.max_blocks_per_sm)
    }
}

/// Named figures of one GPU, for the cost model. Every figure says where it comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSpec {
    pub name: &'static str,
    pub sm: Sm,
    pub sms: u32,
    /// DRAM bandwidth the model streams weights at, GB/s (10⁹ B/s).
    pub mem_bandwidth_gbs: f64,
    pub l2_bytes: usize,
    /// Dense tensor-core peaks, TFLOPS (10¹² FLOP/s). `None`: no such tensor-core path.
    pub fp4_dense_tflops: Option<f64>,
    pub fp8_dense_tflops: f64,
    pub bf16_dense_tflops: f64,
    /// Host-side cost of one kernel launch (stream order, no graph), µs.
    pub launch_overhead_us: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

/// NVIDIA RTX PRO 6000 Blackwell (workstation / server edition), SM120.
pub const RTX_PRO_6000: GpuSpec = GpuSpec {
    name: "NVIDIA RTX PRO 6000 Blackwell",
    sm: Sm::Sm120,
    // 188 SMs, 96 GB GDDR7 at 1792 GB/s, 128 MB L2: vendor data sheet.
    sms: 188,
    mem_bandwidth_gbs: 1792.0,
    l2_bytes: 128 * 1024 * 1024,
    // ~2 PFLOPS dense FP4 (the 4 PFLOPS of the data sheet is the 2:4-sparse figure).
    fp4_dense_tflops: Some(2000.0),
    // Derived, not published as such here: Blackwell's tensor cores run FP4 : FP8 : BF16 at
    // 4 : 2 : 1 per clock, so FP8 ≈ 1000 and BF16 ≈ 500 TFLOPS dense (FP32 accumulate).
    fp8_dense_tflops: 1000.0,
    bf16_dense_tflops: 500.0,
    // A few µs per launch without CUDA graphs (a common rule of thumb, not measured here).
    launch_overhead_us: 4.0,
    source: "vendor data sheet (SMs, bandwidth, L2, sparse FP4 halved); FP8/BF16 derived 4:2:1",
};

/// NVIDIA H200 (SXM), SM90: the GPU lent to some tasks of this project.
pub const H200: GpuSpec = GpuSpec {
    name: "NVIDIA H200",
    sm: Sm::Sm90,
    sms: 132,
    // 4.8 TB/s on the data sheet; ~4.3 TB/s is the device-to-device copy rate measured on the
    // lent H200 (facts sheet), which is what a streaming kernel can reach.
    mem_bandwidth_gbs: 4300.0,
    l2_bytes: 50 * 1024 * 1024,
    // No FP4 tensor cores on SM90.
    fp4_dense_tflops: None,
    // H100/H200 SXM data sheet: 1979 FP8 / 989 BF16 TFLOPS dense (sparse figures are 2×).
    fp8_dense_tflops: 1979.0,
    bf16_dense_tflops: 989.0,
    launch_overhead_us: 4.0,
    source: "data sheet (SMs, L2, dense FP8/BF16); bandwidth = measured copy rate (facts sheet)",
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_is_bounded_by_each_resource() {
        let l = Sm::Sm120.limits();
        // 128 threads at 128 registers: 16K registers per block → 4 blocks by registers.
        assert_eq!(l.blocks_per_sm(128, 128, 0), 4);
        // 90 KB of shared memory: one block.
        assert_eq!(l.blocks_per_sm(32, 128, 90_000), 1);
        // 1024 threads: one block by threads on SM120 (1536 per SM), 2 on SM90 (2048).
        assert_eq!(l.blocks_per_sm(32, 1024, 0), 1);
        assert_eq!(Sm::Sm90.limits().blocks_per_sm(32, 1024, 0), 2);
        // Over the per-thread register ceiling: cannot launch.
        assert_eq!(l.blocks_per_sm(256, 128, 0), 0);
    }

    #[test]
    fn reference_gpus_match_their_sm() {
        for sm in Sm::ALL {
            assert_eq!(sm.reference_gpu().sm, sm);
        }
        assert_eq!(RTX_PRO_6000.sms, 188);
        assert!(H200.fp4_dense_tflops.is_none());
    }
}
