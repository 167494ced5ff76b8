//! The Kimi-K2.5 chat template rendered by minijinja against Hugging Face's jinja2 environment,
//! and Kimi's TypeScript tool declarations against Kimi's Python encoder
//! (golden/gen_serving.py): system, user, assistant and tool turns, thinking on and off,
//! reasoning dropped from history, tool declarations of every schema feature.

use model::text::chat_template::{ChatTemplate, KIMI_K25_TEMPLATE, RenderRequest, TemplateSource};
use model::text::tokenizer::Tokenizer;
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

/// The prompt ids a server encodes (client strings made inert, only the template's markers
/// control tokens) are the ids of jinja2's rendering, wherever the client wrote no spelling of
/// a special token: the guard changes nothing for ordinary conversations.
#[test]
fn inert_client_strings_encode_to_the_ids_of_jinja2s_rendering() {
    let template = ChatTemplate::new(KIMI_K25_TEMPLATE, TemplateSource::Builtin).unwrap();
    let tokenizer = Tokenizer::from_dir(&golden_path("models").join("kimi-chat-tiny")).unwrap();
    let mut spelling_cases = 0;
    for case in &cases() {
        let ids = template
            .render_ids(
                &RenderRequest {
                    messages: case["messages"].as_array().unwrap(),
                    tools: case["tools"].as_array().map(|t| t.as_slice()),
                    add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                    kwargs: case["kwargs"].as_object(),
                },
                &tokenizer,
            )
            .unwrap();
        let rendered = case["rendered"].as_str().unwrap();
        // HF's tokenizer makes a client's spelling of a special token a control token; the
        // server encodes it as the text it is.
        let spelled: Vec<String> = client_strings(&case["messages"])
            .into_iter()
            .filter(|s| tokenizer.control_tokens().inert(s) != s.as_str())
            .collect();
        let expected = match spelled.as_slice() {
            [] => tokenizer.encode(rendered),
            [text] => {
                assert_eq!(
                    rendered.matches(text.as_str()).count(),
                    1,
                    "case {}",
                    case["name"]
                );
                let (before, after) = rendered.split_once(text.as_str()).unwrap();
                spelling_cases += 1;
                [
                    tokenizer.encode(before),
                    tokenizer.encode_ordinary(text),
                    tokenizer.encode(after),
                ]
                .concat()
            }
            _ => panic!(
                "case {}: several client strings spell special tokens",
                case["name"]
            ),
        };
        assert_eq!(ids, expected, "case {}", case["name"]);
        assert!(
            ids.iter().any(|&id| tokenizer.is_special(id)),
            "case {}",
            case["name"]
        );
    }
    assert!(
        spelling_cases >= 1,
        "a golden case spells a special token in client text"
    );
}

/// Every string in `value`.
fn client_strings(value: &Value) -> Vec<String> {
    match value {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items.iter().flat_map(client_strings).collect(),
        Value::Object(map) => map.values().flat_map(client_strings).collect(),
        _ => vec![],
    }
}
