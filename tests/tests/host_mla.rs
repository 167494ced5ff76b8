//! Every gated MLA tactic — the real `mla_decode.cu` (`mla_decode`, `mla_combine`,
//! `mla_append`), compiled for the CPU and run by the host execution layer — against the
//! PyTorch goldens of `golden/gen_mla.py` of its cache widths (Kimi-K2.5's 512 + 64, and the
//! small golden checkpoints' 64 + 16 with fewer heads than a block): BF16 and FP8 caches
//! (per-token and static scales), page boundaries, ragged batches, 64K-token contexts (Kimi's
//! widths); one split and the split count the
//! planner picks for an RTX PRO 6000 (188 SMs), which adds `mla_combine`. The same launcher
//! (`mla::launch`) and checks (`mla::check`) a GPU run uses: outputs poisoned with NaN before
//! every run, two runs in different thread and block orders that must agree bit for bit.

use std::collections::BTreeMap;
use std::time::Instant;

use cuda_host::{HostDevice, Schedule};
use kernels::arch::Sm;
use kernels::mla::cache::KvCacheDtype;
use kernels::mla::check::{Golden, build_cache, check_append, check_decode, load_golden};
use kernels::mla::launch::{DecodeBatch, DeviceCache, MlaKernels};
use kernels::mla::{MlaDims, MlaTactic, PAGE_TOKENS};
use project_tests::golden_path;

/// RTX PRO 6000 Blackwell: the split planner's SM count.
const SM120_MULTIPROCESSORS: usize = 188;

/// Each tactic once, on the SM it targets first (SM120, the project's GPU), else SM90.
fn tactics() -> BTreeMap<String, (MlaTactic, Sm)> {
    let mut out = BTreeMap::new();
    for sm in [Sm::Sm120, Sm::Sm90] {
        for t in MlaTactic::enumerate(sm) {
            out.entry(t.id()).or_insert((t, sm));
        }
    }
    out
}

fn goldens(long: bool) -> Vec<Golden> {
    let dir = golden_path("mla");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .filter(|p| !p.ends_with("hf_absorbed.safetensors"))
        .filter(|p| p.to_string_lossy().contains("_long") == long)
        .collect();
    paths.sort();
    paths.iter().map(|p| load_golden(p).unwrap()).collect()
}

/// `long`: only the split count the planner picks (the one decode uses); a single split over
/// 64K tokens is what the short cases already cover, at a fraction of the time.
fn run_goldens(goldens: &[Golden], long: bool) {
    let filter = std::env::var("HOST_TACTICS").unwrap_or_default();
    let mut failures = Vec::new();
    let mut ran = 0;
    let (mut worst_row, mut worst_lse) = (0f32, 0f32);
    for (id, (t, sm)) in tactics() {
        if !id.contains(&filter) {
            continue;
        }
        let dev = HostDevice::new(sm);
        let k = MlaKernels::load(&dev, t).unwrap();
        let mut cases = 0;
        for g in goldens {
            if (g.dtype == KvCacheDtype::Bf16) == t.kind.is_fp8() || g.dims != t.dims {
                continue;
            }
            cases += 1;
            let start = Instant::now();
            let (cache, queries) = build_cache(g.dims, g.dtype, g.static_scale, &g.lens, &g.seeds);
            // With several requests, pages interleave: block tables are not contiguous.
            if g.lens.len() > 1 && g.lens.iter().any(|&n| n > PAGE_TOKENS) {
                let tables: Vec<&[u32]> = queries
                    .iter()
                    .map(|q| cache.block_table(q.seq).unwrap())
                    .collect();
                assert!(
                    tables
                        .iter()
                        .any(|t| t.windows(2).any(|w| w[1] != w[0] + 1))
                );
            }
            let want = g.expected(t.kind, &cache, &queries).unwrap();
            let dcache = DeviceCache::upload(&dev, &cache, 0).unwrap();
            let mut batch = DecodeBatch::upload(
                &dev,
                &cache,
                &queries,
                g.heads,
                &g.q_abs,
                &g.q_pe,
                t.max_splits as usize,
            )
            .unwrap();
            let max_len = g.lens.iter().copied().max().unwrap_or(0);
            let planned = t.plan_splits(g.lens.len(), g.heads, max_len, SM120_MULTIPROCESSORS);
            let split_counts: &[u32] = if long {
                &[planned]
            } else {
                &[1, planned.max(2)]
            };
            for &splits in split_counts {
                let c = check_decode(&dev, &k, g, &dcache, &mut batch, splits, &want, |run| {
                    dev.set_schedule(if run == 0 {
                        Schedule::Forward
                    } else {
                        Schedule::Shuffled(0xd1ce + run as u64)
                    })
                });
                ran += 1;
                match c {
                    Ok(c) => {
                        println!(
                            "{} {sm} {t} {:<18} splits {splits:>2}: row err {:.2e} lse err {:.2e}{}, {:.2} s",
                            if c.passed() { "PASS" } else { "FAIL" },
                            g.name,
                            c.row_err,
                            c.lse_err,
                            if c.reproducible { "" } else { ", runs differ" },
                            start.elapsed().as_secs_f64()
                        );
                        worst_row = worst_row.max(c.row_err);
                        worst_lse = worst_lse.max(c.lse_err);
                        if !c.passed() {
                            failures.push(format!("{t} {} splits {splits}: {c:?}", g.name));
                        }
                    }
                    Err(e) => failures.push(format!("{t} {} splits {splits}: {e}", g.name)),
                }
            }
            dev.take_history();
        }
        // Every tactic meets goldens of its own widths (the 64K cases exist for Kimi's only).
        if cases == 0 && (!long || t.dims == MlaDims::KIMI) {
            failures.push(format!("{t}: no golden of its cache dtype and widths"));
        }
    }
    println!(
        "host MLA: {ran} (tactic, case, splits) runs; worst row err {worst_row:.2e}, lse err {worst_lse:.2e}"
    );
    assert!(ran > 0, "no tactic matched HOST_TACTICS={filter:?}");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_mla_tactic_matches_the_goldens_on_the_host() {
    run_goldens(&goldens(false), false);
}

/// The 64K-token contexts (the slowest cases: every tactic reads 64K cached tokens in each of
/// its two runs).
#[test]
fn every_mla_tactic_matches_the_64k_goldens_on_the_host() {
    run_goldens(&goldens(true), true);
}

#[test]
fn every_mla_tactic_appends_like_the_cache_encoder_on_the_host() {
    let mut failures = Vec::new();
    for (_, (t, sm)) in tactics() {
        let dev = HostDevice::new(sm);
        let k = MlaKernels::load(&dev, t).unwrap();
        let modes: &[(KvCacheDtype, Option<f32>)] = if t.kind.is_fp8() {
            &[
                (KvCacheDtype::Fp8E4m3, None),
                (KvCacheDtype::Fp8E4m3, Some(5.0 / 448.0)),
            ]
        } else {
            &[(KvCacheDtype::Bf16, None)]
        };
        for &(dtype, static_scale) in modes {
            let c = check_append(&dev, &k, dtype, static_scale).unwrap();
            println!(
                "{} {t} append {} static scale {static_scale:?}: {} of {} values one step off, {} further",
                if c.passed() { "PASS" } else { "FAIL" },
                dtype.id(),
                c.one_step_off,
                c.values,
                c.further
            );
            if !c.passed() {
                failures.push(format!("{t} {} {static_scale:?}: {c:?}", dtype.id()));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
