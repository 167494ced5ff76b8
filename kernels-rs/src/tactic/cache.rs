//! The tactic cache: what the tuning lab (`autotune`) found, per (family, SM, shape bucket),
//! with where it was found, as JSON. The runtime (`model run`, `model logits`, the GPU
//! executor) reads it at start through [`load`].
//!
//! A cache that is missing, corrupt, of another format, or stale — written for another SM,
//! another driver, or other kernel sources than the ones this binary was built from, or before
//! caches recorded their model — is never an error: [`load`] returns a one-line warning and no
//! cache, and the caller uses each family's
//! [`heuristic_default`](super::Tactic::heuristic_default).
//!
//! A cache records the model it was tuned for ([`TunedModel`]: a name and the dimensions its
//! shapes come from). A run of another model is refused by the runtime
//! ([`TunedModel::differences`]): the file is the wrong one, and its entries, filed under
//! another model's shapes, would be used for the nearest shapes of this one.
//!
//! Figures carry their [`FigureSource`]: a predicted time (the cost model, without a device)
//! is never presented as measured.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{KernelFamily, ProblemShape, Tactic};
use crate::arch::Sm;
use crate::files::{FileError, TEXT_FILE_LIMIT, check_regular, read_text_bounded};

/// Version of the JSON layout; a cache of another version is not read.
pub const FORMAT: u32 = 1;
/// `provenance.sm` of a cache of the CPU kernels.
pub const CPU_TARGET: &str = "cpu";
/// `driver_version` / `cuda_version` when the cache was written without a GPU.
pub const NO_GPU: &str = "none (no GPU)";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TacticCache {
    pub format: u32,
    pub provenance: Provenance,
    pub entries: Vec<CacheEntry>,
}

/// Where and from what a cache was made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// The GPU's name, or the CPU's model for CPU caches.
    pub gpu_or_cpu_model: String,
    /// `sm_120a`, `sm_90a`, or [`CPU_TARGET`].
    pub sm: String,
    /// The NVIDIA driver, or [`NO_GPU`].
    pub driver_version: String,
    /// The CUDA version the driver supports, or [`NO_GPU`].
    pub cuda_version: String,
    /// `git rev-parse HEAD` of the tree that was tuned, or `unknown`.
    pub commit: String,
    /// FNV-1a 64 of `ptx/manifest.json` as the static stage read it.
    pub manifest_hash: String,
    /// FNV-1a 64 of each family's kernel source (and `ptx_helpers`), as in the manifest.
    pub kernel_source_hashes: BTreeMap<String, String>,
    /// The command that wrote the cache.
    #[serde(default)]
    pub command: String,
    /// The model tuned; `None` in caches written before caches recorded it (stale).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<TunedModel>,
}

/// The model a cache was tuned for: its name, for messages, and the configuration's dimensions
/// its problem shapes derive from, which decide whether a run's model is the same.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TunedModel {
    /// A preset's id (`mini`, `kimi-k2.5`) or the checkpoint folder's name.
    pub name: String,
    /// `config.json` keys (`hidden_size`, `n_routed_experts`, …) and their values.
    pub dims: BTreeMap<String, u64>,
}

impl TunedModel {
    /// The dimensions in which `run` differs from this model, `key cached→run` each
    /// (comma-separated); `None` when the models are the same.
    pub fn differences(&self, run: &TunedModel) -> Option<String> {
        let keys: std::collections::BTreeSet<&String> =
            self.dims.keys().chain(run.dims.keys()).collect();
        let shown = |v: Option<&u64>| v.map_or("-".to_string(), u64::to_string);
        let differing: Vec<String> = keys
            .into_iter()
            .filter(|k| self.dims.get(*k) != run.dims.get(*k))
            .map(|k| format!("{k} {}→{}", shown(self.dims.get(k)), shown(run.dims.get(k))))
            .collect();
        (!differing.is_empty()).then(|| differing.join(", "))
    }
}

/// The tuning result of one (family, SM, shape bucket).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub family: KernelFamily,
    pub sm: String,
    pub bucket: String,
    pub shape: ProblemShape,
    pub winner: TacticFigure,
    /// The next best, fastest first.
    pub runners_up: Vec<TacticFigure>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FigureSource {
    /// Timed on the device (or on this CPU for CPU tactics).
    Measured,
    /// The cost model's prediction; no device of this SM timed it.
    Predicted,
}

impl fmt::Display for FigureSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FigureSource::Measured => "measured",
            FigureSource::Predicted => "predicted",
        })
    }
}

/// One tactic's time on a shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TacticFigure {
    pub tactic: String,
    pub median_us: f64,
    /// Max − min over the `n` samples (0 for a prediction).
    pub spread_us: f64,
    pub n: u32,
    pub source: FigureSource,
}

impl TacticFigure {
    /// A figure timed on the device: median, spread and count of `samples`.
    pub fn measured(tactic: String, samples: &super::timing::Samples) -> Self {
        TacticFigure {
            tactic,
            median_us: samples.median(),
            spread_us: samples.spread(),
            n: samples.n() as u32,
            source: FigureSource::Measured,
        }
    }

    /// The cost model's prediction: one point, no spread.
    pub fn predicted(tactic: String, us: f64) -> Self {
        TacticFigure {
            tactic,
            median_us: us,
            spread_us: 0.0,
            n: 1,
            source: FigureSource::Predicted,
        }
    }
}

/// FNV-1a 64 as the compile gate writes it into the manifest (16 hex digits).
pub fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Hashes of the kernel sources this binary was built from, keyed as the manifest's
/// `sources` (plus `layers`, which the manifest does not list).
pub fn built_source_hashes() -> BTreeMap<String, String> {
    let sources: [(&str, &[u8]); 5] = [
        ("moe_gemm", include_bytes!("../moe_gemm/moe_gemm.cu")),
        ("mla", include_bytes!("../mla/mla_decode.cu")),
        ("allreduce", include_bytes!("../allreduce/allreduce.cu")),
        ("layers", include_bytes!("../layers/layers.cu")),
        (
            "ptx_helpers",
            include_bytes!("../../include/ptx_helpers.cuh"),
        ),
    ];
    sources
        .into_iter()
        .map(|(k, v)| (k.to_string(), fnv1a64(v)))
        .collect()
}

/// What the reader runs on: a cache must match it to be used.
#[derive(Clone, Debug, PartialEq)]
pub struct Expected {
    /// `sm_120a`, `sm_90a` or [`CPU_TARGET`].
    pub sm: String,
    /// The driver in use; `None` when there is none (a CPU run): not compared.
    pub driver_version: Option<String>,
    /// The sources of the kernels that will run ([`built_source_hashes`]).
    pub kernel_source_hashes: BTreeMap<String, String>,
}

impl Expected {
    /// A reader that will run the kernels of this binary on `sm` under `driver`.
    pub fn for_sm(sm: Sm, driver_version: Option<String>) -> Self {
        Expected {
            sm: sm.arch().to_string(),
            driver_version,
            kernel_source_hashes: built_source_hashes(),
        }
    }
}

/// What [`load`] found: a usable cache, or the one-line reason there is none.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheLookup {
    pub cache: Option<TacticCache>,
    pub warning: Option<String>,
}

/// A choice for one family and shape, and whether it came from the cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Chosen<T> {
    pub tactic: T,
    /// The cache entry's winning figure; `None`: the heuristic default.
    pub figure: Option<TacticFigure>,
    pub bucket: Option<String>,
}

impl<T: Tactic> Chosen<T> {
    /// One log line: `moe_gemm: native_… (cache, moe_t1_…, 12.3 µs predicted)` or
    /// `moe_gemm: native_… (heuristic default)`.
    pub fn describe(&self) -> String {
        match (&self.figure, &self.bucket) {
            (Some(f), Some(b)) => format!(
                "{}: {} (tactic cache, bucket {b}, {:.2} µs {})",
                T::FAMILY,
                self.tactic.tactic_id(),
                f.median_us,
                f.source
            ),
            _ => format!(
                "{}: {} (heuristic default)",
                T::FAMILY,
                self.tactic.tactic_id()
            ),
        }
    }
}

impl CacheLookup {
    /// No cache was asked for.
    pub fn none() -> Self {
        CacheLookup {
            cache: None,
            warning: None,
        }
    }

    /// The tuned tactic of `T`'s family for `shape` on `sm` (the entry of the same bucket,
    /// else the nearest one of the same kind), or the heuristic default. A cached id that no
    /// longer parses or no longer fits `sm` is ignored (with the default).
    pub fn choose<T: Tactic>(&self, sm: Sm, shape: &ProblemShape) -> Option<Chosen<T>> {
        if let Some(entry) = self
            .cache
            .as_ref()
            .and_then(|c| c.nearest(T::FAMILY, sm.arch(), shape))
            && let Ok(t) = T::parse_id(&entry.winner.tactic)
            && t.fits_on(sm)
            && t.serves(shape)
        {
            return Some(Chosen {
                tactic: t,
                figure: Some(entry.winner.clone()),
                bucket: Some(entry.bucket.clone()),
            });
        }
        T::heuristic_default(sm, shape).map(|tactic| Chosen {
            tactic,
            figure: None,
            bucket: None,
        })
    }
}

/// Distance between two shapes of the same kind and fixed dimensions (`None`: not
/// comparable): the log ratio of the dimension that varies with the batch.
fn shape_distance(a: &ProblemShape, b: &ProblemShape) -> Option<f64> {
    let ratio = |x: f64, y: f64| (x.max(1.0) / y.max(1.0)).ln().abs();
    match (a, b) {
        (
            ProblemShape::Moe {
                tokens_per_expert: t1,
                active_experts: e1,
                hidden: h1,
                inter: i1,
            },
            ProblemShape::Moe {
                tokens_per_expert: t2,
                active_experts: e2,
                hidden: h2,
                inter: i2,
            },
        ) if h1 == h2 && i1 == i2 => {
            Some(ratio(*t1 as f64, *t2 as f64) + ratio(*e1 as f64, *e2 as f64))
        }
        (
            ProblemShape::Mla {
                batch: b1,
                heads: h1,
                context: c1,
                fp8_cache: f1,
                latent: l1,
                rope: r1,
            },
            ProblemShape::Mla {
                batch: b2,
                heads: h2,
                context: c2,
                fp8_cache: f2,
                latent: l2,
                rope: r2,
            },
        ) if h1 == h2 && f1 == f2 && (l1, r1) == (l2, r2) => {
            Some(ratio(*b1 as f64, *b2 as f64) + ratio(*c1 as f64, *c2 as f64))
        }
        (
            ProblemShape::AllReduce {
                elements: e1,
                dtype: d1,
                ranks: r1,
            },
            ProblemShape::AllReduce {
                elements: e2,
                dtype: d2,
                ranks: r2,
            },
        ) if d1 == d2 && r1 == r2 => Some(ratio(*e1 as f64, *e2 as f64)),
        (
            ProblemShape::Dense {
                m: m1,
                n: n1,
                k: k1,
            },
            ProblemShape::Dense {
                m: m2,
                n: n2,
                k: k2,
            },
        ) if n1 == n2 && k1 == k2 => Some(ratio(*m1 as f64, *m2 as f64)),
        _ => None,
    }
}

impl TacticCache {
    /// The entry of `family` on `sm` whose shape is `shape`'s bucket, else the nearest
    /// comparable one.
    pub fn nearest(
        &self,
        family: KernelFamily,
        sm: &str,
        shape: &ProblemShape,
    ) -> Option<&CacheEntry> {
        let bucket = shape.bucket();
        let candidates = self
            .entries
            .iter()
            .filter(|e| e.family == family && e.sm == sm);
        let mut best: Option<(f64, &CacheEntry)> = None;
        for e in candidates {
            if e.bucket == bucket {
                return Some(e);
            }
            if let Some(d) = shape_distance(&e.shape, shape)
                && best.is_none_or(|(bd, _)| d < bd)
            {
                best = Some((d, e));
            }
        }
        best.map(|(_, e)| e)
    }

    /// Why this cache may not be used by `expected`, if it may not.
    pub fn staleness(&self, expected: &Expected) -> Option<String> {
        if self.format != FORMAT {
            return Some(format!(
                "format {} (this build reads {FORMAT})",
                self.format
            ));
        }
        let p = &self.provenance;
        if p.sm != expected.sm {
            return Some(format!("tuned for {} (this run is {})", p.sm, expected.sm));
        }
        if let Some(driver) = &expected.driver_version
            && &p.driver_version != driver
        {
            return Some(format!(
                "tuned under driver {} (this run has {driver})",
                p.driver_version
            ));
        }
        for (family, hash) in &p.kernel_source_hashes {
            match expected.kernel_source_hashes.get(family) {
                Some(h) if h == hash => {}
                Some(h) => {
                    return Some(format!(
                        "tuned for other {family} kernel sources ({hash}; this build {h})"
                    ));
                }
                None => {}
            }
        }
        if p.kernel_source_hashes.is_empty() && expected.sm != CPU_TARGET {
            return Some("no kernel source hashes in its provenance".to_string());
        }
        // Which model its shapes are for is unknown: a model's entries would serve the
        // nearest shapes of any other. Its own command line, rerun, writes the record.
        if p.model.is_none() {
            return Some(format!(
                "records no model it was tuned for (written before caches did); regenerate \
                 it with its command: {}",
                if p.command.is_empty() {
                    "autotune … --out FILE"
                } else {
                    &p.command
                }
            ));
        }
        None
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a tactic cache serializes") + "\n"
    }

    pub fn from_json(text: &str) -> Result<Self, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }
}

/// A command line's tactic cache path, refused where it enters when it names something that
/// cannot be a cache (a device, a FIFO, a folder, a file over the read limit). A missing file
/// passes: [`load`] warns about it and the run uses the defaults.
pub fn cache_path_arg(text: &str) -> Result<PathBuf, FileError> {
    let path = PathBuf::from(text);
    match check_regular(&path, TEXT_FILE_LIMIT) {
        Err(e) if !e.is_not_found() => Err(e),
        _ => Ok(path),
    }
}

/// Reads the cache at `path` for a reader that expects `expected`. Never fails: a missing,
/// unreadable, corrupt or stale cache gives a one-line warning and no cache.
pub fn load(path: &Path, expected: &Expected) -> CacheLookup {
    let warn = |why: String| CacheLookup {
        cache: None,
        warning: Some(format!(
            "warning: tactic cache {}: {why}; using the heuristic defaults",
            path.display()
        )),
    };
    let text = match read_text_bounded(path, TEXT_FILE_LIMIT) {
        Ok(t) => t,
        Err(e) if e.is_not_found() => return warn("not found".to_string()),
        // The error names the file itself.
        Err(e) => {
            return CacheLookup {
                cache: None,
                warning: Some(format!(
                    "warning: tactic cache {e}; using the heuristic defaults"
                )),
            };
        }
    };
    let cache = match TacticCache::from_json(&text) {
        Ok(c) => c,
        Err(e) => return warn(format!("corrupt ({})", e.replace('\n', " "))),
    };
    if let Some(why) = cache.staleness(expected) {
        return warn(format!("stale: {why}"));
    }
    CacheLookup {
        cache: Some(cache),
        warning: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_hashes_match_the_manifest_format() {
        let h = built_source_hashes();
        assert_eq!(h.len(), 5);
        assert!(h.values().all(|v| v.len() == 16));
        assert_eq!(fnv1a64(b""), "cbf29ce484222325");
    }

    #[test]
    fn a_device_is_no_cache_and_a_missing_cache_only_warns() {
        let err = cache_path_arg("/dev/zero").unwrap_err().to_string();
        assert!(err.contains("/dev/zero: not a regular file"), "{err}");
        assert!(cache_path_arg("/nonexistent/tactics.json").is_ok());
        let expected = Expected::for_sm(Sm::Sm120, None);
        let lookup = load(Path::new("/dev/zero"), &expected);
        assert!(lookup.cache.is_none());
        let warning = lookup.warning.unwrap();
        assert!(
            warning.contains("/dev/zero: not a regular file"),
            "{warning}"
        );
    }
}

#[cfg(test)]
mod model_record_tests {
    use super::*;

    fn record(name: &str, dims: &[(&str, u64)]) -> TunedModel {
        TunedModel {
            name: name.into(),
            dims: dims.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    fn cpu_cache(model: Option<TunedModel>) -> TacticCache {
        TacticCache {
            format: FORMAT,
            provenance: Provenance {
                gpu_or_cpu_model: "test CPU".into(),
                sm: CPU_TARGET.into(),
                driver_version: NO_GPU.into(),
                cuda_version: NO_GPU.into(),
                commit: "unknown".into(),
                manifest_hash: "none".into(),
                kernel_source_hashes: BTreeMap::new(),
                command: "autotune --cpu --out cache.json".into(),
                model,
            },
            entries: Vec::new(),
        }
    }

    fn cpu_reader() -> Expected {
        Expected {
            sm: CPU_TARGET.into(),
            driver_version: None,
            kernel_source_hashes: BTreeMap::new(),
        }
    }

    #[test]
    fn differences_name_each_dimension_that_differs_and_none_when_equal() {
        let a = record("a", &[("hidden_size", 128), ("n_routed_experts", 8)]);
        let b = record(
            "b",
            &[
                ("hidden_size", 1024),
                ("n_routed_experts", 8),
                ("v_head_dim", 64),
            ],
        );
        assert_eq!(a.differences(&a.clone()), None);
        // The name is not a dimension: the same dimensions under another name are the same model.
        assert_eq!(
            a.differences(&TunedModel {
                name: "other".into(),
                ..a.clone()
            }),
            None
        );
        let d = a.differences(&b).unwrap();
        assert_eq!(d, "hidden_size 128→1024, v_head_dim -→64");
    }

    #[test]
    fn a_cache_without_a_model_record_is_stale_and_says_how_to_regenerate() {
        let old = cpu_cache(None);
        let why = old.staleness(&cpu_reader()).unwrap();
        assert!(why.contains("records no model"), "{why}");
        assert!(why.contains("autotune --cpu --out cache.json"), "{why}");
        let fresh = cpu_cache(Some(record("mini", &[("hidden_size", 1024)])));
        assert_eq!(fresh.staleness(&cpu_reader()), None);
        // The record survives the JSON, and an old file (no `model` key) reads as `None`.
        let back = TacticCache::from_json(&fresh.to_json()).unwrap();
        assert_eq!(back, fresh);
        let text = old.to_json();
        assert!(!text.contains("\"model\""), "{text}");
        assert_eq!(
            TacticCache::from_json(&text).unwrap().provenance.model,
            None
        );
    }
}
