//! The runner seam: what the decode loop, the serving engine, `model chat`, `model run` and
//! `model logits` drive ([`ModelRunner`]), and the one runner that serves it on any backend
//! ([`Runner`]): sequences and their cache pages, a step over decode rows and prefill chunks,
//! sampling where the logits are (only ids cross back from a device), decode graphs.

use kernels::mla::cache::SeqId;

use super::deepseek;
use super::error::ExecError;
use super::ops::{
    GraphKey, LogitRows, Logits, SeqInput, StepOps, StepOutput, StepResult, StepRows,
};
use super::profile::{OpProfile, Profiled};
use super::sampler::SampleRow;
use super::weights::Weights;
use crate::arch::config::ModelConfig;

/// A model with its latent cache, stepped by the decode loop and the serving engine.
pub trait ModelRunner {
    fn config(&self) -> &ModelConfig;
    /// For logs: the backend and its device.
    fn describe(&self) -> String;
    fn add_sequence(&mut self) -> SeqId;
    /// Returns the sequence's pages.
    fn free_sequence(&mut self, seq: SeqId) -> Result<(), ExecError>;
    /// Makes room in the cache for `tokens` more tokens of `seq` (admission reserves a
    /// request's whole length, so a running sequence never runs out).
    fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), ExecError>;
    fn free_pages(&self) -> usize;
    fn total_pages(&self) -> usize;
    /// Runs `inputs` (appending them to the cache) and draws one token for the last row of
    /// each under `draws[i]`, where the logits are.
    fn step(&mut self, inputs: &[SeqInput<'_>], draws: &[SampleRow])
    -> Result<Vec<u32>, ExecError>;
    /// Runs `inputs` and returns the logits of `rows`.
    fn logits(&mut self, inputs: &[SeqInput<'_>], rows: LogitRows) -> Result<Logits, ExecError>;
    /// Times every operation of the steps from now on.
    fn profile_ops(&mut self);
    /// Where the profiled steps' time went, by operation (after [`profile_ops`](Self::profile_ops)).
    fn op_profile_report(&self) -> Option<String>;
    /// Captures the decode steps of 1 to `max_batch` sequences where the backend replays
    /// graphs, and runs one step, so the first request runs as fast as later ones.
    fn warm_up(&mut self, max_batch: usize) -> Result<(), ExecError>;
}

/// The model's step on one backend: [`deepseek::forward`] over `O`, with the backend's weights.
pub struct Runner<O: StepOps> {
    ops: O,
    weights: Weights<O::Kinds>,
    config: ModelConfig,
    /// Decode steps replay a graph per (rows, output) where the backend captures them.
    graphs: bool,
    /// Every operation timed, when profiling (`model run --profile-ops`).
    profile: Option<OpProfile>,
}

impl<O: StepOps> Runner<O> {
    pub fn new(ops: O, weights: Weights<O::Kinds>, config: ModelConfig) -> Self {
        Self {
            ops,
            weights,
            config,
            graphs: true,
            profile: None,
        }
    }

    pub fn op_profile(&self) -> Option<&OpProfile> {
        self.profile.as_ref()
    }

    /// Whether decode steps replay captured graphs (on by default, where the backend can).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    pub fn ops(&self) -> &O {
        &self.ops
    }

    pub fn ops_mut(&mut self) -> &mut O {
        &mut self.ops
    }

    pub fn weights(&self) -> &Weights<O::Kinds> {
        &self.weights
    }

    pub fn seq_len(&self, seq: SeqId) -> Result<usize, ExecError> {
        Ok(self.ops.pages().seq_len(seq)?)
    }

    /// Runs `inputs` through the model, appending their tokens to the cache: the result of
    /// `output` for `logit_rows` (a sampled step draws under `draws`, one per selected row).
    pub fn run(
        &mut self,
        inputs: &[SeqInput<'_>],
        logit_rows: LogitRows,
        output: StepOutput,
        draws: &[SampleRow],
    ) -> Result<StepResult, ExecError> {
        let c = &self.config;
        let mut rows: Vec<(SeqId, usize)> = Vec::new();
        for input in inputs {
            let start = self.ops.pages().seq_len(input.seq)?;
            for (i, &token) in input.tokens.iter().enumerate() {
                if token as usize >= c.vocab_size {
                    return Err(ExecError::TokenOutOfRange {
                        token,
                        vocab: c.vocab_size,
                    });
                }
                if start + i >= c.max_position_embeddings {
                    return Err(ExecError::ContextTooLong {
                        pos: start + i,
                        max: c.max_position_embeddings,
                    });
                }
                rows.push((input.seq, start + i));
            }
        }
        if rows.is_empty() {
            return Err(ExecError::InvalidRequest("a step without tokens".into()));
        }
        let selected: Vec<usize> = match logit_rows {
            LogitRows::All => (0..rows.len()).collect(),
            LogitRows::Last => inputs
                .iter()
                .scan(0, |end, i| {
                    *end += i.tokens.len();
                    Some(*end - 1)
                })
                .collect(),
        };
        if output == StepOutput::Sampled && draws.len() != selected.len() {
            return Err(ExecError::InvalidRequest(format!(
                "{} draws for {} rows that get a token",
                draws.len(),
                selected.len()
            )));
        }
        for input in inputs {
            self.ops
                .pages_mut()
                .reserve(input.seq, input.tokens.len())?;
        }
        let ids: Vec<u32> = inputs
            .iter()
            .flat_map(|i| i.tokens.iter().copied())
            .collect();
        let decode = inputs.iter().all(|i| i.tokens.len() == 1);
        self.ops.begin_step(&StepRows {
            ids: &ids,
            rows: &rows,
            selected: &selected,
            draws,
            output,
            decode,
        })?;
        let key = GraphKey {
            rows: rows.len(),
            output,
        };
        let weights = &self.weights;
        let graphs = self.graphs && decode;
        let started = std::time::Instant::now();
        let (n, selected_rows) = (rows.len(), selected.len());
        let profile = &mut self.profile;
        if let Some(p) = profile.as_mut() {
            p.begin_step();
        }
        self.ops.run_step(&mut |ops| match profile.as_mut() {
            Some(profile) => {
                let mut profiled = Profiled {
                    inner: ops,
                    profile,
                    rows: n,
                    selected: selected_rows,
                };
                step_body(&mut profiled, weights, key, graphs)
            }
            None => step_body(ops, weights, key, graphs),
        })?;
        if let Some(p) = profile.as_mut() {
            p.end_step(started.elapsed());
        }
        let result = self.ops.finish_step()?;
        for input in inputs {
            self.ops.pages_mut().commit(input.seq, input.tokens.len())?;
        }
        Ok(result)
    }
}

/// A step's operations: the decode graph of `key` replayed, or captured and replayed, or the
/// operations run one by one.
fn step_body<O: StepOps>(
    ops: &mut O,
    weights: &Weights<O::Kinds>,
    key: GraphKey,
    graphs: bool,
) -> Result<(), ExecError> {
    if graphs && ops.replay(key)? {
        return Ok(());
    }
    if graphs && ops.begin_capture(key)? {
        let recorded = deepseek::forward(ops, weights, key.output);
        let ended = ops.end_capture(key);
        recorded?;
        ended?;
        if !ops.replay(key)? {
            return Err(ExecError::Device(
                "a captured decode graph could not be replayed".into(),
            ));
        }
        return Ok(());
    }
    deepseek::forward(ops, weights, key.output)
}

impl<O: StepOps> ModelRunner for Runner<O> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn describe(&self) -> String {
        self.ops.describe()
    }

    fn add_sequence(&mut self) -> SeqId {
        self.ops.pages_mut().add_sequence()
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<(), ExecError> {
        Ok(self.ops.pages_mut().free_sequence(seq)?)
    }

    fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), ExecError> {
        Ok(self.ops.pages_mut().reserve(seq, tokens)?)
    }

    fn free_pages(&self) -> usize {
        self.ops.pages().free_pages()
    }

    fn total_pages(&self) -> usize {
        self.ops.pages().total_pages()
    }

    fn step(
        &mut self,
        inputs: &[SeqInput<'_>],
        draws: &[SampleRow],
    ) -> Result<Vec<u32>, ExecError> {
        // Greedy steps need no draw parameters (on a device: one write fewer).
        let output = if draws.iter().all(|d| d.temperature <= 0.0) {
            StepOutput::Greedy
        } else {
            StepOutput::Sampled
        };
        match self.run(inputs, LogitRows::Last, output, draws)? {
            StepResult::Ids(ids) => Ok(ids),
            StepResult::Logits(_) => unreachable!("a decode step returns ids"),
        }
    }

    fn logits(&mut self, inputs: &[SeqInput<'_>], rows: LogitRows) -> Result<Logits, ExecError> {
        match self.run(inputs, rows, StepOutput::Logits, &[])? {
            StepResult::Logits(logits) => Ok(logits),
            StepResult::Ids(_) => unreachable!("asked for logits"),
        }
    }

    fn profile_ops(&mut self) {
        self.profile = Some(OpProfile::default());
    }

    fn op_profile_report(&self) -> Option<String> {
        self.profile.as_ref().map(OpProfile::report)
    }

    fn warm_up(&mut self, max_batch: usize) -> Result<(), ExecError> {
        // Sequences of one token each, as many as the largest batch, then a decode step of
        // every size with either output: each captures its graph where the backend does.
        let max_batch = max_batch.clamp(1, self.free_pages());
        let seqs: Vec<SeqId> = (0..max_batch).map(|_| self.add_sequence()).collect();
        let result = (|| {
            for &seq in &seqs {
                self.reserve(seq, 2)?;
                self.step(&[SeqInput { seq, tokens: &[0] }], &[SampleRow::default()])?;
            }
            let sampled = SampleRow {
                temperature: 1.0,
                top_p: 1.0,
                ..SampleRow::default()
            };
            for batch in 1..=max_batch {
                for draw in [SampleRow::default(), sampled] {
                    let inputs: Vec<SeqInput<'_>> = seqs[..batch]
                        .iter()
                        .map(|&seq| SeqInput { seq, tokens: &[0] })
                        .collect();
                    self.run(
                        &inputs,
                        LogitRows::Last,
                        if draw.temperature > 0.0 {
                            StepOutput::Sampled
                        } else {
                            StepOutput::Greedy
                        },
                        &vec![draw; batch],
                    )?;
                    // Back to one cached token, so the next size's step fits the same pages.
                    for &seq in &seqs[..batch] {
                        self.truncate(seq, 1)?;
                    }
                }
            }
            Ok(())
        })();
        for seq in seqs {
            self.free_sequence(seq)?;
        }
        result
    }
}

impl<O: StepOps> Runner<O> {
    /// Drops `seq`'s tokens after the first `len` (their cache entries are overwritten by the
    /// next ones).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), ExecError> {
        Ok(self.ops.pages_mut().truncate(seq, len)?)
    }
}
