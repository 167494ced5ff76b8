//! The continuous-batching engine on the tiny Kimi checkpoint: sequences that join and leave
//! the batch, with chunked prefill, produce exactly the tokens they produce alone; a
//! cancelled sequence frees its pages; admission respects the cache and the queue bound.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kernels::mla::cache::KvCacheDtype;
use model::checkpoint::Checkpoint;
use model::checkpoint::weights::Model;
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::generate::{GenerationRequest, generate};
use model::exec::sampler::SamplingParams;
use model::quantize::random_tokens;
use model::serve::engine::{
    EngineConfig, EngineHandle, EngineRequest, FinishReason, RequestEnd, SubmitError, TokenEvent,
    start_engine,
};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

fn load() -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/data/models/kimi-tiny");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    Model::new(
        checkpoint.model_config().clone(),
        checkpoint.load_weights().unwrap(),
    )
}

fn config(max_num_seqs: usize, max_waiting: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs,
        max_model_len: 512,
        // Small: prompts are prefilled in several chunks, next to running decodes.
        max_batched_tokens: 8,
        max_waiting,
        warm_up: true,
    }
}

/// The engine over a CPU runner of `model` with a latent cache of `kv_cache_tokens`, warmed
/// up (its warm-up steps leave nothing behind that a request could see).
fn start(model: Model, config: EngineConfig, kv_cache_tokens: usize) -> EngineHandle {
    let engine = start_engine(
        move || {
            let runner = cpu_runner(&model, CpuOptions::new(KvCacheDtype::F32, kv_cache_tokens));
            Ok(Box::new(runner))
        },
        config,
    )
    .unwrap();
    engine.wait_ready().unwrap();
    engine
}

fn submit(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    max_new_tokens: usize,
) -> Result<UnboundedReceiver<TokenEvent>, SubmitError> {
    let (tx, rx) = unbounded_channel();
    engine.submit(EngineRequest {
        request_id: None,
        prompt,
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        host_sampling: Default::default(),
        stop_ids: vec![],
        events: tx,
    })?;
    Ok(rx)
}

fn collect(mut rx: UnboundedReceiver<TokenEvent>) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("the engine answers") {
            TokenEvent::Token(t) => tokens.push(t),
            TokenEvent::Logprobs(_) => {}
            TokenEvent::Finished { reason, .. } => return (tokens, reason),
            TokenEvent::Failed(e) => panic!("{e}"),
        }
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn batched_sequences_equal_their_solo_runs() {
    let model = load();
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = [5, 21, 33, 12, 1]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_tokens(n, vocab, 40 + i as u64))
        .collect();
    let max_new = 7;
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut runner = cpu_runner(&model, CpuOptions::new(KvCacheDtype::F32, 256));
            let request = GenerationRequest {
                prompt: p.clone(),
                max_new_tokens: max_new,
                sampling: SamplingParams::greedy(),
            };
            generate(&mut runner, &[request], |_, _| {})
                .unwrap()
                .0
                .remove(0)
                .tokens
        })
        .collect();

    let engine = start(model, config(3, 16), 1024);
    let receivers: Vec<_> = prompts
        .iter()
        .map(|p| submit(&engine, p.clone(), max_new).unwrap())
        .collect();
    for (i, rx) in receivers.into_iter().enumerate() {
        let (tokens, reason) = collect(rx);
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(tokens, solo[i], "sequence {i}");
    }
    let metrics = &engine.metrics;
    assert_eq!(
        metrics.max_batch_sequences.get(),
        3,
        "the batch held 3 sequences at once"
    );
    wait_until("the cache is empty", || metrics.kv_pages_used.get() == 0);
    engine.shutdown();
    engine.join();
}

#[test]
fn cancellation_frees_pages_and_admission_is_bounded() {
    let model = load();
    let vocab = model.config.vocab_size;
    // 4 pages of 64 tokens; one sequence at a time; one waiting request at most.
    let engine = start(model, config(1, 1), 256);
    let never = submit(&engine, random_tokens(10, vocab, 1), 300).unwrap_err();
    assert!(matches!(never, SubmitError::NeverFits(_)), "{never}");
    let too_long = submit(&engine, random_tokens(10, vocab, 1), 600).unwrap_err();
    assert!(matches!(too_long, SubmitError::NeverFits(_)), "{too_long}");

    let mut long = submit(&engine, random_tokens(10, vocab, 2), 200).unwrap();
    assert!(matches!(long.blocking_recv(), Some(TokenEvent::Token(_))));
    assert!(engine.metrics.kv_pages_used.get() >= 4);
    // The long one runs, the next waits, a third is refused.
    let queued = submit(&engine, random_tokens(6, vocab, 3), 3).unwrap();
    let refused = submit(&engine, random_tokens(6, vocab, 4), 3).unwrap_err();
    assert!(matches!(refused, SubmitError::QueueFull(_)), "{refused}");
    // The client of the long one goes away: its pages come back and the queued one runs.
    drop(long);
    let (tokens, _) = collect(queued);
    assert_eq!(tokens.len(), 3);
    wait_until("pages are free", || engine.metrics.kv_pages_used.get() == 0);
    assert!(engine.metrics.requests_ended(RequestEnd::Abort) >= 1);
    engine.shutdown();
    engine.join();
}
