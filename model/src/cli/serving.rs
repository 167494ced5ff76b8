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

use super::args::{at_least_one, counted, temperature, top_p};
use crate::checkpoint::hub::{display_name, resolve_checkpoint};
use crate::exec::backend::{BackendArgs, TpArgs};
use crate::quantize::generator::cache_base;
use crate::serve::api::{ChatRequest, SamplingRequest, ToolChoice};
use crate::serve::engine::TokenEvent;
use crate::serve::runtime::{Delta, OutputMode, Runtime, checkpoint_name, drive_choice};
use crate::serve::{ApiKey, ConnectionLimits, RuntimeOptions, ServeOptions, serve};
use crate::text::tokenizer::Tokenizer;

/// The name of the model chat, serve and tokenize use without `--checkpoint`.
const DEFAULT_CHAT_MODEL: &str = "kimi-chat-tiny";

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
    crate::checkpoint::embedded::unpack(
        &cache_base(cache_dir),
        DEFAULT_CHAT_MODEL,
        &CHAT_MODEL_FILES,
    )
}

fn checkpoint_or_default(
    checkpoint: &Option<PathBuf>,
    cache_dir: &Option<PathBuf>,
) -> Result<PathBuf> {
    match checkpoint {
        Some(arg) => Ok(resolve_checkpoint("--checkpoint", arg)?),
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
    /// A checkpoint folder (weights, `tiktoken.model`, `tokenizer_config.json`, chat template)
    /// or a Hugging Face repository id in the local cache (`nvidia/Kimi-K2.5-NVFP4`); default:
    /// the small trained `kimi-chat-tiny`.
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
    /// The address to listen on (`127.0.0.1`: this machine only).
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// The port to listen on (0: any free one, printed at start).
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
    /// The key every `/v1/*` request must send as `Authorization: Bearer KEY` (401 without);
    /// `/health` and `/metrics` stay open. The environment variable keeps it out of the
    /// process list, which shows the flag.
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    pub api_key: Option<ApiKey>,
}

pub fn run_serve(args: ServeArgs) -> Result<()> {
    let runtime_options = args.engine.runtime_options()?;
    if runtime_options.is_follower() {
        return runtime_options.follow();
    }
    let name = match &args.served_model_name {
        Some(name) => name.clone(),
        None => match &args.engine.checkpoint {
            None => DEFAULT_CHAT_MODEL.to_string(),
            // A repository id names the model as clients of vLLM know it.
            Some(arg) if crate::checkpoint::hub::repo_id(arg).is_some() && !arg.exists() => {
                display_name(arg, &runtime_options.checkpoint)
            }
            Some(_) => checkpoint_name(&runtime_options.checkpoint),
        },
    };
    serve(
        runtime_options,
        ServeOptions {
            host: args.host,
            port: args.port,
            served_model_name: name,
            api_key: args.api_key,
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
    /// Sampling temperature, >= 0; 0 = greedy.
    #[arg(long, default_value_t = 0.6, value_parser = temperature)]
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = no cut.
    #[arg(long, default_value_t = 0.95, value_parser = top_p)]
    pub top_p: f32,
    /// Sample among the k most likely tokens only; 0 = no cut.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of sampling, for answers that repeat (default: a random one per answer).
    #[arg(long)]
    pub seed: Option<u64>,
    /// New tokens per answer at most, reasoning included.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Answer without reasoning (`thinking: false` in the template).
    #[arg(long)]
    pub no_thinking: bool,
    /// Also print the engine's start-up details (weights placement, tactics, cache size), as
    /// a set `RUST_LOG` does.
    #[arg(short, long)]
    pub verbose: bool,
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

/// The commands of a chat session, typed as a line of their own.
const CHAT_COMMANDS: [(&str, &str); 3] = [
    ("/help", "list these commands"),
    (
        "/reset",
        "forget the conversation (the system message stays)",
    ),
    ("/exit", "end the chat (also Ctrl-D)"),
];

/// What a line typed in a chat asks for.
#[derive(Debug, PartialEq, Eq)]
enum ChatLine {
    /// Nothing: the prompt again.
    Empty,
    Question(String),
    Help,
    Reset,
    Exit,
    /// A line starting with `/` that is no command: never sent to the model.
    Unknown(String),
}

impl ChatLine {
    fn parse(line: &str) -> Self {
        let line = line.trim();
        if line.is_empty() {
            return Self::Empty;
        }
        if !line.starts_with('/') {
            return Self::Question(line.to_string());
        }
        match line {
            "/help" | "/?" => Self::Help,
            "/reset" | "/clear" => Self::Reset,
            "/exit" | "/quit" => Self::Exit,
            _ => Self::Unknown(line.split_whitespace().next().unwrap_or(line).to_string()),
        }
    }
}

fn chat_help() -> String {
    CHAT_COMMANDS
        .iter()
        .map(|(command, what)| format!("  {command:<8} {what}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where the lines of a chat come from: `--prompt` questions, a terminal (line editing and
/// in-memory history with rustyline), or lines read from a pipe or file.
enum ChatInput {
    Prompts(std::vec::IntoIter<String>),
    Terminal(Box<rustyline::DefaultEditor>),
    Lines(std::io::StdinLock<'static>),
}

impl ChatInput {
    fn new(prompts: Vec<String>) -> Result<Self> {
        if !prompts.is_empty() {
            return Ok(Self::Prompts(prompts.into_iter()));
        }
        let stdin = std::io::stdin();
        if stdin.is_terminal() {
            let editor =
                rustyline::DefaultEditor::new().context("opening the terminal for line editing")?;
            return Ok(Self::Terminal(Box::new(editor)));
        }
        Ok(Self::Lines(stdin.lock()))
    }

    fn interactive(&self) -> bool {
        !matches!(self, Self::Prompts(_))
    }

    /// The next line, `None` at the end (Ctrl-D, Ctrl-C at the prompt, the end of the input
    /// or of the questions). Lines that are not typed are echoed after `> `, so that the
    /// transcript shows what was asked.
    fn next_line(&mut self) -> Result<Option<String>> {
        match self {
            Self::Prompts(questions) => Ok(questions.next().inspect(|q| println!("> {q}"))),
            Self::Terminal(editor) => match editor.readline("> ") {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        // In memory only: an error here costs the up arrow, not the chat.
                        let _ = editor.add_history_entry(line.as_str());
                    }
                    Ok(Some(line))
                }
                Err(rustyline::error::ReadlineError::Eof)
                | Err(rustyline::error::ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(anyhow::Error::new(e).context("reading the terminal")),
            },
            Self::Lines(stdin) => {
                let mut line = String::new();
                let read = stdin
                    .read_line(&mut line)
                    .context("reading stdin (it must be UTF-8 text)")?;
                if read == 0 {
                    return Ok(None);
                }
                let line = line.trim_end_matches(['\n', '\r']).to_string();
                if !line.trim().is_empty() {
                    println!("> {line}");
                }
                Ok(Some(line))
            }
        }
    }
}

/// Whether the engine's start-up details were asked for: `--verbose`, or a set `RUST_LOG`.
fn start_details_wanted(verbose: bool) -> bool {
    verbose || std::env::var_os("RUST_LOG").is_some_and(|v| !v.is_empty())
}

pub fn run_chat(args: ChatArgs) -> Result<()> {
    crate::start_details::show_start_details(start_details_wanted(args.verbose));
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
    let mut input = ChatInput::new(args.prompt.clone())?;
    let model = match &args.engine.checkpoint {
        Some(arg) => display_name(arg, &options.checkpoint),
        None => DEFAULT_CHAT_MODEL.to_string(),
    };
    let mut start = format!(
        "{model} loaded in {:.2} s ({})",
        started.elapsed().as_secs_f64(),
        options.backend.backend.name(),
    );
    if input.interactive() {
        start += "; /help lists the commands, /exit or Ctrl-D ends the chat";
    }
    eprintln!("{}", style.dim(&start));
    let tokio = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut history: Vec<Value> = Vec::new();
    if let Some(system) = &args.system {
        history.push(json!({"role": "system", "content": system}));
    }
    let initial = history.clone();
    loop {
        let Some(line) = input.next_line()? else {
            if input.interactive() {
                println!();
            }
            return Ok(());
        };
        let question = match ChatLine::parse(&line) {
            ChatLine::Empty => continue,
            ChatLine::Question(question) => question,
            ChatLine::Help => {
                println!("{}", chat_help());
                continue;
            }
            ChatLine::Reset => {
                history = initial.clone();
                println!("{}", style.dim("(the conversation is forgotten)"));
                continue;
            }
            ChatLine::Exit => return Ok(()),
            ChatLine::Unknown(command) => {
                println!("unknown command {command}; /help lists them");
                continue;
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

/// The line after an answer: tokens and overall time, when the first token came, and the
/// decode rate over the tokens after it ((tokens - 1) / the time after the first token; n/a
/// below two tokens, where there is no time to divide by).
fn answer_summary(
    tokens: usize,
    elapsed: Duration,
    first_token: Option<Duration>,
    prompt_tokens: usize,
    finish_reason: &str,
) -> String {
    let mut parts = vec![format!(
        "{} in {:.2} s",
        counted(tokens, "token"),
        elapsed.as_secs_f64()
    )];
    if let Some(first) = first_token {
        parts.push(format!("first after {:.0} ms", first.as_secs_f64() * 1e3));
    }
    let after_first = first_token.map(|first| elapsed.saturating_sub(first));
    parts.push(match after_first {
        Some(time) if tokens >= 2 && !time.is_zero() => format!(
            "decode {:.1} tok/s",
            (tokens - 1) as f64 / time.as_secs_f64()
        ),
        _ => "decode tok/s n/a".to_string(),
    });
    parts.push(counted(prompt_tokens, "prompt token"));
    parts.push(format!("finish: {finish_reason}"));
    format!("[{}]", parts.join("; "))
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
            host_sampling: Default::default(),
        },
    };
    let (prompt, thinking, parse_tools) = runtime
        .chat_prompt(&request)
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let mut receivers = runtime
        .submit(&prompt, &request.sampling)
        .map_err(|e| anyhow::anyhow!(e.message))?;
    let started = Instant::now();
    // The engine's events pass through here to time the first token itself: a token may
    // print nothing (the reasoning's opening tag), so the first text is not the first token.
    let mut engine_events = receivers.remove(0);
    let (events_tx, events) = tokio::sync::mpsc::unbounded_channel();
    let forward = async move {
        let mut first_token = None;
        while let Some(event) = engine_events.recv().await {
            if matches!(event, TokenEvent::Token(_)) && first_token.is_none() {
                first_token = Some(started.elapsed());
            }
            let last = matches!(event, TokenEvent::Finished { .. } | TokenEvent::Failed(_));
            if events_tx.send(event).is_err() || last {
                break;
            }
        }
        first_token
    };
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut in_reasoning = false;
    let drive = drive_choice(
        runtime.tokenizer.clone(),
        events,
        OutputMode::Chat {
            thinking,
            parse_tools,
        },
        Vec::new(),
        |delta| {
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
    );
    let (end, first_token) = tokio::join!(drive, forward);
    let elapsed = started.elapsed();
    println!();
    if let Some(error) = end.error {
        bail!("generation failed: {error}");
    }
    println!(
        "{}",
        style.dim(&answer_summary(
            end.completion_tokens,
            elapsed,
            first_token,
            prompt.len(),
            end.finish_reason
        ))
    );
    Ok((reasoning, content))
}

#[derive(clap::Args, Clone, Debug)]
pub struct TokenizeArgs {
    /// A folder with `tiktoken.model` (and `tokenizer_config.json`), or a Hugging Face
    /// repository id in the local cache; default: the chat model's.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Where the default model is unpacked.
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

#[cfg(test)]
mod chat_tests {
    use super::*;

    #[test]
    fn lines_starting_with_a_slash_are_commands_never_questions() {
        assert_eq!(ChatLine::parse("  "), ChatLine::Empty);
        assert_eq!(
            ChatLine::parse(" What is 7 + 5? \n"),
            ChatLine::Question("What is 7 + 5?".into())
        );
        assert_eq!(ChatLine::parse("/help"), ChatLine::Help);
        assert_eq!(ChatLine::parse("/reset\n"), ChatLine::Reset);
        assert_eq!(ChatLine::parse("/exit"), ChatLine::Exit);
        assert_eq!(ChatLine::parse("/quit"), ChatLine::Exit);
        assert_eq!(
            ChatLine::parse("/resets please"),
            ChatLine::Unknown("/resets".into())
        );
        assert_eq!(ChatLine::parse("/"), ChatLine::Unknown("/".into()));
        // Every command /help lists is one.
        for (command, _) in CHAT_COMMANDS {
            assert!(
                !matches!(
                    ChatLine::parse(command),
                    ChatLine::Unknown(_) | ChatLine::Question(_)
                ),
                "{command}"
            );
            assert!(chat_help().contains(command));
        }
    }

    #[test]
    fn the_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_it() {
        let ms = Duration::from_millis;
        let line = answer_summary(11, ms(1200), Some(ms(200)), 25, "stop");
        // 10 tokens after the first, in the 1 s after it.
        assert_eq!(
            line,
            "[11 tokens in 1.20 s; first after 200 ms; decode 10.0 tok/s; 25 prompt tokens; \
             finish: stop]"
        );
        // One token: nothing to divide, whatever the clock says.
        let one = answer_summary(1, ms(300), Some(ms(299)), 1, "length");
        assert!(one.contains("decode tok/s n/a"), "{one}");
        assert!(one.starts_with("[1 token in 0.30 s"), "{one}");
        assert!(one.contains("1 prompt token;"), "{one}");
        // No token at all, and two tokens in no measurable time.
        assert!(answer_summary(0, ms(5), None, 3, "error").contains("n/a"));
        assert!(answer_summary(2, ms(5), Some(ms(5)), 3, "length").contains("n/a"));
    }
}
