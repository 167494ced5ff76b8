//! Where a forward step's time goes: a [`Backend`] that times every call of the backend it
//! wraps (`model run --profile-ops`), by operation and shape, and the time a step spends
//! between its calls (norms, RoPE, routing, residuals). Decode and prefill steps are told apart
//! by the rows a step's calls carry, so the table of one phase is not blurred by the other.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};

use crate::exec::cpu::backend::Backend;

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

#[derive(Default)]
struct Recorder {
    ops: BTreeMap<OpKey, OpTotals>,
    /// Steps by the most rows any of their calls carried.
    steps: BTreeMap<usize, StepTotals>,
    step_calls: Duration,
    step_tokens: usize,
}

/// The wrapper: every call goes to `inner`, timed.
pub struct ProfiledBackend<'a> {
    inner: &'a dyn Backend,
    recorder: Mutex<Recorder>,
}

impl<'a> ProfiledBackend<'a> {
    pub fn new(inner: &'a dyn Backend) -> Self {
        Self {
            inner,
            recorder: Mutex::new(Recorder::default()),
        }
    }

    fn timed<R>(
        &self,
        tokens: usize,
        op: impl FnOnce() -> String,
        bytes: usize,
        f: impl FnOnce() -> R,
    ) -> R {
        let start = Instant::now();
        let out = f();
        let time = start.elapsed();
        let mut r = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
        r.step_calls += time;
        r.step_tokens = r.step_tokens.max(tokens);
        let totals = r.ops.entry(OpKey { tokens, op: op() }).or_default();
        totals.calls += 1;
        totals.time += time;
        totals.weight_bytes += bytes as u64;
        out
    }

    /// The recorded totals: by operation, and per step by the step's rows.
    pub fn totals(&self) -> (Vec<(OpKey, OpTotals)>, Vec<StepTotals>) {
        let r = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
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

fn matrix_label(w: &MatrixView<'_>) -> String {
    let dtype = match w {
        MatrixView::Bf16 { .. } => "bf16",
        MatrixView::Nvfp4(_) => "nvfp4",
    };
    format!("{dtype} {}x{}", w.rows(), w.cols())
}

impl Backend for ProfiledBackend<'_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        self.timed(
            tokens,
            || format!("matmul {}", matrix_label(&w)),
            w.bytes(),
            || self.inner.matmul(x, tokens, w, out),
        )
    }

    fn matmul_per_head(&self, x: &[f32], tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        let bytes = w.iter().map(MatrixView::bytes).sum();
        let label = || match w.first() {
            Some(first) => format!("per-head {} x {}", w.len(), matrix_label(first)),
            None => "per-head (none)".to_string(),
        };
        self.timed(tokens, label, bytes, || {
            self.inner.matmul_per_head(x, tokens, w, out)
        })
    }

    fn matmul_many(
        &self,
        x: &[f32],
        tokens: usize,
        ws: &[MatrixView<'_>],
        outs: &mut [&mut [f32]],
    ) {
        let bytes = ws.iter().map(MatrixView::bytes).sum();
        let label = || {
            let parts: Vec<String> = ws.iter().map(matrix_label).collect();
            format!("many {}", parts.join(" + "))
        };
        self.timed(tokens, label, bytes, || {
            self.inner.matmul_many(x, tokens, ws, outs)
        })
    }

    fn moe(
        &self,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        amax: Option<&mut ExpertInputAmax>,
    ) {
        let mut used: Vec<u32> = routing.experts.clone();
        used.sort_unstable();
        used.dedup();
        let bytes = used
            .iter()
            .filter_map(|&e| experts.get(e as usize))
            .map(|e| e.gate.bytes() + e.up.bytes() + e.down.bytes())
            .sum();
        let label = || match experts.first() {
            Some(e) => format!("moe top-{} {}", routing.top_k, matrix_label(&e.gate)),
            None => "moe (no experts)".to_string(),
        };
        self.timed(routing.tokens(), label, bytes, || {
            self.inner.moe(x, hidden, routing, experts, out, amax)
        })
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        let label = || format!("mla attention {} heads", problem.heads);
        self.timed(problem.queries.len(), label, 0, || {
            self.inner.mla_attention(cache, problem, out, lse)
        })
    }

    fn run_step(&self, step: &mut (dyn FnMut() + Send)) {
        {
            let mut r = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
            r.step_calls = Duration::ZERO;
            r.step_tokens = 0;
        }
        let start = Instant::now();
        self.inner.run_step(step);
        let all = start.elapsed();
        let mut r = self.recorder.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, calls) = (r.step_tokens, r.step_calls);
        let entry = r.steps.entry(tokens).or_insert(StepTotals {
            tokens,
            ..StepTotals::default()
        });
        entry.steps += 1;
        entry.time += all;
        entry.in_calls += calls;
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), String> {
        self.timed(
            0,
            || "all-reduce".to_string(),
            0,
            || self.inner.all_reduce_sum(data),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::cpu::backend::CpuBackend;

    #[test]
    fn calls_are_counted_by_shape_and_rows_with_the_bytes_they_read() {
        let (rows, cols) = (8, 32);
        let w: Vec<half::bf16> = (0..rows * cols)
            .map(|i| half::bf16::from_f32(i as f32 * 0.01))
            .collect();
        let view = MatrixView::Bf16 {
            rows,
            cols,
            data: &w,
        };
        let cpu = CpuBackend;
        let profiled = ProfiledBackend::new(&cpu);
        let (x1, x3) = (vec![1.0f32; cols], vec![0.5f32; 3 * cols]);
        let (mut want, mut got) = (vec![0.0f32; rows], vec![0.0f32; rows]);
        cpu.matmul(&x1, 1, view, &mut want);
        for _ in 0..2 {
            profiled.run_step(&mut || profiled.matmul(&x1, 1, view, &mut got));
        }
        let mut out3 = vec![0.0f32; 3 * rows];
        profiled.run_step(&mut || profiled.matmul(&x3, 3, view, &mut out3));
        assert_eq!(got, want, "the wrapped backend computes the product");

        let (ops, steps) = profiled.totals();
        let label = format!("matmul bf16 {rows}x{cols}");
        let one = ops.iter().find(|(k, _)| k.tokens == 1).expect("decode row");
        assert_eq!((one.0.op.as_str(), one.1.calls), (label.as_str(), 2));
        assert_eq!(one.1.weight_bytes, 2 * (rows * cols * 2) as u64);
        let three = ops
            .iter()
            .find(|(k, _)| k.tokens == 3)
            .expect("prefill row");
        assert_eq!(three.1.calls, 1);
        assert_eq!(
            steps
                .iter()
                .map(|s| (s.tokens, s.steps))
                .collect::<Vec<_>>(),
            [(1, 2), (3, 1)]
        );
        for s in &steps {
            assert!(s.in_calls <= s.time, "calls outside their step: {s:?}");
        }
        let report = profiled.report();
        for part in [
            "2 steps of 1 row(s)",
            "1 steps of 3 row(s)",
            &label,
            "(between the calls)",
        ] {
            assert!(report.contains(part), "no {part:?} in:\n{report}");
        }
    }
}
