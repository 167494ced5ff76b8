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
//! This module sits below the families and names none of their types: each family implements
//! [`Tactic`] beside its tactic type (`moe_gemm::tactic`, `mla::tactic`, `allreduce::tactic`,
//! `layers`), and a family whose shapes carry its own types adds their constructors to
//! [`ProblemShape`] there (`ProblemShape::mla` in `mla::tactic`).
//!
//! [`cache`] holds the tuning results (the tactic cache) the runtime reads; [`timing`] the
//! figures of timed runs and the device they were taken on (the timed device itself,
//! `timed_device`, sits above the families it times).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::arch::Sm;

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

impl TacticError {
    /// Tactic `id` is well-formed but cannot be used, because of `why`.
    pub fn invalid(id: impl fmt::Display, why: impl fmt::Display) -> Self {
        TacticError::Invalid(format!("{id}: {why}"))
    }
}

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
    /// over cache rows of `latent` + `rope` values ([`IMPLIED_MLA_WIDTHS`] when a cache file
    /// written before the widths were recorded omits them). `mla::tactic` adds the
    /// constructor from the family's `MlaDims` (`ProblemShape::mla`) and its inverse.
    Mla {
        batch: u32,
        heads: u32,
        context: u32,
        fp8_cache: bool,
        #[serde(default = "implied_mla_latent")]
        latent: u32,
        #[serde(default = "implied_mla_rope")]
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

/// The MLA cache row's widths (latent, RoPE values) a shape implies where it names none:
/// Kimi-K2.5's (`MlaDims::KIMI`), the only ones before other widths were built. Cache files
/// written then omit them, and the buckets of these widths keep not naming them.
pub const IMPLIED_MLA_WIDTHS: (u32, u32) = (512, 64);

fn implied_mla_latent() -> u32 {
    IMPLIED_MLA_WIDTHS.0
}

fn implied_mla_rope() -> u32 {
    IMPLIED_MLA_WIDTHS.1
}

impl ProblemShape {
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
                let widths = if (*latent, *rope) == IMPLIED_MLA_WIDTHS {
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

/// Asserts what every family's tactic space must satisfy on every SM: it is not empty, and
/// each tactic's id parses back to it, fits the SM it is built for, and fits its shared
/// memory; an unknown id is refused. Each family's tests run it on its tactic types.
#[cfg(test)]
pub(crate) fn assert_space_round_trips<T: Tactic + PartialEq>() {
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

#[cfg(test)]
mod tests {
    use super::*;

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
