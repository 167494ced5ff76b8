//! Continuous batching over the model's forward pass, on one engine thread.
//!
//! Between steps, finished and cancelled sequences leave the batch and waiting requests join
//! it. Each step is one forward pass over every running sequence's next token plus chunks of
//! the prompts still being prefilled, within a token budget, so a long prompt is prefilled in
//! pieces and never stalls the running streams for long. A request is admitted only when the
//! latent cache has pages for its whole length (prompt + `max_new_tokens`), reserved at
//! admission, so a running sequence never runs out of cache. Requests whose receiver is gone
//! (the client disconnected, or the server stopped reading) are freed before the next step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use kernels::mla::cache::{PAGE_TOKENS, SeqId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc::UnboundedSender;

use crate::exec::ops::SeqInput;
use crate::exec::runner::ModelRunner;
use crate::exec::sampler::{Sampler, SamplingParams};

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + generated tokens).
    pub max_model_len: usize,
    /// Tokens in one forward pass at most (decode tokens plus prefill chunks).
    pub max_batched_tokens: usize,
    /// Requests waiting for admission at most; more are refused (HTTP 429).
    pub max_waiting: usize,
    /// Warm the runner up before the first request (decode graphs captured, one step run):
    /// the first request then runs as fast as the hundredth.
    pub warm_up: bool,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

/// What the engine sends back for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenEvent {
    Token(u32),
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_ids: Vec<u32>,
    pub events: UnboundedSender<TokenEvent>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    #[error("{0}")]
    NeverFits(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the model is still warming up; retry once /health answers 200")]
    NotReady,
    #[error("the engine failed: {0}")]
    Failed(String),
}

/// Serving metrics, exported in the Prometheus text format.
pub struct EngineMetrics {
    pub registry: Mutex<Registry>,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_pages_used: Gauge,
    pub kv_pages_total: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub requests_finished: Counter,
    pub requests_cancelled: Counter,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub batch_sequences: Histogram,
    /// The most sequences one step held.
    pub max_batch_sequences: Gauge,
    pub steps: AtomicU64,
}

impl EngineMetrics {
    fn new() -> Self {
        let latency = || {
            Histogram::new([
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ])
        };
        let metrics = Self {
            registry: Mutex::new(Registry::with_prefix("kimi")),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_pages_used: Gauge::default(),
            kv_pages_total: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            requests_finished: Counter::default(),
            requests_cancelled: Counter::default(),
            time_to_first_token: latency(),
            inter_token_latency: latency(),
            batch_sequences: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
            max_batch_sequences: Gauge::default(),
            steps: AtomicU64::new(0),
        };
        {
            let mut r = metrics.registry.lock().expect("fresh lock");
            r.register(
                "num_requests_running",
                "Sequences in the decode batch",
                metrics.running.clone(),
            );
            r.register(
                "num_requests_waiting",
                "Requests waiting for admission",
                metrics.waiting.clone(),
            );
            r.register(
                "kv_cache_pages_used",
                "Latent cache pages reserved by sequences",
                metrics.kv_pages_used.clone(),
            );
            r.register(
                "kv_cache_pages_total",
                "Latent cache pages",
                metrics.kv_pages_total.clone(),
            );
            r.register(
                "prompt_tokens",
                "Prompt tokens prefilled",
                metrics.prompt_tokens.clone(),
            );
            r.register(
                "generation_tokens",
                "Tokens generated",
                metrics.generation_tokens.clone(),
            );
            r.register(
                "requests_finished",
                "Requests that ran to a stop token or their length",
                metrics.requests_finished.clone(),
            );
            r.register(
                "requests_cancelled",
                "Requests dropped because their client went away",
                metrics.requests_cancelled.clone(),
            );
            r.register(
                "time_to_first_token_seconds",
                "Arrival to first generated token",
                metrics.time_to_first_token.clone(),
            );
            r.register(
                "inter_token_latency_seconds",
                "Time between tokens of one sequence",
                metrics.inter_token_latency.clone(),
            );
            r.register(
                "batch_sequences",
                "Sequences in each forward step",
                metrics.batch_sequences.clone(),
            );
            r.register(
                "batch_sequences_max",
                "The most sequences one forward step held",
                metrics.max_batch_sequences.clone(),
            );
        }
        metrics
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().expect("metrics lock");
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String");
        out
    }
}

enum Command {
    Submit(Box<Pending>),
    Shutdown,
}

struct Pending {
    request: EngineRequest,
    arrived: Instant,
}

/// The handle the server holds: submit requests, read metrics, stop the engine.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    pub metrics: Arc<EngineMetrics>,
    waiting: Arc<AtomicUsize>,
    accepting: Arc<AtomicBool>,
    config: EngineConfig,
    total_pages: usize,
    state: Arc<Mutex<EngineState>>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

/// Where the engine stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineState {
    /// The runner is warming up.
    Starting,
    /// Steps run; the first request runs as fast as later ones.
    Ready,
    /// A step failed past recovery (a tensor-parallel rank died, the device failed): requests
    /// are refused.
    Failed(String),
}

impl EngineHandle {
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Tokens the latent cache holds in all.
    pub fn cache_tokens(&self) -> usize {
        self.total_pages * PAGE_TOKENS
    }

    pub fn state(&self) -> EngineState {
        self.state.lock().map_or_else(
            |_| EngineState::Failed("the engine's state lock is poisoned".into()),
            |s| s.clone(),
        )
    }

    /// Waits until the engine is ready (its runner warmed up), or says why it failed.
    pub fn wait_ready(&self) -> anyhow::Result<()> {
        loop {
            match self.state() {
                EngineState::Ready => return Ok(()),
                EngineState::Failed(why) => anyhow::bail!("{why}"),
                EngineState::Starting => std::thread::sleep(std::time::Duration::from_millis(5)),
            }
        }
    }

    /// Queues a request, or says at once why it cannot run.
    pub fn submit(&self, request: EngineRequest) -> Result<(), SubmitError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        match self.state() {
            EngineState::Ready => {}
            EngineState::Starting => return Err(SubmitError::NotReady),
            EngineState::Failed(why) => return Err(SubmitError::Failed(why)),
        }
        let total = request.prompt.len() + request.max_new_tokens;
        if request.prompt.is_empty() {
            return Err(SubmitError::NeverFits("the prompt is empty".into()));
        }
        if total > self.config.max_model_len {
            return Err(SubmitError::NeverFits(format!(
                "the prompt ({} tokens) plus max_tokens ({}) is {total} tokens, more than the maximum context length {}",
                request.prompt.len(),
                request.max_new_tokens,
                self.config.max_model_len
            )));
        }
        let pages = total.div_ceil(PAGE_TOKENS);
        if pages > self.total_pages {
            return Err(SubmitError::NeverFits(format!(
                "the request needs {pages} KV cache pages ({total} tokens) but the cache has {} in all",
                self.total_pages
            )));
        }
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.config.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(waiting));
        }
        self.metrics.waiting.set((waiting + 1) as i64);
        self.commands
            .send(Command::Submit(Box::new(Pending {
                request,
                arrived: Instant::now(),
            })))
            .map_err(|_| {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                SubmitError::ShuttingDown
            })
    }

    /// Stops admitting requests; the engine finishes what it holds, then its thread ends.
    pub fn shutdown(&self) {
        self.accepting.store(false, Ordering::SeqCst);
        let _ = self.commands.send(Command::Shutdown);
    }

    /// Waits for the engine thread to end (after [`shutdown`](Self::shutdown)).
    pub fn join(&self) {
        if let Some(thread) = self.thread.lock().expect("join lock").take() {
            let _ = thread.join();
        }
    }
}

struct Running {
    request: EngineRequest,
    seq: SeqId,
    sampler: Sampler,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    generated: Vec<u32>,
    arrived: Instant,
    last_token_at: Option<Instant>,
}

impl Running {
    fn prefill_done(&self) -> bool {
        self.prefilled == self.request.prompt.len()
    }
}

/// Starts the engine thread: it makes its runner with `open` (on the thread that steps it, as
/// a device context wants), warms it up, and serves. Returns once the runner exists (its
/// warm-up goes on: [`EngineHandle::state`]), or with the error that made it fail.
pub fn start_engine(
    open: impl FnOnce() -> anyhow::Result<Box<dyn ModelRunner>> + Send + 'static,
    config: EngineConfig,
) -> anyhow::Result<EngineHandle> {
    let (tx, rx) = mpsc::channel();
    let (opened_tx, opened_rx) = mpsc::channel::<anyhow::Result<usize>>();
    let metrics = Arc::new(EngineMetrics::new());
    let waiting = Arc::new(AtomicUsize::new(0));
    let state = Arc::new(Mutex::new(EngineState::Starting));
    let thread = {
        let metrics = metrics.clone();
        let waiting = waiting.clone();
        let state = state.clone();
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let mut runner = match open() {
                    Ok(runner) => runner,
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                        return;
                    }
                };
                metrics.kv_pages_total.set(runner.total_pages() as i64);
                let set = |s: EngineState| {
                    if let Ok(mut state) = state.lock() {
                        *state = s;
                    }
                };
                if !config.warm_up {
                    set(EngineState::Ready);
                }
                let _ = opened_tx.send(Ok(runner.total_pages()));
                if config.warm_up {
                    if let Err(e) = runner.warm_up(config.max_num_seqs) {
                        set(EngineState::Failed(format!("warming up: {e}")));
                        return;
                    }
                    set(EngineState::Ready);
                }
                let mut engine = Engine {
                    runner,
                    config,
                    metrics,
                    waiting_count: waiting,
                    waiting: VecDeque::new(),
                    running: Vec::new(),
                    shutting_down: false,
                    state,
                };
                engine.run(rx);
            })
            .expect("spawning the engine thread")
    };
    let total_pages = match opened_rx.recv() {
        Ok(Ok(pages)) => pages,
        Ok(Err(e)) => {
            let _ = thread.join();
            return Err(e);
        }
        Err(_) => {
            let _ = thread.join();
            anyhow::bail!("the engine thread ended before its runner was made");
        }
    };
    Ok(EngineHandle {
        commands: tx,
        metrics,
        waiting,
        accepting: Arc::new(AtomicBool::new(true)),
        config,
        total_pages,
        state,
        thread: Arc::new(Mutex::new(Some(thread))),
    })
}

struct Engine {
    runner: Box<dyn ModelRunner>,
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    waiting_count: Arc<AtomicUsize>,
    waiting: VecDeque<Pending>,
    running: Vec<Running>,
    shutting_down: bool,
    state: Arc<Mutex<EngineState>>,
}

impl Engine {
    fn run(&mut self, commands: mpsc::Receiver<Command>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.shutting_down {
                    return;
                }
                match commands.recv() {
                    Ok(command) => self.handle(command),
                    Err(_) => return,
                }
            }
            while let Ok(command) = commands.try_recv() {
                self.handle(command);
            }
            self.drop_cancelled();
            self.admit();
            self.update_gauges();
            if !self.running.is_empty() {
                self.step();
                self.update_gauges();
            }
        }
    }

    /// The runner cannot go on: every request held fails, and the engine refuses new ones.
    fn fail(&mut self, why: String) {
        if let Ok(mut state) = self.state.lock() {
            *state = EngineState::Failed(why.clone());
        }
        for r in self.running.drain(..) {
            let _ = r.request.events.send(TokenEvent::Failed(why.clone()));
        }
        for p in std::mem::take(&mut self.waiting) {
            let _ = p.request.events.send(TokenEvent::Failed(why.clone()));
            self.waiting_count.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(pending) => self.waiting.push_back(*pending),
            Command::Shutdown => self.shutting_down = true,
        }
    }

    fn dequeued(&mut self) {
        self.waiting_count.fetch_sub(1, Ordering::SeqCst);
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.request.events.is_closed());
        for _ in self.waiting.len()..before {
            self.dequeued();
            self.metrics.requests_cancelled.inc();
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].request.events.is_closed() {
                let gone = self.running.swap_remove(i);
                let _ = self.runner.free_sequence(gone.seq);
                self.metrics.requests_cancelled.inc();
            } else {
                i += 1;
            }
        }
    }

    /// Moves waiting requests into the batch, first come first served, while there is a batch
    /// slot and cache pages for the request's whole length.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_num_seqs {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let total = front.request.prompt.len() + front.request.max_new_tokens;
            if total.div_ceil(PAGE_TOKENS) > self.runner.free_pages() {
                break;
            }
            let pending = self.waiting.pop_front().expect("front exists");
            self.dequeued();
            let seq = self.runner.add_sequence();
            if let Err(e) = self.runner.reserve(seq, total) {
                let _ = pending
                    .request
                    .events
                    .send(TokenEvent::Failed(e.to_string()));
                let _ = self.runner.free_sequence(seq);
                continue;
            }
            self.running.push(Running {
                sampler: Sampler::new(pending.request.sampling),
                request: pending.request,
                seq,
                prefilled: 0,
                generated: Vec::new(),
                arrived: pending.arrived,
                last_token_at: None,
            });
        }
    }

    fn update_gauges(&self) {
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics
            .kv_pages_used
            .set((self.runner.total_pages() - self.runner.free_pages()) as i64);
    }

    /// One forward pass: every decoding sequence's last token, then prefill chunks within the
    /// remaining token budget.
    fn step(&mut self) {
        let mut budget = self.config.max_batched_tokens.max(1);
        // (index into running, token range of the input)
        let mut plan: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.prefill_done() {
                let last = *r
                    .generated
                    .last()
                    .expect("a prefilled sequence has a token");
                plan.push((i, vec![last]));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if !r.prefill_done() && budget > 0 {
                let take = (r.request.prompt.len() - r.prefilled).min(budget);
                plan.push((
                    i,
                    r.request.prompt[r.prefilled..r.prefilled + take].to_vec(),
                ));
                budget -= take;
            }
        }
        if plan.is_empty() {
            return;
        }
        let inputs: Vec<SeqInput<'_>> = plan
            .iter()
            .map(|(i, tokens)| SeqInput {
                seq: self.running[*i].seq,
                tokens,
            })
            .collect();
        // A row whose prompt is not all prefilled yet gets no token: its draw is looked at,
        // not taken (the sampler's count stays where the token will be drawn).
        let draws: Vec<_> = plan
            .iter()
            .map(|(i, tokens)| {
                let r = &mut self.running[*i];
                if r.prefilled + tokens.len() >= r.request.prompt.len() {
                    r.sampler.next_row()
                } else {
                    r.sampler.peek_row()
                }
            })
            .collect();
        let result = self.runner.step(&inputs, &draws);
        self.metrics.steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.batch_sequences.observe(plan.len() as f64);
        if plan.len() as i64 > self.metrics.max_batch_sequences.get() {
            self.metrics.max_batch_sequences.set(plan.len() as i64);
        }
        let drawn = match result {
            Ok(drawn) => drawn,
            Err(e) if e.is_fatal() => {
                // The state turns failed before any client hears of it: a client that asks
                // `/health` on its error frame must find the failure there.
                self.fail(e.to_string());
                return;
            }
            Err(e) => {
                // The whole step failed: fail every sequence in it rather than guess which.
                let mut failed: Vec<usize> = plan.iter().map(|(i, _)| *i).collect();
                failed.sort_unstable_by(|a, b| b.cmp(a));
                for i in failed {
                    let r = self.running.swap_remove(i);
                    let _ = r.request.events.send(TokenEvent::Failed(e.to_string()));
                    let _ = self.runner.free_sequence(r.seq);
                }
                return;
            }
        };
        let now = Instant::now();
        let mut finished = Vec::new();
        for (row, (i, tokens)) in plan.iter().enumerate() {
            let r = &mut self.running[*i];
            if !r.prefill_done() {
                r.prefilled += tokens.len();
                self.metrics.prompt_tokens.inc_by(tokens.len() as u64);
                if !r.prefill_done() {
                    continue;
                }
            }
            let token = drawn[row];
            r.generated.push(token);
            self.metrics.generation_tokens.inc();
            match r.last_token_at {
                None => self
                    .metrics
                    .time_to_first_token
                    .observe((now - r.arrived).as_secs_f64()),
                Some(t) => self
                    .metrics
                    .inter_token_latency
                    .observe((now - t).as_secs_f64()),
            }
            r.last_token_at = Some(now);
            let _ = r.request.events.send(TokenEvent::Token(token));
            let reason = if r.request.stop_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if r.generated.len() >= r.request.max_new_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                let _ = r.request.events.send(TokenEvent::Finished {
                    reason,
                    prompt_tokens: r.request.prompt.len(),
                    completion_tokens: r.generated.len(),
                });
                finished.push(*i);
            }
        }
        finished.sort_unstable_by(|a, b| b.cmp(a));
        for i in finished {
            let r = self.running.swap_remove(i);
            let _ = self.runner.free_sequence(r.seq);
            self.metrics.requests_finished.inc();
        }
    }
}
