//! The text-in, text-out commands: `model serve`, `model chat`, `model tokenize`, and the
//! small trained chat model they use when no checkpoint is given (`kimi-chat-tiny`, built by
//! `golden/gen_chat_model.py`, embedded in the binary and unpacked once into the cache
//! folder).

use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kernels::mla::cache::KvCacheDtype;
use serde_json::{Map, Value, json};

use super::args::{at_least_one, temperature, top_p};
use crate::exec::backend::{BackendArgs, TpArgs};
use crate::quantize::generator::cache_base;
use crate::serve::api::{ChatRequest, SamplingRequest, ToolChoice};
use crate::serve::runtime::{Delta, OutputMode, Runtime, checkpoint_name, drive_choice};
use crate::serve::{ConnectionLimits, RuntimeOptions, ServeOptions, serve};
use crate::text::tokenizer::Tokenizer;

/// The question the front door asks when `model` runs without arguments.
pub const DEMO_QUESTION: &str = "What is the capital of France? Answer in one sentence.";

macro_rules! chat_model_file {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!(
                "../../../golden/data/models/kimi-chat-tiny/",
                $name
            )) as &[u8],
        )
    };
}

/// The files of `kimi-chat-tiny` (Kimi-K2.5-NVFP4 layout, tokenizer and template included).
const CHAT_MODEL_FILES: [(&str, &[u8]); 9] = [
    chat_model_file!("config.json"),
    chat_model_file!("generation_config.json"),
    chat_model_file!("hf_quant_config.json"),
    chat_model_file!("model-00001-of-00002.safetensors"),
    chat_model_file!("model-00002-of-00002.safetensors"),
    chat_model_file!("model.safetensors.index.json"),
    chat_model_file!("tiktoken.model"),
    chat_model_file!("tokenizer_config.json"),
    chat_model_file!("chat_template.jinja"),
];

/// The embedded chat model's folder, unpacked on first use into `cache_dir` (default
/// `~/.cache/kimi-sm120`) and checked against the embedded bytes on every later use, unpacked
/// again when damaged.
pub fn default_chat_checkpoint(cache_dir: Option<PathBuf>) -> Result<PathBuf> {
    crate::checkpoint::embedded::unpack(&cache_base(cache_dir), "kimi-chat-tiny", &CHAT_MODEL_FILES)
}

fn checkpoint_or_default(
    checkpoint: &Option<PathBuf>,
    cache_dir: &Option<PathBuf>,
) -> Result<PathBuf> {
    match checkpoint {
        Some(dir) => Ok(dir.clone()),
        None => default_chat_checkpoint(cache_dir.clone()),
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ServeKvDtype {
    /// What the checkpoint asks for (`kv_cache_quant_algo`), else BF16.
    Auto,
    Bf16,
    #[value(alias = "fp8_e4m3")]
    Fp8,
}

/// Engine settings shared by `serve` and `chat`.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// A checkpoint folder (weights, `tiktoken.model`, `tokenizer_config.json`, chat template);
    /// default: the small trained `kimi-chat-tiny`.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Where the default model is unpacked.
    #[arg(long, env = "KIMI_SM120_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    pub max_num_seqs: usize,
    /// Longest sequence, prompt plus output (default: the model's, at most 8192).
    #[arg(long, value_parser = at_least_one)]
    pub max_model_len: Option<usize>,
    /// Tokens per forward step at most: bounds how long a prompt's prefill chunk delays the
    /// running streams.
    #[arg(long, default_value_t = 256, value_parser = at_least_one)]
    pub max_num_batched_tokens: usize,
    /// Requests waiting for a batch slot at most; more get HTTP 429.
    #[arg(long, default_value_t = 256, value_parser = at_least_one)]
    pub max_waiting: usize,
    /// Latent cache size in tokens (default: max-num-seqs × max-model-len).
    #[arg(long, value_parser = at_least_one)]
    pub kv_cache_tokens: Option<usize>,
    /// The latent cache's dtype (vLLM's `--kv-cache-dtype`).
    #[arg(
        long,
        visible_alias = "kv-cache-dtype",
        value_enum,
        default_value = "auto"
    )]
    pub kv_dtype: ServeKvDtype,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub tp: TpArgs,
}

impl EngineArgs {
    fn runtime_options(&self) -> Result<RuntimeOptions> {
        Ok(RuntimeOptions {
            checkpoint: checkpoint_or_default(&self.checkpoint, &self.cache_dir)?,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_waiting: self.max_waiting,
            kv_cache_tokens: self.kv_cache_tokens,
            kv_dtype: match self.kv_dtype {
                ServeKvDtype::Auto => None,
                ServeKvDtype::Bf16 => Some(KvCacheDtype::Bf16),
                ServeKvDtype::Fp8 => Some(KvCacheDtype::Fp8E4m3),
            },
            backend: self.backend.clone(),
            tp: self.tp.clone(),
            warm_up: true,
        })
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model name clients send and see (default: the checkpoint folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Seconds in-flight requests may run after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Seconds a client may take to send a request's head, from its first byte.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub header_read_timeout_secs: u64,
    /// Seconds a client may take to send a request's body, once its head is in (408 after).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub body_read_timeout_secs: u64,
    /// Seconds a connection may stay open without a request, new or kept alive.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub keep_alive_timeout_secs: u64,
    /// Open connections at most (and at most what the open-file limit leaves); past it a new
    /// connection closes the one idle longest.
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    pub max_connections: usize,
}

pub fn run_serve(args: ServeArgs) -> Result<()> {
    let runtime_options = args.engine.runtime_options()?;
    if runtime_options.is_follower() {
        return runtime_options.follow();
    }
    let name = match &args.served_model_name {
        Some(name) => name.clone(),
        None if args.engine.checkpoint.is_none() => "kimi-chat-tiny".to_string(),
        None => checkpoint_name(&runtime_options.checkpoint),
    };
    serve(
        runtime_options,
        ServeOptions {
            host: args.host,
            port: args.port,
            served_model_name: name,
            shutdown_grace: Duration::from_secs(args.shutdown_grace_secs),
            limits: ConnectionLimits {
                header_read_timeout: Duration::from_secs(args.header_read_timeout_secs),
                body_read_timeout: Duration::from_secs(args.body_read_timeout_secs),
                keep_alive_timeout: Duration::from_secs(args.keep_alive_timeout_secs),
                max_connections: args.max_connections,
            },
        },
    )
}

#[derive(clap::Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Ask these questions in turn and exit (default: an interactive session on stdin).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A system message (default: the template's).
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 0.6, value_parser = temperature)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.95, value_parser = top_p)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Answer without reasoning (`thinking: false` in the template).
    #[arg(long)]
    pub no_thinking: bool,
}

/// Terminal styling: reasoning dimmed when stdout is a terminal.
struct Style {
    tty: bool,
}

impl Style {
    fn dim(&self, text: &str) -> String {
        if self.tty {
            format!("\x1b[2m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
}

pub fn run_chat(args: ChatArgs) -> Result<()> {
    let mut options = args.engine.runtime_options()?;
    options.max_num_seqs = 1;
    if options.is_follower() {
        return options.follow();
    }
    let started = Instant::now();
    let runtime = Runtime::load(&options)?;
    runtime.wait_ready()?;
    let style = Style {
        tty: std::io::stdout().is_terminal(),
    };
    let interactive = args.prompt.is_empty();
    eprintln!(
        "{}",
        style.dim(&format!(
            "model {} loaded in {:.2} s ({}); reasoning is shown dimmed{}",
            runtime.checkpoint.display(),
            started.elapsed().as_secs_f64(),
            options.backend.backend.name(),
            if interactive {
                "; /reset clears the conversation, /exit or Ctrl-D quits"
            } else {
                ""
            }
        ))
    );
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut history: Vec<Value> = Vec::new();
    if let Some(system) = &args.system {
        history.push(json!({"role": "system", "content": system}));
    }
    let initial = history.clone();
    let mut questions = args.prompt.clone().into_iter();
    let stdin = std::io::stdin();
    loop {
        let question = if interactive {
            print!("> ");
            std::io::stdout().flush()?;
            let mut line = String::new();
            if stdin.lock().read_line(&mut line)? == 0 {
                println!();
                return Ok(());
            }
            let line = line.trim().to_string();
            match line.as_str() {
                "" => continue,
                "/exit" | "/quit" => return Ok(()),
                "/reset" => {
                    history = initial.clone();
                    continue;
                }
                _ => line,
            }
        } else {
            match questions.next() {
                Some(q) => {
                    println!("> {q}");
                    q
                }
                None => return Ok(()),
            }
        };
        history.push(json!({"role": "user", "content": question}));
        let (reasoning, content) = tokio.block_on(answer(&runtime, &history, &args, &style))?;
        let mut message = json!({"role": "assistant", "content": content});
        if !reasoning.is_empty() {
            message["reasoning_content"] = Value::String(reasoning);
        }
        history.push(message);
    }
}

async fn answer(
    runtime: &Runtime,
    history: &[Value],
    args: &ChatArgs,
    style: &Style,
) -> Result<(String, String)> {
    let mut kwargs = Map::new();
    if args.no_thinking {
        kwargs.insert("thinking".into(), false.into());
    }
    let request = ChatRequest {
        model: None,
        messages: history.to_vec(),
        tools: Vec::new(),
        tool_choice: ToolChoice::Auto,
        template_kwargs: kwargs,
        sampling: SamplingRequest {
            max_tokens: Some(args.max_tokens),
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
            stop: Vec::new(),
            n: 1,
            stream: true,
            include_usage: false,
            ignore_eos: false,
        },
    };
    let (prompt, thinking, parse_tools) = runtime
        .chat_prompt(&request)
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let mut receivers = runtime
        .submit(&prompt, &request.sampling)
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let started = Instant::now();
    let mut first_token: Option<Duration> = None;
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut in_reasoning = false;
    let end = drive_choice(
        runtime.tokenizer.clone(),
        receivers.remove(0),
        OutputMode::Chat {
            thinking,
            parse_tools,
        },
        Vec::new(),
        |delta| {
            first_token.get_or_insert_with(|| started.elapsed());
            let mut out = std::io::stdout().lock();
            match delta {
                Delta::Reasoning(t) => {
                    if !in_reasoning {
                        let _ = write!(out, "{}", style.dim("thinking: "));
                        in_reasoning = true;
                    }
                    let _ = write!(out, "{}", style.dim(&t));
                    reasoning.push_str(&t);
                }
                Delta::Content(t) => {
                    if in_reasoning {
                        let _ = writeln!(out);
                        in_reasoning = false;
                    }
                    let _ = write!(out, "{t}");
                    content.push_str(&t);
                }
                _ => {}
            }
            let _ = out.flush();
            async { true }
        },
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    println!();
    if let Some(error) = end.error {
        bail!("generation failed: {error}");
    }
    let decode_time = elapsed - first_token.map_or(0.0, |d| d.as_secs_f64());
    println!(
        "{}",
        style.dim(&format!(
            "[{} tokens in {elapsed:.2} s: {:.1} tok/s after a first token at {:.0} ms; {} prompt tokens; finish: {}]",
            end.completion_tokens,
            end.completion_tokens.saturating_sub(1) as f64 / decode_time.max(1e-9),
            first_token.map_or(0.0, |d| d.as_secs_f64() * 1e3),
            prompt.len(),
            end.finish_reason
        ))
    );
    Ok((reasoning, content))
}

#[derive(clap::Args, Clone, Debug)]
pub struct TokenizeArgs {
    /// A folder with `tiktoken.model` (and `tokenizer_config.json`); default: the chat model's.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    #[arg(long, env = "KIMI_SM120_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// Treat special-token strings as plain text (default: they become control ids, as Kimi's
    /// tokenizer does).
    #[arg(long)]
    pub no_special: bool,
}

/// Reads text on stdin and prints its ids as one JSON array.
pub fn run_tokenize(args: TokenizeArgs) -> Result<()> {
    let dir = checkpoint_or_default(&args.checkpoint, &args.cache_dir)?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading stdin (it must be UTF-8 text)")?;
    let ids = if args.no_special {
        tokenizer.encode_ordinary(&text)
    } else {
        tokenizer.encode(&text)
    };
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

/// `model` with no arguments: the demo question through the chat model.
pub fn demo_chat_args() -> ChatArgs {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        chat: ChatArgs,
    }
    Wrapper::parse_from(["model", "--prompt", DEMO_QUESTION]).chat
}
