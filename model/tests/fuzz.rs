//! Fuzzing the parsers that read what users hand the engine: safetensors headers, the shard
//! index, the model and quantization configs, `--tokens` lists, and the server's request bodies
//! (`/v1/chat/completions` and `/v1/completions`). Each target starts from a
//! seeded corpus (the committed golden checkpoints, the presets, small files written here) and
//! feeds the parser mutated and random inputs from a fixed proptest seed, so CI runs the same
//! inputs every time; any panic fails the test with the (shrunk) input that caused it.
//!
//! `MODEL_FUZZ_CASES=N` (default 5000 per target) and `MODEL_FUZZ_SEED=S` run longer or other
//! streams; bench/results/fuzz.txt records such a run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use model::arch::config::CheckpointConfig;
use model::arch::rope::Rope;
use model::checkpoint::parse_index;
use model::checkpoint::tensor_file::TensorFile;
use model::input::parse_token_list;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::{Value, json};

fn golden_models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/data/models")
}

fn cases() -> u32 {
    std::env::var("MODEL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

/// Runs `test` on `cases()` inputs of `strategy` from a fixed seed; `test` says whether the
/// parser accepted the input. Returns how many inputs ran.
fn fuzz<S: Strategy>(target: &str, strategy: S, test: impl Fn(S::Value) -> bool) -> usize
where
    S::Value: std::fmt::Debug,
{
    let seed: u64 = std::env::var("MODEL_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5EED_F022);
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..8 + target.len().min(24)].copy_from_slice(&target.as_bytes()[..target.len().min(24)]);
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &key));
    let (ran, accepted) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let started = std::time::Instant::now();
    let result = runner.run(&strategy, |input| {
        ran.fetch_add(1, Ordering::Relaxed);
        if test(input) {
            accepted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    let ran = ran.into_inner();
    println!(
        "fuzz {target}: {ran} inputs ({} accepted), {} in {:.2} s",
        accepted.into_inner(),
        if result.is_ok() { "0 panics" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("fuzz {target}: {e}");
    }
    ran
}

/// Byte-level edits a damaged download or a careless hand makes.
#[derive(Clone, Debug)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
    /// A new 8-byte little-endian value at a position (the header length, an offset).
    Word(usize, u64),
}

fn edits(near: usize) -> impl Strategy<Value = Vec<Edit>> {
    // Positions mostly inside the first `near` bytes (the header), sometimes anywhere.
    let position = prop_oneof![4 => 0..near.max(1), 1 => any::<usize>()];
    let edit = prop_oneof![
        (position.clone(), 1..=255u8).prop_map(|(p, x)| Edit::Flip(p, x)),
        (position.clone(), any::<u8>()).prop_map(|(p, x)| Edit::Set(p, x)),
        (position.clone(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, b)| Edit::Insert(p, b)),
        (position.clone(), 1..64usize).prop_map(|(p, n)| Edit::Delete(p, n)),
        position.clone().prop_map(Edit::Truncate),
        (
            position,
            prop_oneof![
                Just(0u64),
                Just(u64::MAX),
                Just(1 << 40),
                0..4096u64,
                any::<u64>()
            ]
        )
            .prop_map(|(p, w)| Edit::Word(p, w)),
    ];
    prop::collection::vec(edit, 1..4)
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for edit in edits {
        let len = bytes.len();
        let at = |p: usize| if len == 0 { 0 } else { p % len };
        match edit {
            Edit::Flip(p, x) if len > 0 => bytes[at(*p)] ^= x,
            Edit::Set(p, x) if len > 0 => bytes[at(*p)] = *x,
            Edit::Insert(p, b) => {
                let p = if len == 0 { 0 } else { p % (len + 1) };
                bytes.splice(p..p, b.iter().copied());
            }
            Edit::Delete(p, n) if len > 0 => {
                let p = at(*p);
                bytes.drain(p..(p + n).min(len));
            }
            Edit::Truncate(p) => bytes.truncate(if len == 0 { 0 } else { p % (len + 1) }),
            Edit::Word(p, w) if len >= 8 => {
                let p = at(*p).min(len - 8);
                bytes[p..p + 8].copy_from_slice(&w.to_le_bytes());
            }
            _ => {}
        }
    }
    bytes
}

fn small_safetensors() -> Vec<Vec<u8>> {
    let f32s: Vec<u8> = [1.0f32, -2.5, 0.0, f32::NAN]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let mut files = Vec::new();
    let tensors: [(&str, Dtype, Vec<usize>, Vec<u8>); 4] = [
        (
            "w.weight",
            Dtype::BF16,
            vec![2, 2],
            vec![0x80, 0x3f, 0, 0xc0, 0, 0, 0xc0, 0x7f],
        ),
        (
            "w.weight_scale",
            Dtype::F8_E4M3,
            vec![2, 1],
            vec![0x38, 0x7f],
        ),
        (
            "w.weight_scale_2",
            Dtype::F32,
            vec![],
            1.5f32.to_le_bytes().to_vec(),
        ),
        ("x", Dtype::F32, vec![4], f32s),
    ];
    for n in 1..=tensors.len() {
        let views: Vec<(String, TensorView)> = tensors[..n]
            .iter()
            .map(|(name, d, s, b)| (name.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let metadata = Some(std::collections::HashMap::from([(
            "format".to_string(),
            "pt".to_string(),
        )]));
        files.push(safetensors::serialize(views, metadata).unwrap());
    }
    files
}

fn golden_files(extension: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut found = Vec::new();
    for model in std::fs::read_dir(golden_models()).unwrap() {
        for file in std::fs::read_dir(model.unwrap().path()).unwrap() {
            let path = file.unwrap().path();
            if path.to_string_lossy().ends_with(extension) {
                let bytes = std::fs::read(&path).unwrap();
                found.push((path, bytes));
            }
        }
    }
    found.sort();
    found
}

/// Everything a parsed file offers, so a bad offset or shape surfaces as a panic here.
fn exercise(file: &TensorFile) {
    for name in file.names() {
        let info = file.info(name).unwrap();
        let bytes = file.bytes(name, &[info.dtype]).unwrap();
        assert_eq!(
            bytes.len() * 8,
            info.numel() * info.dtype.bitsize(),
            "{name}"
        );
        let _ = file.first_non_finite(name).unwrap();
        let _ = file.f32_values(name);
        let _ = file.positive_scale(name);
        let _ = file.expect_shape(name, &info.shape.clone());
    }
}

#[test]
fn fuzz_safetensors_headers() {
    let mut corpus = small_safetensors();
    let mut truncated = Vec::new();
    for (path, bytes) in golden_files(".safetensors") {
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        if path.ends_with("golden.safetensors") {
            corpus.push(bytes);
        } else {
            // Shards with their data cut short past the header: truncated downloads.
            truncated.push(bytes[..(header + 4096).min(bytes.len())].to_vec());
        }
    }
    for bytes in corpus.iter().chain(&truncated) {
        if let Ok(file) = TensorFile::from_bytes("corpus.safetensors", bytes) {
            exercise(&file);
        }
    }
    // Header-aware edits: one value of the header JSON changed (an offset, a dtype, a shape),
    // the length prefix rewritten to match, so the parser's checks past JSON are reached.
    let headers: Vec<(Value, Vec<JsonPath>, Vec<u8>)> = corpus
        .iter()
        .map(|bytes| {
            let n = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: Value = serde_json::from_slice(&bytes[8..n]).unwrap();
            let mut paths = Vec::new();
            leaf_paths(&header, &mut Vec::new(), &mut paths);
            (header, paths, bytes[n..].to_vec())
        })
        .collect();
    let structured =
        (0..corpus.len(), any::<prop::sample::Index>(), change()).prop_map(move |(i, at, new)| {
            let (header, paths, data) = &headers[i];
            let mut header = header.clone();
            change_at(&mut header, at.get::<JsonPath>(paths), &new);
            let header = header.to_string().into_bytes();
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend(header);
            bytes.extend(data);
            bytes
        });
    corpus.extend(truncated);
    let near = corpus.iter().map(|b| b.len().min(4096)).max().unwrap();
    let byte_level =
        (0..corpus.len(), edits(near)).prop_map(move |(i, e)| apply(corpus[i].clone(), &e));
    let strategy = prop_oneof![
        4 => byte_level,
        4 => structured,
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ];
    fuzz("safetensors-header", strategy, |bytes| {
        let parsed = TensorFile::from_bytes("fuzzed.safetensors", &bytes);
        if let Ok(file) = &parsed {
            exercise(file);
        }
        parsed.is_ok()
    });
}

fn tricky_shard_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model-00001-of-00002.safetensors".to_string()),
        Just("../model.safetensors".to_string()),
        Just("/etc/passwd".to_string()),
        Just("sub/../../x".to_string()),
        Just(".".to_string()),
        Just(String::new()),
        Just("a/./b".to_string()),
        Just("C:\\x".to_string()),
        "[a-z./\\\\]{0,12}",
        any::<String>(),
    ]
}

#[test]
fn fuzz_index_files() {
    let corpus: Vec<String> = golden_files(".index.json")
        .into_iter()
        .map(|(_, b)| String::from_utf8(b).unwrap())
        .collect();
    let texts = corpus.clone();
    let byte_level = (0..corpus.len(), edits(4096)).prop_map(move |(i, e)| {
        String::from_utf8_lossy(&apply(texts[i].clone().into_bytes(), &e)).to_string()
    });
    let structured = prop::collection::btree_map("[a-z.0-9]{1,20}", tricky_shard_name(), 0..6)
        .prop_map(|map| json!({"metadata": {"total_size": 1}, "weight_map": map}).to_string());
    let strategy = prop_oneof![3 => byte_level, 3 => structured, 1 => any::<String>()];
    fuzz("index", strategy, |text| {
        let parsed = parse_index(&text);
        if let Ok(map) = &parsed {
            for shard in map.values() {
                let path = Path::new(shard);
                assert!(
                    !path.is_absolute()
                        && path
                            .components()
                            .all(|c| matches!(c, std::path::Component::Normal(_))),
                    "{shard:?} escapes the checkpoint folder"
                );
            }
        }
        parsed.is_ok()
    });
}

/// The keys and array positions leading to one value of a JSON document.
type JsonPath = Vec<Value>;

/// Paths to every value of a JSON document.
fn leaf_paths(value: &Value, prefix: &mut JsonPath, out: &mut Vec<JsonPath>) {
    out.push(prefix.clone());
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                prefix.push(Value::String(key.clone()));
                leaf_paths(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                prefix.push(json!(i));
                leaf_paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![
            Just(0i64),
            Just(-1),
            Just(1),
            Just(i64::MAX),
            Just(i64::MIN),
            -5..70000i64
        ]
        .prop_map(Value::from),
        prop_oneof![Just(u64::MAX), Just(1u64 << 40), Just(1_000_000_000_000)]
            .prop_map(Value::from),
        prop_oneof![
            Just(0.0f64),
            Just(-1e-5),
            Just(1e-300),
            Just(1e300),
            Just(-64.0),
            Just(0.5),
            any::<f64>()
        ]
        .prop_map(|x| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)),
        prop_oneof![
            Just("yarn".to_string()),
            Just("FP8".into()),
            Just("NVFP4".into()),
            "[a-z_]{0,8}"
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One change to a JSON document.
#[derive(Clone, Debug)]
enum Change {
    Set(Value),
    Remove,
    /// A number `x` becomes `x · factor + offset` (0, 1, -x, x/2, tiny, huge, x ± 1).
    Numeric(f64, f64),
}

fn change() -> impl Strategy<Value = Change> {
    let numeric = prop::sample::select(vec![
        (0.0, 0.0),
        (0.0, 1.0),
        (-1.0, 0.0),
        (0.5, 0.0),
        (1e-40, 0.0),
        (1e40, 0.0),
        (1.0, 1.0),
        (1.0, -1.0),
    ]);
    prop_oneof![
        4 => json_value().prop_map(Change::Set),
        1 => Just(Change::Remove),
        4 => numeric.prop_map(|(f, o)| Change::Numeric(f, o)),
    ]
}

/// Applies `change` at `path` (nothing if earlier changes removed the way there).
fn change_at(root: &mut Value, path: &[Value], change: &Change) {
    let position = |i: &serde_json::Number| i.as_u64().unwrap_or(u64::MAX) as usize;
    let mut node = root;
    for key in path {
        let next = match (node, key) {
            (Value::Object(m), Value::String(k)) => {
                if matches!(change, Change::Remove) && path.last() == Some(key) {
                    m.remove(k);
                    return;
                }
                m.get_mut(k)
            }
            (Value::Array(a), Value::Number(i)) => a.get_mut(position(i)),
            _ => None,
        };
        let Some(next) = next else {
            return;
        };
        node = next;
    }
    match change {
        Change::Set(value) => *node = value.clone(),
        Change::Numeric(factor, offset) => {
            if let Some(x) = node.as_f64() {
                let y = x * factor + offset;
                let integer = node.is_u64() && y >= 0.0 && y == y.trunc() && y < 1e19;
                *node = if integer {
                    Value::from(y as u64)
                } else {
                    serde_json::Number::from_f64(y).map_or(Value::Null, Value::Number)
                };
            }
        }
        Change::Remove => {}
    }
}

/// What an accepted config promises the forward pass: finite scales and rotations.
fn check_accepted(config: &CheckpointConfig) {
    let c = &config.model;
    let scale = c.softmax_scale();
    assert!(scale.is_finite() && scale > 0.0, "softmax scale {scale}");
    let rope = Rope::new(c);
    for pos in [0, 1, 4095, c.max_position_embeddings - 1] {
        let mut x = vec![1.0f32; c.qk_rope_head_dim];
        rope.apply(&mut x, pos);
        assert!(x.iter().all(|v| v.is_finite()), "rope at {pos}: {x:?}");
    }
    for world in 1..=8 {
        let _ = c.check_tensor_parallel(world);
    }
}

#[test]
fn fuzz_configs() {
    let mut documents: Vec<(Value, Option<Value>)> = Vec::new();
    for model in ["kimi-tiny", "dsv3-noqlora-grouped", "dsv3-mini-unsharded"] {
        let dir = golden_models().join(model);
        let read = |name: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap()
        };
        documents.push((read("config.json"), Some(read("hf_quant_config.json"))));
    }
    for preset in [
        model::arch::presets::Preset::Tiny,
        model::arch::presets::Preset::KimiK25,
    ] {
        documents.push((preset.config_json(), None));
    }
    for (config, quant) in &documents {
        let quant = quant
            .as_ref()
            .map(|q| (Path::new("hf_quant_config.json"), q));
        let parsed = CheckpointConfig::from_json(Path::new("config.json"), config, quant);
        check_accepted(&parsed.unwrap());
    }
    let paths: Vec<(Vec<JsonPath>, Vec<JsonPath>)> = documents
        .iter()
        .map(|(config, quant)| {
            let mut config_paths = Vec::new();
            leaf_paths(config, &mut Vec::new(), &mut config_paths);
            let mut quant_paths = Vec::new();
            if let Some(q) = quant {
                leaf_paths(q, &mut Vec::new(), &mut quant_paths);
            }
            (config_paths, quant_paths)
        })
        .collect();
    let change = || (any::<prop::sample::Index>(), change());
    let strategy = (
        0..documents.len(),
        prop::collection::vec(change(), 1..5),
        prop::collection::vec(change(), 0..2),
        any::<bool>(),
    );
    fuzz(
        "config",
        strategy,
        |(doc, config_changes, quant_changes, keep_quant)| {
            let (mut config, mut quant) = documents[doc].clone();
            let (config_paths, quant_paths) = &paths[doc];
            for (index, new) in config_changes {
                change_at(&mut config, index.get::<JsonPath>(config_paths), &new);
            }
            if let Some(q) = quant.as_mut()
                && !quant_paths.is_empty()
            {
                for (index, new) in quant_changes {
                    change_at(q, index.get::<JsonPath>(quant_paths), &new);
                }
            }
            let quant = quant
                .as_ref()
                .filter(|_| keep_quant)
                .map(|q| (Path::new("hf_quant_config.json"), q));
            let parsed = CheckpointConfig::from_json(Path::new("config.json"), &config, quant);
            if let Ok(parsed) = &parsed {
                check_accepted(parsed);
            }
            parsed.is_ok()
        },
    );
}

#[test]
fn fuzz_token_lists() {
    let strategy = prop_oneof![
        any::<String>(),
        "[0-9, +\\-\t]{0,40}",
        prop::collection::vec(any::<u32>(), 1..20)
            .prop_map(|ids| { ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",") }),
    ];
    fuzz("tokens", strategy, |text| {
        let parsed = parse_token_list(&text);
        if let Ok(ids) = &parsed {
            assert!(!ids.is_empty());
            let again = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
            assert_eq!(&parse_token_list(&again).unwrap(), ids, "{text:?}");
        }
        parsed.is_ok()
    });
}

/// Request bodies that parse: the smoke test's, and ones using every field the decoder reads.
fn request_seeds() -> Vec<(bool, Value)> {
    let user = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    vec![
        (
            true,
            json!({"model": "nvidia/Kimi-K2.5-NVFP4", "messages": user, "max_tokens": 256,
                   "temperature": 0.6}),
        ),
        (
            true,
            json!({"messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                             {"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "content": null, "reasoning": "Call the tool.",
                 "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "content": "sunny", "name": "get_weather"}],
                   "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                   "stream": true, "stream_options": {"include_usage": true}, "n": 2, "top_p": 0.9,
                   "top_k": 40, "seed": 7, "stop": ["\n\n", "END"], "max_completion_tokens": 64,
                   "chat_template_kwargs": {"thinking": false}, "ignore_eos": true}),
        ),
        (
            false,
            json!({"prompt": "Once upon a time", "max_tokens": 16, "echo": true, "stop": "."}),
        ),
        (
            false,
            json!({"model": "kimi-chat-tiny", "prompt": [1, 2, 3], "temperature": 0,
                   "logprobs": false, "stream": false}),
        ),
    ]
}

/// The fields the decoder reads, as new keys for a seed.
const REQUEST_FIELDS: [&str; 24] = [
    "model",
    "messages",
    "prompt",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "ignore_eos",
    "logprobs",
    "echo",
    "role",
    "content",
    "tool_calls",
    "reasoning",
    "thinking",
];

/// What an accepted request promises the engine: values the sampler can use and a template
/// context the request cannot take over.
fn check_accepted_sampling(sampling: &model::serve::api::SamplingRequest) {
    assert!((1..=16).contains(&sampling.n), "n {}", sampling.n);
    assert!(
        sampling.top_p.is_normal() && sampling.top_p > 0.0 && sampling.top_p <= 1.0,
        "top_p {}",
        sampling.top_p
    );
    assert!(
        (0.0..=2.0).contains(&sampling.temperature),
        "temperature {}",
        sampling.temperature
    );
    assert!(sampling.max_tokens.is_none_or(|m| m >= 1));
    assert!(sampling.stop.iter().all(|s| !s.is_empty()));
}

#[test]
fn fuzz_request_decoder() {
    use model::serve::api::{SERVER_TEMPLATE_VARIABLES, parse_body, parse_chat, parse_completion};
    let seeds = request_seeds();
    for (chat, body) in &seeds {
        let body = body.as_object().unwrap();
        if *chat {
            parse_chat(body).unwrap();
        } else {
            parse_completion(body).unwrap();
        }
    }
    let paths: Vec<Vec<JsonPath>> = seeds
        .iter()
        .map(|(_, body)| {
            let mut out = Vec::new();
            leaf_paths(body, &mut Vec::new(), &mut out);
            out
        })
        .collect();
    // A body is a seed changed at its own paths, given fields it lacks (at the top or in a
    // message), or with its bytes edited; or random bytes.
    let added = (
        prop::sample::select(&REQUEST_FIELDS[..]),
        json_value(),
        any::<bool>(),
    );
    let document = (
        0..seeds.len(),
        prop::collection::vec((any::<prop::sample::Index>(), change()), 0..4),
        prop::collection::vec(added, 0..3),
        prop::option::weighted(0.2, edits(256)),
    )
        .prop_map(|(seed, changes, additions, byte_edits)| {
            let mut body = seeds[seed].1.clone();
            for (index, new) in changes {
                change_at(&mut body, index.get::<JsonPath>(&paths[seed]), &new);
            }
            for (key, value, in_message) in additions {
                let target = if in_message {
                    body.pointer_mut("/messages/0")
                } else {
                    Some(&mut body)
                };
                if let Some(Value::Object(map)) = target {
                    map.insert(key.to_string(), value);
                }
            }
            let bytes = serde_json::to_vec(&body).unwrap();
            (
                seeds[seed].0,
                match byte_edits {
                    Some(e) => apply(bytes, &e),
                    None => bytes,
                },
            )
        });
    let strategy = prop_oneof![
        9 => document,
        1 => (any::<bool>(), prop::collection::vec(any::<u8>(), 0..64)),
    ];
    fuzz("request", strategy, |(chat, bytes)| {
        let refused = |e: model::serve::api::ApiError| {
            assert!(e.status.is_client_error(), "{}: {}", e.status, e.message);
            assert!(!e.message.is_empty());
            false
        };
        let body = match parse_body(&bytes) {
            Ok(body) => body,
            Err(e) => return refused(e),
        };
        if chat {
            match parse_chat(&body) {
                Ok(request) => {
                    check_accepted_sampling(&request.sampling);
                    for key in SERVER_TEMPLATE_VARIABLES {
                        assert!(!request.template_kwargs.contains_key(key), "{key}");
                    }
                    if let Some(thinking) = request.template_kwargs.get("thinking") {
                        assert!(thinking.is_boolean(), "thinking {thinking}");
                    }
                    true
                }
                Err(e) => refused(e),
            }
        } else {
            match parse_completion(&body) {
                Ok(request) => {
                    check_accepted_sampling(&request.sampling);
                    true
                }
                Err(e) => refused(e),
            }
        }
    });
}
