//! The compile gate's `ptx/manifest.json`, as the static stage reads it: which (family, SM,
//! image) built, with what registers, shared memory and spills, from which source.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use kernels::arch::Sm;
use kernels::tactic::KernelFamily;
use kernels::tactic::cache::fnv1a64;
use serde_json::Value;

/// One kernel of a built image.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelResources {
    pub registers: u32,
    pub dynamic_smem: usize,
    pub static_smem: usize,
    pub spill_bytes: u64,
}

/// One built image.
#[derive(Clone, Debug, PartialEq)]
pub struct Image {
    pub ok: bool,
    pub threads: u32,
    pub kernels: BTreeMap<String, KernelResources>,
}

#[derive(Clone, Debug)]
pub struct Manifest {
    /// `(family, sm_xx, image id)` → image.
    pub images: BTreeMap<(String, String, String), Image>,
    /// Family (and `ptx_helpers`) → FNV-1a 64 of the source it was built from.
    pub source_hashes: BTreeMap<String, String>,
    /// FNV-1a 64 of the manifest file.
    pub hash: String,
}

impl Manifest {
    pub fn load(path: &Path) -> Result<Manifest> {
        let text = kernels::files::read_text_bounded(path, kernels::files::TEXT_FILE_LIMIT)?;
        Self::parse(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Manifest> {
        let v: Value = serde_json::from_str(text)?;
        let mut images = BTreeMap::new();
        let Some(entries) = v.get("entries").and_then(Value::as_array) else {
            bail!("no `entries` array");
        };
        for e in entries {
            let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let mut kernels = BTreeMap::new();
            if let Some(ks) = e.get("kernels").and_then(Value::as_object) {
                for (name, k) in ks {
                    let n = |f: &str| k.get(f).and_then(Value::as_u64).unwrap_or(0);
                    kernels.insert(
                        name.clone(),
                        KernelResources {
                            registers: n("registers") as u32,
                            dynamic_smem: n("dynamic_smem_bytes") as usize,
                            static_smem: n("static_smem_bytes") as usize,
                            spill_bytes: n("spill_load_bytes") + n("spill_store_bytes"),
                        },
                    );
                }
            }
            images.insert(
                (s("family"), s("sm"), s("tactic")),
                Image {
                    ok: e.get("ok").and_then(Value::as_bool).unwrap_or(false),
                    threads: e.get("threads").and_then(Value::as_u64).unwrap_or(0) as u32,
                    kernels,
                },
            );
        }
        let mut source_hashes = BTreeMap::new();
        if let Some(src) = v.get("sources").and_then(Value::as_object) {
            for (family, s) in src {
                if let Some(h) = s.get("fnv1a64").and_then(Value::as_str) {
                    source_hashes.insert(family.clone(), h.to_string());
                }
            }
        }
        Ok(Manifest {
            images,
            source_hashes,
            hash: fnv1a64(text.as_bytes()),
        })
    }

    pub fn image(&self, family: KernelFamily, sm: Sm, image: &str) -> Option<&Image> {
        self.images.get(&(
            family.id().to_string(),
            sm.arch().to_string(),
            image.to_string(),
        ))
    }

    /// Why the manifest does not describe the current sources of `family`, if it does not:
    /// the family's own source or the shared PTX helpers changed since the gate wrote it.
    pub fn stale(
        &self,
        family: KernelFamily,
        current: &BTreeMap<String, String>,
    ) -> Option<String> {
        for key in [family.id(), "ptx_helpers"] {
            match (self.source_hashes.get(key), current.get(key)) {
                (Some(m), Some(c)) if m == c => {}
                (Some(m), Some(c)) => {
                    return Some(format!(
                        "stale manifest: {key} source changed since ptx/manifest.json was \
                         written ({m} → {c}); run scripts/compile-gates.sh"
                    ));
                }
                (None, _) => {
                    return Some(format!(
                        "stale manifest: no hash of the {key} source in ptx/manifest.json; run \
                         scripts/compile-gates.sh"
                    ));
                }
                (Some(_), None) => {}
            }
        }
        None
    }
}

impl Image {
    /// Most shared memory of one block of any kernel (static + dynamic).
    pub fn max_smem(&self) -> usize {
        self.kernels
            .values()
            .map(|k| k.dynamic_smem + k.static_smem)
            .max()
            .unwrap_or(0)
    }

    pub fn spills(&self) -> bool {
        self.kernels.values().any(|k| k.spill_bytes > 0)
    }
}
