//! Checks of the decode step's small kernels (`kernels-rs/src/layers/layers.cu`) against the
//! CPU forward pass's own functions: the router (`model::exec::cpu::route::route`), RMSNorm, YaRN RoPE
//! (`model::arch::rope::Rope`), greedy sampling and the MoE grouping (`GroupedRouting`), at
//! Kimi-K2.5's real sizes (hidden 7168, 384 experts, 64 heads of 128 + 64) and with DeepSeek-V3's
//! group-limited routing. Generic over the [`Device`]: `host_layers.rs` runs them through the
//! host execution layer, `gpu_layers.rs` on a GPU. Every output is poisoned with NaN before the
//! launch, so an element a kernel fails to write shows up. Each check panics on a mismatch.

use half::bf16;
use kernels::device::{Device, DeviceExt};
use kernels::layers::{DenseOutput, HeadRows, LayerKernels, OutputType, RopeSlices, RouterShape};
use kernels::moe_gemm::launch::GroupedRouting;
use kernels::moe_gemm::reference::{Routing, silu};
use kernels::rng::Rng;
use model::arch::config::ModelConfig;
use model::arch::presets::Preset;
use model::arch::rope::Rope;

/// A check of one kernel on a device.
pub type Check<D> = fn(&D, &LayerKernels<D>);

/// Every check, by name.
pub fn all<D: Device>() -> Vec<(&'static str, Check<D>)> {
    vec![
        (
            "sample_rows_draws_what_the_reference_sampler_draws",
            sample_rows_draws_what_the_reference_sampler_draws::<D>,
        ),
        (
            "embed_gather_copies_rows_and_reports_a_bad_id",
            embed_gather_copies_rows_and_reports_a_bad_id::<D>,
        ),
        (
            "add_rms_norm_matches_the_cpu_norm",
            add_rms_norm_matches_the_cpu_norm::<D>,
        ),
        (
            "rope_matches_yarn_rope_on_q_and_kv_layouts",
            rope_matches_yarn_rope_on_q_and_kv_layouts::<D>,
        ),
        (
            "router_matches_the_cpu_router_kimi_and_grouped",
            router_matches_the_cpu_router_kimi_and_grouped::<D>,
        ),
        (
            "router_rejects_shapes_it_cannot_route",
            router_rejects_shapes_it_cannot_route::<D>,
        ),
        (
            "expert_grouping_matches_grouped_routing",
            expert_grouping_matches_grouped_routing::<D>,
        ),
        (
            "dense_bf16_matches_a_double_precision_product",
            dense_bf16_matches_a_double_precision_product::<D>,
        ),
        (
            "silu_mul_matches_the_reference_silu",
            silu_mul_matches_the_reference_silu::<D>,
        ),
        (
            "argmax_matches_greedy_sampling_with_ties",
            argmax_matches_greedy_sampling_with_ties::<D>,
        ),
        (
            "vocabulary_parallel_argmax_equals_the_whole_rows",
            vocabulary_parallel_argmax_equals_the_whole_rows::<D>,
        ),
        (
            "dense_heads_matches_per_head_products_in_both_output_types",
            dense_heads_matches_per_head_products_in_both_output_types::<D>,
        ),
        (
            "to_bf16_strided_and_gather_rows_move_the_right_values",
            to_bf16_strided_and_gather_rows_move_the_right_values::<D>,
        ),
        (
            "launchers_name_the_kernel_and_buffer_that_is_too_small",
            launchers_name_the_kernel_and_buffer_that_is_too_small::<D>,
        ),
    ]
}

/// A zeroed-then-NaN-poisoned output of `count` f32 or i32 (0xFFFFFFFF: NaN, or -1).
fn poisoned<D: Device>(dev: &D, count: usize) -> D::Memory {
    let mut m = dev.alloc_elements::<f32>(count).unwrap();
    dev.fill(&mut m, 0xFF).unwrap();
    m
}

fn random(rng: &mut Rng, count: usize, scale: f32) -> Vec<f32> {
    (0..count).map(|_| rng.sym() * scale).collect()
}

fn bf16_bits(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect()
}

fn from_bits(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// Largest |a - b| / (|b| + floor) over two slices of equal length.
fn worst_rel(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert!(x.is_finite(), "non-finite output {x} (unwritten?)");
            (x - y).abs() / (y.abs() + floor)
        })
        .fold(0.0, f32::max)
}

const KIMI_HIDDEN: usize = 7168;

pub fn embed_gather_copies_rows_and_reports_a_bad_id<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(1);
    let (vocab, hidden) = (1000, KIMI_HIDDEN);
    let table = bf16_bits(&random(&mut rng, vocab * hidden, 1.0));
    let table_d = dev.upload(&table).unwrap();
    let table_f = from_bits(&table);
    // The whole table, then a tensor-parallel rank's rows of it (ids of the vocabulary
    // outside them are zeros, which the ranks' all-reduce fills in).
    let shard = 300..700;
    let shard_d = dev
        .upload(&table[shard.start * hidden..shard.end * hidden])
        .unwrap();
    for (held, table_d) in [(0..vocab, &table_d), (shard, &shard_d)] {
        for (ids, bad) in [
            (vec![0i32, 999, 17, 17, 500, 300, 699, 700], -1),
            (vec![3, 1000, 5], 1000),
            (vec![400, -2], -2),
        ] {
            let ids_d = dev.upload(&ids).unwrap();
            let out = poisoned(dev, ids.len() * hidden);
            let bad_d = dev.upload(&[-1i32]).unwrap();
            k.embed_gather(
                dev,
                &ids_d,
                ids.len(),
                table_d,
                held.clone(),
                vocab,
                hidden,
                &out,
                &bad_d,
            )
            .unwrap();
            let got: Vec<f32> = dev.download(&out).unwrap();
            for (t, &id) in ids.iter().enumerate() {
                let row = &got[t * hidden..(t + 1) * hidden];
                if id >= 0 && held.contains(&(id as usize)) {
                    let want = &table_f[id as usize * hidden..(id as usize + 1) * hidden];
                    assert_eq!(row, want, "rows {held:?}: token {t} (id {id})");
                } else {
                    assert!(
                        row.iter().all(|&v| v == 0.0),
                        "rows {held:?}: id {id}'s row not zeroed"
                    );
                }
            }
            assert_eq!(dev.download::<i32>(&bad_d).unwrap()[0], bad, "{held:?}");
        }
    }
    let ids_d = dev.upload(&[1i32]).unwrap();
    let out = poisoned(dev, hidden);
    let err = k
        .embed_gather(
            dev,
            &ids_d,
            1,
            &shard_d,
            600..1001,
            vocab,
            hidden,
            &out,
            &ids_d,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("embed_gather") && err.contains("600..1001"),
        "{err}"
    );
}

pub fn add_rms_norm_matches_the_cpu_norm<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(2);
    // The residual stream (7168), the q LoRA (1536) and the compressed KV (512) norms.
    for (rows, dim, add) in [(5, KIMI_HIDDEN, true), (3, 1536, false), (4, 512, false)] {
        let residual = random(&mut rng, rows * dim, 3.0);
        let x = random(&mut rng, rows * dim, 1.0);
        let weight = bf16_bits(&random(&mut rng, dim, 2.0));
        let eps = 1e-6;
        let residual_d = dev.upload(&residual).unwrap();
        let x_d = dev.upload(&x).unwrap();
        let weight_d = dev.upload(&weight).unwrap();
        let out = poisoned(dev, rows * dim);
        k.add_rms_norm(
            dev,
            &residual_d,
            add.then_some(&x_d),
            &weight_d,
            eps,
            rows,
            dim,
            &out,
        )
        .unwrap();
        let summed: Vec<f32> = if add {
            residual.iter().zip(&x).map(|(r, x)| r + x).collect()
        } else {
            residual.clone()
        };
        assert_eq!(dev.download::<f32>(&residual_d).unwrap(), summed);
        let w = from_bits(&weight);
        let want: Vec<f32> = summed
            .chunks_exact(dim)
            .flat_map(|row| model::exec::cpu::rows::rms_norm(row, &w, eps as f64))
            .collect();
        let got: Vec<f32> = dev.download(&out).unwrap();
        // The CTA sums squares in another order than the CPU's sequential sum.
        let err = worst_rel(&got, &want, 1e-3);
        assert!(err < 1e-5, "dim {dim}: worst relative error {err}");
    }
}

pub fn rope_matches_yarn_rope_on_q_and_kv_layouts<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let c = Preset::KimiK25.model_config();
    let rope = Rope::new(&c);
    let (nope, rope_dim, heads) = (c.qk_nope_head_dim, c.qk_rope_head_dim, 8);
    let positions = [0i32, 1, 4095, 4096, 131_071, 262_143];
    let freq_d = dev.upload(rope.inv_freq()).unwrap();
    let pos_d = dev.upload(&positions).unwrap();
    let mut rng = Rng(3);
    let head = nope + rope_dim;
    let latent = c.kv_lora_rank;
    for (row_stride, slices) in [
        (
            heads * head,
            RopeSlices {
                offset: nope,
                stride: head,
                count: heads,
                pairs: rope_dim / 2,
            },
        ),
        (
            latent + rope_dim,
            RopeSlices {
                offset: latent,
                stride: rope_dim,
                count: 1,
                pairs: rope_dim / 2,
            },
        ),
    ] {
        let x = random(&mut rng, positions.len() * row_stride, 2.0);
        let x_d = dev.upload(&x).unwrap();
        k.rope_interleaved(
            dev,
            &x_d,
            positions.len(),
            row_stride,
            slices,
            &pos_d,
            &freq_d,
            rope.attention_factor(),
        )
        .unwrap();
        let mut want = x.clone();
        for (r, &p) in positions.iter().enumerate() {
            for s in 0..slices.count {
                let at = r * row_stride + slices.offset + s * slices.stride;
                rope.apply(&mut want[at..at + rope_dim], p as usize);
            }
        }
        let got: Vec<f32> = dev.download(&x_d).unwrap();
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            err < 1e-5,
            "row stride {row_stride}: worst difference {err}"
        );
        // Values outside the slices are untouched.
        for r in 0..positions.len() {
            for i in 0..slices.offset {
                assert_eq!(got[r * row_stride + i], x[r * row_stride + i]);
            }
        }
    }
}

fn grouped_config(n_group: usize, topk_group: usize, experts: usize) -> ModelConfig {
    let mut json = Preset::KimiK25.config_json();
    let t = &mut json["text_config"];
    t["n_group"] = n_group.into();
    t["topk_group"] = topk_group.into();
    t["n_routed_experts"] = experts.into();
    t["routed_scaling_factor"] = 2.5.into();
    model::arch::config::CheckpointConfig::from_json(std::path::Path::new("dsv3"), &json, None)
        .unwrap()
        .model
}

fn router_shape(c: &ModelConfig) -> RouterShape {
    RouterShape {
        experts: c.n_routed_experts,
        n_group: c.n_group,
        topk_group: c.topk_group,
        top_k: c.num_experts_per_tok,
        norm_topk_prob: c.norm_topk_prob,
        routed_scaling_factor: c.routed_scaling_factor as f32,
    }
}

/// Routes `logits` on the device and on the CPU; returns the device's routing after checking
/// that the ids are equal and the weights agree.
fn route_both<D: Device>(
    dev: &D,
    k: &LayerKernels<D>,
    c: &ModelConfig,
    logits: &[f32],
    bias: &[f32],
) -> Routing {
    let shape = router_shape(c);
    let tokens = logits.len() / shape.experts;
    let (logits_d, bias_d) = (dev.upload(logits).unwrap(), dev.upload(bias).unwrap());
    let ids_d = poisoned(dev, tokens * shape.top_k);
    let weights_d = poisoned(dev, tokens * shape.top_k);
    k.route(dev, &shape, &logits_d, &bias_d, tokens, &ids_d, &weights_d)
        .unwrap();
    let ids: Vec<i32> = dev.download(&ids_d).unwrap();
    let weights: Vec<f32> = dev.download(&weights_d).unwrap();
    let want = model::exec::cpu::route::route(logits, bias, c);
    let got_ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    assert_eq!(got_ids, want.experts, "chosen experts");
    let err = worst_rel(&weights, &want.weights, 0.0);
    assert!(err < 1e-6, "routing weights: worst relative error {err}");
    Routing {
        top_k: shape.top_k,
        experts: got_ids,
        weights,
    }
}

pub fn router_matches_the_cpu_router_kimi_and_grouped<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(4);
    let kimi = Preset::KimiK25.model_config();
    let dsv3 = grouped_config(8, 4, 256);
    for c in [&kimi, &dsv3] {
        let experts = c.n_routed_experts;
        let tokens = 24;
        let bias = random(&mut rng, experts, 0.05);
        // Continuous logits; then logits on a coarse grid, so scores tie and the lower index
        // must win; then a zero bias (ties in the biased choice too).
        let smooth = random(&mut rng, tokens * experts, 4.0);
        let coarse: Vec<f32> = smooth.iter().map(|v| v.round()).collect();
        route_both(dev, k, c, &smooth, &bias);
        route_both(dev, k, c, &coarse, &bias);
        route_both(dev, k, c, &coarse, &vec![0.0; experts]);
    }
}

pub fn router_rejects_shapes_it_cannot_route<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let base = router_shape(&Preset::KimiK25.model_config());
    let bad = [
        RouterShape {
            experts: 2048,
            ..base
        },
        RouterShape { n_group: 5, ..base },
        RouterShape { top_k: 0, ..base },
        RouterShape {
            n_group: 8,
            topk_group: 1,
            top_k: 49,
            ..base
        },
    ];
    let m = dev.alloc_elements::<f32>(1 << 16).unwrap();
    for shape in bad {
        let err = k.route(dev, &shape, &m, &m, 1, &m, &m).unwrap_err();
        assert!(err.to_string().starts_with("router:"), "{shape:?}: {err}");
    }
}

pub fn expert_grouping_matches_grouped_routing<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(5);
    let c = Preset::KimiK25.model_config();
    let experts = c.n_routed_experts;
    // Decode batches (1 and 64 tokens) and a prefill chunk; coarse logits for the larger ones
    // so that many tokens share experts.
    for (tokens, scale) in [(1, 4.0), (64, 4.0), (300, 0.5)] {
        let logits: Vec<f32> = random(&mut rng, tokens * experts, scale)
            .iter()
            .map(|v| (v * 2.0).round())
            .collect();
        let routing = route_both(dev, k, &c, &logits, &vec![0.0; experts]);
        let ids: Vec<i32> = routing.experts.iter().map(|&e| e as i32).collect();
        let (ids_d, weights_d) = (
            dev.upload(&ids).unwrap(),
            dev.upload(&routing.weights).unwrap(),
        );
        let a = ids.len();
        let (offsets_d, tokens_d, sorted_w_d) = (
            poisoned(dev, experts + 1),
            poisoned(dev, a),
            poisoned(dev, a),
        );
        // Not 0xFF: the list's padding is -1, which that poison would fake.
        let mut active_d = dev.alloc_elements::<i32>(experts + 1).unwrap();
        dev.fill(&mut active_d, 0x55).unwrap();
        k.group_by_expert(
            dev,
            &ids_d,
            &weights_d,
            tokens,
            routing.top_k,
            experts,
            &offsets_d,
            &tokens_d,
            &sorted_w_d,
            &active_d,
        )
        .unwrap();
        let want = GroupedRouting::new(&routing, experts).unwrap();
        assert_eq!(
            dev.download::<i32>(&offsets_d).unwrap(),
            want.expert_offsets
        );
        assert_eq!(
            dev.download::<i32>(&tokens_d).unwrap(),
            want.sorted_token_ids
        );
        assert_eq!(
            dev.download::<f32>(&sorted_w_d).unwrap(),
            want.sorted_weights
        );
        assert_eq!(
            dev.download::<i32>(&active_d).unwrap(),
            want.active_expert_list()
        );
    }
}

pub fn dense_bf16_matches_a_double_precision_product<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(6);
    // n not a multiple of the 8 rows a block covers; K of Kimi's hidden size.
    let (tokens, kk, n) = (3, KIMI_HIDDEN, 101);
    let x = random(&mut rng, tokens * kk, 1.0);
    let w = bf16_bits(&random(&mut rng, n * kk, 0.05));
    let prior = random(&mut rng, tokens * n, 1.0);
    let wf = from_bits(&w);
    let (x_d, w_d) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    for accumulate in [false, true] {
        let y_d = if accumulate {
            dev.upload(&prior).unwrap()
        } else {
            poisoned(dev, tokens * n)
        };
        k.dense_bf16(dev, &x_d, tokens, &w_d, kk, n, &y_d, accumulate)
            .unwrap();
        let got: Vec<f32> = dev.download(&y_d).unwrap();
        check_dense_rows(&got, &x, &wf, &prior, (tokens, kk, n), accumulate);
        // The same product into columns 40.. of rows of 300 (a vocabulary-parallel lm_head
        // writing its columns of full rows): the columns around it keep their values.
        let out = DenseOutput {
            offset: 40,
            row_stride: 300,
        };
        let mut wide = random(&mut rng, out.span(tokens, n) + 7, 1.0);
        for t in 0..tokens {
            let row = &mut wide[40 + t * 300..40 + t * 300 + n];
            row.copy_from_slice(&prior[t * n..(t + 1) * n]);
        }
        let wide_d = dev.upload(&wide).unwrap();
        k.dense_bf16_into(dev, &x_d, tokens, &w_d, kk, n, &wide_d, out, accumulate)
            .unwrap();
        let got_wide: Vec<f32> = dev.download(&wide_d).unwrap();
        let mut packed = Vec::new();
        for (i, (&g, &before)) in got_wide.iter().zip(&wide).enumerate() {
            let column = i.checked_sub(40).map(|j| (j / 300, j % 300));
            match column {
                Some((t, c)) if t < tokens && c < n => packed.push(g),
                _ => assert_eq!(
                    g.to_bits(),
                    before.to_bits(),
                    "element {i} outside the rows"
                ),
            }
        }
        assert_eq!(
            packed, got,
            "the strided product differs from the packed one"
        );
        let overlapping = DenseOutput {
            offset: 0,
            row_stride: n - 1,
        };
        let err = k
            .dense_bf16_into(dev, &x_d, tokens, &w_d, kk, n, &wide_d, overlapping, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("dense_bf16"), "{err}");
    }
}

/// `got [tokens][n]` against `x · wᵀ` (+ `prior`) in f64, within FP32 rounding.
fn check_dense_rows(
    got: &[f32],
    x: &[f32],
    wf: &[f32],
    prior: &[f32],
    (tokens, kk, n): (usize, usize, usize),
    accumulate: bool,
) {
    for t in 0..tokens {
        for r in 0..n {
            let xs = &x[t * kk..(t + 1) * kk];
            let ws = &wf[r * kk..(r + 1) * kk];
            let dot: f64 = xs.iter().zip(ws).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = xs.iter().zip(ws).map(|(a, b)| (*a * *b).abs() as f64).sum();
            let base = if accumulate {
                prior[t * n + r] as f64
            } else {
                0.0
            };
            let diff = (got[t * n + r] as f64 - (base + dot)).abs();
            assert!(
                diff <= 1e-6 * (mag + base.abs()),
                "token {t} row {r}: {} vs {}",
                got[t * n + r],
                base + dot
            );
        }
    }
}

pub fn silu_mul_matches_the_reference_silu<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(7);
    let (rows, inter) = (5, 2048);
    let gate_up = random(&mut rng, rows * 2 * inter, 8.0);
    let gate_up_d = dev.upload(&gate_up).unwrap();
    let h = poisoned(dev, rows * inter);
    k.silu_mul(dev, &gate_up_d, rows, inter, &h).unwrap();
    let want: Vec<f32> = gate_up
        .chunks_exact(2 * inter)
        .flat_map(|r| {
            let (g, u) = r.split_at(inter);
            g.iter()
                .zip(u)
                .map(|(&g, &u)| silu(g) * u)
                .collect::<Vec<_>>()
        })
        .collect();
    let err = worst_rel(&dev.download::<f32>(&h).unwrap(), &want, 1e-6);
    assert!(err < 1e-6, "worst relative error {err}");
}

pub fn argmax_matches_greedy_sampling_with_ties<D: Device>(dev: &D, k: &LayerKernels<D>) {
    let mut rng = Rng(8);
    let vocab = 163_840;
    let mut logits = random(&mut rng, 4 * vocab, 10.0);
    // Row 1: a tie between two far-apart indices; row 2: all equal; row 3: the maximum last.
    logits[vocab + 5] = 50.0;
    logits[vocab + 150_000] = 50.0;
    logits[2 * vocab..3 * vocab].fill(-1.0);
    logits[4 * vocab - 1] = 60.0;
    let logits_d = dev.upload(&logits).unwrap();
    let ids = poisoned(dev, 4);
    k.argmax_rows(dev, &logits_d, 4, vocab, &ids).unwrap();
    let want: Vec<i32> = logits
        .chunks_exact(vocab)
        .map(|r| model::exec::sampler::argmax(r) as i32)
        .collect();
    assert_eq!(want[1..], [5, 0, vocab as i32 - 1]);
    assert_eq!(dev.download::<i32>(&ids).unwrap(), want);
}

/// The vocabulary-parallel greedy pick: every rank's `argmax_shard` over its
/// `TpShard::vocab_rows`, the pairs summed over the ranks in rank order (what the all-reduce
/// does), then `argmax_ranks`, gives the whole row's `argmax_rows`, on Kimi's vocabulary over
/// 3 ranks (uneven) and 8: ties inside a rank and across a rank boundary, a row all equal, the
/// maximum last, a rank all NaN, rows of -inf.
pub fn vocabulary_parallel_argmax_equals_the_whole_rows<D: Device>(dev: &D, k: &LayerKernels<D>) {
    use model::checkpoint::weights::TpShard;
    let mut rng = Rng(13);
    let vocab = 163_840;
    let rows = 7;
    let mut logits = random(&mut rng, rows * vocab, 10.0);
    logits[vocab + 5] = 50.0;
    logits[vocab + 150_000] = 50.0;
    logits[2 * vocab..3 * vocab].fill(-1.0);
    logits[4 * vocab - 1] = 60.0;
    // Row 4: the first ids (rank 0's) all NaN; the best is on a later rank.
    logits[4 * vocab..4 * vocab + 60_000].fill(f32::NAN);
    // Row 5: all -inf but one NaN (the first -inf wins, as on whole rows); row 6: all NaN.
    logits[5 * vocab..6 * vocab].fill(f32::NEG_INFINITY);
    logits[5 * vocab] = f32::NAN;
    logits[6 * vocab..7 * vocab].fill(f32::NAN);
    let logits_d = dev.upload(&logits).unwrap();
    let whole = poisoned(dev, rows);
    k.argmax_rows(dev, &logits_d, rows, vocab, &whole).unwrap();
    let want: Vec<i32> = dev.download(&whole).unwrap();
    assert_eq!(want[1..4], [5, 0, vocab as i32 - 1]);
    assert_eq!(want[5..], [1, 0]);
    for world in [3, 8] {
        // Row 3: a tie across the first boundary, the later rank's first id loses.
        let boundary = TpShard { rank: 1, world }.vocab_rows(vocab).start;
        let mut tied = logits.clone();
        tied[3 * vocab + boundary - 1] = 70.0;
        tied[3 * vocab + boundary] = 70.0;
        let tied_d = dev.upload(&tied).unwrap();
        let mut summed = vec![0.0f32; rows * world * 2];
        for rank in 0..world {
            let ids = TpShard { rank, world }.vocab_rows(vocab);
            // Each rank scores only its columns: give it a buffer of just them.
            let mine: Vec<f32> = tied
                .chunks_exact(vocab)
                .flat_map(|r| r[ids.clone()].to_vec())
                .collect();
            let mine_d = dev.upload(&mine).unwrap();
            let pairs = poisoned(dev, rows * world * 2);
            k.argmax_shard(
                dev,
                &mine_d,
                rows,
                ids.len(),
                ids.len(),
                ids.start,
                world,
                rank,
                &pairs,
            )
            .unwrap();
            for (s, v) in summed.iter_mut().zip(dev.download::<f32>(&pairs).unwrap()) {
                *s += v;
            }
        }
        let summed_d = dev.upload(&summed).unwrap();
        let ids = poisoned(dev, rows);
        k.argmax_ranks(dev, &summed_d, rows, world, &ids).unwrap();
        let whole = poisoned(dev, rows);
        k.argmax_rows(dev, &tied_d, rows, vocab, &whole).unwrap();
        let want: Vec<i32> = dev.download(&whole).unwrap();
        assert_eq!(want[3], boundary as i32 - 1, "tp {world}");
        assert_eq!(dev.download::<i32>(&ids).unwrap(), want, "tp {world}");
    }
    let pairs = poisoned(dev, 8);
    let err = k
        .argmax_shard(dev, &logits_d, 1, vocab, 10, 0, 4, 4, &pairs)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("argmax_shard") && err.contains("rank 4 of 4"),
        "{err}"
    );
}

/// `sample_rows` on Kimi's vocabulary draws, for every counter, the token the CPU sampler draws
/// (`kernels::layers::sampling::sample_row`, which `model::exec::sampler` runs): greedy, temperature
/// alone, top-k (with a tie across the cut, and wider than one thread's slice), top-p, both, and
/// top-k 1. Rows drawn at a temperature are overwritten with probabilities, so each draw
/// uploads the logits again.
pub fn sample_rows_draws_what_the_reference_sampler_draws<D: Device>(dev: &D, k: &LayerKernels<D>) {
    use kernels::layers::sampling::{SampleRow, sample_row};
    let mut rng = Rng(12);
    let vocab = 163_840;
    let params = [
        (0.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.0, 1000, 1.0),
        (0.6, 0, 0.95),
        (1.3, 50, 0.8),
        (1.0, 1, 1.0),
        (1.0, 3, 1.0),
    ];
    let rows = params.len();
    let mut logits = random(&mut rng, rows * vocab, 4.0);
    // Row 6: three tokens tie for the top, far apart: top-3 keeps exactly them.
    for i in [7, 90_000, 163_000] {
        logits[6 * vocab + i] = 30.0;
    }
    logits[6 * vocab + 163_001] = 30.0;
    let mut draws_seen = std::collections::BTreeSet::new();
    for counter in 0..6u64 {
        let draws: Vec<SampleRow> = params
            .iter()
            .enumerate()
            .map(|(r, &(temperature, top_k, top_p))| SampleRow {
                temperature,
                top_k,
                top_p,
                reserved: 0,
                seed: 0x5eed + r as u64,
                counter,
            })
            .collect();
        let logits_d = dev.upload(&logits).unwrap();
        let draws_d = dev.upload(&draws).unwrap();
        let ids = poisoned(dev, rows);
        k.sample_rows(dev, &logits_d, rows, vocab, &draws_d, &ids)
            .unwrap();
        let want: Vec<i32> = logits
            .chunks_exact(vocab)
            .zip(&draws)
            .map(|(row, d)| sample_row(row, d) as i32)
            .collect();
        let got = dev.download::<i32>(&ids).unwrap();
        assert_eq!(got, want, "draw {counter}");
        assert_eq!(
            got[5],
            model::exec::sampler::argmax(&logits[5 * vocab..6 * vocab]) as i32
        );
        assert!(
            [7, 90_000, 163_000].contains(&got[6]),
            "top-3 drew {}",
            got[6]
        );
        draws_seen.insert(got[1]);
    }
    assert!(
        draws_seen.len() > 1,
        "a temperature draw never changed with the counter"
    );
}

/// The absorbed-attention products at Kimi's per-head sizes: `q_nope · W_UK` (x strided inside
/// q's rows, y BF16 into q_abs) and `o_latent · W_UVᵀ` (W_UV rows inside `kv_b`, y FP32).
pub fn dense_heads_matches_per_head_products_in_both_output_types<D: Device>(
    dev: &D,
    k: &LayerKernels<D>,
) {
    let mut rng = Rng(9);
    // 3 tokens, 5 heads; x head slices of 24 values at offset 2 in rows of 5·32 values.
    let (tokens, heads, kk, n) = (3, 5, 24, 37);
    let x_rows = HeadRows {
        offset: 2,
        row_stride: heads * 32,
        head_stride: 32,
    };
    let x = random(&mut rng, tokens * heads * 32 + 2, 1.0);
    // W_h at 7 + h·(n·kk + 11): heads' matrices with gaps, as W_UV's rows inside kv_b.
    let (w_offset, w_stride) = (7, n * kk + 11);
    let w = bf16_bits(&random(&mut rng, w_offset + heads * w_stride, 0.1));
    let wf = from_bits(&w);
    let (x_d, w_d) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
    let want = |t: usize, h: usize, r: usize| -> (f64, f64) {
        let xs = &x[x_rows.offset + t * x_rows.row_stride + h * x_rows.head_stride..][..kk];
        let ws = &wf[w_offset + h * w_stride + r * kk..][..kk];
        let dot = xs.iter().zip(ws).map(|(a, b)| *a as f64 * *b as f64).sum();
        let mag = xs.iter().zip(ws).map(|(a, b)| (*a * *b).abs() as f64).sum();
        (dot, mag)
    };
    // y as [tokens][heads][n], contiguous.
    let y_rows = HeadRows {
        offset: 0,
        row_stride: heads * n,
        head_stride: n,
    };
    let y = poisoned(dev, tokens * heads * n);
    k.dense_heads(
        dev,
        &x_d,
        x_rows,
        tokens,
        heads,
        &w_d,
        w_offset,
        w_stride,
        kk,
        n,
        &y,
        y_rows,
        OutputType::F32,
    )
    .unwrap();
    let got: Vec<f32> = dev.download(&y).unwrap();
    for t in 0..tokens {
        for h in 0..heads {
            for r in 0..n {
                let (dot, mag) = want(t, h, r);
                let g = got[(t * heads + h) * n + r] as f64;
                assert!(
                    (g - dot).abs() <= 1e-6 * mag,
                    "f32 token {t} head {h} row {r}: {g} vs {dot}"
                );
            }
        }
    }
    let yb = dev.alloc_elements::<u16>(tokens * heads * n).unwrap();
    k.dense_heads(
        dev,
        &x_d,
        x_rows,
        tokens,
        heads,
        &w_d,
        w_offset,
        w_stride,
        kk,
        n,
        &yb,
        y_rows,
        OutputType::Bf16,
    )
    .unwrap();
    let got_b: Vec<u16> = dev.download(&yb).unwrap();
    for (i, (&b, &f)) in got_b.iter().zip(&got).enumerate() {
        assert_eq!(b, bf16::from_f32(f).to_bits(), "bf16 output {i}");
    }
}

/// `to_bf16_strided` on q_pe's layout (the RoPE part of every head) and a whole-row conversion;
/// `gather_rows` picks rows in any order, repeats included.
pub fn to_bf16_strided_and_gather_rows_move_the_right_values<D: Device>(
    dev: &D,
    k: &LayerKernels<D>,
) {
    let mut rng = Rng(10);
    let (rows, heads, nope, rope) = (4, 6, 12, 8);
    let qk = nope + rope;
    let q = random(&mut rng, rows * heads * qk, 3.0);
    let q_d = dev.upload(&q).unwrap();
    let out = dev.alloc_elements::<u16>(rows * heads * rope).unwrap();
    k.to_bf16_strided(dev, &q_d, rows, heads * qk, nope, qk, heads, rope, &out)
        .unwrap();
    let got: Vec<u16> = dev.download(&out).unwrap();
    for r in 0..rows {
        for h in 0..heads {
            for j in 0..rope {
                assert_eq!(
                    got[(r * heads + h) * rope + j],
                    bf16::from_f32(q[(r * heads + h) * qk + nope + j]).to_bits(),
                    "row {r} head {h} value {j}"
                );
            }
        }
    }
    let whole = dev.alloc_elements::<u16>(rows * heads * qk).unwrap();
    k.to_bf16_strided(dev, &q_d, rows, heads * qk, 0, 0, 1, heads * qk, &whole)
        .unwrap();
    assert_eq!(dev.download::<u16>(&whole).unwrap(), bf16_bits(&q));
    let picks: Vec<i32> = vec![3, 0, 3];
    let picks_d = dev.upload(&picks).unwrap();
    let width = heads * qk;
    let gathered = poisoned(dev, picks.len() * width);
    k.gather_rows(dev, &q_d, rows, &picks_d, picks.len(), width, &gathered)
        .unwrap();
    let got: Vec<f32> = dev.download(&gathered).unwrap();
    for (i, &r) in picks.iter().enumerate() {
        let r = r as usize;
        assert_eq!(
            got[i * width..(i + 1) * width],
            q[r * width..(r + 1) * width]
        );
    }
    let err = k
        .to_bf16_strided(dev, &q_d, rows, heads * qk, nope, qk, heads + 1, rope, &out)
        .unwrap_err()
        .to_string();
    assert!(err.contains("to_bf16_strided"), "{err}");
}

pub fn launchers_name_the_kernel_and_buffer_that_is_too_small<D: Device>(
    dev: &D,
    k: &LayerKernels<D>,
) {
    let small = dev.alloc_elements::<f32>(10).unwrap();
    let big = dev.alloc_elements::<f32>(1 << 16).unwrap();
    let err = k
        .dense_bf16(dev, &big, 1, &small, 64, 64, &big, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("dense_bf16") && err.contains(" w "), "{err}");
    let err = k
        .argmax_rows(dev, &small, 2, 10, &big)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("argmax_rows") && err.contains("logits"),
        "{err}"
    );
    let slices = RopeSlices {
        offset: 60,
        stride: 64,
        count: 1,
        pairs: 32,
    };
    let err = k
        .rope_interleaved(dev, &big, 1, 100, slices, &big, &big, 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rope_interleaved"), "{err}");
}
