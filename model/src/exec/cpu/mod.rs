//! The CPU backend: [`StepOps`] on the `kernels` crate's CPU kernels (the dense BF16 products,
//! the NVFP4 grouped GEMM of the routed experts, MLA decode over a host latent cache), with
//! FP32 activations as HF computes them, the rows of a prefill in parallel, and the calls of a
//! step on the tactic's thread pool ([`pool`]).

pub mod choice;
pub mod heap;
pub mod pool;
pub mod route;
pub mod rows;
pub mod weights;

use std::ops::Range;
use std::sync::Mutex;

use kernels::allreduce::AllReduce;
use kernels::allreduce::cpu::CpuCommunicator;
use kernels::isa::Isa;
use kernels::matrix::MatrixView;
use kernels::mla::cache::{KvCacheDtype, PageTables, PagedLatentCache, SeqId};
use kernels::mla::reference::{AttentionQuery, MlaProblem};
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing, silu};

use self::pool::CpuCompute;
use self::rows::{
    add_in_place, check_finite, for_rows, rms_norm_into, rms_norm_rows_into, round_to_bf16,
};
use self::weights::{CpuHeads, CpuKinds, CpuMatrix, cpu_weights};
use super::error::ExecError;
use super::ops::{Buf, GraphKey, Logits, StepOps, StepOutput, StepResult, StepRows, Sublayer};
use super::runner::Runner;
use super::sampler::{SampleRow, argmax, sample_row};
use crate::arch::config::ModelConfig;
use crate::arch::rope::Rope;
use crate::checkpoint::weights::{ExpertWeights, Model};

/// How a CPU runner is made.
#[derive(Clone, Debug)]
pub struct CpuOptions {
    pub kv_dtype: KvCacheDtype,
    /// Latent cache capacity in tokens, over every sequence.
    pub cache_tokens: usize,
    pub compute: CpuCompute,
    /// Round where the device kernels round: the MLA queries and the routed experts' input to
    /// BF16. Off by default (the CPU keeps FP32 as HF does); on, the CPU step reproduces the
    /// device's numerics up to summation order.
    pub device_roundings: bool,
}

impl CpuOptions {
    /// The default tactic on the calling thread, FP32 activations.
    pub fn new(kv_dtype: KvCacheDtype, cache_tokens: usize) -> Self {
        Self {
            kv_dtype,
            cache_tokens,
            compute: CpuCompute::plain(),
            device_roundings: false,
        }
    }
}

/// A CPU runner over `model`'s weights (borrowed from its tensors).
pub fn cpu_runner(model: &Model, options: CpuOptions) -> Runner<CpuOps> {
    let weights = cpu_weights(model);
    let ops = CpuOps::new(&model.config, weights.heads, options);
    Runner::new(ops, weights, model.config.clone())
}

/// What a CPU step records besides its result, for calibration and tests.
#[derive(Debug, Default)]
pub struct Observations {
    /// Activation maxima at the routed experts' inputs, per MoE layer in order (calibration).
    pub expert_input_amax: Option<Vec<ExpertInputAmax>>,
    /// Every routing the step chose, per MoE layer in order.
    pub routings: Option<Vec<Routing>>,
}

/// The CPU backend's [`StepOps`]. See the module documentation.
pub struct CpuOps {
    config: ModelConfig,
    heads: usize,
    compute: CpuCompute,
    cache: PagedLatentCache,
    rope: Rope,
    softmax_scale: f32,
    device_roundings: bool,
    communicator: Option<Mutex<CpuCommunicator>>,
    /// Removes the communicator's segment name if the process is interrupted.
    _segment: Option<crate::cleanup::Registration>,
    /// The step's activations, by [`Buf`]; each op sizes what it writes.
    bufs: Vec<Vec<f32>>,
    ids: Vec<u32>,
    rows: Vec<(SeqId, usize)>,
    selected: Vec<usize>,
    draws: Vec<SampleRow>,
    output: StepOutput,
    routing: Option<Routing>,
    result_ids: Vec<u32>,
    pub observations: Observations,
}

impl CpuOps {
    pub fn new(config: &ModelConfig, heads: usize, options: CpuOptions) -> Self {
        let cache = PagedLatentCache::with_capacity_tokens(
            kernels::mla::cache::LatentCacheShape {
                layers: config.num_hidden_layers,
                latent_dim: config.kv_lora_rank,
                rope_dim: config.qk_rope_head_dim,
            },
            options.kv_dtype,
            options.cache_tokens,
        );
        Self {
            rope: Rope::new(config),
            softmax_scale: config.softmax_scale(),
            config: config.clone(),
            heads,
            compute: options.compute,
            cache,
            device_roundings: options.device_roundings,
            communicator: None,
            _segment: None,
            bufs: vec![Vec::new(); Buf::COUNT],
            ids: Vec::new(),
            rows: Vec::new(),
            selected: Vec::new(),
            draws: Vec::new(),
            output: StepOutput::Logits,
            routing: None,
            result_ids: Vec::new(),
            observations: Observations::default(),
        }
    }

    /// Makes this backend one rank of a tensor-parallel group summing over `communicator`
    /// (its weights a rank's shard; see [`crate::exec::backend::join_cpu_group`]).
    pub fn set_communicator(
        &mut self,
        communicator: CpuCommunicator,
        segment: crate::cleanup::Registration,
    ) {
        self.communicator = Some(Mutex::new(communicator));
        self._segment = Some(segment);
    }

    pub fn compute(&self) -> &CpuCompute {
        &self.compute
    }

    pub fn cache(&self) -> &PagedLatentCache {
        &self.cache
    }

    pub fn cache_mut(&mut self) -> &mut PagedLatentCache {
        &mut self.cache
    }

    /// The step's activation `b` as the CPU lays it out (for inspection and probes).
    pub fn activation(&self, b: Buf) -> &[f32] {
        &self.bufs[b as usize]
    }

    /// The step's activation `b`, to overwrite (probes that stand in for an operation).
    pub fn activation_mut(&mut self, b: Buf) -> &mut Vec<f32> {
        &mut self.bufs[b as usize]
    }

    /// Rows of the current step, and of them the rows that get logits.
    pub fn step_rows(&self) -> (usize, usize) {
        (self.rows.len(), self.selected.len())
    }

    /// The routing of the last [`StepOps::route`], until the routed experts take it.
    pub fn routing(&self) -> Option<&Routing> {
        self.routing.as_ref()
    }

    fn buf(&self, b: Buf) -> &[f32] {
        &self.bufs[b as usize]
    }

    /// Takes `b` out to write it, `len` values long (its old values kept where they fit).
    fn take(&mut self, b: Buf, len: usize) -> Vec<f32> {
        let mut v = std::mem::take(&mut self.bufs[b as usize]);
        v.resize(len, 0.0);
        v
    }

    fn put(&mut self, b: Buf, v: Vec<f32>) {
        self.bufs[b as usize] = v;
    }

    fn n(&self) -> usize {
        self.rows.len()
    }

    fn qk(&self) -> usize {
        self.config.qk_nope_head_dim + self.config.qk_rope_head_dim
    }

    /// `outs[i] = x · W_iᵀ` of every part of every matrix, in one call.
    fn matmul_parts(&self, x: &[f32], tokens: usize, ws: &[&CpuMatrix], outs: &mut [&mut [f32]]) {
        let views: Vec<MatrixView<'_>> = ws
            .iter()
            .flat_map(|m| m.parts.iter().map(|p| p.view()))
            .collect();
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(views.len());
        for (m, out) in ws.iter().zip(outs.iter_mut()) {
            let mut rest: &mut [f32] = out;
            for p in &m.parts {
                let (part, tail) = rest.split_at_mut(tokens * p.rows);
                parts.push(part);
                rest = tail;
            }
        }
        let tactic = *self.compute.tactic();
        self.compute.run(|| {
            if let ([w], [out]) = (&views[..], &mut parts[..]) {
                kernels::dense::matmul_transposed_tuned(&tactic, x, tokens, *w, out);
            } else {
                kernels::dense::matmul_transposed_many_tuned(
                    &tactic, x, tokens, &views, &mut parts,
                );
            }
        });
    }

    /// Per head `out[h] = x[h] · W[h]ᵀ` for head-major `x: [heads, tokens, cols]`.
    fn per_head(&self, x: &[f32], tokens: usize, w: &CpuHeads, out: &mut [f32]) {
        let views = w.views();
        let tactic = *self.compute.tactic();
        self.compute
            .run(|| kernels::dense::matmul_per_head_tuned(&tactic, x, tokens, &views, out));
    }

    /// The index among MoE layers of `layer`.
    fn moe_index(&self, layer: usize) -> usize {
        (0..layer).filter(|&l| self.config.is_moe_layer(l)).count()
    }

    fn all_reduce_values(&self, data: &mut [f32]) -> Result<(), ExecError> {
        let Some(communicator) = &self.communicator else {
            return Ok(());
        };
        let mut communicator = communicator
            .lock()
            .map_err(|_| ExecError::AllReduce("all-reduce lock poisoned".into()))?;
        // A message larger than the segment's slots (the gathered logits of a long prompt)
        // goes in slot-sized pieces; every rank cuts the same pieces.
        let piece = (communicator.capacity_bytes() / 4).max(1);
        for chunk in data.chunks_mut(piece) {
            communicator
                .all_reduce_f32(chunk, None)
                .map_err(|e| ExecError::AllReduce(e.to_string()))?;
        }
        Ok(())
    }
}

impl StepOps for CpuOps {
    type Kinds = CpuKinds;

    fn describe(&self) -> String {
        "cpu".into()
    }

    fn pages(&self) -> &PageTables {
        self.cache.page_tables()
    }

    fn pages_mut(&mut self) -> &mut PageTables {
        self.cache.page_tables_mut()
    }

    fn begin_step(&mut self, step: &StepRows<'_>) -> Result<(), ExecError> {
        self.ids.clear();
        self.ids.extend_from_slice(step.ids);
        self.rows.clear();
        self.rows.extend_from_slice(step.rows);
        self.selected.clear();
        self.selected.extend_from_slice(step.selected);
        self.draws.clear();
        self.draws.extend_from_slice(step.draws);
        self.output = step.output;
        self.routing = None;
        self.result_ids.clear();
        Ok(())
    }

    fn run_step(
        &mut self,
        body: &mut (dyn FnMut(&mut Self) -> Result<(), ExecError> + Send),
    ) -> Result<(), ExecError> {
        let compute = self.compute.clone();
        let mut result = Ok(());
        compute.run_step(&mut || result = body(self));
        result
    }

    fn replay(&mut self, _: GraphKey) -> Result<bool, ExecError> {
        Ok(false)
    }

    fn begin_capture(&mut self, _: GraphKey) -> Result<bool, ExecError> {
        Ok(false)
    }

    fn end_capture(&mut self, _: GraphKey) -> Result<(), ExecError> {
        Ok(())
    }

    fn embed(
        &mut self,
        table: &CpuMatrix,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let hidden = self.config.hidden_size;
        let table = &table.parts[0];
        let mut x = self.take(out, self.n() * hidden);
        for (dst, &token) in x.chunks_exact_mut(hidden).zip(&self.ids) {
            // A tensor-parallel shard holds some of the vocabulary's rows: the others are
            // zeros here, and the all-reduce adds the one rank's row to zeros (exact).
            if !vocab_rows.contains(&(token as usize)) {
                dst.fill(0.0);
                continue;
            }
            for (d, w) in dst
                .iter_mut()
                .zip(table.row(token as usize - vocab_rows.start))
            {
                *d = w.to_f32();
            }
        }
        self.put(out, x);
        Ok(())
    }

    fn add_rms_norm(
        &mut self,
        residual: Buf,
        delta: Option<Buf>,
        weight: &Vec<f32>,
        out: Buf,
        added: Sublayer,
    ) -> Result<(), ExecError> {
        let hidden = self.config.hidden_size;
        let mut x = self.take(residual, self.n() * hidden);
        if let Some(delta) = delta {
            add_in_place(&mut x, self.buf(delta));
        }
        let checked = check_finite(&x, hidden, || added.to_string());
        let mut h = self.take(out, x.len());
        rms_norm_rows_into(&x, hidden, weight, self.config.rms_norm_eps, &mut h);
        self.put(residual, x);
        self.put(out, h);
        checked
    }

    fn rms_norm(&mut self, x: Buf, weight: &Vec<f32>, out: Buf) -> Result<(), ExecError> {
        let dim = weight.len();
        let mut h = self.take(out, self.buf(x).len());
        rms_norm_rows_into(self.buf(x), dim, weight, self.config.rms_norm_eps, &mut h);
        self.put(out, h);
        Ok(())
    }

    fn products(&mut self, x: Buf, outs: &[(&CpuMatrix, Buf)]) -> Result<(), ExecError> {
        let n = if x == Buf::Selected {
            self.selected.len()
        } else {
            self.n()
        };
        let mut taken: Vec<Vec<f32>> = outs
            .iter()
            .map(|(w, b)| self.take(*b, n * w.rows()))
            .collect();
        let ws: Vec<&CpuMatrix> = outs.iter().map(|(w, _)| *w).collect();
        {
            let mut slices: Vec<&mut [f32]> = taken.iter_mut().map(|v| v.as_mut_slice()).collect();
            self.matmul_parts(self.buf(x), n, &ws, &mut slices);
        }
        for ((_, b), v) in outs.iter().zip(taken) {
            self.put(*b, v);
        }
        Ok(())
    }

    fn product_add(&mut self, x: Buf, w: &CpuMatrix, out: Buf) -> Result<(), ExecError> {
        let n = self.n();
        let mut product = vec![0.0f32; n * w.rows()];
        self.matmul_parts(self.buf(x), n, &[w], &mut [&mut product]);
        let mut y = self.take(out, n * w.rows());
        add_in_place(&mut y, &product);
        self.put(out, y);
        Ok(())
    }

    fn rope(&mut self, buf: Buf) -> Result<(), ExecError> {
        let c = &self.config;
        let (nope, rope_dim) = (c.qk_nope_head_dim, c.qk_rope_head_dim);
        let (width, offset, stride) = match buf {
            Buf::Query => (self.heads * self.qk(), nope, self.qk()),
            Buf::KeyRope => (rope_dim, 0, rope_dim),
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "RoPE of {other:?}: only the queries and the RoPE key rotate"
                )));
            }
        };
        let mut v = std::mem::take(&mut self.bufs[buf as usize]);
        let (rope, rows) = (&self.rope, &self.rows);
        for_rows(&mut v, width, |r, row| {
            rope.apply_slices(row, offset, rope_dim, stride, rows[r].1);
        });
        self.put(buf, v);
        Ok(())
    }

    fn append_cache(
        &mut self,
        layer: usize,
        latent: Buf,
        key_rope: Buf,
        norm: &Vec<f32>,
    ) -> Result<(), ExecError> {
        let (l, r) = (self.config.kv_lora_rank, self.config.qk_rope_head_dim);
        let mut c = std::mem::take(&mut self.bufs[latent as usize]);
        let eps = self.config.rms_norm_eps;
        for_rows(&mut c, l, |_, row| {
            let mut normed = vec![0.0; l];
            rms_norm_into(row, norm, eps, &mut normed);
            row.copy_from_slice(&normed);
        });
        let pe = std::mem::take(&mut self.bufs[key_rope as usize]);
        let written = self
            .rows
            .iter()
            .enumerate()
            .try_for_each(|(i, &(seq, pos))| {
                self.cache.write(
                    layer,
                    seq,
                    pos,
                    &c[i * l..(i + 1) * l],
                    &pe[i * r..(i + 1) * r],
                )
            });
        self.put(latent, c);
        self.put(key_rope, pe);
        Ok(written?)
    }

    fn absorb_query(
        &mut self,
        query: Buf,
        w_uk_t: &CpuHeads,
        absorbed: Buf,
        rope: Buf,
    ) -> Result<(), ExecError> {
        let c = &self.config;
        let (n, heads, qk) = (self.n(), self.heads, self.qk());
        let (nope, rope_dim, latent) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank);
        let q = self.buf(query);
        // Head-major for one product per head: [heads, n, P] in, [heads, n, L] out.
        let mut q_nope = vec![0.0f32; heads * n * nope];
        for_rows(&mut q_nope, n * nope, |head, block| {
            for (r, dst) in block.chunks_exact_mut(nope).enumerate() {
                dst.copy_from_slice(&q[(r * heads + head) * qk..][..nope]);
            }
        });
        let mut q_pe = self.take(rope, n * heads * rope_dim);
        let q = self.buf(query);
        for_rows(&mut q_pe, heads * rope_dim, |r, pe_row| {
            for (head, pe) in pe_row.chunks_exact_mut(rope_dim).enumerate() {
                pe.copy_from_slice(&q[(r * heads + head) * qk + nope..][..rope_dim]);
            }
        });
        let mut by_head = vec![0.0f32; heads * n * latent];
        self.per_head(&q_nope, n, w_uk_t, &mut by_head);
        let mut q_abs = self.take(absorbed, n * heads * latent);
        for_rows(&mut q_abs, heads * latent, |r, row| {
            for (head, dst) in row.chunks_exact_mut(latent).enumerate() {
                dst.copy_from_slice(&by_head[(head * n + r) * latent..][..latent]);
            }
        });
        if self.device_roundings {
            round_to_bf16(&mut q_abs);
            round_to_bf16(&mut q_pe);
        }
        self.put(absorbed, q_abs);
        self.put(rope, q_pe);
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        absorbed: Buf,
        rope: Buf,
        out: Buf,
    ) -> Result<(), ExecError> {
        let (n, heads, latent) = (self.n(), self.heads, self.config.kv_lora_rank);
        let queries: Vec<AttentionQuery> = self
            .rows
            .iter()
            .map(|&(seq, pos)| AttentionQuery {
                seq,
                context: pos + 1,
            })
            .collect();
        let mut o_latent = self.take(out, n * heads * latent);
        let mut lse = vec![0.0f32; n * heads];
        let problem = MlaProblem {
            layer,
            heads,
            queries: &queries,
            q_abs: self.buf(absorbed),
            q_pe: self.buf(rope),
            softmax_scale: self.softmax_scale,
        };
        let tactic = *self.compute.tactic();
        let cache = &self.cache;
        let attended = self.compute.run(|| {
            kernels::mla::cpu::mla_attention_tuned(
                &tactic,
                cache,
                &problem,
                &mut o_latent,
                &mut lse,
            )
        });
        self.put(out, o_latent);
        Ok(attended?)
    }

    fn unabsorb(&mut self, latent: Buf, w_uv: &CpuHeads, out: Buf) -> Result<(), ExecError> {
        let (n, heads) = (self.n(), self.heads);
        let (l, v_dim) = (self.config.kv_lora_rank, self.config.v_head_dim);
        let o_latent = self.buf(latent);
        let mut by_head = vec![0.0f32; heads * n * l];
        for_rows(&mut by_head, n * l, |head, block| {
            for (r, dst) in block.chunks_exact_mut(l).enumerate() {
                dst.copy_from_slice(&o_latent[(r * heads + head) * l..][..l]);
            }
        });
        let mut head_v = vec![0.0f32; heads * n * v_dim];
        self.per_head(&by_head, n, w_uv, &mut head_v);
        let mut o = self.take(out, n * heads * v_dim);
        for_rows(&mut o, heads * v_dim, |r, row| {
            for (head, dst) in row.chunks_exact_mut(v_dim).enumerate() {
                dst.copy_from_slice(&head_v[(head * n + r) * v_dim..][..v_dim]);
            }
        });
        self.put(out, o);
        Ok(())
    }

    fn silu_mul(&mut self, gate_up: Buf, out: Buf) -> Result<(), ExecError> {
        // Gate's rows for every token, then up's ([`CpuMatrix`]'s stacked layout).
        let n = self.n();
        let both = std::mem::take(&mut self.bufs[gate_up as usize]);
        let inter = both.len() / (2 * n.max(1));
        let (gate, up) = both.split_at(n * inter);
        let mut act = self.take(out, n * inter);
        act.copy_from_slice(gate);
        for_rows(&mut act, inter, |r, row| {
            for (g, u) in row.iter_mut().zip(&up[r * inter..(r + 1) * inter]) {
                *g = silu(*g) * u;
            }
        });
        self.put(out, act);
        self.put(gate_up, both);
        Ok(())
    }

    fn route(&mut self, _layer: usize, logits: Buf, bias: &Vec<f32>) -> Result<(), ExecError> {
        let routing = route::route(self.buf(logits), bias, &self.config);
        if let Some(log) = &mut self.observations.routings {
            log.push(routing.clone());
        }
        self.routing = Some(routing);
        Ok(())
    }

    fn routed_experts(
        &mut self,
        layer: usize,
        x: Buf,
        experts: &Vec<ExpertWeights>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let hidden = self.config.hidden_size;
        let routing = self
            .routing
            .take()
            .ok_or_else(|| ExecError::InvalidRequest("routed experts before a routing".into()))?;
        let views: Vec<ExpertView<'_>> = experts.iter().map(ExpertWeights::view).collect();
        let moe_layer = self.moe_index(layer);
        let mut y = self.take(out, self.n() * hidden);
        y.fill(0.0);
        let rounded;
        let input = if self.device_roundings {
            let mut h = self.bufs[x as usize].clone();
            round_to_bf16(&mut h);
            rounded = h;
            &rounded[..]
        } else {
            &self.bufs[x as usize][..]
        };
        let amax = self.observations.expert_input_amax.as_mut().map(|cal| {
            if cal.len() <= moe_layer {
                cal.resize(moe_layer + 1, ExpertInputAmax::default());
            }
            &mut cal[moe_layer]
        });
        let tactic = *self.compute.tactic();
        self.compute.run(|| {
            kernels::moe_gemm::cpu::moe_cpu_tuned(
                &tactic,
                Isa::detect(),
                input,
                hidden,
                &routing,
                &views,
                &mut y,
                amax,
            )
        });
        self.put(out, y);
        Ok(())
    }

    fn routed_experts_used(&self) -> Option<usize> {
        let mut used = self.routing.as_ref()?.experts.clone();
        used.sort_unstable();
        used.dedup();
        Some(used.len())
    }

    fn all_reduce(&mut self, buf: Buf) -> Result<(), ExecError> {
        let mut v = std::mem::take(&mut self.bufs[buf as usize]);
        let reduced = self.all_reduce_values(&mut v);
        self.put(buf, v);
        reduced
    }

    fn select_rows(&mut self, x: Buf, out: Buf) -> Result<(), ExecError> {
        let hidden = self.config.hidden_size;
        let mut selected = self.take(out, self.selected.len() * hidden);
        let rows = self.buf(x);
        for (dst, &r) in selected.chunks_exact_mut(hidden).zip(&self.selected) {
            dst.copy_from_slice(&rows[r * hidden..(r + 1) * hidden]);
        }
        self.put(out, selected);
        Ok(())
    }

    fn vocab_columns(
        &mut self,
        x: Buf,
        lm_head: &CpuMatrix,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let (r, vocab) = (self.selected.len(), self.config.vocab_size);
        let held = vocab_rows.len();
        let mut part = vec![0.0f32; r * held];
        self.matmul_parts(self.buf(x), r, &[lm_head], &mut [&mut part]);
        let mut values = self.take(out, r * vocab);
        values.fill(0.0);
        for (row, scored) in values.chunks_exact_mut(vocab).zip(part.chunks(held)) {
            row[vocab_rows.clone()].copy_from_slice(scored);
        }
        self.put(out, values);
        Ok(())
    }

    fn argmax_shard(
        &mut self,
        logits: Buf,
        vocab_rows: Range<usize>,
        rank: usize,
        ranks: usize,
        pairs: Buf,
    ) -> Result<(), ExecError> {
        let r = self.selected.len();
        let held = vocab_rows.len();
        let mut out = self.take(pairs, r * ranks * 2);
        out.fill(0.0);
        for (row, slots) in self
            .buf(logits)
            .chunks_exact(held)
            .zip(out.chunks_exact_mut(ranks * 2))
        {
            let best = argmax(row) as usize;
            slots[rank * 2] = row[best];
            slots[rank * 2 + 1] = (vocab_rows.start + best) as f32;
        }
        self.put(pairs, out);
        Ok(())
    }

    fn argmax_ranks(&mut self, pairs: Buf, ranks: usize) -> Result<(), ExecError> {
        self.result_ids = self
            .buf(pairs)
            .chunks_exact(ranks * 2)
            .map(|slots| {
                // Ranks hold ascending ids: the first of equal values is the lower id.
                let mut best = 0;
                for k in 1..ranks {
                    if slots[k * 2] > slots[best * 2] {
                        best = k;
                    }
                }
                slots[best * 2 + 1] as u32
            })
            .collect();
        Ok(())
    }

    fn argmax(&mut self, logits: Buf) -> Result<(), ExecError> {
        let vocab = self.config.vocab_size;
        self.result_ids = self.buf(logits).chunks_exact(vocab).map(argmax).collect();
        Ok(())
    }

    fn sample(&mut self, logits: Buf) -> Result<(), ExecError> {
        let vocab = self.config.vocab_size;
        self.result_ids = self
            .buf(logits)
            .chunks_exact(vocab)
            .zip(&self.draws)
            .map(|(row, draw)| sample_row(row, draw))
            .collect();
        Ok(())
    }

    fn finish_step(&mut self) -> Result<StepResult, ExecError> {
        let logits = std::mem::take(&mut self.bufs[Buf::Logits as usize]);
        let width = logits.len() / self.selected.len().max(1);
        let checked = check_finite(&logits, width, || "the final norm and lm_head".into());
        if let Err(e) = checked {
            self.put(Buf::Logits, logits);
            return Err(e);
        }
        Ok(match self.output {
            StepOutput::Logits => StepResult::Logits(Logits {
                rows: self.selected.len(),
                vocab: self.config.vocab_size,
                values: logits,
            }),
            StepOutput::Greedy | StepOutput::Sampled => {
                self.put(Buf::Logits, logits);
                StepResult::Ids(std::mem::take(&mut self.result_ids))
            }
        })
    }
}

/// The model on the CPU: the runner over [`CpuOps`].
pub type CpuRunner = Runner<CpuOps>;
