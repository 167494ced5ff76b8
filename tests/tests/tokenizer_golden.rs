//! Our tokenizer against Python `tiktoken` (golden/gen_tokenizer.py): Kimi's pattern and special
//! tokens over Llama 4's 200,000-rank tiktoken vocabulary (the ranks the corpus reaches), on a
//! corpus of English, code, Chinese and other scripts, emoji, long whitespace and digit runs,
//! special-token strings and the 25,000-character cuts.
//!
//! `KIMI_FULL_VOCAB_DIR=DIR` (a folder with the full `tiktoken.model` and the subset's
//! `tokenizer_config.json`) runs the same check on the whole vocabulary.

use model::checkpoint::tensor_file::TensorFile;
use model::text::tokenizer::{StreamDecoder, Tokenizer};
use project_tests::golden_path;
use serde_json::Value;

struct Corpus {
    texts: Vec<String>,
    ids: Vec<Vec<u32>>,
}

fn corpus() -> Corpus {
    let dir = golden_path("tokenizer");
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("corpus.json")).unwrap()).unwrap();
    let texts: Vec<String> = cases
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            case.as_array()
                .unwrap()
                .iter()
                .map(|part| {
                    let text = part[0].as_str().unwrap();
                    text.repeat(part[1].as_u64().unwrap() as usize)
                })
                .collect()
        })
        .collect();
    let file = TensorFile::open(dir.join("ids.safetensors")).unwrap();
    let flat: Vec<u32> = file
        .bytes("ids", &[safetensors::Dtype::U32])
        .unwrap()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let offsets = file.i64_values("offsets").unwrap();
    let ids = offsets
        .windows(2)
        .map(|w| flat[w[0] as usize..w[1] as usize].to_vec())
        .collect();
    Corpus { texts, ids }
}

fn tokenizer() -> Tokenizer {
    let dir = std::env::var_os("KIMI_FULL_VOCAB_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| golden_path("tokenizer").join("llama4-subset"));
    Tokenizer::from_dir(&dir).unwrap()
}

#[test]
fn ids_equal_python_tiktoken_on_the_corpus() {
    let corpus = corpus();
    let tokenizer = tokenizer();
    assert_eq!(tokenizer.num_ranks(), 200_000);
    assert_eq!(tokenizer.special_id("<|im_end|>"), Some(200_002));
    let chars: usize = corpus.texts.iter().map(|t| t.chars().count()).sum();
    assert!(corpus.texts.len() > 700 && chars > 200_000, "{chars}");
    let mut mismatches = Vec::new();
    for (i, (text, expected)) in corpus.texts.iter().zip(&corpus.ids).enumerate() {
        let ids = tokenizer.encode(text);
        if &ids != expected {
            mismatches.push(format!(
                "case {i} {:?}: ours {:?}, tiktoken {:?}",
                text.chars().take(60).collect::<String>(),
                &ids[..ids.len().min(20)],
                &expected[..expected.len().min(20)]
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} cases differ:\n{}",
        mismatches.len(),
        corpus.texts.len(),
        mismatches[..mismatches.len().min(10)].join("\n")
    );
}

#[test]
fn streaming_decode_reproduces_every_case_without_replacement_characters() {
    let corpus = corpus();
    let tokenizer = tokenizer();
    for (text, ids) in corpus.texts.iter().zip(&corpus.ids) {
        let mut decoder = StreamDecoder::new(false);
        let mut out = String::new();
        for &id in ids {
            let piece = decoder.push(&tokenizer, id);
            assert!(!piece.contains('\u{FFFD}'), "U+FFFD emitted in {text:?}");
            out.push_str(&piece);
        }
        assert_eq!(decoder.finish(), "");
        assert_eq!(&out, text);
    }
}
