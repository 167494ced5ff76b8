//! Continuous batching over the model's forward pass, on one engine thread.
//!
//! Between steps, finished and cancelled sequences leave the batch and waiting requests join
//! it. Each step is one forward pass over every running sequence's next token plus chunks of
//! the prompts still being prefilled, within a token budget, so a long prompt is prefilled in
//! pieces and never stalls the running streams for long. A request is admitted only when the
//! latent cache has pages for its whole length (prompt + `max_new_tokens`), reserved at
//! admission, so a running sequence never runs out of cache. Requests whose receiver is gone
//! (the client disconnected, or the server stopped reading) are freed before the next step.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use kernels::mla::cache::{PAGE_TOKENS, SeqId};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc::UnboundedSender;

use crate::exec::ops::{LogitRows, SeqInput};
use crate::exec::runner::ModelRunner;
use crate::exec::sampler::{Drawn, HostSampling, Sampler, SamplingParams, TokenLogprobs};

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
    /// The logprobs of the token that comes next (where the request asked for them).
    Logprobs(TokenLogprobs),
    Token(u32),
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

pub struct EngineRequest {
    /// The id the request's end is logged under (`None`: not logged, as in `model chat`).
    pub request_id: Option<String>,
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Penalties, `min_tokens` and logprobs: drawn on the host (the default: none).
    pub host_sampling: HostSampling,
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

/// Why a request left the engine: vLLM's `finished_reason` label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestEnd {
    /// A stop token.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// Its receiver went away: the client hung up, a stop string ended it, or the drain's
    /// grace period cut it.
    Abort,
    /// The engine failed it.
    Error,
}

impl RequestEnd {
    pub const ALL: [Self; 4] = [Self::Stop, Self::Length, Self::Abort, Self::Error];

    pub fn label(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

impl From<FinishReason> for RequestEnd {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => Self::Stop,
            FinishReason::Length => Self::Length,
        }
    }
}

type FinishedReasonLabel = [(&'static str, &'static str); 1];

/// Serving metrics under vLLM's names (`vllm:` prefix, a `model_name` label), exported in the
/// OpenMetrics text format.
pub struct EngineMetrics {
    pub running: Gauge,
    pub waiting: Gauge,
    /// Reserved latent cache pages over all pages, 0 to 1.
    pub kv_cache_usage: Gauge<f64, AtomicU64>,
    pub kv_pages_used: Gauge,
    pub kv_pages_total: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    request_success: Family<FinishedReasonLabel, Counter>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
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
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_cache_usage: Gauge::default(),
            kv_pages_used: Gauge::default(),
            kv_pages_total: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            time_to_first_token: latency(),
            inter_token_latency: latency(),
            // vLLM's buckets: a request runs from a fraction of a second to hours.
            e2e_request_latency: Histogram::new([
                0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
            ]),
            batch_sequences: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
            max_batch_sequences: Gauge::default(),
            steps: AtomicU64::new(0),
        };
        // Every reason's sample exists from the start, at 0, as vLLM's do: a rate over a
        // counter that appears mid-way misses its first increments.
        for end in RequestEnd::ALL {
            drop(
                metrics
                    .request_success
                    .get_or_create(&[("finished_reason", end.label())]),
            );
        }
        metrics
    }

    /// Requests that ended for `end` so far.
    pub fn requests_ended(&self, end: RequestEnd) -> u64 {
        self.request_success
            .get_or_create(&[("finished_reason", end.label())])
            .get()
    }

    fn request_ended(&self, end: RequestEnd, latency: std::time::Duration) {
        self.request_success
            .get_or_create(&[("finished_reason", end.label())])
            .inc();
        self.e2e_request_latency.observe(latency.as_secs_f64());
    }

    /// The OpenMetrics text exposition (ending in `# EOF`), every sample labelled with
    /// `model_name`.
    pub fn render(&self, model_name: &str) -> String {
        let model_name = [(
            Cow::Borrowed("model_name"),
            Cow::Owned(escape_label_value(model_name)),
        )];
        let mut r = Registry::with_labels(model_name.into_iter());
        r.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            self.running.clone(),
        );
        r.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            self.waiting.clone(),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            self.kv_cache_usage.clone(),
        );
        r.register(
            "vllm:kv_cache_pages_used",
            "Latent cache pages reserved by sequences",
            self.kv_pages_used.clone(),
        );
        r.register(
            "vllm:kv_cache_pages_total",
            "Latent cache pages",
            self.kv_pages_total.clone(),
        );
        r.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed",
            self.prompt_tokens.clone(),
        );
        r.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            self.generation_tokens.clone(),
        );
        r.register(
            "vllm:request_success",
            "Count of processed requests by finished reason (abort: the client went away or a stop string ended it)",
            self.request_success.clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            self.time_to_first_token.clone(),
        );
        r.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            self.inter_token_latency.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds",
            self.e2e_request_latency.clone(),
        );
        r.register(
            "vllm:batch_sequences",
            "Sequences in each forward step",
            self.batch_sequences.clone(),
        );
        r.register(
            "vllm:batch_sequences_max",
            "The most sequences one forward step held",
            self.max_batch_sequences.clone(),
        );
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("writing to a String");
        out
    }
}

/// A label value as the exposition format quotes it (the encoder writes values as given).
fn escape_label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// What the per-request log line says of a request that left the engine.
struct EndedRequest<'a> {
    id: Option<&'a str>,
    end: RequestEnd,
    prompt_tokens: usize,
    completion_tokens: usize,
    arrived: Instant,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
}

impl EndedRequest<'_> {
    /// `request ID finished: finish_reason=…, prompt_tokens=…, completion_tokens=…, ttft=…s,
    /// decode=… tok/s, e2e=…s`; `n/a` where there is no measure (no token, or one).
    fn log_line(&self, now: Instant) -> Option<String> {
        let id = self.id?;
        let ttft = self.first_token_at.map_or("n/a".to_string(), |first| {
            format!("{:.3}s", (first - self.arrived).as_secs_f64())
        });
        let decode = match (self.first_token_at, self.last_token_at) {
            (Some(first), Some(last)) if self.completion_tokens > 1 && last > first => format!(
                "{:.1} tok/s",
                (self.completion_tokens - 1) as f64 / (last - first).as_secs_f64()
            ),
            _ => "n/a".to_string(),
        };
        Some(format!(
            "request {id} finished: finish_reason={}, prompt_tokens={}, completion_tokens={}, ttft={ttft}, decode={decode}, e2e={:.3}s",
            self.end.label(),
            self.prompt_tokens,
            self.completion_tokens,
            (now - self.arrived).as_secs_f64(),
        ))
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
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
}

impl Running {
    fn prefill_done(&self) -> bool {
        self.prefilled == self.request.prompt.len()
    }

    fn ended(&self, end: RequestEnd) -> EndedRequest<'_> {
        EndedRequest {
            id: self.request.request_id.as_deref(),
            end,
            prompt_tokens: self.request.prompt.len(),
            completion_tokens: self.generated.len(),
            arrived: self.arrived,
            first_token_at: self.first_token_at,
            last_token_at: self.last_token_at,
        }
    }
}

impl Pending {
    fn ended(&self, end: RequestEnd) -> EndedRequest<'_> {
        EndedRequest {
            id: self.request.request_id.as_deref(),
            end,
            prompt_tokens: self.request.prompt.len(),
            completion_tokens: 0,
            arrived: self.arrived,
            first_token_at: None,
            last_token_at: None,
        }
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
        for r in std::mem::take(&mut self.running) {
            let _ = r.request.events.send(TokenEvent::Failed(why.clone()));
            self.record_end(r.ended(RequestEnd::Error));
        }
        for p in std::mem::take(&mut self.waiting) {
            let _ = p.request.events.send(TokenEvent::Failed(why.clone()));
            self.waiting_count.fetch_sub(1, Ordering::SeqCst);
            self.record_end(p.ended(RequestEnd::Error));
        }
    }

    /// Counts a request that left the engine and logs its line (one per request, as vLLM's
    /// server does: its id, token counts, time to first token, decode speed, finish reason).
    fn record_end(&self, ended: EndedRequest<'_>) {
        let now = Instant::now();
        self.metrics.request_ended(ended.end, now - ended.arrived);
        if let Some(line) = ended.log_line(now) {
            eprintln!("{line}");
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
        let (gone, staying) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|p| p.request.events.is_closed());
        self.waiting = staying;
        for p in gone {
            self.dequeued();
            self.record_end(p.ended(RequestEnd::Abort));
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].request.events.is_closed() {
                let gone = self.running.swap_remove(i);
                let _ = self.runner.free_sequence(gone.seq);
                self.record_end(gone.ended(RequestEnd::Abort));
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
                self.record_end(pending.ended(RequestEnd::Error));
                continue;
            }
            self.running.push(Running {
                sampler: Sampler::with_host(
                    pending.request.sampling,
                    pending.request.host_sampling.clone(),
                    &pending.request.prompt,
                    &pending.request.stop_ids,
                ),
                request: pending.request,
                seq,
                prefilled: 0,
                generated: Vec::new(),
                arrived: pending.arrived,
                first_token_at: None,
                last_token_at: None,
            });
        }
    }

    fn update_gauges(&self) {
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        let (total, used) = (
            self.runner.total_pages(),
            self.runner.total_pages() - self.runner.free_pages(),
        );
        self.metrics.kv_pages_used.set(used as i64);
        self.metrics.kv_cache_usage.set(if total == 0 {
            0.0
        } else {
            used as f64 / total as f64
        });
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
        // A row whose prompt is not all prefilled yet gets no token: its draw is not taken
        // (the sampler's count stays where the token will be drawn).
        let takes_token: Vec<bool> = plan
            .iter()
            .map(|(i, tokens)| {
                let r = &self.running[*i];
                r.prefilled + tokens.len() >= r.request.prompt.len()
            })
            .collect();
        // One row that needs its logits on the host (penalties, min_tokens, logprobs) draws
        // the whole step there: the other rows' draws are the same definition as the device's.
        let on_host = plan
            .iter()
            .zip(&takes_token)
            .any(|((i, _), &takes)| takes && self.running[*i].sampler.needs_logits());
        let result: Result<Vec<Option<Drawn>>, _> = if on_host {
            self.runner.logits(&inputs, LogitRows::Last).map(|logits| {
                plan.iter()
                    .zip(&takes_token)
                    .enumerate()
                    .map(|(row, ((i, _), &takes))| {
                        takes.then(|| self.running[*i].sampler.draw(logits.row(row)))
                    })
                    .collect()
            })
        } else {
            let draws: Vec<_> = plan
                .iter()
                .zip(&takes_token)
                .map(|((i, _), &takes)| {
                    let sampler = &mut self.running[*i].sampler;
                    if takes {
                        sampler.next_row()
                    } else {
                        sampler.peek_row()
                    }
                })
                .collect();
            self.runner.step(&inputs, &draws).map(|ids| {
                plan.iter()
                    .zip(&takes_token)
                    .zip(ids)
                    .map(|(((i, _), &takes), token)| {
                        takes.then(|| {
                            self.running[*i].sampler.accept(token);
                            Drawn {
                                token,
                                logprobs: None,
                            }
                        })
                    })
                    .collect()
            })
        };
        self.metrics.steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.batch_sequences.observe(plan.len() as f64);
        if plan.len() as i64 > self.metrics.max_batch_sequences.get() {
            self.metrics.max_batch_sequences.set(plan.len() as i64);
        }
        let mut drawn = match result {
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
                    self.record_end(r.ended(RequestEnd::Error));
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
            let Some(Drawn { token, logprobs }) = drawn[row].take() else {
                unreachable!("a row whose prefill is done takes its token")
            };
            r.generated.push(token);
            self.metrics.generation_tokens.inc();
            match r.last_token_at {
                None => {
                    r.first_token_at = Some(now);
                    self.metrics
                        .time_to_first_token
                        .observe((now - r.arrived).as_secs_f64())
                }
                Some(t) => self
                    .metrics
                    .inter_token_latency
                    .observe((now - t).as_secs_f64()),
            }
            r.last_token_at = Some(now);
            if let Some(logprobs) = logprobs {
                let _ = r.request.events.send(TokenEvent::Logprobs(logprobs));
            }
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
                finished.push((*i, reason));
            }
        }
        finished.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in finished {
            let r = self.running.swap_remove(i);
            let _ = self.runner.free_sequence(r.seq);
            self.record_end(r.ended(reason.into()));
        }
    }
}
