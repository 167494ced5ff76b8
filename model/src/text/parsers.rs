//! Kimi's reasoning and tool-call output, parsed on token ids (the markers are single special
//! tokens, so no text matching can split or forge them).
//!
//! - Reasoning: a leading `<think>` is dropped; reasoning is the text before `</think>`, or
//!   before the tool-call section when that starts first; with no end marker everything is
//!   reasoning (a length-truncated answer). With thinking off everything is content.
//! - Tool calls: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>ID
//!   <|tool_call_argument_begin|>JSON<|tool_call_end|>`, then `<|tool_calls_section_end|>`.
//!   The id (`functions.NAME:IDX`) is kept verbatim; the name is the part after the last `.`
//!   and before the `:`. Content is the text before the section.
//!
//! [`OutputParser`] is the streaming form, one token at a time; [`parse_output`] runs it over
//! a whole completion, so both forms split text the same way.

use crate::text::tokenizer::{StreamDecoder, Tokenizer};

/// The special token ids the parsers act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KimiMarkers {
    pub think_start: Option<u32>,
    pub think_end: Option<u32>,
    pub section_begin: Option<u32>,
    pub section_end: Option<u32>,
    pub call_begin: Option<u32>,
    pub argument_begin: Option<u32>,
    pub call_end: Option<u32>,
}

impl KimiMarkers {
    pub fn from_tokenizer(t: &Tokenizer) -> Self {
        Self {
            think_start: t.special_id("<think>"),
            think_end: t.special_id("</think>"),
            section_begin: t.special_id("<|tool_calls_section_begin|>"),
            section_end: t.special_id("<|tool_calls_section_end|>"),
            call_begin: t.special_id("<|tool_call_begin|>"),
            argument_begin: t.special_id("<|tool_call_argument_begin|>"),
            call_end: t.special_id("<|tool_call_end|>"),
        }
    }
}

/// One piece of parsed output, in generation order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    /// A tool call begins: its id and function name (sent before any argument text).
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolCallArguments {
        index: usize,
        fragment: String,
    },
}

impl OutputEvent {
    /// The text of a reasoning or content event.
    pub fn text(&self) -> Option<&str> {
        match self {
            Self::Reasoning(t) | Self::Content(t) => Some(t),
            _ => None,
        }
    }

    /// The same kind of text event with other text (reasoning stays reasoning).
    pub fn with_text(&self, text: String) -> Self {
        match self {
            Self::Reasoning(_) => Self::Reasoning(text),
            _ => Self::Content(text),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Reasoning,
    Content,
    Section,
    CallId,
    CallArguments,
}

/// Streaming parser: feed token ids, get events.
pub struct OutputParser<'t> {
    tokenizer: &'t Tokenizer,
    markers: KimiMarkers,
    parse_tools: bool,
    phase: Phase,
    decoder: StreamDecoder,
    at_start: bool,
    call_id: Vec<u8>,
    calls: usize,
}

impl<'t> OutputParser<'t> {
    /// `thinking`: the prompt opened a `<think>` block (output starts as reasoning).
    /// `parse_tools`: tool-call markers become tool calls (else they are dropped as specials).
    pub fn new(tokenizer: &'t Tokenizer, thinking: bool, parse_tools: bool) -> Self {
        Self {
            tokenizer,
            markers: KimiMarkers::from_tokenizer(tokenizer),
            parse_tools,
            phase: if thinking {
                Phase::Reasoning
            } else {
                Phase::Content
            },
            decoder: StreamDecoder::new(true),
            at_start: true,
            call_id: Vec::new(),
            calls: 0,
        }
    }

    /// Tool calls started so far.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Consumes one token id; appends what it completes to `events`.
    pub fn push(&mut self, id: u32, events: &mut Vec<OutputEvent>) {
        let m = self.markers;
        let is = |marker: Option<u32>| marker == Some(id);
        let at_start = std::mem::replace(&mut self.at_start, false);
        match self.phase {
            Phase::Reasoning | Phase::Content => {
                if self.phase == Phase::Reasoning && at_start && is(m.think_start) {
                    return;
                }
                if self.phase == Phase::Reasoning && is(m.think_end) {
                    self.flush(events);
                    self.phase = Phase::Content;
                } else if self.parse_tools && is(m.section_begin) {
                    self.flush(events);
                    self.phase = Phase::Section;
                } else {
                    let text = self.decoder.push(self.tokenizer, id);
                    self.emit_text(text, events);
                }
            }
            Phase::Section => {
                if is(m.call_begin) {
                    self.call_id.clear();
                    self.phase = Phase::CallId;
                } else if is(m.section_end) {
                    self.phase = Phase::Content;
                }
            }
            Phase::CallId => {
                if is(m.argument_begin) {
                    let id = String::from_utf8_lossy(&self.call_id).trim().to_string();
                    let name = function_name(&id);
                    events.push(OutputEvent::ToolCallStart {
                        index: self.calls,
                        id,
                        name,
                    });
                    self.calls += 1;
                    self.decoder = StreamDecoder::new(true);
                    self.phase = Phase::CallArguments;
                } else if !self.tokenizer.is_special(id)
                    && let Some(bytes) = self.tokenizer.token_bytes(id)
                {
                    self.call_id.extend_from_slice(&bytes);
                }
            }
            Phase::CallArguments => {
                if is(m.call_end) {
                    self.flush(events);
                    self.phase = Phase::Section;
                } else if is(m.section_end) {
                    self.flush(events);
                    self.phase = Phase::Content;
                } else {
                    let text = self.decoder.push(self.tokenizer, id);
                    self.emit_text(text, events);
                }
            }
        }
    }

    /// End of generation: flushes held-back bytes.
    pub fn finish(&mut self, events: &mut Vec<OutputEvent>) {
        self.flush(events);
    }

    fn flush(&mut self, events: &mut Vec<OutputEvent>) {
        let text = self.decoder.finish();
        self.emit_text(text, events);
    }

    fn emit_text(&mut self, text: String, events: &mut Vec<OutputEvent>) {
        if text.is_empty() {
            return;
        }
        events.push(match self.phase {
            Phase::Reasoning => OutputEvent::Reasoning(text),
            Phase::Content | Phase::Section => OutputEvent::Content(text),
            Phase::CallId => return,
            Phase::CallArguments => OutputEvent::ToolCallArguments {
                index: self.calls - 1,
                fragment: text,
            },
        });
    }
}

/// The function name in a Kimi tool-call id: after the last `.`, before the `:`.
pub fn function_name(id: &str) -> String {
    let before_colon = id.rsplit_once(':').map_or(id, |(name, _)| name);
    before_colon
        .rsplit_once('.')
        .map_or(before_colon, |(_, name)| name)
        .to_string()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A whole completion, split.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    pub reasoning: Option<String>,
    pub content: Option<String>,
    pub tool_calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    /// Adds a streamed event (how [`parse_output`] builds its result).
    pub fn apply(&mut self, event: OutputEvent) {
        match event {
            OutputEvent::Reasoning(t) => self.reasoning.get_or_insert_default().push_str(&t),
            OutputEvent::Content(t) => self.content.get_or_insert_default().push_str(&t),
            OutputEvent::ToolCallStart { id, name, .. } => self.tool_calls.push(ParsedToolCall {
                id,
                name,
                arguments: String::new(),
            }),
            OutputEvent::ToolCallArguments { index, fragment } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.arguments.push_str(&fragment);
                }
            }
        }
    }

    /// Empty reasoning or content becomes `None`; argument text is trimmed.
    pub fn normalized(mut self) -> Self {
        self.reasoning = self.reasoning.filter(|r| !r.is_empty());
        self.content = self.content.filter(|c| !c.is_empty());
        for call in &mut self.tool_calls {
            call.arguments = call.arguments.trim().to_string();
        }
        self
    }
}

/// Parses a whole completion (the generated ids, without the prompt).
pub fn parse_output(
    tokenizer: &Tokenizer,
    ids: &[u32],
    thinking: bool,
    parse_tools: bool,
) -> ParsedOutput {
    let mut parser = OutputParser::new(tokenizer, thinking, parse_tools);
    let mut events = Vec::new();
    for &id in ids {
        parser.push(id, &mut events);
    }
    parser.finish(&mut events);
    let mut out = ParsedOutput::default();
    for event in events {
        out.apply(event);
    }
    out.normalized()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte-level ranks plus Kimi's named specials in their slots (after 256 ranks).
    fn kimi_toy() -> Tokenizer {
        let names = [
            (2, "<|im_end|>"),
            (11, "<|tool_calls_section_begin|>"),
            (12, "<|tool_calls_section_end|>"),
            (13, "<|tool_call_begin|>"),
            (14, "<|tool_call_argument_begin|>"),
            (15, "<|tool_call_end|>"),
            (22, "<think>"),
            (23, "</think>"),
        ];
        crate::text::tokenizer::byte_level_tokenizer(&[], &names)
    }

    #[test]
    fn reasoning_then_content() {
        let t = kimi_toy();
        let ids = t.encode("<think>France → Paris.</think>The capital is Paris.<|im_end|>");
        let out = parse_output(&t, &ids, true, true);
        assert_eq!(out.reasoning.as_deref(), Some("France → Paris."));
        assert_eq!(out.content.as_deref(), Some("The capital is Paris."));
        // The generation prompt ends with <think>, so the output usually starts after it.
        let ids = t.encode("Paris.</think>Paris");
        let out = parse_output(&t, &ids, true, true);
        assert_eq!(out.reasoning.as_deref(), Some("Paris."));
        assert_eq!(out.content.as_deref(), Some("Paris"));
    }

    #[test]
    fn no_end_marker_means_all_reasoning_and_thinking_off_means_all_content() {
        let t = kimi_toy();
        let ids = t.encode("still thinking about it");
        let out = parse_output(&t, &ids, true, true);
        assert_eq!(out.reasoning.as_deref(), Some("still thinking about it"));
        assert_eq!(out.content, None);
        let out = parse_output(&t, &ids, false, true);
        assert_eq!(out.reasoning, None);
        assert_eq!(out.content.as_deref(), Some("still thinking about it"));
        let out = parse_output(&t, &t.encode("plan</think>"), true, true);
        assert_eq!(out.content, None, "empty content is null");
    }

    #[test]
    fn tool_calls_keep_ids_and_split_names() {
        let t = kimi_toy();
        let text = concat!(
            "I will call it.</think>Checking.",
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|> functions.get_weather:3 <|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>",
            "<|tool_call_begin|>functions.ns.add:4<|tool_call_argument_begin|> {\"a\": 1} <|tool_call_end|>",
            "<|tool_calls_section_end|><|im_end|>"
        );
        let out = parse_output(&t, &t.encode(text), true, true);
        assert_eq!(out.reasoning.as_deref(), Some("I will call it."));
        assert_eq!(out.content.as_deref(), Some("Checking."));
        assert_eq!(
            out.tool_calls,
            vec![
                ParsedToolCall {
                    id: "functions.get_weather:3".into(),
                    name: "get_weather".into(),
                    arguments: "{\"city\": \"Paris\"}".into()
                },
                ParsedToolCall {
                    id: "functions.ns.add:4".into(),
                    name: "add".into(),
                    arguments: "{\"a\": 1}".into()
                },
            ]
        );
        // A section that starts before </think> ends the reasoning.
        let text = "thinking<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
        let out = parse_output(&t, &t.encode(text), true, true);
        assert_eq!(out.reasoning.as_deref(), Some("thinking"));
        assert_eq!(out.content, None);
        assert_eq!(out.tool_calls.len(), 1);
        assert_eq!(out.tool_calls[0].arguments, "{}");
        // Markers never leak into content, even when tools are not parsed.
        let out = parse_output(&t, &t.encode(text), false, false);
        assert!(!out.content.unwrap().contains("<|"));
    }

    #[test]
    fn streaming_gives_id_and_name_first_then_argument_fragments() {
        let t = kimi_toy();
        let text = "go</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Zürich\"}<|tool_call_end|><|tool_calls_section_end|>";
        let mut parser = OutputParser::new(&t, true, true);
        let mut events = Vec::new();
        for id in t.encode(text) {
            parser.push(id, &mut events);
        }
        parser.finish(&mut events);
        assert_eq!(events[0], OutputEvent::Reasoning("g".into()));
        let start = events
            .iter()
            .position(|e| matches!(e, OutputEvent::ToolCallStart { .. }))
            .unwrap();
        assert_eq!(
            events[start],
            OutputEvent::ToolCallStart {
                index: 0,
                id: "functions.get_weather:0".into(),
                name: "get_weather".into()
            }
        );
        let fragments: Vec<&str> = events[start + 1..]
            .iter()
            .map(|e| match e {
                OutputEvent::ToolCallArguments { index: 0, fragment } => fragment.as_str(),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert!(fragments.len() > 5, "arguments stream in fragments");
        assert_eq!(fragments.concat(), "{\"city\": \"Zürich\"}");
        assert!(fragments.iter().all(|f| !f.contains('\u{FFFD}')));
    }
}
