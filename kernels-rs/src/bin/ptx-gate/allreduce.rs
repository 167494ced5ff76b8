//! The all-reduce family of the compile gate: one image per (algorithm, dtype, threads) — the
//! distinct image ids of `AllReduceTactic`'s space — for sm_90a and sm_120a.
//!
//! Checks per image, beyond the shared ones (no spills, shared memory within the SM's limit,
//! the system-scope acquire load and release store of `tactic::REQUIRED_SASS` in the SASS):
//! no compiler warning, and at most `MAX_GLOBAL_ATOMICS` global atomics (the control block's
//! done counter) and no `RED`: an atomic anywhere else could land on peer memory, which PCIe
//! does not support.

use std::collections::BTreeMap;

use kernels::allreduce::tactic::{AllReduceTactic, KERNEL, MAX_GLOBAL_ATOMICS, REQUIRED_SASS};
use kernels::arch::Sm;
use kernels::tactic::Tactic;
use serde_json::{Value, json};

use super::{Build, Gated, KernelReport, key_count};

impl Gated for AllReduceTactic {
    const KERNELS: &'static [&'static str] = &[KERNEL];
    /// Only full mnemonics are recorded; the manifest counts the ones below by prefix.
    const COUNTED: &'static [&'static str] = &[];

    fn defines(&self) -> Vec<String> {
        self.nvcc_defines()
    }

    fn dynamic_smem(&self, _kernel: &str) -> usize {
        0
    }

    fn required(&self, _sm: Sm, _kernel: &str) -> Vec<&'static str> {
        REQUIRED_SASS.to_vec()
    }

    fn extra_failures(&self, log: &str, kernels: &BTreeMap<String, KernelReport>) -> Vec<String> {
        let mut failures = Vec::new();
        if log.contains("warning") {
            failures.push(format!("nvcc warnings:\n{log}"));
        }
        if let Some(k) = kernels.get(KERNEL) {
            let atomics = key_count(k, "ATOMG") + key_count(k, "ATOM.");
            if atomics > MAX_GLOBAL_ATOMICS || key_count(k, "RED") > 0 {
                failures.push(format!(
                    "{atomics} global atomics (+{} RED): at most {MAX_GLOBAL_ATOMICS}, on the local control block",
                    key_count(k, "RED")
                ));
            }
        }
        failures
    }

    fn manifest_entry(b: &Build<Self>) -> Value {
        let k = b.kernels.get(KERNEL).cloned().unwrap_or_default();
        let counted = [
            REQUIRED_SASS[0],
            REQUIRED_SASS[1],
            "MEMBAR.ALL.SYS",
            "ATOMG",
            "LDG.E.128",
            "STG.E.128",
        ];
        let sass: BTreeMap<&str, u32> = counted.iter().map(|&op| (op, key_count(&k, op))).collect();
        let t = b.tactic;
        json!({
            "family": Self::FAMILY.id(),
            "tactic": t.image_id(),
            "sm": b.sm.arch(),
            "variant": t.algorithm.id(),
            "dtype": t.dtype.id(),
            "threads": t.threads,
            "smem_limit_bytes": b.sm.smem_optin_per_block(),
            "required_sass": REQUIRED_SASS,
            "cubin": b.cubin,
            "ptx": b.ptx,
            "kernels": {
                KERNEL: {
                    "registers": k.regs,
                    "stack_bytes": k.stack,
                    "spill_store_bytes": k.spill_stores,
                    "spill_load_bytes": k.spill_loads,
                    "static_smem_bytes": k.static_smem,
                    "dynamic_smem_bytes": 0,
                    "sass_counts": sass,
                }
            },
            "ok": b.failures.is_empty(),
        })
    }
}
