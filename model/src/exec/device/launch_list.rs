//! The launch list of one decode step of any model the executor runs, recorded from the
//! executor itself on a [`DryDevice`] (wrapped in a [`CountingDevice`]): zeroed weights of the
//! rank's shapes ([`DeviceWeights::zeroed`]), the rank's all-reduce as the GPU path launches
//! it ([`DryAllReduce`]), every sequence prefilled to the context through the executor's own
//! steps, then one decode step captured as a graph and replayed, as a serving decode step is.
//! No kernel runs: the list is what the executor issues, and its bytes are the launchers'
//! own counts of what each launch reads and writes at least.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kernels::arch::Sm;
use kernels::device::dry::DryDevice;
use kernels::mla::cache::KvCacheDtype;

use super::all_reduce::DryAllReduce;
use super::counting::{CountingDevice, DeviceTraffic, LaunchEntry};
use super::ops::{DeviceBytes, DeviceOptions, device_moe_tactics, runner_with_weights};
use super::support::{ExecutorTactics, unsupported};
use super::weights::{DeviceKinds, DeviceWeights};
use super::workspace::StepCapacity;
use crate::arch::config::ModelConfig;
use crate::arch::shard::TpShard;
use crate::exec::error::ExecError;
use crate::exec::ops::{LogitRows, SeqInput, StepOutput};
use crate::exec::runner::ModelRunner;
use crate::exec::tactics::TacticSelector;
use crate::exec::weights::{Mlp, Weights};

/// Prefill rows per step when filling the cache to the context (the row kernels' grids take
/// up to 65535 rows).
const PREFILL_CHUNK: usize = 4096;

/// What to record.
#[derive(Clone, Debug)]
pub struct DryStep {
    /// For the header: the model's name.
    pub model: String,
    pub config: ModelConfig,
    pub sm: Sm,
    pub shard: TpShard,
    /// Sequences in the decode step.
    pub batch: usize,
    /// Tokens every sequence attends over in the decode step (its new token included).
    pub context: usize,
    pub kv_dtype: KvCacheDtype,
    /// Chooses the step's tactics for its batch and context, as a run does.
    pub selector: TacticSelector,
    /// For the header: where the tactics came from.
    pub tactics_source: String,
}

/// A recorded decode step.
#[derive(Clone, Debug)]
pub struct RecordedStep {
    pub request: DryStep,
    /// The tactics the decode step ran with.
    pub tactics: ExecutorTactics,
    pub traffic: DeviceTraffic,
    pub held: DeviceBytes,
    /// Weight bytes any decode step of this rank must read: see [`weights_every_step_reads`].
    pub weights_every_step_reads: u64,
    /// The routed experts' weight bytes the MoE grids are sized to read at this batch.
    pub expert_bound: u64,
    pub graphs: usize,
}

/// Launches and bytes of one (family, tactic, kernel).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelTotals {
    pub launches: usize,
    pub read: u64,
    pub written: u64,
}

impl DryStep {
    /// Records the step (see the module documentation).
    pub fn record(&self) -> Result<RecordedStep, ExecError> {
        let c = &self.config;
        let world = self.shard.world.max(1);
        if self.batch == 0 || self.context == 0 {
            return Err(unsupported(
                "a decode step needs at least one sequence and a context of one token",
            ));
        }
        let dev = CountingDevice::new(DryDevice::new(self.sm));
        let tactics = self.selector.select(1, self.context)?.executor();
        let prefill_rows = (self.context - 1).clamp(1, PREFILL_CHUNK);
        let capacity = StepCapacity {
            tokens: prefill_rows.max(self.batch),
            logit_rows: self.batch,
        };
        let options = DeviceOptions {
            kv_dtype: self.kv_dtype,
            cache_tokens: self.batch * self.context,
            capacity,
            tactics,
            selector: Some(self.selector.clone()),
            fill_memory: None,
            quiet: true,
        };
        let weights = DeviceWeights::zeroed(&dev, c, self.shard, &device_moe_tactics(&options)?)?;
        let mut ex = runner_with_weights(dev, c, weights, options)?;
        if world > 1 {
            let largest_message = capacity.tokens * c.hidden_size * 4;
            let all_reduce =
                DryAllReduce::new(ex.ops().device(), self.shard.rank, world, largest_message)?;
            ex.ops_mut().set_all_reduce(Box::new(all_reduce))?;
        }
        let seqs: Vec<_> = (0..self.batch).map(|_| ex.add_sequence()).collect();
        let prompt = vec![1u32; self.context - 1];
        for &seq in &seqs {
            for chunk in prompt.chunks(PREFILL_CHUNK) {
                ex.run(
                    &[SeqInput { seq, tokens: chunk }],
                    LogitRows::Last,
                    StepOutput::Greedy,
                    &[],
                )?;
            }
        }
        ex.ops().device().take();
        let inputs: Vec<SeqInput<'_>> = seqs
            .iter()
            .map(|&seq| SeqInput { seq, tokens: &[1] })
            .collect();
        ex.run(&inputs, LogitRows::Last, StepOutput::Greedy, &[])?;
        let traffic = ex.ops().device().take();
        let tactics = ex.ops().step_tactics();
        let (dense, expert_bound) = weights_every_step_reads(ex.weights(), c, self.batch);
        Ok(RecordedStep {
            request: self.clone(),
            tactics,
            traffic,
            held: ex.ops().device_bytes(),
            weights_every_step_reads: dense,
            expert_bound,
            graphs: ex.ops().graph_count(),
        })
    }
}

/// `(dense, experts)`: bytes of the weights a decode step of `batch` sequences reads whatever
/// the routing — every BF16 matrix but the embedding (one row per token) and the routed
/// experts, W_UV's rows of `kv_b` (W_UK is read from its transposed copy) — and the routed
/// experts' bytes the MoE grids are sized for (`min(batch · top_k, experts)` experts per MoE
/// layer, each read once).
pub fn weights_every_step_reads<D: kernels::device::Device>(
    w: &Weights<DeviceKinds<D>>,
    c: &ModelConfig,
    batch: usize,
) -> (u64, u64) {
    use kernels::device::DeviceMemory;
    let (mut dense, mut experts) = (w.lm_head.memory.len(), 0);
    for l in &w.layers {
        let a = &l.attention;
        dense += a.q_a.as_ref().map_or(0, |(q_a, _)| q_a.memory.len())
            + a.q_b.memory.len()
            + a.kv_a_latent.memory.len()
            + a.kv_a_rope.memory.len()
            + a.w_uk_t.memory.len()
            + a.w_uv.heads * a.w_uv.rows * a.w_uv.cols * 2
            + a.o.memory.len();
        dense += match &l.mlp {
            Mlp::Dense(d) => d.gate_up.memory.len() + d.down.memory.len(),
            Mlp::Moe(m) => {
                let bound = (batch * c.num_experts_per_tok).min(m.experts.experts);
                experts += bound * m.experts.bytes_per_expert;
                m.router.memory.len()
                    + m.shared
                        .as_ref()
                        .map_or(0, |s| s.gate_up.memory.len() + s.down.memory.len())
            }
        };
    }
    (dense as u64, experts as u64)
}

impl RecordedStep {
    pub fn launches(&self) -> &[LaunchEntry] {
        &self.traffic.launches
    }

    pub fn read(&self) -> u64 {
        self.launches().iter().map(|l| l.traffic.read).sum()
    }

    pub fn written(&self) -> u64 {
        self.launches().iter().map(|l| l.traffic.written).sum()
    }

    /// Totals per `family/tactic kernel`, in the order each first appears in the step.
    pub fn by_kernel(&self) -> Vec<(String, KernelTotals)> {
        let mut order: Vec<String> = Vec::new();
        let mut totals: BTreeMap<String, KernelTotals> = BTreeMap::new();
        for l in self.launches() {
            let key = format!("{}/{} {}", l.family, l.tactic, l.kernel);
            let t = totals.entry(key.clone()).or_insert_with(|| {
                order.push(key);
                KernelTotals::default()
            });
            t.launches += 1;
            t.read += l.traffic.read;
            t.written += l.traffic.written;
        }
        order
            .into_iter()
            .map(|k| {
                let t = totals.remove(&k).expect("every key was counted");
                (k, t)
            })
            .collect()
    }

    /// The launch list as text: the format of the emulated recording
    /// (`bench/results/launch-list-kimi-kernel-dims.txt`), then totals per kernel.
    pub fn render(&self, regenerate: &str) -> String {
        let r = &self.request;
        let c = &r.config;
        let t = &self.traffic;
        let moe_layers = (0..c.num_hidden_layers)
            .filter(|&l| c.is_moe_layer(l))
            .count();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Launch list of one decode step, RECORDED from the device runner (DeviceOps) on a dry \
             device (DryDevice with the limits of {}, recorded by CountingDevice): no kernel ran.",
            r.sm
        );
        let _ = writeln!(
            out,
            "# {} ({} layers: {} dense, {} MoE; {} heads, {} of them on this rank), rank {} of \
             TP{}, batch {}, context {} tokens per sequence, {} cache; the decode step captured \
             as a graph and replayed ({} graph).",
            r.model,
            c.num_hidden_layers,
            c.num_hidden_layers - moe_layers,
            moe_layers,
            c.num_attention_heads,
            c.num_attention_heads / r.shard.world.max(1),
            r.shard.rank,
            r.shard.world,
            r.batch,
            r.context,
            r.kv_dtype.id().to_uppercase(),
            self.graphs
        );
        let _ = writeln!(
            out,
            "# Tactics ({}): mla {}, moe_gemm {}. Weights are zeroed placeholders of the rank's \
             shapes{}.",
            r.tactics_source,
            self.tactics.mla.id(),
            self.tactics.moe.map_or("-".into(), |m| m.id()),
            if r.shard.world > 1 {
                format!(
                    "; the all-reduce is the GPU path's launch (one-shot pull); the rank holds \
                     vocabulary rows {:?} of the embedding and lm_head, and the greedy id is \
                     the best of the ranks' gathered (value, id) picks",
                    r.shard.vocab_rows(c.vocab_size)
                )
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            out,
            "# Bytes are the launchers' own counts of what each launch reads and writes at least \
             (routed experts: the grid's bound), not measurements."
        );
        let _ = writeln!(out, "# Regenerate: {regenerate}");
        let _ = writeln!(
            out,
            "decode step: {} launches, {} writes ({} B), {} uploads, {} reads ({} B), {} device fills",
            t.launches.len(),
            t.writes,
            t.bytes_to_device,
            t.uploads,
            t.downloads,
            t.bytes_to_host,
            t.fills
        );
        for l in &t.launches {
            let _ = writeln!(
                out,
                "  {}/{} {} grid {:?} block {:?} smem {} read {} B written {} B",
                l.family,
                l.tactic,
                l.kernel,
                l.config.grid_dim,
                l.config.block_dim,
                l.config.shared_mem_bytes,
                l.traffic.read,
                l.traffic.written
            );
        }
        let _ = writeln!(
            out,
            "decode step: {} B read, {} B written; the weights every step must read {} B (+ {} B \
             of routed experts the MoE grids are sized for); the device holds {} B of weights, {} \
             B of cache, {} B of workspace",
            self.read(),
            self.written(),
            self.weights_every_step_reads,
            self.expert_bound,
            self.held.weights,
            self.held.cache,
            self.held.workspace
        );
        let _ = writeln!(out, "# Per kernel, one decode step:");
        for (kernel, k) in self.by_kernel() {
            let _ = writeln!(
                out,
                "  {kernel} launches {} read {} B written {} B",
                k.launches, k.read, k.written
            );
        }
        let _ = writeln!(
            out,
            "total: {} launches, {} B read, {} B written",
            t.launches.len(),
            self.read(),
            self.written()
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::presets::Preset;

    fn kimi_tp8_rank0(batch: usize, kv_dtype: KvCacheDtype) -> RecordedStep {
        let config = Preset::KimiK25.model_config();
        let world = 8;
        let (selector, _) = TacticSelector::from_cache(
            None,
            Sm::Sm120,
            &config,
            kv_dtype,
            world,
            kernels::blas::DenseTactic::default(),
        );
        DryStep {
            model: "kimi-k2.5".into(),
            config,
            sm: Sm::Sm120,
            shard: TpShard { rank: 0, world },
            batch,
            context: 4096,
            kv_dtype,
            selector,
            tactics_source: "heuristic defaults".into(),
        }
        .record()
        .unwrap()
    }

    fn count(launches: &[LaunchEntry], kernel: &str) -> usize {
        launches.iter().filter(|l| l.kernel == kernel).count()
    }

    /// Kimi-K2.5's decode step on rank 0 of TP8, as the executor issues it: per layer the
    /// attention (cache append, split MLA decode and its combine) and its all-reduce, then the
    /// dense MLP (layers before `first_k_dense_replace`) or the MoE (router, grouping, the two
    /// grouped GEMMs, the shared expert) and its all-reduce; then the final norm, `lm_head`
    /// and argmax. The bytes read cover the rank's weights a step must touch: every dense
    /// matrix once plus the routed experts the grids are sized for.
    #[test]
    fn kimi_tp8_decode_step_has_the_models_structure_and_reads_its_weights() {
        for (batch, kv_dtype) in [(1, KvCacheDtype::Bf16), (8, KvCacheDtype::Fp8E4m3)] {
            let step = kimi_tp8_rank0(batch, kv_dtype);
            let c = &step.request.config;
            let launches = step.launches();
            assert_eq!(step.graphs, 1, "the decode step is captured once");
            assert_eq!(step.traffic.replays, 1);
            // The rank's embedding rows, summed over the ranks.
            assert_eq!(launches[0].kernel, "embed_gather");
            assert_eq!(launches[1].kernel, "allreduce");
            // A layer ends with the all-reduce of its MLP's partial sums.
            let mut layers = Vec::new();
            let mut start = 2;
            let mut reduces = 0;
            for (i, l) in launches.iter().enumerate().skip(start) {
                if l.kernel == "allreduce" && layers.len() < c.num_hidden_layers {
                    reduces += 1;
                    if reduces % 2 == 0 {
                        layers.push(&launches[start..=i]);
                        start = i + 1;
                    }
                }
            }
            assert_eq!(layers.len(), c.num_hidden_layers, "batch {batch}");
            for (i, layer) in layers.iter().enumerate() {
                let what = format!("batch {batch}, layer {i}");
                assert_eq!(count(layer, "allreduce"), 2, "{what}");
                for kernel in ["mla_append", "mla_decode", "mla_combine"] {
                    assert_eq!(count(layer, kernel), 1, "{what}: {kernel}");
                }
                let decode = layer.iter().position(|l| l.kernel == "mla_decode").unwrap();
                let first_reduce = layer.iter().position(|l| l.kernel == "allreduce").unwrap();
                assert!(
                    decode < first_reduce,
                    "{what}: attention before its all-reduce"
                );
                let moe = [
                    "route_noaux_tc",
                    "group_by_expert",
                    "moe_gate_up",
                    "moe_down",
                ];
                let expect_moe = usize::from(i >= c.first_k_dense_replace);
                assert_eq!(expect_moe == 1, c.is_moe_layer(i));
                for kernel in moe {
                    assert_eq!(count(layer, kernel), expect_moe, "{what}: {kernel}");
                }
                // The dense MLP, or the MoE layer's shared expert.
                assert_eq!(count(layer, "silu_mul"), 1, "{what}");
            }
            let head: Vec<&str> = launches[start..]
                .iter()
                .map(|l| l.kernel.as_str())
                .collect();
            // The vocabulary-parallel head: this rank's eighth of lm_head, its greedy pick,
            // the ranks' picks gathered, the best of them.
            assert_eq!(
                head,
                [
                    "add_rms_norm",
                    "dense_bf16",
                    "argmax_shard",
                    "allreduce",
                    "argmax_ranks"
                ]
            );
            let lm_head = &launches[start + 1];
            let rank_vocab = c.vocab_size / 8;
            let lm_head_bytes = (rank_vocab * c.hidden_size * 2) as u64;
            assert!(lm_head.traffic.read >= lm_head_bytes, "{lm_head:?}");
            assert!(lm_head.traffic.read < 2 * lm_head_bytes, "{lm_head:?}");
            assert_eq!(
                lm_head.problem,
                Some(kernels::tactic::ProblemShape::Dense {
                    m: batch as u32,
                    n: rank_vocab as u32,
                    k: c.hidden_size as u32
                })
            );
            // The picks, not the logits, cross the ranks: 2 values per rank per row.
            let gather = &launches[start + 3];
            assert_eq!(
                gather.traffic.written,
                (2 * batch * 8 * 2 * 4) as u64,
                "{gather:?}"
            );
            assert!(
                launches
                    .iter()
                    .filter(|l| l.kernel.starts_with("dense_"))
                    .all(|l| l.problem.is_some()),
                "every dense product names its m, n, k"
            );

            assert!(
                launches
                    .iter()
                    .all(|l| l.traffic.read > 0 && l.traffic.written > 0),
                "every launch counts its bytes"
            );
            let experts_read: u64 = launches
                .iter()
                .filter(|l| l.family == kernels::moe_gemm::launch::FAMILY)
                .map(|l| l.traffic.read)
                .sum();
            assert!(experts_read >= step.expert_bound, "batch {batch}");
            let must_read = step.weights_every_step_reads + step.expert_bound;
            assert!(
                step.read() >= must_read,
                "batch {batch}: {} B read < {must_read} B of weights a step touches",
                step.read()
            );
            // The rank's share: one eighth of the heads, the intermediate columns and the
            // vocabulary, and replicated latent projections.
            let per_expert = 3 * c.hidden_size * (c.moe_intermediate_size / 8) * 9 / 16;
            let moe_layers = c.num_hidden_layers - c.first_k_dense_replace;
            let experts_held = moe_layers * c.n_routed_experts * per_expert;
            assert!(step.held.weights > experts_held, "{:?}", step.held);
            assert!(
                step.expert_bound
                    == (moe_layers
                        * (batch * c.num_experts_per_tok).min(c.n_routed_experts)
                        * per_expert) as u64
            );
        }
    }

    /// The text carries the provenance the brief asks for and one line per launch.
    #[test]
    fn the_rendered_list_says_it_is_recorded_on_a_dry_device() {
        let step = kimi_tp8_rank0(1, KvCacheDtype::Bf16);
        let text = step.render("cargo run ...");
        let header: Vec<&str> = text.lines().filter(|l| l.starts_with('#')).collect();
        assert!(header[0].contains("RECORDED") && header[0].contains("dry device"));
        assert!(header[0].contains("sm_120a"));
        assert!(header[1].contains("rank 0 of TP8, batch 1, context 4096"));
        let listed = text.lines().filter(|l| l.contains(" grid (")).count();
        assert_eq!(listed, step.launches().len());
        let by_kernel: usize = step.by_kernel().iter().map(|(_, k)| k.launches).sum();
        assert_eq!(by_kernel, step.launches().len());
    }
}
