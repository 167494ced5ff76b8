"""Chat template and tool declaration goldens.

Independent implementations: Hugging Face transformers' chat-template environment (jinja2, the
environment `apply_chat_template` uses) renders the project's Kimi-K2.5 template
(model/templates/kimi_k25_chat_template.jinja), and Kimi's own TypeScript tool encoder (as the
pinned PyPI package tinker-cookbook ships it, `kimi_k2_5_tool_declaration_ts.py`, loaded by
file) writes the tool declarations. Tools are deep-sorted first, as Kimi's tokenizer does.

Writes golden/data/serving/chat_template.json: a list of cases
  {name, messages, tools, add_generation_prompt, kwargs, tools_ts_str, rendered}.
"""

import argparse
import copy
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from transformers.utils.chat_template_utils import _compile_jinja_template

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent / "model" / "templates" / "kimi_k25_chat_template.jinja"


def load_ts_encoder():
    spec = importlib.util.find_spec("tinker_cookbook")
    path = Path(spec.submodule_search_locations[0]) / "renderers" / "kimi_k2_5_tool_declaration_ts.py"
    module_spec = importlib.util.spec_from_file_location("kimi_tool_declaration_ts", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.encode_tools_to_typescript_style


def deep_sort(obj):
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.\nReturns their sum.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 100},
        "b": {"type": "integer"}}, "required": ["a", "b"]}}}
RICH = {"type": "function", "function": {
    "name": "search_docs",
    "description": "Search the documentation.",
    "parameters": {
        "type": "object",
        "$defs": {
            "Filter": {"type": "object", "description": "A field filter.",
                       "properties": {"field": {"type": "string"}, "value": {"anyOf": [{"type": "string"}, {"type": "number"}]}},
                       "required": ["field"]},
        },
        "properties": {
            "query": {"type": "string", "description": "Words to find", "minLength": 1, "maxLength": 200},
            "limit": {"type": "integer", "default": 10, "description": "How many\n\nresults"},
            "ratio": {"type": "number", "default": 0.5},
            "exact": {"type": "boolean", "default": False},
            "tags": {"type": "array", "items": {"type": "string", "description": "A tag"}, "maxItems": 5},
            "ids": {"type": "array", "items": {"type": "integer"}},
            "anything": {"type": "array"},
            "filters": {"type": "array", "items": {"$ref": "#/$defs/Filter"}},
            "mode": {"enum": ["fast", "slow", 3, None], "description": "Search mode"},
            "nullable": {"type": ["string", "null"]},
            "meta": {"type": "object", "additionalProperties": {"type": "string"}},
            "strict": {"type": "object", "properties": {"on": {"type": "boolean"}}, "additionalProperties": False},
            "loose": {"type": "object", "additionalProperties": True},
            "options": {"type": "object", "properties": {
                "depth": {"type": "integer", "description": "Nested depth"},
                "path": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}}},
                "required": ["depth"], "default": {"depth": 1}},
            "names": {"type": "array", "default": ["a", "b"], "items": {"type": "string"}},
            "free": {},
        },
        "required": ["query", "filters"],
    }}}
TREE = {"type": "function", "function": {
    "name": "make_tree", "description": "Builds a tree.",
    "parameters": {"type": "object", "properties": {
        "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["label"]}}}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}
PLUGIN = {"type": "_plugin", "_plugin": {"name": "browser"}}

SYSTEM = {"role": "system", "content": "You are a careful assistant."}
Q = {"role": "user", "content": "What is the capital of France? Answer in one sentence."}


def tool_call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


CASES = [
    ("user_only", [Q], None, True, {}),
    ("thinking_off", [Q], None, True, {"thinking": False}),
    ("thinking_on_explicit", [Q], None, True, {"thinking": True}),
    ("no_generation_prompt", [Q], None, False, {}),
    ("system_first", [SYSTEM, Q], None, True, {}),
    ("empty_messages", [], None, True, {}),
    ("named_user", [{"role": "user", "name": "alice", "content": "Hi <|im_end|> there"}], None, True, {}),
    ("multi_turn_history_drops_reasoning", [
        Q, {"role": "assistant", "content": "Paris is the capital of France.", "reasoning_content": "France -> Paris."},
        {"role": "user", "content": "And of Germany?"},
        {"role": "assistant", "content": "Berlin.", "reasoning_content": "Germany -> Berlin."},
        {"role": "user", "content": "Thanks! 谢谢 😀"}], None, True, {}),
    ("tools_declared", [Q], [WEATHER, ADD], True, {}),
    ("tool_round_trip", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [tool_call("functions.get_weather:0", "get_weather", "{\"city\": \"Paris\"}")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"temp_c\": 18, \"sky\": \"sunny\"}"}],
     [WEATHER], True, {}),
    ("two_calls_and_answer", [
        SYSTEM, {"role": "user", "content": "Add 2 and 3, and weather in Oslo."},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two tools.",
         "tool_calls": [tool_call("functions.add:0", "add", "{\"a\": 2, \"b\": 3}"),
                        tool_call("functions.get_weather:1", "get_weather", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "functions.add:0", "content": "5"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "-2 C, snow"},
        {"role": "assistant", "content": "2 + 3 = 5; Oslo is at -2 C with snow.", "reasoning_content": "Done."},
        {"role": "user", "content": "And 4 + 4?"}], [ADD, WEATHER], True, {"thinking": False}),
    ("calls_without_ids", [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "content": "12:00"},
        {"role": "tool", "name": "now", "content": "extra result"}], [NO_PARAMS], True, {}),
    ("rich_schema", [Q], [RICH, TREE, NO_PARAMS, PLUGIN], True, {}),
    ("only_plugin_tools_fall_back_to_json", [Q], [PLUGIN], True, {}),
    ("multipart_content", [{"role": "user", "content": [
        {"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": " please."}]}], None, True, {}),
    ("assistant_prefill_last", [Q, {"role": "assistant", "content": "Paris", "reasoning_content": "r"}],
     None, False, {}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    encode_ts = load_ts_encoder()
    template_text = TEMPLATE.read_text()
    compiled = _compile_jinja_template(template_text)
    cases = []
    for name, messages, tools, add_generation_prompt, kwargs in CASES:
        sorted_tools = deep_sort(tools) if tools else None
        tools_ts_str = encode_ts(sorted_tools) if sorted_tools else None
        render_kwargs = dict(kwargs)
        if tools_ts_str is not None:
            render_kwargs["tools_ts_str"] = tools_ts_str
        rendered = compiled.render(messages=copy.deepcopy(messages), tools=sorted_tools,
                                   add_generation_prompt=add_generation_prompt, **render_kwargs)
        cases.append({"name": name, "messages": messages, "tools": tools,
                      "add_generation_prompt": add_generation_prompt, "kwargs": kwargs,
                      "tools_ts_str": tools_ts_str, "rendered": rendered})
    out = args.out / "serving"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": {
        "generator": "golden/gen_serving.py",
        "renderer": f"transformers=={importlib.metadata.version('transformers')} chat template environment, "
                    f"jinja2=={importlib.metadata.version('jinja2')}",
        "tool_encoder": f"tinker-cookbook=={importlib.metadata.version('tinker-cookbook')} "
                        "renderers/kimi_k2_5_tool_declaration_ts.py (Kimi's encoder)",
        "template": "model/templates/kimi_k25_chat_template.jinja"}, "cases": cases}
    (out / "chat_template.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"chat template goldens: {len(cases)} cases")


if __name__ == "__main__":
    main()
