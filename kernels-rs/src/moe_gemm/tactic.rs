//! The tactic space of the NVFP4 MoE grouped GEMM.
//!
//! A [`MoeGemmTactic`] fixes everything `moe_gemm.cu` is templated on. Its [`id`] is stable and
//! [`parse`]s back, so manifests, autotune caches and logs name tactics the same way. The
//! shared-memory footprint is computed here and passed to nvcc, where a `static_assert` checks
//! it against the kernel's own layout: the two cannot drift apart silently.
//!
//! The problem shapes a tactic can compute ([`check_problem`]) and the family's [`Tactic`]
//! implementation (validation per SM, the space built for it, the heuristic default) are here
//! too, so the tactic layer needs no MoE type.
//!
//! [`id`]: MoeGemmTactic::id
//! [`parse`]: MoeGemmTactic::parse

use std::fmt;
use std::str::FromStr;

use crate::arch::{MAX_THREADS_PER_BLOCK, Sm, WARP_SIZE};
use crate::device::{self, DeviceError};
use crate::tactic::{KernelFamily, ProblemShape, Tactic, TacticError};

/// NVFP4 elements per block scale.
const SF_VEC: usize = 16;
/// cp.async chunk; every shared-memory region starts on one.
const SMEM_ALIGN: usize = 16;

/// How the MMA itself is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelVariant {
    /// Block-scaled FP4 `mma.sync` (OMMA) with activations quantized to NVFP4 in the kernel.
    Sm120Native,
    /// Exact e2m1×ue4m3 → BF16 dequantization and BF16 `mma.sync` (HMMA); for SMs without FP4
    /// tensor cores. Same NVFP4 activation quantization, so it computes the same products.
    Portable,
    /// The native kernel built for sm_90a with only the MMA instruction replaced by a
    /// shuffle-based emulation of the same register-level semantics: lets the native kernel's
    /// loaders, quantizer and epilogue be tested on an H200.
    Sm120EmulatedOnSm90,
}

impl KernelVariant {
    pub const ALL: [KernelVariant; 3] = [
        KernelVariant::Sm120Native,
        KernelVariant::Portable,
        KernelVariant::Sm120EmulatedOnSm90,
    ];

    fn token(self) -> &'static str {
        match self {
            KernelVariant::Sm120Native => "native",
            KernelVariant::Portable => "portable",
            KernelVariant::Sm120EmulatedOnSm90 => "emu90",
        }
    }

    /// Value of `MOE_VARIANT` in `moe_gemm.cu`.
    pub fn macro_value(self) -> u32 {
        match self {
            KernelVariant::Sm120Native => 0,
            KernelVariant::Portable => 1,
            KernelVariant::Sm120EmulatedOnSm90 => 2,
        }
    }

    /// Whether this variant is built for `sm`.
    pub fn runs_on(self, sm: Sm) -> bool {
        match self {
            KernelVariant::Sm120Native => sm == Sm::Sm120,
            // Built for SM90 only: on SM120 the native variant is always preferable, and
            // every extra (tactic, SM) pair costs gate compile time.
            KernelVariant::Portable => sm == Sm::Sm90,
            KernelVariant::Sm120EmulatedOnSm90 => sm == Sm::Sm90,
        }
    }

    /// A SASS mnemonic prefix the compiled kernel must contain: proof that the intended
    /// datapath was actually emitted rather than optimized away or lowered differently.
    pub fn required_sass(self) -> &'static str {
        match self {
            KernelVariant::Sm120Native => "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X",
            KernelVariant::Portable => "HMMA.16816.F32.BF16",
            // The emulation gathers other lanes' fragments; without shuffles it is not
            // emulating a warp-wide MMA.
            KernelVariant::Sm120EmulatedOnSm90 => "SHFL.IDX",
        }
    }
}

/// Where the weights' block scales come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScaleLoad {
    /// The 128×4 swizzled layout (`formats::swizzle`), prepared once at load time.
    Swizzled128x4,
    /// The checkpoint's row-major `[rows, K/16]`, no preprocessing.
    RowMajor,
}

impl ScaleLoad {
    fn token(self) -> &'static str {
        match self {
            ScaleLoad::Swizzled128x4 => "sfsw",
            ScaleLoad::RowMajor => "sfrm",
        }
    }

    pub fn macro_value(self) -> u32 {
        match self {
            ScaleLoad::Swizzled128x4 => 0,
            ScaleLoad::RowMajor => 1,
        }
    }
}

/// One point of the tactic space. Fields are public so tests and the autotuner can build any
/// point; [`MoeGemmTactic::validate`] says whether the kernel template accepts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MoeGemmTactic {
    pub variant: KernelVariant,
    /// Weight rows per CTA. In the gate+up GEMM half are gate rows, half the matching up rows,
    /// so SiLU(gate)·up is formed without leaving the CTA.
    pub tile_n: u32,
    /// Tokens per CTA (of one expert's token list).
    pub tile_m: u32,
    /// K elements per pipeline stage.
    pub tile_k: u32,
    pub warps: u32,
    pub stages: u32,
    /// K splits of the down projection (its output is accumulated atomically anyway). The
    /// gate+up GEMM never splits K: its epilogue needs complete sums.
    pub split_k: u32,
    /// Weights feed the MMA's 16-row A operand and tokens its 8-column B operand: the decode
    /// shape, where an expert sees few tokens.
    pub swap_ab: bool,
    pub scale_load: ScaleLoad,
}

/// Shared memory of the two kernels of one tactic, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmemFootprint {
    pub gate_up: usize,
    pub down: usize,
}

impl SmemFootprint {
    pub fn max(self) -> usize {
        self.gate_up.max(self.down)
    }
}

const fn align(n: usize) -> usize {
    n.div_ceil(SMEM_ALIGN) * SMEM_ALIGN
}

impl MoeGemmTactic {
    /// Rows of the MMA's A operand per instruction and columns of its B operand.
    const MMA_M: u32 = 16;
    const MMA_N: u32 = 8;
    const MMA_K: u32 = 64;

    pub fn threads(&self) -> u32 {
        self.warps * WARP_SIZE
    }

    /// Weight rows and tokens each MMA instruction covers.
    fn mma_weight_rows(&self) -> u32 {
        if self.swap_ab {
            Self::MMA_M
        } else {
            Self::MMA_N
        }
    }

    fn mma_tokens(&self) -> u32 {
        if self.swap_ab {
            Self::MMA_N
        } else {
            Self::MMA_M
        }
    }

    /// Stable identifier, e.g. `native_n128_m16_k256_w4_s3_sk1_wa_sfsw`.
    pub fn id(&self) -> String {
        format!(
            "{}_n{}_m{}_k{}_w{}_s{}_sk{}_{}_{}",
            self.variant.token(),
            self.tile_n,
            self.tile_m,
            self.tile_k,
            self.warps,
            self.stages,
            self.split_k,
            if self.swap_ab { "wa" } else { "ta" },
            self.scale_load.token()
        )
    }

    /// Inverse of [`id`](Self::id); the result is also [`validate`](Self::validate)d.
    pub fn parse(id: &str) -> Result<Self, TacticError> {
        let err = || TacticError::Parse(id.to_string());
        let parts: Vec<&str> = id.split('_').collect();
        let [variant, n, m, k, w, s, sk, ab, sf] = parts.as_slice() else {
            return Err(err());
        };
        let variant = KernelVariant::ALL
            .into_iter()
            .find(|v| v.token() == *variant)
            .ok_or_else(err)?;
        let num = |field: &str, prefix: &str| -> Result<u32, TacticError> {
            field
                .strip_prefix(prefix)
                .and_then(|v| v.parse().ok())
                .ok_or_else(err)
        };
        let swap_ab = match *ab {
            "wa" => true,
            "ta" => false,
            _ => return Err(err()),
        };
        let scale_load = [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor]
            .into_iter()
            .find(|v| v.token() == *sf)
            .ok_or_else(err)?;
        let tactic = MoeGemmTactic {
            variant,
            tile_n: num(n, "n")?,
            tile_m: num(m, "m")?,
            tile_k: num(k, "k")?,
            warps: num(w, "w")?,
            stages: num(s, "s")?,
            split_k: num(sk, "sk")?,
            swap_ab,
            scale_load,
        };
        tactic.validate()?;
        Ok(tactic)
    }

    /// Constraints of the kernel template (the same ones `moe_gemm.cu` static_asserts).
    pub fn validate(&self) -> Result<(), TacticError> {
        let bad = |why: String| Err(TacticError::Invalid(format!("{}: {why}", self.id())));
        if !(1..=16).contains(&self.warps) || self.threads() > MAX_THREADS_PER_BLOCK {
            return bad(format!("{} warps", self.warps));
        }
        if !(2..=8).contains(&self.stages) {
            return bad(format!("{} stages (2..=8)", self.stages));
        }
        if !(1..=8).contains(&self.split_k) {
            return bad(format!("split-k {}", self.split_k));
        }
        if self.tile_k == 0 || !self.tile_k.is_multiple_of(Self::MMA_K) {
            return bad(format!("tile_k {} is not a multiple of 64", self.tile_k));
        }
        // Each warp owns a slice of the weight rows of both halves (gate and up) with whole
        // MMAs; the slice must also hold whole 16-element scale blocks of the intermediate,
        // which the epilogue quantizes.
        let per_warp = 2 * self.warps * self.mma_weight_rows().max(SF_VEC as u32 / 2);
        if self.tile_n == 0 || !self.tile_n.is_multiple_of(per_warp) {
            return bad(format!(
                "tile_n {} is not a multiple of {per_warp} (2 halves × {} warps × MMA rows)",
                self.tile_n, self.warps
            ));
        }
        if self.tile_m == 0 || !self.tile_m.is_multiple_of(self.mma_tokens()) {
            return bad(format!(
                "tile_m {} is not a multiple of {}",
                self.tile_m,
                self.mma_tokens()
            ));
        }
        Ok(())
    }

    /// Bytes of the per-stage and single buffers, mirrored by `moe_gemm.cu`'s `SmemLayout`.
    pub fn smem(&self) -> SmemFootprint {
        let (n, m, k, s) = (
            self.tile_n as usize,
            self.tile_m as usize,
            self.tile_k as usize,
            self.stages as usize,
        );
        let fp4 = |rows: usize| align(rows * k / 2) + align(rows * k / SF_VEC);
        let weights = fp4(n);
        // Gate+up reads BF16 activations and quantizes each stage into one NVFP4 buffer.
        let act_bf16 = align(m * k * 2);
        let gate_up_main = s * (weights + act_bf16) + fp4(m);
        // Its epilogue stages SiLU(gate)·up in f32 so whole 16-blocks can be quantized; it
        // reuses the pipeline buffers.
        let gate_up_epilogue = align(m * (n / 2) * 4);
        SmemFootprint {
            gate_up: gate_up_main.max(gate_up_epilogue),
            // The down projection's activations are already NVFP4.
            down: s * (weights + fp4(m)),
        }
    }

    /// Whether the tactic can be built and launched on `sm`.
    pub fn fits(&self, sm: Sm) -> bool {
        self.variant.runs_on(sm)
            && self.validate().is_ok()
            && self.smem().max() <= sm.smem_optin_per_block()
    }

    /// `-D` flags that instantiate this tactic in `moe_gemm.cu`.
    pub fn nvcc_defines(&self) -> Vec<String> {
        let smem = self.smem();
        vec![
            format!("-DMOE_VARIANT={}", self.variant.macro_value()),
            format!("-DMOE_TILE_N={}", self.tile_n),
            format!("-DMOE_TILE_M={}", self.tile_m),
            format!("-DMOE_TILE_K={}", self.tile_k),
            format!("-DMOE_WARPS={}", self.warps),
            format!("-DMOE_STAGES={}", self.stages),
            format!("-DMOE_SPLIT_K={}", self.split_k),
            format!("-DMOE_SWAP_AB={}", u32::from(self.swap_ab)),
            format!("-DMOE_SCALE_LOAD={}", self.scale_load.macro_value()),
            format!("-DMOE_EXPECT_SMEM_GATE_UP={}", smem.gate_up),
            format!("-DMOE_EXPECT_SMEM_DOWN={}", smem.down),
        ]
    }

    /// The tactic space built for `sm`: every combination of the axes below that the template
    /// accepts and whose shared memory fits the SM's opt-in limit. The axes are kept small so
    /// the compile gate (one nvcc run per tactic) stays within minutes on two cores.
    ///
    /// The narrow tile (64 weight rows on 2 warps) is for decode: at TP8 batch 1 an expert's
    /// 256 intermediate rows and 7168 output rows make too few 128-row CTAs to fill the SMs,
    /// and half-width tiles double them; it is built only for the token tiles decode uses.
    pub fn enumerate(sm: Sm) -> Vec<MoeGemmTactic> {
        let mut out = Vec::new();
        for variant in KernelVariant::ALL {
            for (tile_n, warps) in [(64, 2), (128, 4), (256, 8)] {
                for tile_m in [8, 16, 32] {
                    if tile_n == 64 && tile_m > 16 {
                        continue;
                    }
                    for stages in [2, 4] {
                        let t = MoeGemmTactic {
                            variant,
                            tile_n,
                            tile_m,
                            tile_k: 256,
                            warps,
                            stages,
                            split_k: 1,
                            swap_ab: true,
                            scale_load: ScaleLoad::Swizzled128x4,
                        };
                        if t.fits(sm) {
                            out.push(t);
                        }
                    }
                }
            }
        }
        // A tensor-parallel rank's experts hold `moe_intermediate_size / world` columns: 64
        // or 128 for a small model split 4 or 2 ways, which only the MMA's own K (64) divides.
        // After the tactics above, so that where both serve the heuristic keeps its choice.
        for variant in KernelVariant::ALL {
            let t = MoeGemmTactic {
                variant,
                tile_n: 128,
                tile_m: 8,
                tile_k: Self::MMA_K,
                warps: 4,
                stages: 2,
                split_k: 1,
                swap_ab: true,
                scale_load: ScaleLoad::Swizzled128x4,
            };
            if t.fits(sm) {
                out.push(t);
            }
        }
        // Prefill shape: tokens as the MMA's A operand, with the checkpoint's scales as-is.
        let prefill = MoeGemmTactic {
            variant: if sm == Sm::Sm120 {
                KernelVariant::Sm120Native
            } else {
                KernelVariant::Portable
            },
            tile_n: 128,
            tile_m: 64,
            tile_k: 128,
            warps: 4,
            stages: 3,
            split_k: 2,
            swap_ab: false,
            scale_load: ScaleLoad::RowMajor,
        };
        if prefill.fits(sm) {
            out.push(prefill);
        }
        out
    }
}

impl fmt::Display for MoeGemmTactic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

impl FromStr for MoeGemmTactic {
    type Err = TacticError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Shape constraints of `moe_gemm.cu` that it does not check itself: violating one makes the
/// kernels skip rows or K tails, or issue misaligned `cp.async`, silently.
pub fn check_problem(tactic: &MoeGemmTactic, hidden: usize, inter: usize) -> device::Result<()> {
    let bad = |why: String| {
        Err(DeviceError::Shape {
            tactic: tactic.id(),
            why,
        })
    };
    let (tn, tk, sk) = (
        tactic.tile_n as usize,
        tactic.tile_k as usize,
        tactic.split_k as usize,
    );
    if !hidden.is_multiple_of(tk) {
        return bad(format!("hidden {hidden} is not a multiple of tile_k {tk}"));
    }
    if !hidden.is_multiple_of(tn) {
        return bad(format!(
            "hidden {hidden} is not a multiple of tile_n {tn} (moe_down grid)"
        ));
    }
    if !inter.is_multiple_of(tn / 2) {
        return bad(format!(
            "inter {inter} is not a multiple of tile_n/2 = {} (moe_gate_up grid)",
            tn / 2
        ));
    }
    if !inter.is_multiple_of(sk) || !(inter / sk).is_multiple_of(tk) {
        return bad(format!(
            "inter {inter} / split_k {sk} is not a multiple of tile_k {tk}"
        ));
    }
    // Rows of h_q (I/2 bytes) are read in 16-byte cp.async chunks and rows of h_sf (I/16
    // bytes) and of row-major weight scales (K/16 bytes) in 4-byte ones.
    if !inter.is_multiple_of(64) || !hidden.is_multiple_of(64) {
        return bad(format!(
            "hidden {hidden} and inter {inter} must be multiples of 64"
        ));
    }
    Ok(())
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
            return Err(TacticError::invalid(
                self.id(),
                format!("variant {:?} is not built for {sm}", self.variant),
            ));
        }
        let smem = self.smem().max();
        if smem > sm.smem_optin_per_block() {
            return Err(TacticError::invalid(
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
                check_problem(self, *hidden as usize, *inter as usize).is_ok()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::SM120_SMEM_OPTIN_PER_BLOCK;

    fn decode() -> MoeGemmTactic {
        MoeGemmTactic {
            variant: KernelVariant::Sm120Native,
            tile_n: 128,
            tile_m: 16,
            tile_k: 256,
            warps: 4,
            stages: 3,
            split_k: 1,
            swap_ab: true,
            scale_load: ScaleLoad::Swizzled128x4,
        }
    }

    #[test]
    fn id_is_stable_and_round_trips() {
        let t = decode();
        assert_eq!(t.id(), "native_n128_m16_k256_w4_s3_sk1_wa_sfsw");
        assert_eq!(MoeGemmTactic::parse(&t.id()), Ok(t));
        for sm in Sm::ALL {
            for t in MoeGemmTactic::enumerate(sm) {
                assert_eq!(t.id().parse::<MoeGemmTactic>(), Ok(t));
            }
        }
        assert!(MoeGemmTactic::parse("native_n128_m16").is_err());
        assert!(MoeGemmTactic::parse("native_n100_m16_k256_w4_s3_sk1_wa_sfsw").is_err());
    }

    #[test]
    fn smem_matches_a_hand_count() {
        // Weights: 128×256/2 + 128×256/16 = 16384 + 2048; BF16 activations 16×256×2 = 8192;
        // one NVFP4 activation buffer 16×128 + 16×16 = 2304.
        let t = decode();
        assert_eq!(t.smem().gate_up, 3 * (18432 + 8192) + 2304);
        assert_eq!(t.smem().down, 3 * (18432 + 2304));
    }

    #[test]
    fn enumeration_respects_each_sms_limit() {
        for sm in Sm::ALL {
            let all = MoeGemmTactic::enumerate(sm);
            assert!(!all.is_empty());
            for t in &all {
                assert!(t.smem().max() <= sm.smem_optin_per_block(), "{t} on {sm}");
                assert!(t.variant.runs_on(sm));
            }
        }
        // 4 stages of 256 weight rows fit an H200 but not an RTX PRO 6000.
        let big = MoeGemmTactic {
            tile_n: 256,
            warps: 8,
            stages: 4,
            tile_m: 32,
            ..decode()
        };
        assert!(big.smem().max() > SM120_SMEM_OPTIN_PER_BLOCK);
        assert!(!big.fits(Sm::Sm120));
        let big90 = MoeGemmTactic {
            variant: KernelVariant::Portable,
            ..big
        };
        assert!(big90.fits(Sm::Sm90));
        assert!(MoeGemmTactic::enumerate(Sm::Sm90).contains(&big90));
        assert!(!MoeGemmTactic::enumerate(Sm::Sm120).contains(&big));
    }

    #[test]
    fn narrow_decode_tiles_are_in_each_space() {
        for (sm, variants) in [(Sm::Sm120, 1), (Sm::Sm90, 2)] {
            let narrow: Vec<_> = MoeGemmTactic::enumerate(sm)
                .into_iter()
                .filter(|t| t.tile_n == 64)
                .collect();
            // Token tiles 8 and 16, 2 and 4 stages, per variant built for the SM.
            assert_eq!(narrow.len(), 4 * variants, "{sm}: {narrow:?}");
            assert!(narrow.iter().all(|t| t.warps == 2 && t.tile_m <= 16));
        }
        let t = MoeGemmTactic {
            tile_n: 64,
            warps: 2,
            tile_m: 8,
            stages: 2,
            ..decode()
        };
        assert_eq!(t.id(), "native_n64_m8_k256_w2_s2_sk1_wa_sfsw");
        // 64 rows on 4 warps would leave each warp half an MMA of each half.
        assert!(MoeGemmTactic { warps: 4, ..t }.validate().is_err());
    }

    #[test]
    fn variants_are_built_only_where_they_run() {
        assert!(
            MoeGemmTactic::enumerate(Sm::Sm120)
                .iter()
                .all(|t| t.variant == KernelVariant::Sm120Native)
        );
        let sm90 = MoeGemmTactic::enumerate(Sm::Sm90);
        assert!(sm90.iter().all(|t| t.variant != KernelVariant::Sm120Native));
        assert!(
            sm90.iter()
                .any(|t| t.variant == KernelVariant::Sm120EmulatedOnSm90)
        );
    }

    #[test]
    fn the_space_round_trips_and_fits_where_it_is_built() {
        crate::tactic::assert_space_round_trips::<MoeGemmTactic>();
    }

    #[test]
    fn the_native_variant_is_never_offered_to_sm90() {
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
        }
    }

    #[test]
    fn problem_shapes_are_checked_against_the_tactic() {
        for t in MoeGemmTactic::enumerate(Sm::Sm90)
            .into_iter()
            .chain(MoeGemmTactic::enumerate(Sm::Sm120))
        {
            // Kimi-K2.5 at TP8 and at TP4, and the full expert.
            for inter in [256, 512, 2048] {
                check_problem(&t, 7168, inter).unwrap();
            }
        }
        let t = MoeGemmTactic::enumerate(Sm::Sm90)
            .into_iter()
            .find(|t| t.tile_n == 256 && t.variant == KernelVariant::Portable)
            .unwrap();
        let msg = check_problem(&t, 7168, 192).unwrap_err().to_string();
        assert!(msg.contains(&t.id()) && msg.contains("inter 192"), "{msg}");
        assert!(check_problem(&t, 7168 + 64, 256).is_err());
    }
}
