//! Where a forward step's time goes: [`Profiled`] wraps any backend's [`StepOps`] and times
//! every operation (`model run --profile-ops`), by operation and shape, with the weight bytes
//! it read, and the time a step spends outside them. Decode and prefill steps are told apart by
//! their rows, so the table of one phase is not blurred by the other. On a device an operation
//! is timed as issued (launches return before the kernels end) unless the device runs them as
//! they come, as the host execution layer does.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;
use std::time::{Duration, Instant};

use kernels::mla::cache::PageTables;

use super::error::ExecError;
use super::ops::{Buf, GraphKey, Measured, StepOps, StepResult, StepRows, Sublayer, WeightKinds};

/// One row of the profile: an operation at one shape, at one number of rows per call.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct OpKey {
    /// Rows (tokens) the calls carry: the batch in decode, the prompt in prefill.
    pub tokens: usize,
    pub op: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpTotals {
    pub calls: u64,
    pub time: Duration,
    /// Weight bytes the calls read (0 for attention, which reads the cache).
    pub weight_bytes: u64,
}

/// The steps whose calls carried at most `tokens` rows (and some carried that many).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTotals {
    pub tokens: usize,
    pub steps: u64,
    /// The steps' whole time.
    pub time: Duration,
    /// The part of it inside backend calls.
    pub in_calls: Duration,
}

/// The recorded times of a run's steps.
#[derive(Debug, Default)]
pub struct OpProfile {
    ops: BTreeMap<OpKey, OpTotals>,
    /// Steps by the most rows any of their calls carried.
    steps: BTreeMap<usize, StepTotals>,
    step_calls: Duration,
    step_tokens: usize,
}

/// A step's operations on `inner`, each timed into `profile`: what the runner runs the step on
/// while profiling (inside the backend's [`StepOps::run_step`]).
pub struct Profiled<'a, O: StepOps> {
    pub inner: &'a mut O,
    pub profile: &'a mut OpProfile,
    pub rows: usize,
    pub selected: usize,
}

impl<O: StepOps> Profiled<'_, O> {
    fn timed<R>(
        &mut self,
        tokens: usize,
        op: impl FnOnce() -> String,
        bytes: u64,
        f: impl FnOnce(&mut O) -> R,
    ) -> R {
        let start = Instant::now();
        let out = f(self.inner);
        let time = start.elapsed();
        let r = &mut *self.profile;
        r.step_calls += time;
        r.step_tokens = r.step_tokens.max(tokens);
        let totals = r.ops.entry(OpKey { tokens, op: op() }).or_default();
        totals.calls += 1;
        totals.time += time;
        totals.weight_bytes += bytes;
        out
    }
}

impl OpProfile {
    /// Starts a step's record.
    pub fn begin_step(&mut self) {
        self.step_calls = Duration::ZERO;
        self.step_tokens = 0;
    }

    /// Ends a step that took `all`.
    pub fn end_step(&mut self, all: Duration) {
        let (tokens, calls) = (self.step_tokens, self.step_calls);
        let entry = self.steps.entry(tokens).or_insert(StepTotals {
            tokens,
            ..StepTotals::default()
        });
        entry.steps += 1;
        entry.time += all;
        entry.in_calls += calls;
    }

    /// The recorded totals: by operation, and per step by the step's rows.
    pub fn totals(&self) -> (Vec<(OpKey, OpTotals)>, Vec<StepTotals>) {
        let r = self;
        (
            r.ops.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            r.steps.values().copied().collect(),
        )
    }

    /// The profile as tables, one per rows-per-step (decode first: fewest rows), each op's time
    /// per step, its share, and the rate at which it read its weights.
    pub fn report(&self) -> String {
        let (ops, steps) = self.totals();
        let mut text = String::new();
        for StepTotals {
            tokens,
            steps: count,
            time: all,
            in_calls: calls,
        } in steps
        {
            if count == 0 {
                continue;
            }
            let per_step = |d: Duration| d.as_secs_f64() * 1e3 / count as f64;
            let _ = writeln!(
                text,
                "{count} steps of {tokens} row(s): {:.3} ms per step, {:.3} ms of it in backend calls",
                per_step(all),
                per_step(calls)
            );
            let _ = writeln!(
                text,
                "  {:<50} {:>9} {:>10} {:>9} {:>7} {:>9} {:>7}",
                "operation", "calls/st", "µs/call", "ms/step", "share", "MB/step", "GB/s"
            );
            let mut rows: Vec<_> = ops.iter().filter(|(k, _)| k.tokens == tokens).collect();
            rows.sort_by_key(|(_, t)| std::cmp::Reverse(t.time));
            let mut bytes_all = 0u64;
            for (key, t) in rows {
                bytes_all += t.weight_bytes;
                let secs = t.time.as_secs_f64();
                let rate = if t.weight_bytes > 0 && secs > 0.0 {
                    format!("{:.1}", t.weight_bytes as f64 / secs / 1e9)
                } else {
                    "-".to_string()
                };
                let _ = writeln!(
                    text,
                    "  {:<50} {:>9.1} {:>10.1} {:>9.3} {:>6.1}% {:>9.2} {:>7}",
                    key.op,
                    t.calls as f64 / count as f64,
                    secs * 1e6 / t.calls.max(1) as f64,
                    per_step(t.time),
                    100.0 * t.time.as_secs_f64() / all.as_secs_f64().max(1e-12),
                    t.weight_bytes as f64 / count as f64 / 1e6,
                    rate
                );
            }
            let outside = all.saturating_sub(calls);
            let _ = writeln!(
                text,
                "  {:<50} {:>9} {:>10} {:>9.3} {:>6.1}% {:>9} {:>7}",
                "(between the calls)",
                "",
                "",
                per_step(outside),
                100.0 * outside.as_secs_f64() / all.as_secs_f64().max(1e-12),
                "",
                ""
            );
            let _ = writeln!(
                text,
                "  weights read: {:.2} MB per step, {:.1} GB/s over the whole step",
                bytes_all as f64 / count as f64 / 1e6,
                bytes_all as f64 / all.as_secs_f64().max(1e-12) / 1e9
            );
        }
        text
    }
}

type Matrix<O> = <<O as StepOps>::Kinds as WeightKinds>::Matrix;
type Heads<O> = <<O as StepOps>::Kinds as WeightKinds>::Heads;
type Vector<O> = <<O as StepOps>::Kinds as WeightKinds>::Vector;
type Experts<O> = <<O as StepOps>::Kinds as WeightKinds>::Experts;

impl<O: StepOps> StepOps for Profiled<'_, O> {
    type Kinds = O::Kinds;

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn pages(&self) -> &PageTables {
        self.inner.pages()
    }

    fn pages_mut(&mut self) -> &mut PageTables {
        self.inner.pages_mut()
    }

    fn begin_step(&mut self, step: &StepRows<'_>) -> Result<(), ExecError> {
        self.inner.begin_step(step)
    }

    fn run_step(
        &mut self,
        body: &mut (dyn FnMut(&mut Self) -> Result<(), ExecError> + Send),
    ) -> Result<(), ExecError> {
        // Already inside the backend's step (the runner wraps it there).
        body(self)
    }

    fn replay(&mut self, key: GraphKey) -> Result<bool, ExecError> {
        let rows = self.rows;
        self.timed(rows, || "graph replay".into(), 0, |o| o.replay(key))
    }

    fn begin_capture(&mut self, key: GraphKey) -> Result<bool, ExecError> {
        self.inner.begin_capture(key)
    }

    fn end_capture(&mut self, key: GraphKey) -> Result<(), ExecError> {
        self.inner.end_capture(key)
    }

    fn embed(
        &mut self,
        table: &Matrix<O>,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(
            rows,
            || "embed".into(),
            0,
            |o| o.embed(table, vocab_rows, out),
        )
    }

    fn add_rms_norm(
        &mut self,
        residual: Buf,
        delta: Option<Buf>,
        weight: &Vector<O>,
        out: Buf,
        added: Sublayer,
    ) -> Result<(), ExecError> {
        let rows = self.rows;
        let label = || format!("add + rms_norm into {out:?}");
        self.timed(rows, label, 0, |o| {
            o.add_rms_norm(residual, delta, weight, out, added)
        })
    }

    fn rms_norm(&mut self, x: Buf, weight: &Vector<O>, out: Buf) -> Result<(), ExecError> {
        let rows = self.rows;
        let label = || format!("rms_norm {x:?}");
        self.timed(rows, label, 0, |o| o.rms_norm(x, weight, out))
    }

    fn products(&mut self, x: Buf, outs: &[(&Matrix<O>, Buf)]) -> Result<(), ExecError> {
        let tokens = if x == Buf::Selected {
            self.selected
        } else {
            self.rows
        };
        let bytes = outs.iter().map(|(w, _)| w.bytes()).sum();
        let label = || {
            let parts: Vec<String> = outs.iter().map(|(w, _)| w.label()).collect();
            if parts.len() == 1 {
                format!("matmul {}", parts[0])
            } else {
                format!("many {}", parts.join(" + "))
            }
        };
        self.timed(tokens, label, bytes, |o| o.products(x, outs))
    }

    fn product_add(&mut self, x: Buf, w: &Matrix<O>, out: Buf) -> Result<(), ExecError> {
        let rows = self.rows;
        let label = || format!("matmul-add {}", w.label());
        self.timed(rows, label, w.bytes(), |o| o.product_add(x, w, out))
    }

    fn rope(&mut self, buf: Buf) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(rows, || format!("rope {buf:?}"), 0, |o| o.rope(buf))
    }

    fn append_cache(
        &mut self,
        layer: usize,
        latent: Buf,
        key_rope: Buf,
        norm: &Vector<O>,
    ) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(
            rows,
            || "cache append".into(),
            0,
            |o| o.append_cache(layer, latent, key_rope, norm),
        )
    }

    fn absorb_query(
        &mut self,
        query: Buf,
        w_uk_t: &Heads<O>,
        absorbed: Buf,
        rope: Buf,
    ) -> Result<(), ExecError> {
        let rows = self.rows;
        let label = || format!("absorb per-head {}", w_uk_t.label());
        self.timed(rows, label, w_uk_t.bytes(), |o| {
            o.absorb_query(query, w_uk_t, absorbed, rope)
        })
    }

    fn attention(
        &mut self,
        layer: usize,
        absorbed: Buf,
        rope: Buf,
        out: Buf,
    ) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(
            rows,
            || "mla attention".into(),
            0,
            |o| o.attention(layer, absorbed, rope, out),
        )
    }

    fn unabsorb(&mut self, latent: Buf, w_uv: &Heads<O>, out: Buf) -> Result<(), ExecError> {
        let rows = self.rows;
        let label = || format!("unabsorb per-head {}", w_uv.label());
        self.timed(rows, label, w_uv.bytes(), |o| o.unabsorb(latent, w_uv, out))
    }

    fn silu_mul(&mut self, gate_up: Buf, out: Buf) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(rows, || "silu_mul".into(), 0, |o| o.silu_mul(gate_up, out))
    }

    fn route(&mut self, layer: usize, logits: Buf, bias: &Vector<O>) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(rows, || "route".into(), 0, |o| o.route(layer, logits, bias))
    }

    fn routed_experts(
        &mut self,
        layer: usize,
        x: Buf,
        experts: &Experts<O>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let rows = self.rows;
        // The experts the routing chose, each read once, where the backend knows them.
        let bytes = self.inner.routed_experts_used().map_or(0, |used| {
            experts.bytes() / experts.count().max(1) as u64 * used as u64
        });
        let label = || format!("moe {}", experts.label());
        self.timed(rows, label, bytes, |o| {
            o.routed_experts(layer, x, experts, out)
        })
    }

    fn routed_experts_used(&self) -> Option<usize> {
        self.inner.routed_experts_used()
    }

    fn all_reduce(&mut self, buf: Buf) -> Result<(), ExecError> {
        let rows = self.rows;
        self.timed(
            rows,
            || format!("all-reduce {buf:?}"),
            0,
            |o| o.all_reduce(buf),
        )
    }

    fn select_rows(&mut self, x: Buf, out: Buf) -> Result<(), ExecError> {
        let selected = self.selected;
        self.timed(
            selected,
            || "select rows".into(),
            0,
            |o| o.select_rows(x, out),
        )
    }

    fn vocab_columns(
        &mut self,
        x: Buf,
        lm_head: &Matrix<O>,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let selected = self.selected;
        let label = || format!("lm_head columns {}", lm_head.label());
        self.timed(selected, label, lm_head.bytes(), |o| {
            o.vocab_columns(x, lm_head, vocab_rows, out)
        })
    }

    fn argmax_shard(
        &mut self,
        logits: Buf,
        vocab_rows: Range<usize>,
        rank: usize,
        ranks: usize,
        pairs: Buf,
    ) -> Result<(), ExecError> {
        let selected = self.selected;
        self.timed(
            selected,
            || "argmax of the shard".into(),
            0,
            |o| o.argmax_shard(logits, vocab_rows, rank, ranks, pairs),
        )
    }

    fn argmax_ranks(&mut self, pairs: Buf, ranks: usize) -> Result<(), ExecError> {
        let selected = self.selected;
        self.timed(
            selected,
            || "argmax of the ranks".into(),
            0,
            |o| o.argmax_ranks(pairs, ranks),
        )
    }

    fn argmax(&mut self, logits: Buf) -> Result<(), ExecError> {
        let selected = self.selected;
        self.timed(selected, || "argmax".into(), 0, |o| o.argmax(logits))
    }

    fn sample(&mut self, logits: Buf) -> Result<(), ExecError> {
        let selected = self.selected;
        self.timed(selected, || "sample".into(), 0, |o| o.sample(logits))
    }

    fn finish_step(&mut self) -> Result<StepResult, ExecError> {
        self.inner.finish_step()
    }
}
