//! Text in and out: Kimi's tokenizer, the chat template, the tool declaration and the parsers
//! of reasoning and tool calls.

pub mod chat_template;
pub mod control_tokens;
pub mod parsers;
pub mod tokenizer;
pub mod tool_declaration;
