//! The tactic space of the MLA decode kernel (`mla_decode.cu`).
//!
//! An [`MlaTactic`] fixes everything the kernel is templated on, the cache row's widths
//! ([`MlaDims`]: latent and RoPE values per token) among them; its [`id`](MlaTactic::id) is
//! stable and [`parse`](MlaTactic::parse)s back. The shared-memory footprint is computed here,
//! passed to nvcc and `static_assert`ed against the kernel's own layout, as for the MoE GEMM.
//!
//! The split count of flash-decoding is a launch-time choice ([`MlaTactic::plan_splits`]): it
//! depends on the batch, the lengths and the SM count, not on the compiled code. The tactic
//! only caps it (`max_splits`), which sizes the partial-result workspace; [`MlaSplitTactic`]
//! fixes it instead, for the tuning lab.
//!
//! Both implement [`Tactic`] here, and the MLA problem shapes are built from an [`MlaDims`]
//! here too ([`ProblemShape::mla`]), so the tactic layer needs no MLA type.

use std::fmt;

use crate::arch::{MAX_THREADS_PER_BLOCK, Sm, WARP_SIZE};
use crate::tactic::{KernelFamily, ProblemShape, Tactic, TacticError};

/// The widths of a cached token's row: `latent` values (`kv_lora_rank`) and `rope` values
/// (`qk_rope_head_dim`). Each kernel image is compiled for one (the tactic's); a model runs on
/// the images of its own widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MlaDims {
    pub latent: usize,
    pub rope: usize,
}

impl MlaDims {
    /// Kimi-K2.5 / DeepSeek-V3: 512 latent + 64 RoPE values. Its tactics' ids carry no widths.
    pub const KIMI: MlaDims = MlaDims {
        latent: 512,
        rope: 64,
    };
    /// The small golden checkpoints of `golden/gen_model.py` (`kimi-tiny`, `kimi-chat-tiny`,
    /// the DeepSeek-V3 ones): 64 latent + 16 RoPE values.
    pub const GOLDEN_SMALL: MlaDims = MlaDims {
        latent: 64,
        rope: 16,
    };
    /// Every width the compile gate builds images for.
    pub const BUILT: [MlaDims; 2] = [MlaDims::KIMI, MlaDims::GOLDEN_SMALL];

    /// Values per cached token.
    pub fn row(&self) -> usize {
        self.latent + self.rope
    }

    /// The kernel template's constraints on the widths (`mla_decode.cu` static_asserts them):
    /// whole 64-byte FP8 code blocks of latent, whole k16 steps of RoPE, and `mla_append`'s
    /// 128 threads covering the RoPE part.
    pub fn validate(&self) -> Result<(), String> {
        let (l, r) = (self.latent, self.rope);
        if l == 0 || !l.is_multiple_of(64) || l > 1024 {
            return Err(format!("latent {l} (a multiple of 64, at most 1024)"));
        }
        if r == 0 || !r.is_multiple_of(16) || r > 128 {
            return Err(format!("RoPE {r} (a multiple of 16, at most 128)"));
        }
        Ok(())
    }

    /// The id token of these widths: empty for Kimi-K2.5's (ids predate the others).
    fn token(&self) -> Option<String> {
        (*self != MlaDims::KIMI).then(|| format!("l{}r{}", self.latent, self.rope))
    }

    fn parse_token(token: &str) -> Option<MlaDims> {
        let (l, r) = token.strip_prefix('l')?.split_once('r')?;
        Some(MlaDims {
            latent: l.parse().ok()?,
            rope: r.parse().ok()?,
        })
    }
}

impl fmt::Display for MlaDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "latent {} + RoPE {}", self.latent, self.rope)
    }
}

/// Every shared-memory row is padded by 16 bytes: row strides that are multiples of 128 B would
/// put the 8 rows one `ldmatrix` reads into the same banks (8-way conflicts).
const ROW_PAD: usize = 16;

/// How the cache is stored and how the kernel multiplies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MlaKind {
    /// BF16 cache (latent + RoPE), BF16 `mma.sync` for both products.
    Bf16,
    /// FP8 E4M3 latent (per-token FP32 scale) + BF16 RoPE. The codes are widened to BF16 in the
    /// shared-memory → register path (exact: E4M3's 3 mantissa bits fit BF16's 7) and both
    /// products run as BF16 `mma.sync`; the token scale is applied to the score column and
    /// folded into P. No precision is lost beyond the cache's own quantization.
    Fp8,
    /// As [`MlaKind::Fp8`], but `q_abs·c` runs on the FP8 tensor cores
    /// (`mma.sync.m16n8k32.e4m3`): the kernel quantizes `q_abs` to E4M3 with one scale per
    /// head. Costs the query's E4M3 rounding (≈2⁻⁴ relative per element); P·C stays BF16
    /// because P in E4M3 would lose the small weights that long contexts sum over.
    Fp8QkMma,
}

impl MlaKind {
    pub const ALL: [MlaKind; 3] = [MlaKind::Bf16, MlaKind::Fp8, MlaKind::Fp8QkMma];

    pub fn token(self) -> &'static str {
        match self {
            MlaKind::Bf16 => "bf16",
            MlaKind::Fp8 => "fp8",
            MlaKind::Fp8QkMma => "fp8qk",
        }
    }

    /// Value of `MLA_KIND` in `mla_decode.cu`.
    pub fn macro_value(self) -> u32 {
        match self {
            MlaKind::Bf16 => 0,
            MlaKind::Fp8 => 1,
            MlaKind::Fp8QkMma => 2,
        }
    }

    pub fn is_fp8(self) -> bool {
        self != MlaKind::Bf16
    }

    /// SASS mnemonic prefixes `mla_decode` must contain: proof that the intended tensor-core
    /// datapath was emitted rather than lowered differently.
    pub fn required_sass(self, sm: Sm) -> Vec<&'static str> {
        const BF16_MMA: &str = "HMMA.16816.F32.BF16";
        match (self, sm) {
            // SM120 has E4M3 `mma.sync` in hardware: ptxas emits QMMA.
            (MlaKind::Fp8QkMma, Sm::Sm120) => vec![BF16_MMA, "QMMA.16832.F32.E4M3.E4M3"],
            // SM90 has FP8 only in wgmma: ptxas lowers the E4M3 `mma.sync` to E4M3→F16
            // unpacking plus F16 HMMAs. It still runs (the H200 check covers the kernel's
            // logic), just without the FP8 speed-up.
            (MlaKind::Fp8QkMma, Sm::Sm90) => vec![BF16_MMA, "F2FP.F16.E4M3.UNPACK_B"],
            // The exact E4M3 → BF16 widening (HMUL2 by 2^120) must be there for FP8 caches.
            (MlaKind::Fp8, _) => vec![BF16_MMA, "HMUL2.BF16_V2"],
            (MlaKind::Bf16, _) => vec![BF16_MMA, "LDSM.16.MT88.4"],
        }
    }
}

/// One point of the tactic space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MlaTactic {
    pub kind: MlaKind,
    /// The cache row's widths the image is compiled for.
    pub dims: MlaDims,
    /// Query heads per CTA: the MMA's M dimension (multiples of 16). With 8 heads per GPU
    /// (TP8) half of the 16 rows are padding; the kernel is bandwidth-bound, so idle MMA rows
    /// cost nothing, while more heads per CTA mean fewer re-reads of the same cache tile.
    pub heads_per_block: u32,
    /// Tokens per pipeline stage (the N dimension of `q·Kᵀ`, the K dimension of `P·C`).
    pub tile_tokens: u32,
    pub warps: u32,
    /// cp.async stages of cache tiles in flight.
    pub stages: u32,
    /// Upper bound of the KV splits a launch may use (sizes the partial-output workspace).
    pub max_splits: u32,
}

/// Shared memory of `mla_decode`, by region, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaSmem {
    pub q: usize,
    pub stage: usize,
    pub scores: usize,
    pub probs: usize,
    pub stats: usize,
    pub total: usize,
}

const fn align16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

impl MlaTactic {
    pub fn threads(&self) -> u32 {
        self.warps * WARP_SIZE
    }

    /// `<kind>[_l<latent>r<rope>]_h<heads>_t<tile>_w<warps>_s<stages>_sp<max splits>`; the
    /// widths are named only when they are not Kimi-K2.5's.
    pub fn id(&self) -> String {
        let dims = self
            .dims
            .token()
            .map(|t| format!("_{t}"))
            .unwrap_or_default();
        format!(
            "{}{dims}_h{}_t{}_w{}_s{}_sp{}",
            self.kind.token(),
            self.heads_per_block,
            self.tile_tokens,
            self.warps,
            self.stages,
            self.max_splits
        )
    }

    pub fn parse(id: &str) -> Result<Self, TacticError> {
        let err = || TacticError::Parse(id.to_string());
        let mut parts: Vec<&str> = id.split('_').collect();
        let dims = if parts.len() == 7 {
            MlaDims::parse_token(parts.remove(1))
                .filter(|d| *d != MlaDims::KIMI)
                .ok_or_else(err)?
        } else {
            MlaDims::KIMI
        };
        let [kind, h, t, w, s, sp] = parts.as_slice() else {
            return Err(err());
        };
        let kind = MlaKind::ALL
            .into_iter()
            .find(|k| k.token() == *kind)
            .ok_or_else(err)?;
        let num = |field: &str, prefix: &str| -> Result<u32, TacticError> {
            field
                .strip_prefix(prefix)
                .and_then(|v| v.parse().ok())
                .ok_or_else(err)
        };
        let tactic = MlaTactic {
            kind,
            dims,
            heads_per_block: num(h, "h")?,
            tile_tokens: num(t, "t")?,
            warps: num(w, "w")?,
            stages: num(s, "s")?,
            max_splits: num(sp, "sp")?,
        };
        tactic.validate()?;
        Ok(tactic)
    }

    pub fn validate(&self) -> Result<(), TacticError> {
        let bad = |why: String| Err(TacticError::Invalid(format!("{}: {why}", self.id())));
        if let Err(why) = self.dims.validate() {
            return bad(why);
        }
        let latent = self.dims.latent as u32;
        if self.kind == MlaKind::Fp8QkMma && (!latent.is_multiple_of(128) || self.dims.rope > 64) {
            // One warp quantizes a head: latent/32 codes per lane in packs of four, and two
            // q_pe values per lane.
            return bad(format!(
                "fp8qk needs a latent multiple of 128 and RoPE ≤ 64, not {}",
                self.dims
            ));
        }
        let m_tiles = self.heads_per_block / 16;
        if self.heads_per_block == 0 || !self.heads_per_block.is_multiple_of(16) || m_tiles > 4 {
            return bad(format!(
                "heads_per_block {} (16, 32, 48, 64)",
                self.heads_per_block
            ));
        }
        if ![16, 32, 64].contains(&self.tile_tokens) {
            return bad(format!("tile_tokens {} (16, 32, 64)", self.tile_tokens));
        }
        if !(1..=16).contains(&self.warps) || self.threads() > MAX_THREADS_PER_BLOCK {
            return bad(format!("{} warps", self.warps));
        }
        // P·C: each warp owns latent/warps columns of every M tile, in whole groups of 32 (the
        // FP8 loader's four n-tiles); 64 f32 accumulators per thread is the most that leaves
        // room for the fragments without spilling.
        if !latent.is_multiple_of(32 * self.warps) {
            return bad(format!(
                "{} warps split a latent of {latent} into slices narrower than 32 columns",
                self.warps
            ));
        }
        if m_tiles * latent / 2 / self.warps > 64 {
            return bad(format!(
                "{} warps for {} heads: P·C needs ≥ {} warps",
                self.warps,
                self.heads_per_block,
                (m_tiles * latent / 128).max(1)
            ));
        }
        // Softmax: each head's row is handled by a power-of-two group of lanes in one warp.
        let per_row = self.threads() / self.heads_per_block;
        if !self.threads().is_multiple_of(self.heads_per_block)
            || !per_row.is_power_of_two()
            || per_row > WARP_SIZE
            || !self.tile_tokens.is_multiple_of(per_row)
        {
            return bad(format!("{per_row} softmax lanes per head"));
        }
        if !(1..=4).contains(&self.stages) {
            return bad(format!("{} stages (1..=4)", self.stages));
        }
        if !(1..=256).contains(&self.max_splits) {
            return bad(format!("max_splits {}", self.max_splits));
        }
        Ok(())
    }

    /// Mirrors `SmemLayout` in `mla_decode.cu`.
    pub fn smem(&self) -> MlaSmem {
        let h = self.heads_per_block as usize;
        let t = self.tile_tokens as usize;
        let MlaDims { latent: l, rope: r } = self.dims;
        let q = match self.kind {
            MlaKind::Bf16 | MlaKind::Fp8 => h * (2 * (l + r) + ROW_PAD),
            // E4M3 latent codes, BF16 RoPE part, one FP32 scale per head.
            MlaKind::Fp8QkMma => h * (l + ROW_PAD) + h * (2 * r + ROW_PAD) + align16(4 * h),
        };
        let stage = if self.kind.is_fp8() {
            t * (l + ROW_PAD) + t * (2 * r + ROW_PAD) + align16(4 * t)
        } else {
            t * (2 * (l + r) + ROW_PAD)
        };
        let scores = h * (4 * t + ROW_PAD);
        let probs = h * (2 * t + ROW_PAD);
        // Running max, running sum, and this tile's rescale factor per head.
        let stats = align16(3 * 4 * h);
        let total = q + self.stages as usize * stage + scores + probs + stats;
        MlaSmem {
            q,
            stage,
            scores,
            probs,
            stats,
            total,
        }
    }

    pub fn fits(&self, sm: Sm) -> bool {
        self.validate().is_ok() && self.smem().total <= sm.smem_optin_per_block()
    }

    pub fn nvcc_defines(&self) -> Vec<String> {
        vec![
            format!("-DMLA_KIND={}", self.kind.macro_value()),
            format!("-DMLA_LATENT={}", self.dims.latent),
            format!("-DMLA_ROPE={}", self.dims.rope),
            format!("-DMLA_HEADS={}", self.heads_per_block),
            format!("-DMLA_TILE={}", self.tile_tokens),
            format!("-DMLA_WARPS={}", self.warps),
            format!("-DMLA_STAGES={}", self.stages),
            format!("-DMLA_EXPECT_SMEM={}", self.smem().total),
        ]
    }

    /// Splits for a launch: enough CTAs to give every SM about two, never more than
    /// `max_splits`, and never a split shorter than one tile of the longest request.
    pub fn plan_splits(&self, batch: usize, heads: usize, max_len: usize, num_sms: usize) -> u32 {
        let groups = heads.div_ceil(self.heads_per_block as usize).max(1);
        let ctas = (batch * groups).max(1);
        let want = (2 * num_sms).div_ceil(ctas);
        let tiles = max_len.div_ceil(self.tile_tokens as usize).max(1);
        want.min(tiles).clamp(1, self.max_splits as usize) as u32
    }

    /// Bytes of the split-KV workspace (`part_out` + `part_lse`, f32) a launch of up to
    /// `batch` requests and `heads` heads needs: sized by `max_splits`, allocated once.
    pub fn workspace_bytes(&self, batch: usize, heads: usize) -> usize {
        4 * batch * heads * self.max_splits as usize * (self.dims.latent + 1)
    }

    /// The tactics the compile gate builds for `sm`: Kimi-K2.5's widths, then the small
    /// golden checkpoints' ([`MlaDims::GOLDEN_SMALL`]).
    pub fn enumerate(sm: Sm) -> Vec<MlaTactic> {
        let t = |kind, heads_per_block, tile_tokens, warps, stages| MlaTactic {
            kind,
            dims: MlaDims::KIMI,
            heads_per_block,
            tile_tokens,
            warps,
            stages,
            max_splits: 64,
        };
        let list = match sm {
            // 99 KiB: one M tile of heads, and 2–3 stages of 32 tokens (16 for BF16 at 3).
            Sm::Sm120 => vec![
                t(MlaKind::Bf16, 16, 32, 4, 2),
                t(MlaKind::Bf16, 16, 16, 4, 3),
                t(MlaKind::Fp8, 16, 32, 4, 2),
                t(MlaKind::Fp8, 16, 32, 4, 3),
                t(MlaKind::Fp8QkMma, 16, 32, 4, 2),
                t(MlaKind::Fp8QkMma, 16, 32, 4, 3),
            ],
            // 227 KiB: also 32 heads per CTA (H200 runs all 64 heads of one GPU's model).
            Sm::Sm90 => vec![
                t(MlaKind::Bf16, 16, 32, 4, 2),
                t(MlaKind::Bf16, 32, 32, 8, 3),
                t(MlaKind::Fp8, 16, 32, 4, 2),
                t(MlaKind::Fp8, 32, 64, 8, 2),
                t(MlaKind::Fp8QkMma, 16, 32, 4, 2),
            ],
        };
        // A 64-value latent: two warps own its 64 output columns in 32-column slices (the
        // whole P·C width of four warps at Kimi's 512 would leave each warp half a slice).
        // One 16-head block serves these models' 2–8 heads per rank; the cache rows are small
        // enough that two stages of 32 tokens cost 18 KB. BF16 and the exact FP8 widening
        // only: `fp8qk` needs a latent that is a multiple of 128.
        let small = [MlaKind::Bf16, MlaKind::Fp8].map(|kind| MlaTactic {
            dims: MlaDims::GOLDEN_SMALL,
            ..t(kind, 16, 32, 2, 2)
        });
        list.into_iter()
            .chain(small)
            .filter(|t| t.fits(sm))
            .collect()
    }

    /// Whether the image serves a cache of these widths.
    pub fn serves_dims(&self, dims: MlaDims) -> bool {
        self.dims == dims
    }
}

/// Split counts the tuning lab tries (each at most the kernel's `max_splits`).
pub const SPLIT_CHOICES: [u32; 7] = [1, 2, 4, 8, 16, 32, 64];

/// A launch tactic of MLA decode: a compiled kernel ([`MlaTactic`]) and a fixed number of KV
/// splits, instead of [`MlaTactic::plan_splits`]'s choice. Same image for every split count:
/// the split count is a launch parameter (as the all-reduce's block count), so it needs no
/// compile-gate entry of its own; `mla_decode` handles empty splits (short requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MlaSplitTactic {
    pub kernel: MlaTactic,
    pub splits: u32,
}

impl MlaSplitTactic {
    /// `<kernel id>_x<splits>`, e.g. `fp8_h16_t32_w4_s2_sp64_x16`.
    pub fn id(&self) -> String {
        format!("{}_x{}", self.kernel.id(), self.splits)
    }

    pub fn parse(id: &str) -> Result<Self, TacticError> {
        let err = || TacticError::Parse(id.to_string());
        let (kernel, splits) = id.rsplit_once("_x").ok_or_else(err)?;
        let t = MlaSplitTactic {
            kernel: MlaTactic::parse(kernel)?,
            splits: splits.parse().map_err(|_| err())?,
        };
        t.validate()?;
        Ok(t)
    }

    pub fn validate(&self) -> Result<(), TacticError> {
        self.kernel.validate()?;
        if self.splits == 0 || self.splits > self.kernel.max_splits {
            return Err(TacticError::Invalid(format!(
                "{}: {} splits (1..={})",
                self.id(),
                self.splits,
                self.kernel.max_splits
            )));
        }
        Ok(())
    }

    /// Every gated kernel of `sm` with every split count of [`SPLIT_CHOICES`] it allows.
    pub fn enumerate(sm: Sm) -> Vec<MlaSplitTactic> {
        MlaTactic::enumerate(sm)
            .into_iter()
            .flat_map(|kernel| {
                SPLIT_CHOICES
                    .into_iter()
                    .filter(move |&s| s <= kernel.max_splits)
                    .map(move |splits| MlaSplitTactic { kernel, splits })
            })
            .collect()
    }
}

impl fmt::Display for MlaSplitTactic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

impl fmt::Display for MlaTactic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

/// The MLA decode shapes, built from the family's cache-row widths.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_reject_garbage() {
        for sm in Sm::ALL {
            for t in MlaTactic::enumerate(sm) {
                assert_eq!(MlaTactic::parse(&t.id()).unwrap(), t);
            }
        }
        assert!(MlaTactic::parse("bf16_h16_t32_w4_s2").is_err());
        assert!(MlaTactic::parse("int8_h16_t32_w4_s2_sp64").is_err());
        // 64 heads need 16 warps for P·C's accumulators; 4 are rejected.
        assert!(matches!(
            MlaTactic::parse("bf16_h64_t32_w4_s2_sp64"),
            Err(TacticError::Invalid(_))
        ));
    }

    #[test]
    fn every_gated_tactic_fits_its_sm_and_the_sm120_list_is_not_empty() {
        for sm in Sm::ALL {
            let list = MlaTactic::enumerate(sm);
            assert!(list.len() >= 5, "{sm}: {list:?}");
            for t in list {
                assert!(t.smem().total <= sm.smem_optin_per_block(), "{t} on {sm}");
            }
        }
        // The FP8 kinds need both on SM120 to have a tactic.
        let sm120 = MlaTactic::enumerate(Sm::Sm120);
        for kind in MlaKind::ALL {
            assert!(sm120.iter().any(|t| t.kind == kind), "{kind:?}");
        }
    }

    /// Kimi-K2.5's ids name no widths (they predate the others); other widths are part of the
    /// id, parse back, and have their own shared memory and constraints.
    #[test]
    fn widths_are_named_in_ids_except_kimis() {
        let kimi = MlaTactic::parse("fp8_h16_t32_w4_s2_sp64").unwrap();
        assert_eq!(kimi.dims, MlaDims::KIMI);
        let small = MlaTactic::parse("fp8_l64r16_h16_t32_w2_s2_sp64").unwrap();
        assert_eq!(small.dims, MlaDims::GOLDEN_SMALL);
        assert_eq!(small.id(), "fp8_l64r16_h16_t32_w2_s2_sp64");
        // Kimi's widths spelled out are not a second name of the same tactic.
        assert!(MlaTactic::parse("fp8_l512r64_h16_t32_w4_s2_sp64").is_err());
        assert!(MlaTactic::parse("fp8_l64_h16_t32_w2_s2_sp64").is_err());
        // Q 16 × (2·80 + 16), two stages of 32 × (64 + 16) codes + 32 × (32 + 16) RoPE + 128 B
        // of scales, scores 16 × (128 + 16), P 16 × (64 + 16), stats 192.
        assert_eq!(
            small.smem().total,
            16 * 176 + 2 * (32 * 80 + 32 * 48 + 128) + 16 * 144 + 16 * 80 + 192
        );
        assert!(
            small
                .nvcc_defines()
                .contains(&"-DMLA_LATENT=64".to_string())
        );
        assert!(kimi.nvcc_defines().contains(&"-DMLA_ROPE=64".to_string()));
        assert_eq!(small.workspace_bytes(1, 4), 4 * 4 * 64 * 65);
        // Four warps would split a 64-value latent into 16-column slices.
        assert!(MlaTactic::parse("bf16_l64r16_h16_t32_w4_s2_sp64").is_err());
        // fp8qk quantizes q per warp in packs of 4 values per lane: 128-value multiples only.
        assert!(MlaTactic::parse("fp8qk_l64r16_h16_t32_w2_s2_sp64").is_err());
        assert!(MlaTactic::parse("bf16_l96r16_h16_t32_w2_s2_sp64").is_err());
        assert!(MlaTactic::parse("bf16_l64r8_h16_t32_w2_s2_sp64").is_err());
        for sm in Sm::ALL {
            let built: Vec<MlaTactic> = MlaTactic::enumerate(sm)
                .into_iter()
                .filter(|t| t.dims == MlaDims::GOLDEN_SMALL)
                .collect();
            let kinds: Vec<MlaKind> = built.iter().map(|t| t.kind).collect();
            assert_eq!(kinds, [MlaKind::Bf16, MlaKind::Fp8], "{sm}");
        }
    }

    #[test]
    fn bf16_tiles_that_overflow_sm120_are_rejected_there_only() {
        let t = MlaTactic::parse("bf16_h32_t32_w8_s3_sp64").unwrap();
        assert!(t.smem().total > Sm::Sm120.smem_optin_per_block());
        assert!(!t.fits(Sm::Sm120));
        assert!(t.fits(Sm::Sm90));
    }

    #[test]
    fn split_tactics_round_trip_and_respect_max_splits() {
        for sm in Sm::ALL {
            let all = MlaSplitTactic::enumerate(sm);
            assert_eq!(
                all.len(),
                MlaTactic::enumerate(sm).len() * SPLIT_CHOICES.len()
            );
            for t in all {
                assert_eq!(MlaSplitTactic::parse(&t.id()).unwrap(), t);
            }
        }
        assert!(MlaSplitTactic::parse("fp8_h16_t32_w4_s2_sp64_x65").is_err());
        assert!(MlaSplitTactic::parse("fp8_h16_t32_w4_s2_sp64_x0").is_err());
        assert!(MlaSplitTactic::parse("fp8_h16_t32_w4_s2_sp64").is_err());
    }

    #[test]
    fn split_planning_fills_the_gpu_for_batch_one() {
        let t = MlaTactic::parse("fp8_h16_t32_w4_s2_sp64").unwrap();
        // Batch 1, 8 heads per GPU, 8K context on 188 SMs: capped at 64 splits.
        assert_eq!(t.plan_splits(1, 8, 8192, 188), 64);
        // A 40-token context never gets an empty second-tile split beyond its 2 tiles.
        assert_eq!(t.plan_splits(1, 8, 40, 188), 2);
        // A big batch needs no splitting.
        assert_eq!(t.plan_splits(512, 64, 8192, 188), 1);
        // 64 splits × 8 heads × 513 f32 for one request.
        assert_eq!(t.workspace_bytes(1, 8), 4 * 64 * 8 * 513);
    }

    #[test]
    fn the_spaces_round_trip_and_fit_where_they_are_built() {
        crate::tactic::assert_space_round_trips::<MlaTactic>();
        crate::tactic::assert_space_round_trips::<MlaSplitTactic>();
    }

    #[test]
    fn a_tactic_that_overflows_sm120_is_refused_there() {
        let t = MlaTactic::parse("bf16_h32_t32_w8_s3_sp64").unwrap();
        assert!(t.fits_on(Sm::Sm90));
        let e = t.validate_for(Sm::Sm120).unwrap_err();
        assert!(e.to_string().contains("shared memory"), "{e}");
    }

    #[test]
    fn defaults_serve_their_shape() {
        for sm in Sm::ALL {
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
        }
        // A shape of another family is served by none.
        let moe = ProblemShape::Moe {
            tokens_per_expert: 1,
            active_experts: 8,
            hidden: 7168,
            inter: 256,
        };
        assert!(MlaTactic::heuristic_default(Sm::Sm120, &moe).is_none());
    }

    #[test]
    fn shapes_that_name_no_widths_are_kimis() {
        let implied = crate::tactic::IMPLIED_MLA_WIDTHS;
        let kimi = MlaDims::KIMI;
        assert_eq!((kimi.latent as u32, kimi.rope as u32), implied);
        let json = r#"{"kind": "mla", "batch": 1, "heads": 8, "context": 128, "fp8_cache": false}"#;
        let shape: ProblemShape = serde_json::from_str(json).unwrap();
        assert_eq!(shape, ProblemShape::mla(1, 8, 128, false, kimi));
    }
}
