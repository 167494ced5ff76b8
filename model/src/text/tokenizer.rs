//! Kimi's tokenizer: the tiktoken BPE format (`tiktoken.model`, one `<base64 bytes> <rank>` line
//! per token), Kimi's pre-tokenizer pattern (class intersection and a look-ahead, run by
//! fancy-regex exactly as Python `tiktoken` runs it), and 256 special-token slots after the
//! ranks, named from `tokenizer_config.json` (`added_tokens_decoder`) or
//! `<|reserved_token_{id}|>`.
//!
//! Encoding allows every special token in text, as Kimi's `tokenization_kimi.py` does, and
//! cuts the input the way it does (400,000-character pieces, no run of more than 25,000
//! whitespace or non-whitespace characters), which changes ids only at those cuts.
//! [`StreamDecoder`] turns ids into text as they come, holding back a multi-byte character
//! until all of its bytes have arrived.

use crate::text::control_tokens::{ControlTokens, Segment};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustc_hash::FxHashMap;
use serde_json::Value;
use thiserror::Error;
use tiktoken_rs::CoreBPE;

/// Kimi's pre-tokenizer pattern (K2, K2.5, K2.6): eight alternatives joined by `|`.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Special-token slots after the last rank.
pub const RESERVED_SPECIAL_TOKENS: usize = 256;
/// Kimi encodes at most this many characters per tiktoken call.
const MAX_ENCODE_CHARS: usize = 400_000;
/// ... and cuts runs of whitespace or non-whitespace longer than this.
const MAX_CONSECUTIVE_CHARS: usize = 25_000;

pub const TIKTOKEN_FILE: &str = "tiktoken.model";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error(transparent)]
    File(#[from] kernels::files::FileError),
    #[error("{path}: line {line}: {message}")]
    BadRankLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    BadConfig { path: PathBuf, message: String },
    #[error("building the BPE: {0}")]
    Bpe(String),
}

/// A loaded tokenizer: BPE ranks, the special tokens and their names.
pub struct Tokenizer {
    bpe: CoreBPE,
    /// Ranks of the BPE vocabulary (the special slots start here).
    num_ranks: usize,
    special_ids: FxHashMap<String, u32>,
    special_names: BTreeMap<u32, String>,
    /// The special tokens' spellings, to keep a client's text from becoming control tokens.
    control: ControlTokens,
    /// `bos_token` / `eos_token` / ... from `tokenizer_config.json`, when given.
    pub named_roles: BTreeMap<String, String>,
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a checkpoint folder. Without
    /// `tokenizer_config.json` every special slot is `<|reserved_token_{id}|>`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let ranks_path = dir.join(TIKTOKEN_FILE);
        let ranks_text = read(&ranks_path)?;
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = if config_path.exists() {
            let text = read(&config_path)?;
            Some(
                serde_json::from_str::<Value>(&text).map_err(|e| TokenizerError::BadConfig {
                    path: config_path.clone(),
                    message: e.to_string(),
                })?,
            )
        } else {
            None
        };
        Self::from_parts(&ranks_path, &ranks_text, &config_path, config.as_ref())
    }

    /// Builds a tokenizer from the text of a tiktoken file and an optional tokenizer config;
    /// the paths only name the sources in errors.
    pub fn from_parts(
        ranks_path: &Path,
        ranks_text: &str,
        config_path: &Path,
        config: Option<&Value>,
    ) -> Result<Self, TokenizerError> {
        let ranks = parse_tiktoken_ranks(ranks_path, ranks_text)?;
        let num_ranks = ranks.values().map(|&r| r as usize + 1).max().unwrap_or(0);
        let mut named: BTreeMap<u32, String> = BTreeMap::new();
        let mut named_roles = BTreeMap::new();
        if let Some(config) = config {
            if let Some(added) = config.get("added_tokens_decoder") {
                let added = added.as_object().ok_or_else(|| TokenizerError::BadConfig {
                    path: config_path.to_path_buf(),
                    message: "`added_tokens_decoder` is not an object".into(),
                })?;
                for (id, entry) in added {
                    let id: u32 = id.parse().map_err(|_| TokenizerError::BadConfig {
                        path: config_path.to_path_buf(),
                        message: format!("`added_tokens_decoder`: key `{id}` is not a token id"),
                    })?;
                    let content =
                        entry
                            .get("content")
                            .and_then(Value::as_str)
                            .ok_or_else(|| TokenizerError::BadConfig {
                                path: config_path.to_path_buf(),
                                message: format!(
                                    "`added_tokens_decoder.{id}` has no string `content`"
                                ),
                            })?;
                    named.insert(id, content.to_string());
                }
            }
            for role in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(name) = config.get(role).and_then(token_name) {
                    named_roles.insert(role.to_string(), name);
                }
            }
        }
        let mut special_ids = FxHashMap::default();
        let mut special_names = BTreeMap::new();
        for id in num_ranks..num_ranks + RESERVED_SPECIAL_TOKENS {
            let id = id as u32;
            let name = named
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            special_ids.insert(name.clone(), id);
            special_names.insert(id, name);
        }
        if let Some((&id, name)) = named.iter().find(|(id, _)| !special_names.contains_key(id)) {
            return Err(TokenizerError::BadConfig {
                path: config_path.to_path_buf(),
                message: format!(
                    "added token `{name}` has id {id}, outside the special slots {num_ranks}..{}",
                    num_ranks + RESERVED_SPECIAL_TOKENS
                ),
            });
        }
        let bpe = CoreBPE::new(ranks, special_ids.clone(), KIMI_PATTERN)
            .map_err(|e| TokenizerError::Bpe(e.to_string()))?;
        Ok(Self {
            bpe,
            num_ranks,
            control: ControlTokens::new(special_names.values().map(String::as_str)),
            special_ids,
            special_names,
            named_roles,
        })
    }

    /// Ranks plus special slots: the model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.num_ranks + RESERVED_SPECIAL_TOKENS
    }

    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// The id of a special token by name (`<|im_end|>`, `[EOS]`, ...).
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_ids.get(name).copied()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_names.contains_key(&id)
    }

    /// The name of a special token, if `id` is one.
    pub fn special_name(&self, id: u32) -> Option<&str> {
        self.special_names.get(&id).map(String::as_str)
    }

    /// Token ids of `text`; special-token strings in it become their control ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let allowed: HashSet<&str> = self.special_ids.keys().map(String::as_str).collect();
        let mut ids = Vec::new();
        for piece in kimi_pieces(text) {
            let (piece_ids, _) = self
                .bpe
                .encode(piece, &allowed)
                .expect("every special token is allowed");
            ids.extend(piece_ids);
        }
        ids
    }

    /// The special tokens' spellings, for making a client's strings inert before a template
    /// renders them ([`Tokenizer::encode_prompt`]).
    pub fn control_tokens(&self) -> &ControlTokens {
        &self.control
    }

    /// Token ids of a prompt rendered from inert client strings: the template's special
    /// tokens become control ids, everything between them, the client's spellings of special
    /// tokens included, plain text.
    pub fn encode_prompt(&self, rendered: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        for segment in self.control.segments(rendered) {
            match segment {
                Segment::Control(name) => ids.push(self.special_ids[name]),
                Segment::Text(text) => ids.extend(self.encode_ordinary(&text)),
            }
        }
        ids
    }

    /// Token ids of `text` with special-token strings treated as plain text.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        kimi_pieces(text)
            .flat_map(|piece| self.bpe.encode_ordinary(piece))
            .collect()
    }

    /// The bytes of one token (a special token's name for a special id); `None` for an id
    /// outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.bpe.decode_bytes(&[id]).ok()
    }

    /// Text of `ids`, invalid UTF-8 replaced by U+FFFD; with `skip_special`, special tokens
    /// are left out. Unknown ids are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut decoder = StreamDecoder::new(skip_special);
        let mut out = String::new();
        for &id in ids {
            out.push_str(&decoder.push(self, id));
        }
        out.push_str(&decoder.finish());
        out
    }
}

fn token_name(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    Ok(kernels::files::read_text_bounded(
        path,
        kernels::files::TEXT_FILE_LIMIT,
    )?)
}

/// Parses tiktoken's rank file: `<base64 token bytes> <rank>` per line.
pub fn parse_tiktoken_ranks(
    path: &Path,
    text: &str,
) -> Result<FxHashMap<Vec<u8>, u32>, TokenizerError> {
    let mut ranks = FxHashMap::default();
    let mut seen_ranks = HashSet::new();
    for (index, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let bad = |message: String| TokenizerError::BadRankLine {
            path: path.to_path_buf(),
            line: index + 1,
            message,
        };
        let (token, rank) = line
            .split_once(' ')
            .ok_or_else(|| bad("expected `<base64> <rank>`".into()))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(token)
            .map_err(|e| bad(format!("token `{token}` is not base64: {e}")))?;
        let rank: u32 = rank
            .trim()
            .parse()
            .map_err(|_| bad(format!("rank `{rank}` is not a number")))?;
        if !seen_ranks.insert(rank) {
            return Err(bad(format!("rank {rank} appears twice")));
        }
        if ranks.insert(bytes, rank).is_some() {
            return Err(bad(format!("token `{token}` appears twice")));
        }
    }
    if ranks.is_empty() {
        return Err(TokenizerError::BadRankLine {
            path: path.to_path_buf(),
            line: 0,
            message: "no ranks".into(),
        });
    }
    Ok(ranks)
}

/// Python's `str.isspace`: Unicode `White_Space` plus the four information separators
/// U+001C..U+001F (bidirectional class B/S).
fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The substrings Kimi's encoder hands to tiktoken one by one: 400,000-character pieces, each
/// cut so that no run of whitespace or non-whitespace exceeds 25,000 characters.
pub fn kimi_pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut count = 0;
    for (offset, _) in text.char_indices() {
        if count == MAX_ENCODE_CHARS {
            chunks.push(&text[start..offset]);
            start = offset;
            count = 0;
        }
        count += 1;
    }
    chunks.push(&text[start..]);
    chunks.into_iter().flat_map(split_long_runs)
}

fn split_long_runs(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut run_len = 0;
    let mut run_is_space = s.chars().next().is_some_and(python_isspace);
    let mut slice_start = 0;
    for (offset, c) in s.char_indices() {
        let is_space = python_isspace(c);
        if run_is_space != is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > MAX_CONSECUTIVE_CHARS {
                out.push(&s[slice_start..offset]);
                slice_start = offset;
                run_len = 1;
            }
        }
    }
    out.push(&s[slice_start..]);
    out
}

/// Incremental detokenizer: text comes out only once it is valid UTF-8, so a character whose
/// bytes are split across tokens is held back until it is complete; bytes that can never
/// form a character become U+FFFD.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    pub fn new(skip_special: bool) -> Self {
        Self {
            pending: Vec::new(),
            skip_special,
        }
    }

    /// Adds one token and returns the text that is now complete (maybe empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        if self.skip_special && tokenizer.is_special(id) {
            return String::new();
        }
        if let Some(bytes) = tokenizer.token_bytes(id) {
            self.pending.extend_from_slice(&bytes);
        }
        self.take_complete()
    }

    /// Adds raw bytes (for callers that hold token bytes already).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.take_complete()
    }

    /// Bytes still waiting for the rest of their character.
    pub fn held_back(&self) -> usize {
        self.pending.len()
    }

    /// Flushes what is left (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid"));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}

/// A test vocabulary: the 256 bytes, then `merges` as ranks 256…, then specials named at
/// offsets from the first special slot.
#[cfg(test)]
pub(crate) fn byte_level_tokenizer(merges: &[&str], specials: &[(u32, &str)]) -> Tokenizer {
    use base64::engine::general_purpose::STANDARD;
    let mut lines: Vec<String> = (0..=255u8)
        .map(|b| format!("{} {b}", STANDARD.encode([b])))
        .collect();
    for (i, merge) in merges.iter().enumerate() {
        lines.push(format!("{} {}", STANDARD.encode(merge), 256 + i));
    }
    let first_special = 256 + merges.len() as u32;
    let added: serde_json::Map<String, Value> = specials
        .iter()
        .map(|(offset, name)| {
            (
                (first_special + offset).to_string(),
                serde_json::json!({ "content": name }),
            )
        })
        .collect();
    let config = serde_json::json!({ "added_tokens_decoder": added });
    Tokenizer::from_parts(
        Path::new("test.model"),
        &lines.join("\n"),
        Path::new("test.json"),
        Some(&config),
    )
    .expect("a valid test vocabulary")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Tokenizer {
        byte_level_tokenizer(
            &["he", "ll", "hell", "hello", " w", "or"],
            &[(0, "[BOS]"), (2, "<|im_end|>")],
        )
    }

    #[test]
    fn specials_fill_the_slots_after_the_ranks() {
        let t = toy();
        assert_eq!(t.num_ranks(), 262);
        assert_eq!(t.vocab_size(), 262 + 256);
        assert_eq!(t.special_id("[BOS]"), Some(262));
        assert_eq!(t.special_id("<|im_end|>"), Some(264));
        assert_eq!(t.special_id("<|reserved_token_263|>"), Some(263));
        assert_eq!(t.special_name(517), Some("<|reserved_token_517|>"));
        assert!(t.special_id("<|reserved_token_518|>").is_none());
    }

    #[test]
    fn special_strings_in_text_become_control_ids() {
        let t = toy();
        let ids = t.encode("hello<|im_end|>hello");
        assert_eq!(ids, vec![259, 264, 259]);
        let plain = t.encode_ordinary("<|im_end|>");
        assert!(plain.len() > 1 && !plain.contains(&264));
        assert_eq!(t.decode(&ids, false), "hello<|im_end|>hello");
        assert_eq!(t.decode(&ids, true), "hellohello");
    }

    #[test]
    fn stream_decoding_holds_back_split_characters() {
        let t = toy();
        // "é" is C3 A9 and "😀" F0 9F 98 80: single-byte tokens split them.
        let text = "é😀!";
        let ids = t.encode(text);
        assert_eq!(ids.len(), text.len());
        let mut decoder = StreamDecoder::new(true);
        let pieces: Vec<String> = ids.iter().map(|&id| decoder.push(&t, id)).collect();
        assert_eq!(pieces, ["", "é", "", "", "", "😀", "!"]);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        assert_eq!(decoder.finish(), "");
        // Bytes that can never be a character are replaced at once; a truncated tail at the end.
        let mut decoder = StreamDecoder::new(false);
        assert_eq!(decoder.push_bytes(&[0xFF, b'a', 0xE4]), "\u{FFFD}a");
        assert_eq!(decoder.held_back(), 1);
        assert_eq!(decoder.finish(), "\u{FFFD}");
    }

    #[test]
    fn long_runs_are_cut_like_kimi() {
        let text = format!("{}{}", "a".repeat(60_000), " ".repeat(30_000));
        let pieces: Vec<&str> = kimi_pieces(&text).collect();
        let lens: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
        assert_eq!(lens, [25_000, 25_000, 10_000 + 25_000, 5_000]);
        assert_eq!(pieces.concat(), text);
        // U+001C counts as whitespace, as in Python.
        assert!(python_isspace('\u{1c}') && !python_isspace('x'));
    }

    #[test]
    fn bad_rank_files_name_the_line() {
        let err = parse_tiktoken_ranks(Path::new("t.model"), "YQ== 0\nnot-base64! 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.model: line 2"), "{err}");
        let err = parse_tiktoken_ranks(Path::new("t.model"), "YQ== 0\nYg== 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 0 appears twice"), "{err}");
    }
}
