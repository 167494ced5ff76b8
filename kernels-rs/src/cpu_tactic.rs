//! The tunables of the CPU kernels as one typed tactic value.
//!
//! A [`CpuTactic`] fixes the work split of every CPU hot path of a decode step: the work-item
//! size of the fast NVFP4 grouped GEMM ([`moe_gemm::cpu`](crate::moe_gemm::cpu)), the parallel
//! threshold and rows per task of the dense products ([`dense`](crate::dense)), the split-KV
//! chunking of MLA attention ([`mla::cpu`](crate::mla::cpu)), the thread count, and how the
//! grouped GEMM computes its W4A4 dot products ([`MoeDot`]). None of them changes what is
//! computed:
//! - the MoE work-item size and the dense split only decide which thread computes which output
//!   row, and every output element is the same dot product in the same order: results are
//!   bit-identical for every valid tactic;
//! - the MLA chunking decides where the split-KV merge cuts a sequence, which changes the order
//!   of the softmax sums: results agree to rounding (the merge is exact in real arithmetic);
//! - the MoE dot kind multiplies the same quantized weights and activations: f32 FMAs round
//!   every product-sum, the integer kernels only the sums of exact block terms, so results
//!   agree to rounding.
//!
//! [`CpuTactic::DEFAULT`] holds the constants the kernels used before they were tunable, and
//! the integer dot products, which were measured faster at every decode size on AVX-512 VNNI
//! and AVX2 (`bench/results/cpu_grouped_gemm.txt`). Its [`id`](CpuTactic::id) is stable and [`parse`](CpuTactic::parse)s back, so
//! autotune caches, benchmarks and logs name tactics the same way.
//!
//! The tactic is passed explicitly (`moe_cpu_tuned`, `matmul_transposed_tuned`,
//! `mla_attention_tuned`); the untuned entry points use the default. The thread count is the
//! one knob a kernel cannot apply itself: rayon's pool is the caller's, so whoever owns the
//! process (the `model` binary at start, a benchmark around each measurement) builds the pool
//! with [`CpuTactic::threads`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::tactic::cache::{self, CPU_TARGET, Expected};
use crate::tactic::{KernelFamily, ProblemShape};

/// Logical CPUs this process may use, read once: `std::thread::available_parallelism` reads
/// the cgroup's CPU quota files on every call (tens of microseconds on Linux), which the MLA
/// kernel's once-per-call and the backend's once-per-step use paid at every decode step.
pub fn machine_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Tokens the MLA kernel dequantizes together; a split-KV chunk is a multiple of it.
pub const MLA_TILE: usize = 16;

/// One point of the CPU kernels' tactic space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuTactic {
    /// Grouped GEMM: weight bytes one parallel work item streams (rounded by the kernel to
    /// whole 16-row tiles). Large enough that rayon's per-item cost (~1 µs) is a few percent
    /// of the item's memory time, small enough for a few items per thread on one expert.
    pub moe_item_bytes: usize,
    /// Dense BF16 products below this many weight bytes run on the calling thread: waking the
    /// pool costs tens of microseconds, more than reading a few hundred KB takes.
    pub dense_parallel_min_bytes: usize,
    /// Dense products: weight rows per parallel task over more than four tokens; over at most
    /// four (decode), the fewest rows one guided claim takes ([`guided`](crate::guided)).
    pub dense_rows_per_task: usize,
    /// Dense BF16 products over at least this many tokens widen each task's rows once into
    /// an f32 panel ([`bf16_panel`](crate::dense::bf16_panel); AVX2, where it has a kernel);
    /// fewer tokens widen in registers. Same bits either way.
    pub dense_panel_min_tokens: usize,
    /// MLA split-KV: the shortest chunk worth a task of its own (a multiple of [`MLA_TILE`]).
    pub mla_min_chunk: usize,
    /// MLA split-KV: chunks aimed for per pool thread over the whole batch.
    pub mla_tasks_per_thread: usize,
    /// Threads of the rayon pool the kernels run in; 0 = rayon's default (every core).
    pub threads: usize,
    /// Grouped GEMM: how an NVFP4 expert's dot products are computed.
    pub moe_dot: MoeDot,
}

/// How the grouped GEMM computes NVFP4 W4A4 dot products. Both have the checkpoint's
/// semantics (the same quantized weights and activations); they differ in rounding only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoeDot {
    /// Weights decoded to f32 in registers, FMAs against the fake-quantized f32 activations
    /// ([`cpu_simd`](crate::moe_gemm::cpu_simd)).
    F32Fma,
    /// Exact integer block dots of `2·e2m1` codes (AVX-512 VNNI `vpdpbusd`, AVX2
    /// `vpmaddubsw`), one f32 multiply-add per block by the two block scales
    /// ([`cpu_int`](crate::moe_gemm::cpu_int)).
    IntDot,
}

impl MoeDot {
    /// Every kind, for sweeps.
    pub const ALL: [Self; 2] = [Self::F32Fma, Self::IntDot];

    /// The stable name in a tactic id.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32Fma => "f32",
            Self::IntDot => "int",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == text)
    }
}

impl Default for CpuTactic {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Why a tactic string or value is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuTacticError {
    #[error("cpu tactic: `{0}` is not KEY=VALUE")]
    NotKeyValue(String),
    #[error("cpu tactic: unknown key `{0}` (known: {known})", known = KEYS.join(", "))]
    UnknownKey(String),
    #[error("cpu tactic: key `{0}` given twice")]
    Duplicate(String),
    #[error("cpu tactic: `{key}={value}` is not a size")]
    BadValue { key: String, value: String },
    #[error("cpu tactic: {0}")]
    OutOfRange(String),
    #[error("cpu tactic: `{key}={value}` is not one of f32, int")]
    BadKind { key: String, value: String },
}

const KEYS: [&str; 8] = [
    "moe_item",
    "dense_min",
    "dense_rows",
    "dense_panel",
    "mla_chunk",
    "mla_tasks",
    "threads",
    "moe_dot",
];

/// Upper bounds of the valid space: beyond them a knob only disables parallelism, which the
/// smaller values already express (or, for threads, oversubscribes any machine).
const MAX_ITEM_BYTES: usize = 64 << 20;
const MAX_PARALLEL_MIN_BYTES: usize = 1 << 40;
const MAX_ROWS_PER_TASK: usize = 1 << 16;
/// Above any batch a step takes: the panel is never used.
const MAX_PANEL_MIN_TOKENS: usize = 1 << 20;
/// The default of [`CpuTactic::dense_panel_min_tokens`]: below this many tokens a product
/// takes the register tiles, since the panel costs a write and a read of f32 per weight,
/// which only pays when the weights serve many tokens.
pub const PANEL_MIN_TOKENS: usize = 8;
const MAX_MLA_CHUNK: usize = 1 << 20;
const MAX_TASKS_PER_THREAD: usize = 256;
const MAX_THREADS: usize = 1024;

impl CpuTactic {
    /// The constants of the kernels before they were tunable.
    pub const DEFAULT: Self = Self {
        moe_item_bytes: 128 * 1024,
        dense_parallel_min_bytes: 512 << 10,
        dense_rows_per_task: 64,
        dense_panel_min_tokens: PANEL_MIN_TOKENS,
        mla_min_chunk: 256,
        mla_tasks_per_thread: 4,
        threads: 0,
        moe_dot: MoeDot::IntDot,
    };

    /// The stable id: every key in a fixed order, sizes in bytes with a `k`/`m` suffix when
    /// exact, e.g.
    /// `moe_item=128k,dense_min=512k,dense_rows=64,dense_panel=8,mla_chunk=256,mla_tasks=4,threads=0,moe_dot=int`.
    pub fn id(&self) -> String {
        format!(
            "moe_item={},dense_min={},dense_rows={},dense_panel={},mla_chunk={},mla_tasks={},threads={},moe_dot={}",
            size(self.moe_item_bytes),
            size(self.dense_parallel_min_bytes),
            self.dense_rows_per_task,
            self.dense_panel_min_tokens,
            self.mla_min_chunk,
            self.mla_tasks_per_thread,
            self.threads,
            self.moe_dot.name()
        )
    }

    /// Parses an id. Keys may come in any order and may be left out (the default's value);
    /// an empty string or `default` is the default. The result is validated.
    pub fn parse(text: &str) -> Result<Self, CpuTacticError> {
        let mut tactic = Self::DEFAULT;
        let text = text.trim();
        if text.is_empty() || text == "default" {
            return Ok(tactic);
        }
        let mut seen = Vec::new();
        for part in text.split(',') {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| CpuTacticError::NotKeyValue(part.to_string()))?;
            let (key, value) = (key.trim(), value.trim());
            if seen.contains(&key) {
                return Err(CpuTacticError::Duplicate(key.to_string()));
            }
            seen.push(key);
            if key == "moe_dot" {
                tactic.moe_dot = MoeDot::parse(value).ok_or_else(|| CpuTacticError::BadKind {
                    key: key.to_string(),
                    value: value.to_string(),
                })?;
                continue;
            }
            let n = parse_size(value).ok_or_else(|| CpuTacticError::BadValue {
                key: key.to_string(),
                value: value.to_string(),
            })?;
            match key {
                "moe_item" => tactic.moe_item_bytes = n,
                "dense_min" => tactic.dense_parallel_min_bytes = n,
                "dense_rows" => tactic.dense_rows_per_task = n,
                "dense_panel" => tactic.dense_panel_min_tokens = n,
                "mla_chunk" => tactic.mla_min_chunk = n,
                "mla_tasks" => tactic.mla_tasks_per_thread = n,
                "threads" => tactic.threads = n,
                _ => return Err(CpuTacticError::UnknownKey(key.to_string())),
            }
        }
        tactic.validate()?;
        Ok(tactic)
    }

    /// Whether every knob is in range. The kernels rely on it (a zero tile would never end).
    pub fn validate(&self) -> Result<(), CpuTacticError> {
        let range = |what: &str, v: usize, lo: usize, hi: usize| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(CpuTacticError::OutOfRange(format!(
                    "{what} {v} is outside {lo}..={hi}"
                )))
            }
        };
        range("moe_item", self.moe_item_bytes, 1, MAX_ITEM_BYTES)?;
        range(
            "dense_min",
            self.dense_parallel_min_bytes,
            0,
            MAX_PARALLEL_MIN_BYTES,
        )?;
        range("dense_rows", self.dense_rows_per_task, 1, MAX_ROWS_PER_TASK)?;
        range(
            "dense_panel",
            self.dense_panel_min_tokens,
            1,
            MAX_PANEL_MIN_TOKENS,
        )?;
        range("mla_chunk", self.mla_min_chunk, MLA_TILE, MAX_MLA_CHUNK)?;
        if !self.mla_min_chunk.is_multiple_of(MLA_TILE) {
            return Err(CpuTacticError::OutOfRange(format!(
                "mla_chunk {} is not a multiple of {MLA_TILE}",
                self.mla_min_chunk
            )));
        }
        range(
            "mla_tasks",
            self.mla_tasks_per_thread,
            1,
            MAX_TASKS_PER_THREAD,
        )?;
        range("threads", self.threads, 0, MAX_THREADS)?;
        Ok(())
    }

    /// The pool size this tactic asks for on a machine with `cores` logical CPUs.
    pub fn pool_threads(&self, cores: usize) -> usize {
        if self.threads == 0 {
            cores.max(1)
        } else {
            self.threads
        }
    }

    /// A rayon pool of [`threads`](Self::threads) threads, for callers that run the kernels
    /// under several tactics in one process (benchmarks, autotune): `pool.install(|| …)`.
    pub fn build_pool(&self) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(self.threads)
            .build()
    }

    /// The search space of `autotune --cpu` and the benchmark sweeps, per knob group: every
    /// value is valid, and each list holds the default's value. `cores` bounds the thread
    /// counts tried.
    pub fn space(cores: usize) -> CpuTacticSpace {
        let mut threads: Vec<usize> = vec![0];
        let mut t = 1;
        while t < cores.max(1) {
            threads.push(t);
            t *= 2;
        }
        CpuTacticSpace {
            moe_item_bytes: [16, 32, 64, 128, 256, 512, 1024].map(|k| k * 1024).to_vec(),
            dense_parallel_min_bytes: [0, 64, 128, 256, 512, 1024, 2048, 4096]
                .map(|k| k * 1024)
                .to_vec(),
            dense_rows_per_task: vec![8, 16, 32, 64, 128, 256],
            mla_min_chunk: vec![64, 128, 256, 512, 1024],
            mla_tasks_per_thread: vec![1, 2, 4, 8],
            threads,
            moe_dot: MoeDot::ALL.to_vec(),
        }
    }
}

/// The values `autotune --cpu` tries for each knob (see [`CpuTactic::space`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuTacticSpace {
    pub moe_item_bytes: Vec<usize>,
    pub dense_parallel_min_bytes: Vec<usize>,
    pub dense_rows_per_task: Vec<usize>,
    pub mla_min_chunk: Vec<usize>,
    pub mla_tasks_per_thread: Vec<usize>,
    pub threads: Vec<usize>,
    pub moe_dot: Vec<MoeDot>,
}

impl CpuTacticSpace {
    /// Tactics that differ from `base` in the MoE dot kind only.
    pub fn moe_dot(&self, base: CpuTactic) -> Vec<CpuTactic> {
        self.moe_dot
            .iter()
            .map(|&moe_dot| CpuTactic { moe_dot, ..base })
            .collect()
    }

    /// Tactics that differ from `base` in the MoE knob only.
    pub fn moe(&self, base: CpuTactic) -> Vec<CpuTactic> {
        self.moe_item_bytes
            .iter()
            .map(|&moe_item_bytes| CpuTactic {
                moe_item_bytes,
                ..base
            })
            .collect()
    }

    /// Tactics that differ from `base` in the dense knobs only.
    pub fn dense(&self, base: CpuTactic) -> Vec<CpuTactic> {
        let mut out = Vec::new();
        for &dense_parallel_min_bytes in &self.dense_parallel_min_bytes {
            for &dense_rows_per_task in &self.dense_rows_per_task {
                out.push(CpuTactic {
                    dense_parallel_min_bytes,
                    dense_rows_per_task,
                    ..base
                });
            }
        }
        out
    }

    /// Tactics that differ from `base` in the MLA knobs only.
    pub fn mla(&self, base: CpuTactic) -> Vec<CpuTactic> {
        let mut out = Vec::new();
        for &mla_min_chunk in &self.mla_min_chunk {
            for &mla_tasks_per_thread in &self.mla_tasks_per_thread {
                out.push(CpuTactic {
                    mla_min_chunk,
                    mla_tasks_per_thread,
                    ..base
                });
            }
        }
        out
    }

    /// Tactics that differ from `base` in the thread count only.
    pub fn threads(&self, base: CpuTactic) -> Vec<CpuTactic> {
        self.threads
            .iter()
            .map(|&threads| CpuTactic { threads, ..base })
            .collect()
    }

    /// Points of the full cross product (the knob groups are searched one after another, so
    /// autotune times far fewer).
    pub fn size(&self) -> usize {
        self.moe_item_bytes.len()
            * self.dense_parallel_min_bytes.len()
            * self.dense_rows_per_task.len()
            * self.mla_min_chunk.len()
            * self.mla_tasks_per_thread.len()
            * self.threads.len()
            * self.moe_dot.len()
    }
}

impl fmt::Display for CpuTactic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

impl FromStr for CpuTactic {
    type Err = CpuTacticError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// FNV-1a 64 (16 hex digits) over the sources of the CPU kernels a [`CpuTactic`] tunes, as
/// this binary was built from them: a tactic cache records it, and a cache tuned on other
/// sources is stale.
pub fn cpu_kernel_source_hash() -> String {
    let sources: [&[u8]; 10] = [
        include_bytes!("cpu_tactic.rs"),
        include_bytes!("isa.rs"),
        include_bytes!("prefetch.rs"),
        include_bytes!("dense/mod.rs"),
        include_bytes!("dense/bf16_tile.rs"),
        include_bytes!("dense/bf16_panel.rs"),
        include_bytes!("moe_gemm/cpu.rs"),
        include_bytes!("moe_gemm/cpu_simd.rs"),
        include_bytes!("moe_gemm/cpu_int.rs"),
        include_bytes!("mla/cpu.rs"),
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in sources.iter().flat_map(|s| s.iter()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Bucket prefix of the tactic cache entry that holds the tuned tactic of a model's decode
/// step (`autotune --cpu` writes `cpu_decode_b1_<model>`).
pub const DECODE_BUCKET_PREFIX: &str = "cpu_decode_b1_";
/// Key of [`cpu_kernel_source_hash`] in a cache's `kernel_source_hashes`.
pub const CPU_SOURCES_KEY: &str = "cpu";

/// The shape a model's decode entry is filed under: its MoE layer at one token (`top_k` of
/// `experts` experts, one token each), which tells models apart.
pub fn decode_entry_shape(
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
) -> ProblemShape {
    let active = top_k.min(experts).max(1);
    ProblemShape::Moe {
        tokens_per_expert: top_k.div_ceil(active) as u32,
        active_experts: active as u32,
        hidden: hidden as u32,
        inter: inter as u32,
    }
}

/// The CPU tactic a run uses, and the line it logs.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuChoice {
    pub tactic: CpuTactic,
    /// `tactic cpu: <id> (<where it came from>)`.
    pub description: String,
    /// Why the cache could not be used (missing, corrupt, stale, no CPU entry), one line.
    pub warning: Option<String>,
}

impl CpuChoice {
    /// No cache: the default.
    pub fn default_choice() -> Self {
        Self {
            tactic: CpuTactic::DEFAULT,
            description: format!("tactic cpu: {} (default)", CpuTactic::DEFAULT),
            warning: None,
        }
    }
}

/// The CPU tactic of the tactic cache at `path` for the decode of the model whose MoE layer at
/// one token is `decode_shape` (the entry of that model, else any CPU decode entry). Never
/// fails: a missing, corrupt or stale cache (another target, other CPU kernel sources), one
/// without a CPU entry, or an entry whose id does not parse gives a warning and the default.
pub fn choose_from_cache(path: &Path, decode_shape: &ProblemShape) -> CpuChoice {
    let expected = Expected {
        sm: CPU_TARGET.to_string(),
        driver_version: None,
        kernel_source_hashes: BTreeMap::from([(
            CPU_SOURCES_KEY.to_string(),
            cpu_kernel_source_hash(),
        )]),
    };
    let lookup = cache::load(path, &expected);
    let fallback = |warning: String| CpuChoice {
        warning: Some(warning),
        ..CpuChoice::default_choice()
    };
    let Some(cache) = lookup.cache else {
        return fallback(
            lookup
                .warning
                .unwrap_or_else(|| format!("warning: tactic cache {}: not usable", path.display())),
        );
    };
    let entries: Vec<_> = cache
        .entries
        .iter()
        .filter(|e| {
            e.family == KernelFamily::Cpu
                && e.sm == CPU_TARGET
                && e.bucket.starts_with(DECODE_BUCKET_PREFIX)
        })
        .collect();
    let Some(entry) = entries
        .iter()
        .find(|e| &e.shape == decode_shape)
        .or(entries.first())
    else {
        return fallback(format!(
            "warning: tactic cache {}: no CPU decode entry; using the default CPU tactic",
            path.display()
        ));
    };
    match CpuTactic::parse(&entry.winner.tactic) {
        Ok(tactic) => CpuChoice {
            tactic,
            description: format!(
                "tactic cpu: {tactic} (tactic cache, bucket {}, {:.1} µs per decode step {}{})",
                entry.bucket,
                entry.winner.median_us,
                entry.winner.source,
                if tactic == CpuTactic::DEFAULT {
                    "; the constants were best"
                } else {
                    ""
                }
            ),
            warning: None,
        },
        Err(e) => fallback(format!(
            "warning: tactic cache {}: bucket {}: {e}; using the default CPU tactic",
            path.display(),
            entry.bucket
        )),
    }
}

fn size(bytes: usize) -> String {
    if bytes != 0 && bytes.is_multiple_of(1 << 20) {
        format!("{}m", bytes >> 20)
    } else if bytes != 0 && bytes.is_multiple_of(1 << 10) {
        format!("{}k", bytes >> 10)
    } else {
        bytes.to_string()
    }
}

fn parse_size(text: &str) -> Option<usize> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'k' | b'K' => (&text[..text.len() - 1], 10),
        b'm' | b'M' => (&text[..text.len() - 1], 20),
        _ => (text, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_default_is_valid_and_its_id_round_trips() {
        let d = CpuTactic::DEFAULT;
        d.validate().unwrap();
        assert_eq!(CpuTactic::parse(&d.id()).unwrap(), d);
        assert_eq!(CpuTactic::parse("").unwrap(), d);
        assert_eq!(CpuTactic::parse("default").unwrap(), d);
        assert_eq!(
            CpuTactic::parse("threads=1, moe_item=64k").unwrap(),
            CpuTactic {
                threads: 1,
                moe_item_bytes: 64 << 10,
                ..d
            }
        );
        // The dot kind by name (ids without the key, older ones too, get the default's).
        assert_eq!(
            CpuTactic::parse("moe_dot=f32").unwrap(),
            CpuTactic {
                moe_dot: MoeDot::F32Fma,
                ..d
            }
        );
    }

    #[test]
    fn bad_strings_are_refused_with_the_reason() {
        for (text, want) in [
            ("moe_item", "not KEY=VALUE"),
            ("tile=4", "unknown key"),
            ("threads=1,threads=2", "given twice"),
            ("dense_rows=-3", "not a size"),
            ("dense_rows=0", "outside"),
            ("mla_chunk=100", "multiple of 16"),
            ("mla_chunk=0", "outside"),
            ("moe_item=99999999999999999999m", "not a size"),
            ("threads=5000", "outside"),
            ("moe_dot=f16", "not one of"),
            ("moe_dot=int,moe_dot=f32", "given twice"),
        ] {
            let err = CpuTactic::parse(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn every_point_of_the_space_is_valid_and_the_default_is_in_it() {
        let space = CpuTactic::space(8);
        let d = CpuTactic::DEFAULT;
        for group in [
            space.moe(d),
            space.dense(d),
            space.mla(d),
            space.threads(d),
            space.moe_dot(d),
        ] {
            assert!(group.contains(&d));
            for t in group {
                t.validate().unwrap();
                assert_eq!(CpuTactic::parse(&t.id()).unwrap(), t);
            }
        }
        assert_eq!(space.threads, vec![0, 1, 2, 4]);
    }

    proptest! {
        #[test]
        fn ids_round_trip(
            moe in 1usize..MAX_ITEM_BYTES,
            dmin in 0usize..(1 << 32),
            drows in 1usize..MAX_ROWS_PER_TASK,
            panel in 1usize..MAX_PANEL_MIN_TOKENS,
            chunk in 1usize..4096,
            tasks in 1usize..MAX_TASKS_PER_THREAD,
            threads in 0usize..MAX_THREADS,
            int_dot in proptest::bool::ANY,
        ) {
            let t = CpuTactic {
                moe_item_bytes: moe,
                dense_parallel_min_bytes: dmin,
                dense_rows_per_task: drows,
                dense_panel_min_tokens: panel,
                mla_min_chunk: chunk * MLA_TILE,
                mla_tasks_per_thread: tasks,
                threads,
                moe_dot: if int_dot { MoeDot::IntDot } else { MoeDot::F32Fma },
            };
            prop_assert!(t.validate().is_ok());
            prop_assert_eq!(CpuTactic::parse(&t.id()).unwrap(), t);
            prop_assert_eq!(t.to_string().parse::<CpuTactic>().unwrap(), t);
        }
    }

    mod cache_reading {
        use super::super::*;
        use crate::tactic::cache::{
            CacheEntry, FORMAT, FigureSource, NO_GPU, Provenance, TacticCache, TacticFigure,
        };

        fn shape(hidden: u32) -> ProblemShape {
            ProblemShape::Moe {
                tokens_per_expert: 1,
                active_experts: 8,
                hidden,
                inter: 64,
            }
        }

        fn entry(bucket: &str, hidden: u32, tactic: &str) -> CacheEntry {
            let figure = |t: &str| TacticFigure {
                tactic: t.to_string(),
                median_us: 100.0,
                spread_us: 3.0,
                n: 5,
                source: FigureSource::Measured,
            };
            CacheEntry {
                family: KernelFamily::Cpu,
                sm: CPU_TARGET.into(),
                bucket: bucket.into(),
                shape: shape(hidden),
                winner: figure(tactic),
                runners_up: vec![figure("default")],
            }
        }

        fn cache(entries: Vec<CacheEntry>) -> TacticCache {
            TacticCache {
                format: FORMAT,
                provenance: Provenance {
                    gpu_or_cpu_model: "test CPU".into(),
                    sm: CPU_TARGET.into(),
                    driver_version: NO_GPU.into(),
                    cuda_version: NO_GPU.into(),
                    commit: "unknown".into(),
                    manifest_hash: "none".into(),
                    kernel_source_hashes: BTreeMap::from([(
                        CPU_SOURCES_KEY.to_string(),
                        cpu_kernel_source_hash(),
                    )]),
                    command: "test".into(),
                    model: Some(crate::tactic::cache::TunedModel {
                        name: "test".into(),
                        dims: BTreeMap::new(),
                    }),
                },
                entries,
            }
        }

        fn dir() -> std::path::PathBuf {
            let d = std::env::temp_dir().join(format!(
                "cpu-tactic-cache-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            std::fs::create_dir_all(&d).unwrap();
            d
        }

        #[test]
        fn the_models_decode_entry_is_chosen_and_logged() {
            let d = dir();
            let path = d.join("fresh.json");
            let tuned = CpuTactic {
                threads: 1,
                ..CpuTactic::DEFAULT
            };
            let c = cache(vec![
                entry("cpu_moe_x", 64, "threads=2"),
                // A knob's entry of the decode stage, same model: not the verdict.
                entry("cpu_decode_knob_threads_this", 64, "threads=2"),
                entry("cpu_decode_b1_other", 128, "moe_item=64k"),
                entry("cpu_decode_b1_this", 64, &tuned.id()),
            ]);
            std::fs::write(&path, c.to_json()).unwrap();
            let choice = choose_from_cache(&path, &shape(64));
            assert_eq!(choice.warning, None);
            assert_eq!(choice.tactic, tuned);
            assert!(choice.description.contains("cpu_decode_b1_this"));
            assert!(choice.description.contains("measured"));
            // Another model: the other decode entry is the nearest there is, not a default.
            let other = choose_from_cache(&path, &shape(4096));
            assert!(other.warning.is_none());
            std::fs::remove_dir_all(d).unwrap();
        }

        #[test]
        fn missing_corrupt_stale_and_empty_caches_warn_and_give_the_default() {
            let d = dir();
            let good = cache(vec![entry("cpu_decode_b1_m", 64, "threads=1")]);
            let mut other_sources = good.clone();
            other_sources
                .provenance
                .kernel_source_hashes
                .insert(CPU_SOURCES_KEY.into(), "0123456789abcdef".into());
            let mut gpu = good.clone();
            gpu.provenance.sm = "sm_120a".into();
            let mut bad_id = good.clone();
            bad_id.entries[0].winner.tactic = "dense_rows=0".into();
            let cases = [
                ("corrupt", good.to_json()[..40].to_string()),
                ("stale", other_sources.to_json()),
                ("stale", gpu.to_json()),
                ("no CPU decode entry", cache(vec![]).to_json()),
                ("outside", bad_id.to_json()),
            ];
            assert!(
                choose_from_cache(&d.join("absent.json"), &shape(64))
                    .warning
                    .unwrap()
                    .contains("not found")
            );
            for (i, (want, text)) in cases.iter().enumerate() {
                let path = d.join(format!("{i}.json"));
                std::fs::write(&path, text).unwrap();
                let c = choose_from_cache(&path, &shape(64));
                let w = c.warning.unwrap_or_default();
                assert!(w.contains(want) && !w.contains('\n'), "{want}: {w}");
                assert_eq!(c.tactic, CpuTactic::DEFAULT, "{want}");
            }
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}
