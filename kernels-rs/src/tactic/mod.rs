//! One tactic abstraction for every kernel family.
//!
//! A tactic is one point of a family's tuning space: everything its kernel is compiled or
//! launched with. The [`Tactic`] trait gives what the compile gate, the GPU checks, the tuning
//! lab (`autotune`) and the runtime selection need from any family: a stable id that parses
//! back, validation against an SM's limits (a tactic that cannot launch on an SM is never
//! offered to it), the shared-memory footprint, the problem shapes it serves, and the
//! heuristic default used when no tuned choice is available. Running a tactic against the
//! goldens needs the host execution layer or a GPU, so it lives with them (`autotune`'s
//! correct stage), built on the same launchers and check harnesses as the tests.
//!
//! [`cache`] holds the tuning results (the tactic cache) the runtime reads; [`timing`] is the
//! seam through which the lab's timed stage and the CUDA sweeps time tactics on a GPU.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::allreduce::algorithm::{Algorithm, Transfer};
use crate::allreduce::element::DType;
use crate::allreduce::tactic::{AllReduceTactic, default_blocks};
use crate::arch::Sm;
use crate::layers::LayersTactic;
use crate::mla::{MlaDims, MlaKind, MlaSplitTactic, MlaTactic};
use crate::moe_gemm::MoeGemmTactic;

pub mod cache;
pub mod timing;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TacticError {
    Parse(String),
    Invalid(String),
}

impl fmt::Display for TacticError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TacticError::Parse(s) => write!(f, "cannot parse tactic id: {s}"),
            TacticError::Invalid(s) => write!(f, "invalid tactic: {s}"),
        }
    }
}

impl std::error::Error for TacticError {}

/// The kernel families that have tactics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelFamily {
    /// The NVFP4 grouped GEMM of the routed experts (`moe_gemm.cu`).
    MoeGemm,
    /// MLA decode attention (`mla_decode.cu`).
    #[serde(rename = "mla")]
    MlaDecode,
    /// The CUDA IPC all-reduce (`allreduce.cu`).
    #[serde(rename = "allreduce")]
    AllReduce,
    /// The decode step's small kernels and BF16 decode products (`layers.cu`).
    Layers,
    /// The CPU kernels.
    Cpu,
}

impl KernelFamily {
    pub const ALL: [KernelFamily; 5] = [
        KernelFamily::MoeGemm,
        KernelFamily::MlaDecode,
        KernelFamily::AllReduce,
        KernelFamily::Layers,
        KernelFamily::Cpu,
    ];

    /// Stable name: the folder under `ptx/` and the manifest's `family` for GPU families.
    pub fn id(self) -> &'static str {
        match self {
            KernelFamily::MoeGemm => "moe_gemm",
            KernelFamily::MlaDecode => "mla",
            KernelFamily::AllReduce => "allreduce",
            KernelFamily::Layers => "layers",
            KernelFamily::Cpu => "cpu",
        }
    }

    pub fn parse(s: &str) -> Option<KernelFamily> {
        KernelFamily::ALL.into_iter().find(|f| f.id() == s)
    }

    /// The CUDA source of a GPU family, relative to the repository root.
    pub fn source_path(self) -> Option<&'static str> {
        match self {
            KernelFamily::MoeGemm => Some("kernels-rs/src/moe_gemm/moe_gemm.cu"),
            KernelFamily::MlaDecode => Some("kernels-rs/src/mla/mla_decode.cu"),
            KernelFamily::AllReduce => Some("kernels-rs/src/allreduce/allreduce.cu"),
            KernelFamily::Layers => Some("kernels-rs/src/layers/layers.cu"),
            KernelFamily::Cpu => None,
        }
    }
}

impl fmt::Display for KernelFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

/// One problem a tactic is tuned for, on one GPU (shapes are per rank under tensor
/// parallelism).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ProblemShape {
    /// One MoE layer's grouped GEMM: `active_experts` experts with `tokens_per_expert` routed
    /// rows each; `inter` is the per-rank intermediate size.
    Moe {
        tokens_per_expert: u32,
        active_experts: u32,
        hidden: u32,
        inter: u32,
    },
    /// MLA decode of `batch` requests of `context` cached tokens with `heads` heads per rank,
    /// over cache rows of `latent` + `rope` values (Kimi-K2.5's 512 + 64 when a cache file
    /// written before the widths were recorded omits them).
    Mla {
        batch: u32,
        heads: u32,
        context: u32,
        fp8_cache: bool,
        #[serde(default = "kimi_latent")]
        latent: u32,
        #[serde(default = "kimi_rope")]
        rope: u32,
    },
    /// One all-reduce of `elements` values over `ranks` GPUs.
    AllReduce {
        elements: u64,
        dtype: String,
        ranks: u32,
    },
    /// A dense product `[m, k] × [k, n]` (BF16 weights on the GPU; any format on the CPU).
    Dense { m: u32, n: u32, k: u32 },
}

fn kimi_latent() -> u32 {
    MlaDims::KIMI.latent as u32
}

fn kimi_rope() -> u32 {
    MlaDims::KIMI.rope as u32
}

impl ProblemShape {
    /// An MLA decode shape over cache rows of `dims`.
    pub fn mla(batch: u32, heads: u32, context: u32, fp8_cache: bool, dims: MlaDims) -> Self {
        ProblemShape::Mla {
            batch,
            heads,
            context,
            fp8_cache,
            latent: dims.latent as u32,
            rope: dims.rope as u32,
        }
    }

    /// The cache row's widths of an MLA shape.
    pub fn mla_dims(&self) -> Option<MlaDims> {
        match *self {
            ProblemShape::Mla { latent, rope, .. } => Some(MlaDims {
                latent: latent as usize,
                rope: rope as usize,
            }),
            _ => None,
        }
    }

    /// The cache key of the shape: stable, readable, one per bucket.
    pub fn bucket(&self) -> String {
        match self {
            ProblemShape::Moe {
                tokens_per_expert,
                active_experts,
                hidden,
                inter,
            } => format!("moe_t{tokens_per_expert}_e{active_experts}_h{hidden}_i{inter}"),
            ProblemShape::Mla {
                batch,
                heads,
                context,
                fp8_cache,
                latent,
                rope,
            } => {
                // Kimi-K2.5's widths are implied (the buckets of caches written before others
                // were built); other widths are named.
                let dims = self.mla_dims().expect("an MLA shape");
                let widths = if dims == MlaDims::KIMI {
                    String::new()
                } else {
                    format!("_l{latent}r{rope}")
                };
                format!(
                    "mla{widths}_b{batch}_h{heads}_c{context}_{}",
                    if *fp8_cache { "fp8" } else { "bf16" }
                )
            }
            ProblemShape::AllReduce {
                elements,
                dtype,
                ranks,
            } => format!("ar_{elements}x{dtype}_r{ranks}"),
            ProblemShape::Dense { m, n, k } => format!("dense_m{m}_n{n}_k{k}"),
        }
    }
}

/// What every family's tactic type provides. See the module documentation.
pub trait Tactic: Clone + fmt::Debug + Sized {
    const FAMILY: KernelFamily;

    /// Stable identifier (manifests, caches, logs, command lines). Never renamed.
    fn tactic_id(&self) -> String;
    /// Inverse of [`tactic_id`](Self::tactic_id).
    fn parse_id(id: &str) -> Result<Self, TacticError>;
    /// The compiled image the tactic runs (several tactics may share one).
    fn image_id(&self) -> String {
        self.tactic_id()
    }
    /// Whether the tactic can be built and launched on `sm`: the template's constraints, the
    /// SM's limits and the variants built for it.
    fn validate_for(&self, sm: Sm) -> Result<(), TacticError>;
    fn fits_on(&self, sm: Sm) -> bool {
        self.validate_for(sm).is_ok()
    }
    /// Largest shared memory (static + dynamic) of one block of any of its kernels, bytes.
    fn smem_bytes(&self) -> usize;
    /// The tactics built (gated) for `sm`.
    fn space(sm: Sm) -> Vec<Self>;
    /// Whether the tactic can compute `shape` (its launcher accepts it).
    fn serves(&self, shape: &ProblemShape) -> bool;
    /// The choice without tuning results: what the runtime uses when the cache has none.
    fn heuristic_default(sm: Sm, shape: &ProblemShape) -> Option<Self>;
}

fn invalid(id: String, why: impl fmt::Display) -> TacticError {
    TacticError::Invalid(format!("{id}: {why}"))
}

impl Tactic for MoeGemmTactic {
    const FAMILY: KernelFamily = KernelFamily::MoeGemm;

    fn tactic_id(&self) -> String {
        self.id()
    }

    fn parse_id(id: &str) -> Result<Self, TacticError> {
        MoeGemmTactic::parse(id)
    }

    fn validate_for(&self, sm: Sm) -> Result<(), TacticError> {
        self.validate()?;
        if !self.variant.runs_on(sm) {
            return Err(invalid(
                self.id(),
                format!("variant {:?} is not built for {sm}", self.variant),
            ));
        }
        let smem = self.smem().max();
        if smem > sm.smem_optin_per_block() {
            return Err(invalid(
                self.id(),
                format!(
                    "{smem} B of shared memory > {} B on {sm}",
                    sm.smem_optin_per_block()
                ),
            ));
        }
        Ok(())
    }

    fn smem_bytes(&self) -> usize {
        self.smem().max()
    }

    fn space(sm: Sm) -> Vec<Self> {
        MoeGemmTactic::enumerate(sm)
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        match shape {
            ProblemShape::Moe { hidden, inter, .. } => {
                crate::moe_gemm::launch::check_problem(self, *hidden as usize, *inter as usize)
                    .is_ok()
            }
            _ => false,
        }
    }

    /// Decode shapes (≤ 32 tokens per expert): the weights-as-A tactic with the smallest
    /// token tile that holds them, 128 weight rows, the fewest stages; prefill: the
    /// tokens-as-A tactic.
    fn heuristic_default(sm: Sm, shape: &ProblemShape) -> Option<Self> {
        let ProblemShape::Moe {
            tokens_per_expert, ..
        } = shape
        else {
            return None;
        };
        let mut space: Vec<MoeGemmTactic> = Self::space(sm)
            .into_iter()
            .filter(|t| t.serves(shape))
            .collect();
        // 128 weight rows first: the 64-row tiles fill more SMs at tiny batches but lose at
        // batch 32 (predicted), so they are left to the tuner, not made the default.
        space.sort_by_key(|t| (t.tile_n < 128, t.tile_n, t.stages, t.tile_m));
        let tpe = *tokens_per_expert;
        if tpe > 32
            && let Some(t) = space.iter().find(|t| !t.swap_ab)
        {
            return Some(*t);
        }
        space
            .iter()
            .filter(|t| t.swap_ab)
            .find(|t| t.tile_m >= tpe.min(32))
            .or_else(|| space.first())
            .copied()
    }
}

impl Tactic for MlaTactic {
    const FAMILY: KernelFamily = KernelFamily::MlaDecode;

    fn tactic_id(&self) -> String {
        self.id()
    }

    fn parse_id(id: &str) -> Result<Self, TacticError> {
        MlaTactic::parse(id)
    }

    fn validate_for(&self, sm: Sm) -> Result<(), TacticError> {
        self.validate()?;
        let smem = self.smem().total;
        if smem > sm.smem_optin_per_block() {
            return Err(invalid(
                self.id(),
                format!(
                    "{smem} B of shared memory > {} B on {sm}",
                    sm.smem_optin_per_block()
                ),
            ));
        }
        Ok(())
    }

    fn smem_bytes(&self) -> usize {
        self.smem().total
    }

    fn space(sm: Sm) -> Vec<Self> {
        MlaTactic::enumerate(sm)
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        match shape {
            ProblemShape::Mla { fp8_cache, .. } => {
                self.kind.is_fp8() == *fp8_cache && shape.mla_dims() == Some(self.dims)
            }
            _ => false,
        }
    }

    /// The first gated tactic of the cache's kind (FP8 caches: the exact widening kind) and
    /// widths.
    fn heuristic_default(sm: Sm, shape: &ProblemShape) -> Option<Self> {
        let ProblemShape::Mla { fp8_cache, .. } = shape else {
            return None;
        };
        let kind = if *fp8_cache {
            MlaKind::Fp8
        } else {
            MlaKind::Bf16
        };
        Self::space(sm)
            .into_iter()
            .find(|t| t.kind == kind && t.serves(shape))
    }
}

/// MLA decode with a fixed split count: the family's tuned launch tactic (the kernel's image
/// is [`MlaTactic`]'s).
impl Tactic for MlaSplitTactic {
    const FAMILY: KernelFamily = KernelFamily::MlaDecode;

    fn tactic_id(&self) -> String {
        self.id()
    }

    fn parse_id(id: &str) -> Result<Self, TacticError> {
        MlaSplitTactic::parse(id)
    }

    fn image_id(&self) -> String {
        self.kernel.id()
    }

    fn validate_for(&self, sm: Sm) -> Result<(), TacticError> {
        self.validate()?;
        self.kernel.validate_for(sm)
    }

    fn smem_bytes(&self) -> usize {
        self.kernel.smem().total
    }

    fn space(sm: Sm) -> Vec<Self> {
        MlaSplitTactic::enumerate(sm)
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        self.kernel.serves(shape)
    }

    /// The default kernel with the split count the planner picks for the reference GPU.
    fn heuristic_default(sm: Sm, shape: &ProblemShape) -> Option<Self> {
        let kernel = MlaTactic::heuristic_default(sm, shape)?;
        let ProblemShape::Mla {
            batch,
            heads,
            context,
            ..
        } = *shape
        else {
            return None;
        };
        let splits = kernel.plan_splits(
            batch as usize,
            heads as usize,
            context as usize,
            sm.reference_gpu().sms as usize,
        );
        Some(MlaSplitTactic { kernel, splits })
    }
}

impl Tactic for AllReduceTactic {
    const FAMILY: KernelFamily = KernelFamily::AllReduce;

    fn tactic_id(&self) -> String {
        self.id()
    }

    fn parse_id(id: &str) -> Result<Self, TacticError> {
        AllReduceTactic::parse(id).ok_or_else(|| TacticError::Parse(id.to_string()))
    }

    fn image_id(&self) -> String {
        AllReduceTactic::image_id(self)
    }

    /// Every image is built for both SMs; only the block count and threads are checked.
    fn validate_for(&self, _sm: Sm) -> Result<(), TacticError> {
        self.validate().map_err(|why| invalid(self.id(), why))
    }

    /// The flag and status words of the kernel's static shared memory (the manifest's
    /// `static_smem_bytes`: 136 B, 264 B for the hierarchical exchange).
    fn smem_bytes(&self) -> usize {
        match self.algorithm {
            Algorithm::IslandHierarchical(_) => 264,
            _ => 136,
        }
    }

    fn space(_sm: Sm) -> Vec<Self> {
        AllReduceTactic::enumerate()
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        match shape {
            ProblemShape::AllReduce { dtype, ranks, .. } => {
                dtype == self.dtype.id()
                    && (*ranks as usize) <= crate::allreduce::tactic::MAX_RANKS
                    && (!matches!(self.algorithm, Algorithm::IslandHierarchical(_)) || *ranks >= 4)
            }
            _ => false,
        }
    }

    /// What `CudaIpcConfig::default` runs: one-shot pull, 512 threads, blocks by size.
    fn heuristic_default(_sm: Sm, shape: &ProblemShape) -> Option<Self> {
        let ProblemShape::AllReduce {
            elements, dtype, ..
        } = shape
        else {
            return None;
        };
        let dtype: DType = dtype.parse().ok()?;
        let bytes = *elements as usize * dtype.size();
        Some(AllReduceTactic {
            algorithm: Algorithm::OneShot(Transfer::Pull),
            dtype,
            threads: 512,
            blocks: default_blocks(bytes),
        })
    }
}

impl Tactic for LayersTactic {
    const FAMILY: KernelFamily = KernelFamily::Layers;

    fn tactic_id(&self) -> String {
        crate::layers::IMAGE.to_string()
    }

    fn parse_id(id: &str) -> Result<Self, TacticError> {
        if id == crate::layers::IMAGE {
            Ok(LayersTactic)
        } else {
            Err(TacticError::Parse(id.to_string()))
        }
    }

    fn validate_for(&self, _sm: Sm) -> Result<(), TacticError> {
        Ok(())
    }

    /// `route_noaux_tc`'s dynamic shared memory at its largest (one f32 score and one
    /// selection score per expert).
    fn smem_bytes(&self) -> usize {
        2 * 4 * crate::layers::MAX_EXPERTS
    }

    fn space(_sm: Sm) -> Vec<Self> {
        vec![LayersTactic]
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        matches!(shape, ProblemShape::Dense { .. })
    }

    fn heuristic_default(_sm: Sm, shape: &ProblemShape) -> Option<Self> {
        matches!(shape, ProblemShape::Dense { .. }).then_some(LayersTactic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trips<T: Tactic + PartialEq>() {
        for sm in Sm::ALL {
            let space = T::space(sm);
            assert!(!space.is_empty(), "{} on {sm}", T::FAMILY);
            for t in space {
                assert_eq!(T::parse_id(&t.tactic_id()).unwrap(), t);
                assert!(t.fits_on(sm), "{} {} on {sm}", T::FAMILY, t.tactic_id());
                assert!(t.smem_bytes() <= sm.smem_optin_per_block());
            }
        }
        assert!(T::parse_id("no_such_tactic").is_err());
    }

    #[test]
    fn every_family_round_trips_and_fits_where_it_is_built() {
        round_trips::<MoeGemmTactic>();
        round_trips::<MlaTactic>();
        round_trips::<MlaSplitTactic>();
        round_trips::<AllReduceTactic>();
        round_trips::<LayersTactic>();
    }

    #[test]
    fn a_tactic_that_overflows_sm120_is_refused_there() {
        let t = MlaTactic::parse("bf16_h32_t32_w8_s3_sp64").unwrap();
        assert!(t.fits_on(Sm::Sm90));
        let e = t.validate_for(Sm::Sm120).unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
        // The native FP4 variant is never offered to SM90.
        let native = MoeGemmTactic::enumerate(Sm::Sm120)[0];
        assert!(!native.fits_on(Sm::Sm90));
    }

    #[test]
    fn defaults_serve_their_shape() {
        let moe = |tpe| ProblemShape::Moe {
            tokens_per_expert: tpe,
            active_experts: 8,
            hidden: 7168,
            inter: 256,
        };
        for sm in Sm::ALL {
            for tpe in [1, 4, 16, 64] {
                let t = MoeGemmTactic::heuristic_default(sm, &moe(tpe)).unwrap();
                assert!(t.serves(&moe(tpe)) && t.fits_on(sm), "{t} for {tpe}");
            }
            let mla = ProblemShape::mla(1, 8, 4096, true, MlaDims::KIMI);
            let t = MlaTactic::heuristic_default(sm, &mla).unwrap();
            assert!(t.serves(&mla) && t.kind.is_fp8());
            assert_eq!(t.dims, MlaDims::KIMI);
            // The small golden checkpoints' widths get their own images, which serve no
            // Kimi-K2.5 shape.
            let small = ProblemShape::mla(1, 4, 4096, false, MlaDims::GOLDEN_SMALL);
            let s = MlaTactic::heuristic_default(sm, &small).unwrap();
            assert!(s.serves(&small) && s.kind == MlaKind::Bf16);
            assert_eq!(s.dims, MlaDims::GOLDEN_SMALL);
            assert!(!s.serves(&mla) && !t.serves(&small));
            assert_eq!(small.bucket(), "mla_l64r16_b1_h4_c4096_bf16");
            assert_eq!(mla.bucket(), "mla_b1_h8_c4096_fp8");
            let ar = ProblemShape::AllReduce {
                elements: 7168,
                dtype: "bf16".into(),
                ranks: 8,
            };
            let t = AllReduceTactic::heuristic_default(sm, &ar).unwrap();
            assert!(t.serves(&ar) && t.blocks == 1);
        }
        // A shape of another family is served by none.
        assert!(MlaTactic::heuristic_default(Sm::Sm120, &moe(1)).is_none());
    }

    #[test]
    fn buckets_are_distinct_and_families_parse_back() {
        let a = ProblemShape::Dense { m: 1, n: 2, k: 3 };
        let b = ProblemShape::Dense { m: 1, n: 3, k: 2 };
        assert_ne!(a.bucket(), b.bucket());
        for f in KernelFamily::ALL {
            assert_eq!(KernelFamily::parse(f.id()), Some(f));
            // The cache's JSON names families by their id.
            assert_eq!(serde_json::to_value(f).unwrap(), f.id());
        }
    }
}
