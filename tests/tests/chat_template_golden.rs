//! The Kimi-K2.5 chat template rendered by minijinja against Hugging Face's jinja2 environment,
//! and Kimi's TypeScript tool declarations against Kimi's Python encoder
//! (golden/gen_serving.py): system, user, assistant and tool turns, thinking on and off,
//! reasoning dropped from history, tool declarations of every schema feature.

use model::text::chat_template::{ChatTemplate, KIMI_K25_TEMPLATE, RenderRequest, TemplateSource};
use model::text::tool_declaration::{deep_sort, encode_tools};
use project_tests::golden_path;
use serde_json::Value;

fn cases() -> Vec<Value> {
    let path = golden_path("serving").join("chat_template.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

#[test]
fn typescript_tool_declarations_equal_kimis_encoder() {
    let mut checked = 0;
    for case in cases() {
        let Some(tools) = case["tools"].as_array() else {
            continue;
        };
        let sorted: Vec<Value> = tools.iter().map(deep_sort).collect();
        let ours = encode_tools(&sorted).unwrap();
        assert_eq!(
            ours,
            case["tools_ts_str"].as_str().unwrap(),
            "case {}",
            case["name"]
        );
        checked += 1;
    }
    assert!(checked >= 5);
}

#[test]
fn minijinja_renders_what_jinja2_renders() {
    let template = ChatTemplate::new(KIMI_K25_TEMPLATE, TemplateSource::Builtin).unwrap();
    let cases = cases();
    assert!(cases.len() >= 15);
    for case in &cases {
        let messages = case["messages"].as_array().unwrap();
        let tools = case["tools"].as_array().map(|t| t.as_slice());
        let rendered = template
            .render(&RenderRequest {
                messages,
                tools,
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                kwargs: case["kwargs"].as_object(),
            })
            .unwrap_or_else(|e| panic!("case {}: {e}", case["name"]));
        assert_eq!(
            rendered,
            case["rendered"].as_str().unwrap(),
            "case {}",
            case["name"]
        );
    }
}
