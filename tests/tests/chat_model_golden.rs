//! The trained `kimi-chat-tiny` end to end against golden/gen_chat_model.py: our template and
//! tokenizer give the prompt ids Python (jinja2 + tiktoken) gave, our CPU engine's greedy
//! answer equals the PyTorch W4A4 model's (ModelOpt NVFP4 experts), and the parsers split it
//! into reasoning, content and tool calls.

use kernels::mla::cache::KvCacheDtype;
use model::checkpoint::Checkpoint;
use model::checkpoint::weights::Model;
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::generate::{GenerationRequest, generate};
use model::exec::sampler::SamplingParams;
use model::text::chat_template::{ChatTemplate, RenderRequest};
use model::text::parsers::parse_output;
use model::text::tokenizer::Tokenizer;
use project_tests::golden_path;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn trained_chat_model_answers_like_pytorch() {
    let dir = golden_path("models").join("kimi-chat-tiny");
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let template = ChatTemplate::from_dir(&dir).unwrap();
    let checkpoint = Checkpoint::open(&dir).unwrap();
    let model = Model::new(
        checkpoint.model_config().clone(),
        checkpoint.load_weights().unwrap(),
    );
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_path("serving").join("chat_model_golden.json")).unwrap(),
    )
    .unwrap();
    let stop = [
        tokenizer.special_id("<|im_end|>").unwrap(),
        tokenizer.special_id("[EOS]").unwrap(),
    ];
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let messages = case["messages"].as_array().unwrap();
        let rendered = template
            .render(&RenderRequest {
                messages,
                tools: case["tools"].as_array().map(Vec::as_slice),
                add_generation_prompt: true,
                kwargs: case["kwargs"].as_object(),
            })
            .unwrap();
        assert_eq!(rendered, case["prompt"].as_str().unwrap());
        let prompt = tokenizer.encode(&rendered);
        assert_eq!(
            prompt,
            ids(&case["prompt_ids"]),
            "prompt ids of {rendered:?}"
        );

        let expected = ids(&case["greedy_ids"]);
        let mut runner = cpu_runner(
            &model,
            CpuOptions::new(KvCacheDtype::F32, prompt.len() + expected.len() + 64),
        );
        let request = GenerationRequest {
            prompt: prompt.clone(),
            max_new_tokens: expected.len(),
            sampling: SamplingParams::greedy(),
        };
        let (mut results, _) = generate(&mut runner, &[request], |_, _| {}).unwrap();
        let mut ours = results.remove(0).tokens;
        if let Some(end) = ours.iter().position(|t| stop.contains(t)) {
            ours.truncate(end + 1);
        }
        assert_eq!(
            tokenizer.decode(&ours, false),
            case["greedy_text"].as_str().unwrap(),
            "answer to {:?}",
            messages.last().unwrap()["content"]
        );
        assert_eq!(ours, expected);

        let thinking = case["kwargs"]["thinking"].as_bool() != Some(false);
        let parsed = parse_output(&tokenizer, &ours, thinking, case["tools"].is_array());
        if case["tools"].is_array() {
            assert_eq!(parsed.tool_calls.len(), 1, "{parsed:?}");
            assert_eq!(parsed.tool_calls[0].name, "get_weather");
        } else {
            assert!(parsed.content.is_some(), "{parsed:?}");
            assert_eq!(parsed.reasoning.is_some(), thinking, "{parsed:?}");
        }
    }
}
