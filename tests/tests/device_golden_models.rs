//! Every golden checkpoint on `cuda-emulated` — the device executor, its kernels and launch
//! arguments run by the host execution layer — against HF transformers' W4A4 goldens beside
//! the CPU forward pass, with the BF16 and FP8 latent caches: Kimi-K2.5's MLA widths
//! (`kimi-kernel-dims`) and the small golden checkpoints' (latent 64, RoPE 16, 2–8 heads per
//! rank, 32–128-column experts padded to the MoE kernels' 64, no query LoRA and group-limited
//! routing in `dsv3-noqlora-grouped`). Then tensor parallelism against one rank, and greedy
//! decoding of the trained `kimi-chat-tiny` against the CPU.

use cuda_host::HostDevice;
use kernels::arch::Sm;
use kernels::mla::cache::KvCacheDtype;
use model::checkpoint::weights::Model;
use model::cli::compare::{LogitsAgreement, compare};
use model::exec::cpu::CpuOptions;
use model::exec::device::ExecutorTactics;
use project_tests::device_models::{
    CHAT_MODEL, GOLDEN_MODELS, cpu_prefill, cpu_prefill_with, device_prefill, executor,
    executor_for_rank, first_layers, greedy_on_cpu, greedy_on_cpu_with, greedy_on_device, ids,
    join_tp_group, load, load_model, shards,
};
use project_tests::golden_path;

const DTYPES: [KvCacheDtype; 2] = [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3];

/// The CPU backend rounding where the device kernels round.
fn rounded(dtype: KvCacheDtype, tokens: usize) -> CpuOptions {
    CpuOptions {
        device_roundings: true,
        ..CpuOptions::new(dtype, tokens)
    }
}

/// Prefill logits of `model` on the CPU as it is, on the CPU rounding where the device kernels
/// do, and on `cuda-emulated`.
fn three_prefills(model: &mut Model, tokens: &[u32], dtype: KvCacheDtype) -> [Vec<f32>; 3] {
    let cpu = cpu_prefill(model, tokens, dtype);
    let cpu_rounded = cpu_prefill_with(model, tokens, rounded(dtype, tokens.len()));
    let mut ex = executor(HostDevice::new(Sm::Sm120), model, dtype, tokens.len());
    [cpu, cpu_rounded, device_prefill(&mut ex, tokens)]
}

fn agreement(ours: &[f32], reference: &[f32], vocab: usize) -> LogitsAgreement {
    compare(ours, reference, vocab).unwrap()
}

/// One line of the report: rel L2 per position (median / max) and top-1 against a reference.
fn figures(a: &LogitsAgreement) -> String {
    format!(
        "median {:.2e} max {:.2e} top-1 {}/{}",
        a.median(),
        a.max(),
        a.top1_agree,
        a.positions
    )
}

/// Prefill logits of the whole model on `cuda-emulated` against HF's W4A4 goldens (FP32 cache)
/// as closely as the CPU backend with the same cache dtype gets (both reported): the median
/// position error at most 1.5× the CPU's and top-1 at most 0.1 below it (`compare-logits
/// --as-close-as`, the criterion `gpu-check.sh` holds a GPU to). On these random models any
/// rounding of the cache flips near-tied NVFP4 activation codes and expert choices in later
/// layers, on the CPU as on the device (model_golden.rs), so the two are held to the same
/// distance, and pointwise only where attention has one key: position 0 with the BF16 cache
/// equals the CPU that rounds where the device does, through every layer.
#[test]
fn every_golden_model_on_cuda_emulated_matches_hf_as_closely_as_the_cpu() {
    let mut failures = Vec::new();
    for name in GOLDEN_MODELS {
        let (mut model, golden) = load(name);
        let tokens = ids(&golden, "tokens");
        let hf = golden.f32_values("logits_w4a4").unwrap();
        let vocab = model.config.vocab_size;
        for dtype in DTYPES {
            let [cpu, cpu_rounded, dev] = three_prefills(&mut model, &tokens, dtype);
            let mla = ExecutorTactics::defaults(Sm::Sm120, &model.config, dtype)
                .unwrap()
                .mla;
            let (a_cpu, a_dev, a_same) = (
                agreement(&cpu, &hf, vocab),
                agreement(&dev, &hf, vocab),
                agreement(&dev, &cpu_rounded, vocab),
            );
            println!(
                "{name:<21} {:<4} cache vs HF W4A4 ({} positions): cpu {}; cuda-emulated {}; \
                 cuda-emulated vs cpu with device roundings: median {:.2e}, position 0 {:.2e} \
                 [{}, MLA {}]",
                dtype.id(),
                tokens.len(),
                figures(&a_cpu),
                figures(&a_dev),
                a_same.median(),
                a_same.row_rel_l2[0],
                model.config.mla_dims(),
                mla,
            );
            if !a_dev.as_close_as(&a_cpu) {
                failures.push(format!(
                    "{name} {}: cuda-emulated {} vs cpu {}",
                    dtype.id(),
                    figures(&a_dev),
                    figures(&a_cpu)
                ));
            }
            // The first position attends to itself alone, so with the BF16 cache the kernels'
            // rounding of the attention probabilities cannot reach it. (The FP8 kernels fold
            // each token's scale into its BF16 probability, which rounds even a lone 1.)
            if dtype == KvCacheDtype::Bf16 && a_same.row_rel_l2[0] > 1e-5 {
                failures.push(format!(
                    "{name}: position 0 {:.2e} from the CPU with device roundings",
                    a_same.row_rel_l2[0]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each model cut to its dense first layer, where no expert choice can flip: each cache dtype
/// against HF with the same cache rounding (`dense_only.logits_{bf16,fp8}_cache`), and against
/// the CPU that rounds where the device does. The MLA kernels read BF16 queries (as FlashMLA
/// does; HF keeps them in FP32), which alone moves the CPU's logits to 4e-3 of HF's on
/// `kimi-kernel-dims`; they also round the attention probabilities to BF16 before P·V, the FP8
/// kernels with each token's scale folded in.
#[test]
fn every_golden_models_dense_layer_matches_hf_with_the_same_cache() {
    let mut failures = Vec::new();
    for name in GOLDEN_MODELS {
        let (full, golden) = load(name);
        let mut model = first_layers(&full, 1);
        let tokens = ids(&golden, "tokens");
        let vocab = model.config.vocab_size;
        for dtype in DTYPES {
            let hf = golden
                .f32_values(&format!("dense_only.logits_{}_cache", dtype.id()))
                .unwrap();
            let [cpu, cpu_rounded, dev] = three_prefills(&mut model, &tokens, dtype);
            let (a_cpu, a_rounded, a_dev, a_same) = (
                agreement(&cpu, &hf, vocab),
                agreement(&cpu_rounded, &hf, vocab),
                agreement(&dev, &hf, vocab),
                agreement(&dev, &cpu_rounded, vocab),
            );
            println!(
                "{name:<21} dense layer, {:<4} cache vs HF with the same cache: worst position \
                 rel L2 cpu {:.2e}, cpu with device roundings {:.2e}, cuda-emulated {:.2e}; \
                 cuda-emulated vs cpu with device roundings {:.2e}; top-1 cpu {}/{n}, \
                 cuda-emulated {}/{n}",
                dtype.id(),
                a_cpu.max(),
                a_rounded.max(),
                a_dev.max(),
                a_same.max(),
                a_cpu.top1_agree,
                a_dev.top1_agree,
                n = a_dev.positions,
            );
            // Device vs CPU with the same roundings: measured 4.9e-4 (BF16 cache) and 2.3e-3
            // (FP8) on kimi-kernel-dims, the kernels' BF16 attention probabilities.
            let bound = if dtype == KvCacheDtype::Bf16 {
                1e-3
            } else {
                5e-3
            };
            if a_dev.max() > 1e-2 || a_same.max() > bound || a_dev.top1() < 0.95 {
                failures.push(format!(
                    "{name} {}: cuda-emulated {} vs HF, {} vs the rounded CPU",
                    dtype.id(),
                    figures(&a_dev),
                    figures(&a_same)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Greedy decoding on the device gives the CPU's tokens with either cache on every golden
/// model cut to its dense first layer (where the roundings cannot cascade through expert
/// choices); on the whole random models the tokens agree until the first near-tie (reported).
#[test]
fn every_golden_models_greedy_decode_on_cuda_emulated_equals_the_cpu() {
    let new_tokens = 8;
    let mut failures = Vec::new();
    for name in GOLDEN_MODELS {
        let (full, golden) = load(name);
        let tokens = ids(&golden, "tokens");
        let whole = first_layers(&full, full.config.num_hidden_layers);
        for (what, model) in [
            ("whole model", whole),
            ("dense layer", first_layers(&full, 1)),
        ] {
            for dtype in DTYPES {
                let options = rounded(dtype, tokens.len() + new_tokens);
                let cpu = greedy_on_cpu_with(&model, &tokens, new_tokens, options);
                let mut ex = executor(
                    HostDevice::new(Sm::Sm120),
                    &model,
                    dtype,
                    tokens.len() + new_tokens,
                );
                let dev = greedy_on_device(&mut ex, &tokens, new_tokens);
                let agree = cpu.iter().zip(&dev).take_while(|(a, b)| a == b).count();
                println!(
                    "{name:<21} {what}, {:<4} cache: cpu {cpu:?}, cuda-emulated {dev:?}: first \
                     {agree}/{new_tokens} agree",
                    dtype.id()
                );
                if what == "dense layer" && dev != cpu {
                    failures.push(format!("{name} dense layer {}", dtype.id()));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The trained `kimi-chat-tiny` (the default embedded model, Kimi-K2.5's layout at the small
/// widths): greedy decoding of each golden chat prompt on `cuda-emulated` gives exactly the
/// CPU backend's tokens with either cache. On a trained model near-ties are rare, so the
/// device's roundings (BF16 queries and MoE input, BF16 attention probabilities) must not
/// change a token. Also reported: agreement with PyTorch's W4A4 greedy answer (FP32 cache).
#[test]
fn the_trained_chat_model_decodes_the_cpus_greedy_tokens_on_cuda_emulated() {
    let model = load_model(CHAT_MODEL);
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden_path("serving").join("chat_model_golden.json")).unwrap(),
    )
    .unwrap();
    let as_ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut failures = Vec::new();
    for dtype in DTYPES {
        let (mut same, mut total, mut pytorch_same) = (0, 0, 0);
        for (i, case) in golden["cases"].as_array().unwrap().iter().enumerate() {
            let prompt = as_ids(&case["prompt_ids"]);
            let pytorch = as_ids(&case["greedy_ids"]);
            let n = pytorch.len();
            let cpu = greedy_on_cpu(&model, &prompt, n, dtype);
            let mut ex = executor(HostDevice::new(Sm::Sm120), &model, dtype, prompt.len() + n);
            let dev = greedy_on_device(&mut ex, &prompt, n);
            let agree = cpu.iter().zip(&dev).filter(|(a, b)| a == b).count();
            same += agree;
            total += n;
            pytorch_same += dev.iter().zip(&pytorch).filter(|(a, b)| a == b).count();
            println!(
                "{CHAT_MODEL} {} cache, prompt {i} ({} tokens): {agree}/{n} device tokens equal \
                 the CPU's; PyTorch {pytorch:?}, cuda-emulated {dev:?}",
                dtype.id(),
                prompt.len()
            );
            if dev != cpu {
                failures.push(format!(
                    "{} prompt {i}: cpu {cpu:?}, cuda-emulated {dev:?}",
                    dtype.id()
                ));
            }
        }
        println!(
            "{CHAT_MODEL} {} cache: {same}/{total} greedy tokens equal the CPU's, {pytorch_same}/{total} \
             PyTorch's (FP32 cache)",
            dtype.id()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Tensor parallelism on `cuda-emulated` for every golden model whose shapes split over two
/// ranks: two rank threads, each the executor of its shard on its own host device, summing
/// partials with the all-reduce kernel over a shared-memory segment, give one rank's prefill
/// logits up to the FP32 order of the split sums (each rank sums its heads' and intermediate
/// columns' share; padded expert columns add zeros): every position within 1e-4 (measured
/// 2e-7 … 1e-4), top-1 everywhere the same. One position may hold a flipped near-tie instead:
/// `moe_down` accumulates the top-k experts' rows atomically, so even two `--tp 1` runs differ
/// in the last bits (measured: a third to a half of the logits), and on these random models a
/// BF16 MoE input or NVFP4 activation code near a rounding boundary then flips in a later
/// layer (measured once on `kimi-tiny`: the last position 2.8e-2 off, every other 2e-7); a
/// wrong shard or padding would move every position. Bitwise equality would mean nothing was
/// split.
#[test]
fn tensor_parallel_ranks_give_one_ranks_logits_on_every_golden_model() {
    use kernels::allreduce::shm::unique_segment_name;
    let world = 2;
    let mut failures = Vec::new();
    let mut ran = 0;
    for name in GOLDEN_MODELS.into_iter().chain([CHAT_MODEL]) {
        let model = load_model(name);
        if let Err(why) = model.config.check_tensor_parallel(world) {
            println!("{name}: does not split over {world} ranks ({why})");
            continue;
        }
        ran += 1;
        let tokens: Vec<u32> = (0..12u32)
            .map(|i| (i * 37 + 5) % model.config.vocab_size as u32)
            .collect();
        let dtype = KvCacheDtype::Bf16;
        let single = {
            let mut ex = executor(HostDevice::new(Sm::Sm120), &model, dtype, tokens.len());
            device_prefill(&mut ex, &tokens)
        };
        let shards = shards(&model, world);
        let segment = unique_segment_name("device-tp-golden");
        let per_rank: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = shards
                .iter()
                .enumerate()
                .map(|(rank, shard)| {
                    let (segment, tokens) = (segment.clone(), &tokens);
                    s.spawn(move || {
                        let mut ex = executor_for_rank(
                            HostDevice::new(Sm::Sm120),
                            shard,
                            dtype,
                            tokens.len(),
                            world,
                        );
                        join_tp_group(&mut ex, &segment, rank, world, tokens.len());
                        device_prefill(&mut ex, tokens)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let vocab = model.config.vocab_size;
        let a = agreement(&per_rank[0], &single, vocab);
        println!(
            "{name:<21} cuda-emulated --tp {world} vs --tp 1 (BF16 cache, {} positions): {}",
            tokens.len(),
            figures(&a)
        );
        let ranks_agree = per_rank.iter().all(|r| {
            r.iter()
                .zip(&per_rank[0])
                .all(|(x, y)| x.to_bits() == y.to_bits())
        });
        let flipped: Vec<f64> = a.row_rel_l2.iter().copied().filter(|&e| e > 1e-4).collect();
        // The exact build flips at most one near-tie. A GPU's FMA contraction and approximate
        // `expf` round the ranks' partial sums apart from one rank's whole sums enough to flip
        // more, and every later position attending to a flipped one moves too (the
        // `gpu-numerics` build: kimi-tiny 5 of 12 positions above 1e-4, max 3.5e-2, top-1
        // 12/12): there the bound is on the distance and the top-1 tokens only.
        let most_flipped = if cuda_host::GPU_NUMERICS {
            tokens.len()
        } else {
            1
        };
        if !ranks_agree
            || per_rank[0] == single
            || flipped.len() > most_flipped
            || a.max() > 5e-2
            || a.top1_agree != a.positions
        {
            failures.push(format!(
                "{name}: ranks agree {ranks_agree}, bitwise equal to one rank {}, {}, positions \
                 above 1e-4: {flipped:?}",
                per_rank[0] == single,
                figures(&a)
            ));
        }
    }
    assert!(
        ran >= 4,
        "only {ran} golden models split over {world} ranks"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
