//! The operations of a step on the device: each a fixed set of launches on the workspace's
//! buffers, decided on the host from the step's shape alone (see [`crate::exec::device`]).

use std::ops::Range;

use kernels::blas::DenseTactic;
use kernels::device::{Device, DeviceMemory};
use kernels::layers::{DenseOutput, HeadRows, OutputType, RopeSlices};
use kernels::mla::cache::PageTables;
use kernels::mla::launch::DecodeIo;
use kernels::moe_gemm::launch::{
    MoeDeviceGrouping, MoeDeviceIo, MoeDeviceWeights, MoeGroupingBounds,
};

use super::{DeviceOps, StepShape, buffer};
use crate::exec::device::support::unsupported;
use crate::exec::device::weights::{DeviceHeads, DeviceKinds, DeviceMatrix};
use crate::exec::device::workspace::{Workspace, WorkspaceShape};
use crate::exec::error::ExecError;
use crate::exec::ops::{Buf, GraphKey, StepOps, StepResult, StepRows, Sublayer};

impl<D: Device> StepOps for DeviceOps<D> {
    type Kinds = DeviceKinds<D>;

    fn describe(&self) -> String {
        self.dev.describe()
    }

    fn pages(&self) -> &PageTables {
        &self.pages
    }

    fn pages_mut(&mut self) -> &mut PageTables {
        &mut self.pages
    }

    fn begin_step(&mut self, step: &StepRows<'_>) -> Result<(), ExecError> {
        let n = step.rows.len();
        if self.ranks > 1 && self.all_reduce.is_none() {
            return Err(unsupported(format!(
                "a rank of {} holds a shard of the model: a step needs the group's all-reduce \
                 (set_all_reduce)",
                self.ranks
            )));
        }
        let selected = step.selected.len();
        if n > self.ws.rows || selected > self.ws.logit_capacity {
            // Graphs name the old buffers.
            self.graphs.clear();
            self.ws = Workspace::new(
                &self.dev,
                &self.config,
                WorkspaceShape {
                    rows: n.max(self.ws.rows),
                    heads: self.heads,
                    max_pages: self.ws.max_pages,
                    max_splits: self.ws.max_splits,
                    logit_rows: selected.max(self.ws.logit_capacity),
                    ranks: self.ranks,
                    vendor_dense: self.tactics.dense == DenseTactic::CublasLt,
                },
            )?;
        }
        self.write_step_inputs(step)?;
        let longest = step.rows.iter().map(|&(_, pos)| pos + 1).max().unwrap_or(1);
        let (mla, moe, tuned_splits) = self.select(step.selected.len().max(1), n, longest)?;
        // A decode step's launches depend on its batch size alone (the split count is planned
        // for the cache's capacity, not the current lengths), so one graph serves every step
        // of that size and selection.
        let context = if step.decode {
            self.pages.total_slots()
        } else {
            longest
        };
        let tactic = &self.kernels.mla[mla].tactic;
        let splits = if n > self.ws.split_rows {
            1
        } else if let Some(tuned) = tuned_splits {
            tuned.clamp(1, tactic.max_splits)
        } else {
            tactic.plan_splits(
                n,
                self.heads,
                context,
                self.dev.sm()?.reference_gpu().sms as usize,
            )
        };
        self.step = StepShape {
            rows: n,
            selected,
            every_row: selected == n && step.selected.iter().enumerate().all(|(i, &s)| s == i),
            splits,
            output: step.output,
            cached_tokens: step.rows.iter().map(|&(_, pos)| pos + 1).sum(),
            mla,
            moe,
        };
        Ok(())
    }

    fn run_step(
        &mut self,
        body: &mut (dyn FnMut(&mut Self) -> Result<(), ExecError> + Send),
    ) -> Result<(), ExecError> {
        body(self)
    }

    fn replay(&mut self, key: GraphKey) -> Result<bool, ExecError> {
        match self.graphs.get(&(key, self.step.mla, self.step.moe)) {
            Some(graph) => {
                self.dev.replay(graph)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn begin_capture(&mut self, _: GraphKey) -> Result<bool, ExecError> {
        self.dev.begin_capture()?;
        Ok(true)
    }

    fn end_capture(&mut self, key: GraphKey) -> Result<(), ExecError> {
        let graph = self.dev.end_capture()?;
        self.graphs
            .insert((key, self.step.mla, self.step.moe), graph);
        Ok(())
    }

    fn embed(
        &mut self,
        table: &DeviceMatrix<D>,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let c = &self.config;
        self.dev.fill(&mut self.ws.bad_id, 0xFF)?;
        self.layers.embed_gather(
            &self.dev,
            &self.ws.ids,
            self.step.rows,
            &table.memory,
            vocab_rows,
            c.vocab_size,
            c.hidden_size,
            self.mem(out),
            &self.ws.bad_id,
        )?;
        Ok(())
    }

    fn add_rms_norm(
        &mut self,
        residual: Buf,
        delta: Option<Buf>,
        weight: &D::Memory,
        out: Buf,
        _: Sublayer,
    ) -> Result<(), ExecError> {
        self.layers.add_rms_norm(
            &self.dev,
            self.mem(residual),
            delta.map(|d| self.mem(d)),
            weight,
            self.eps,
            self.step.rows,
            self.config.hidden_size,
            self.mem(out),
        )?;
        Ok(())
    }

    fn rms_norm(&mut self, x: Buf, weight: &D::Memory, out: Buf) -> Result<(), ExecError> {
        // The weight is BF16, one value per element of a row.
        self.layers.add_rms_norm(
            &self.dev,
            self.mem(x),
            None,
            weight,
            self.eps,
            self.step.rows,
            weight.len() / 2,
            self.mem(out),
        )?;
        Ok(())
    }

    fn products(&mut self, x: Buf, outs: &[(&DeviceMatrix<D>, Buf)]) -> Result<(), ExecError> {
        let tokens = self.rows_of(x);
        for (w, out) in outs {
            if *out == Buf::GateUp {
                self.gate_up_width = w.rows;
            }
            self.dense().product(
                &self.dev,
                self.mem(x),
                tokens,
                &w.memory,
                w.cols,
                w.rows,
                self.mem(*out),
                false,
            )?;
        }
        Ok(())
    }

    fn product_add(&mut self, x: Buf, w: &DeviceMatrix<D>, out: Buf) -> Result<(), ExecError> {
        self.dense().product(
            &self.dev,
            self.mem(x),
            self.step.rows,
            &w.memory,
            w.cols,
            w.rows,
            self.mem(out),
            true,
        )?;
        Ok(())
    }

    fn rope(&mut self, buf: Buf) -> Result<(), ExecError> {
        let c = &self.config;
        let (nope, rope) = (c.qk_nope_head_dim, c.qk_rope_head_dim);
        let qk = nope + rope;
        let (row_stride, slices) = match buf {
            Buf::Query => (
                self.heads * qk,
                RopeSlices {
                    offset: nope,
                    stride: qk,
                    count: self.heads,
                    pairs: rope / 2,
                },
            ),
            Buf::KeyRope => (
                rope,
                RopeSlices {
                    offset: 0,
                    stride: rope,
                    count: 1,
                    pairs: rope / 2,
                },
            ),
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "RoPE of {other:?}: only the queries and the RoPE key rotate"
                )));
            }
        };
        self.layers.rope_interleaved(
            &self.dev,
            self.mem(buf),
            self.step.rows,
            row_stride,
            slices,
            &self.ws.positions,
            &self.rope_inv_freq,
            self.attention_factor,
        )?;
        Ok(())
    }

    fn append_cache(
        &mut self,
        layer: usize,
        latent: Buf,
        key_rope: Buf,
        norm: &D::Memory,
    ) -> Result<(), ExecError> {
        self.kernels.mla[self.step.mla].append_io(
            &self.dev,
            &mut self.caches[layer],
            buffer(&self.ws, self.step.every_row, latent),
            buffer(&self.ws, self.step.every_row, key_rope),
            norm,
            self.eps,
            &self.ws.slots,
            self.step.rows,
            0.0,
        )?;
        Ok(())
    }

    fn absorb_query(
        &mut self,
        query: Buf,
        w_uk_t: &DeviceHeads<D>,
        absorbed: Buf,
        rope: Buf,
    ) -> Result<(), ExecError> {
        let c = &self.config;
        let (heads, n) = (self.heads, self.step.rows);
        let (nope, latent, rope_dim) = (c.qk_nope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim);
        let qk = nope + rope_dim;
        // q_abs[t, h] = q_nope[t, h] · W_UK[h], with W_UK[h]ᵀ ([L, P]) as the product's matrix.
        self.layers.dense_heads(
            &self.dev,
            self.mem(query),
            HeadRows {
                offset: 0,
                row_stride: heads * qk,
                head_stride: qk,
            },
            n,
            heads,
            &w_uk_t.memory,
            w_uk_t.offset,
            w_uk_t.stride,
            w_uk_t.cols,
            w_uk_t.rows,
            self.mem(absorbed),
            HeadRows {
                offset: 0,
                row_stride: heads * latent,
                head_stride: latent,
            },
            OutputType::Bf16,
        )?;
        self.layers.to_bf16_strided(
            &self.dev,
            self.mem(query),
            n,
            heads * qk,
            nope,
            qk,
            heads,
            rope_dim,
            self.mem(rope),
        )?;
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        absorbed: Buf,
        rope: Buf,
        out: Buf,
    ) -> Result<(), ExecError> {
        let ws = &self.ws;
        let n = self.step.rows;
        let io = DecodeIo {
            rows: n,
            heads: self.heads,
            max_pages: ws.max_pages,
            max_splits: if n > ws.split_rows { 1 } else { ws.max_splits },
            q_abs: self.mem(absorbed),
            q_pe: self.mem(rope),
            block_table: &ws.block_table,
            seq_lens: &ws.seq_lens,
            out: self.mem(out),
            lse: &ws.lse,
            part_out: &ws.part_out,
            part_lse: &ws.part_lse,
            cached_tokens: self.step.cached_tokens,
        };
        self.kernels.mla[self.step.mla].decode_io(
            &self.dev,
            &self.caches[layer],
            &io,
            self.step.splits,
            self.softmax_scale,
        )?;
        Ok(())
    }

    fn unabsorb(&mut self, latent: Buf, w_uv: &DeviceHeads<D>, out: Buf) -> Result<(), ExecError> {
        let c = &self.config;
        let (heads, l, v_dim) = (self.heads, c.kv_lora_rank, c.v_head_dim);
        // o[t, h] = o_latent[t, h] · W_UV[h]ᵀ, W_UV[h] = kv_b's rows h·(P+V)+P .. (h+1)·(P+V).
        self.layers.dense_heads(
            &self.dev,
            self.mem(latent),
            HeadRows {
                offset: 0,
                row_stride: heads * l,
                head_stride: l,
            },
            self.step.rows,
            heads,
            &w_uv.memory,
            w_uv.offset,
            w_uv.stride,
            w_uv.cols,
            w_uv.rows,
            self.mem(out),
            HeadRows {
                offset: 0,
                row_stride: heads * v_dim,
                head_stride: v_dim,
            },
            OutputType::F32,
        )?;
        Ok(())
    }

    fn silu_mul(&mut self, gate_up: Buf, out: Buf) -> Result<(), ExecError> {
        self.layers.silu_mul(
            &self.dev,
            self.mem(gate_up),
            self.step.rows,
            self.gate_up_width / 2,
            self.mem(out),
        )?;
        Ok(())
    }

    fn route(&mut self, _layer: usize, logits: Buf, bias: &D::Memory) -> Result<(), ExecError> {
        let router = self.router.as_ref().expect("MoE layers have a router");
        let (n, ws) = (self.step.rows, &self.ws);
        self.layers.route(
            &self.dev,
            router,
            self.mem(logits),
            bias,
            n,
            &ws.route_ids,
            &ws.route_weights,
        )?;
        self.layers.group_by_expert(
            &self.dev,
            &ws.route_ids,
            &ws.route_weights,
            n,
            router.top_k,
            router.experts,
            &ws.expert_offsets,
            &ws.sorted_token_ids,
            &ws.sorted_weights,
            &ws.active_experts,
        )?;
        Ok(())
    }

    fn routed_experts(
        &mut self,
        _layer: usize,
        x: Buf,
        experts: &MoeDeviceWeights<D>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let router = self.router.as_ref().expect("MoE layers have a router");
        let moe = &self.kernels.moe[self.step.moe.expect("MoE layers have MoE kernels")];
        let (n, hidden) = (self.step.rows, self.config.hidden_size);
        self.layers.to_bf16_strided(
            &self.dev,
            self.mem(x),
            n,
            hidden,
            0,
            0,
            1,
            hidden,
            &self.ws.x_bf16,
        )?;
        let bytes = n * hidden * 4;
        match out {
            Buf::Delta => self.dev.fill_prefix(&mut self.ws.delta, bytes, 0)?,
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "the routed experts write the layer's delta, not {other:?}"
                )));
            }
        }
        let ws = &self.ws;
        moe.run_device_grouped(
            &self.dev,
            experts,
            &MoeDeviceGrouping {
                tokens: n,
                top_k: router.top_k,
                experts: router.experts,
                bounds: MoeGroupingBounds::for_tokens(n, router.top_k, router.experts),
                expert_offsets: &ws.expert_offsets,
                active_experts: &ws.active_experts,
                sorted_token_ids: &ws.sorted_token_ids,
                sorted_weights: &ws.sorted_weights,
            },
            &MoeDeviceIo {
                x: &ws.x_bf16,
                h_q: &ws.h_q,
                h_sf: &ws.h_sf,
                out: &ws.delta,
            },
        )?;
        Ok(())
    }

    fn all_reduce(&mut self, buf: Buf) -> Result<(), ExecError> {
        let total = self.elements(buf);
        let Some(ar) = self.all_reduce.as_deref_mut() else {
            return Ok(());
        };
        let memory = match buf {
            Buf::Residual => &self.ws.x,
            Buf::Delta => &self.ws.delta,
            Buf::Logits => &self.ws.logits,
            Buf::ArgmaxPairs => &self.ws.argmax_pairs,
            other => unreachable!("the step does not sum {other:?} over ranks"),
        };
        // In slot-sized pieces (a prompt's logits outgrow the segment's slot), each a multiple of
        // the kernel's 4-value vectors.
        let piece = (ar.capacity_elements() / 4 * 4).max(4);
        for start in (0..total).step_by(piece) {
            ar.sum_f32(&self.dev, memory, start..(start + piece).min(total))?;
        }
        Ok(())
    }

    fn select_rows(&mut self, x: Buf, out: Buf) -> Result<(), ExecError> {
        if self.step.every_row {
            return Ok(());
        }
        self.layers.gather_rows(
            &self.dev,
            self.mem(x),
            self.step.rows,
            &self.ws.logit_rows,
            self.step.selected,
            self.config.hidden_size,
            self.mem(out),
        )?;
        Ok(())
    }

    fn vocab_columns(
        &mut self,
        x: Buf,
        lm_head: &DeviceMatrix<D>,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let (r, vocab) = (self.step.selected, self.config.vocab_size);
        match out {
            Buf::Logits => self
                .dev
                .fill_prefix(&mut self.ws.logits, r * vocab * 4, 0)?,
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "vocabulary columns go into the logits, not {other:?}"
                )));
            }
        }
        self.dense().product_into(
            &self.dev,
            self.mem(x),
            r,
            &lm_head.memory,
            lm_head.cols,
            vocab_rows.len(),
            self.mem(out),
            DenseOutput {
                offset: vocab_rows.start,
                row_stride: vocab,
            },
            false,
        )?;
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
        self.layers.argmax_shard(
            &self.dev,
            self.mem(logits),
            self.step.selected,
            vocab_rows.len(),
            vocab_rows.len(),
            vocab_rows.start,
            ranks,
            rank,
            self.mem(pairs),
        )?;
        Ok(())
    }

    fn argmax_ranks(&mut self, pairs: Buf, ranks: usize) -> Result<(), ExecError> {
        self.layers.argmax_ranks(
            &self.dev,
            self.mem(pairs),
            self.step.selected,
            ranks,
            &self.ws.sampled,
        )?;
        Ok(())
    }

    fn argmax(&mut self, logits: Buf) -> Result<(), ExecError> {
        self.layers.argmax_rows(
            &self.dev,
            self.mem(logits),
            self.step.selected,
            self.config.vocab_size,
            &self.ws.sampled,
        )?;
        Ok(())
    }

    fn sample(&mut self, logits: Buf) -> Result<(), ExecError> {
        self.layers.sample_rows(
            &self.dev,
            self.mem(logits),
            self.step.selected,
            self.config.vocab_size,
            &self.ws.sample_params,
            &self.ws.sampled,
        )?;
        Ok(())
    }

    fn finish_step(&mut self) -> Result<StepResult, ExecError> {
        let result = self.read_result()?;
        if let Some(all_reduce) = self.all_reduce.as_mut() {
            all_reduce.check(&self.dev)?;
        }
        Ok(result)
    }
}
