//! Kimi's TypeScript-style tool declarations: OpenAI function tools (JSON Schema parameters)
//! written as `namespace functions { type NAME = (_: {…}) => any; }`, the form Kimi-K2.5 was
//! trained on (its tokenizer passes it to the template as `tools_ts_str`; the plain-JSON
//! fallback costs accuracy).
//!
//! Field order and formatting follow Kimi's encoder: required parameters first, each group
//! sorted by name; descriptions and constraints as `//` comment lines; `integer` as `number`;
//! `$defs` as interfaces, a `$ref` to `#` as the `parameters` interface; Python's spelling of
//! scalars in comments (`True`, `None`). Checked against Kimi's Python encoder by the goldens
//! of `golden/gen_serving.py`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Map, Value};

const INDENT: &str = "  ";
const FIELD_DELIMITER: &str = ",\n";

/// Why a tool list could not be written as TypeScript (the template then falls back to JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeError(pub String);

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EncodeError {}

/// Recursively sorts object keys, as Kimi's tokenizer does to tools before encoding them.
pub fn deep_sort(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let sorted: BTreeMap<&String, Value> =
                map.iter().map(|(k, v)| (k, deep_sort(v))).collect();
            Value::Object(sorted.into_iter().map(|(k, v)| (k.clone(), v)).collect())
        }
        Value::Array(items) => Value::Array(items.iter().map(deep_sort).collect()),
        other => other.clone(),
    }
}

/// The TypeScript declaration of `tools` (OpenAI `{"type": "function", "function": {…}}`
/// entries; other tool types are skipped). Empty when no function tool is given.
pub fn encode_tools(tools: &[Value]) -> Result<String, EncodeError> {
    let mut functions = Vec::new();
    for tool in tools {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            continue;
        }
        match tool.get("function") {
            Some(Value::Object(f)) if !f.is_empty() => functions.push(encode_function(f)?),
            _ => {}
        }
    }
    if functions.is_empty() {
        return Ok(String::new());
    }
    Ok(format!(
        "# Tools\n\n## functions\nnamespace functions {{\n{}\n}}\n",
        functions.join("\n")
    ))
}

fn encode_function(function: &Map<String, Value>) -> Result<String, EncodeError> {
    let mut registry = Registry::default();
    let empty = Map::new();
    let parameters = match function.get("parameters") {
        Some(Value::Object(p)) => p,
        None | Some(Value::Null) => &empty,
        Some(other) if is_falsy(other) => &empty,
        Some(other) => {
            return Err(EncodeError(format!(
                "parameters must be an object: {other}"
            )));
        }
    };
    let parsed = ObjectType::parse(parameters, &mut registry)?;

    let mut interfaces = Vec::new();
    let mut root_interface = None;
    if registry.has_self_ref {
        root_interface = Some("parameters");
        let fields: Vec<String> = parsed
            .properties
            .iter()
            .map(|p| p.to_typescript(INDENT))
            .collect::<Result<_, _>>()?;
        let body = if fields.is_empty() {
            String::new()
        } else {
            format!("\n{}\n", fields.join(FIELD_DELIMITER))
        };
        interfaces.push(format!("interface parameters {{{body}}}"));
    }
    let definitions = registry.definitions.clone();
    for (name, schema) in &definitions {
        let parsed_def = parse_type(schema, &mut registry)?;
        let mut description = String::new();
        if let Some(d) = schema.get("description").and_then(Value::as_str)
            && !d.is_empty()
        {
            description = format_description(d, "") + "\n";
        }
        interfaces.push(format!(
            "{description}interface {name} {}",
            parsed_def.to_typescript("")?
        ));
    }
    let name = match function.get("name") {
        Some(Value::String(n)) => n.clone(),
        Some(other) => python_str(other),
        None => "function".into(),
    };
    let signature = match root_interface {
        Some(root) => root.to_string(),
        None => parsed.to_typescript("")?,
    };
    let type_def = format!("type {name} = (_: {signature}) => any;");
    let description = match function.get("description") {
        Some(Value::String(d)) if !d.is_empty() => format_description(d, ""),
        _ => String::new(),
    };
    Ok([interfaces.join("\n"), description, type_def]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n"))
}

#[derive(Default)]
struct Registry {
    /// `$defs` in the order they were met (keys are sorted within one `$defs`).
    definitions: Vec<(String, Value)>,
    has_self_ref: bool,
}

impl Registry {
    fn register(&mut self, defs: &Value) {
        if let Value::Object(defs) = defs {
            for (name, schema) in defs {
                match self.definitions.iter_mut().find(|(n, _)| n == name) {
                    Some(slot) => slot.1 = schema.clone(),
                    None => self.definitions.push((name.clone(), schema.clone())),
                }
            }
        }
    }

    fn resolve(&mut self, reference: &str) -> Result<Option<String>, EncodeError> {
        if reference == "#" {
            self.has_self_ref = true;
            return Ok(None);
        }
        if let Some(name) = reference.strip_prefix("#/$defs/") {
            let name = reference.rsplit('/').next().unwrap_or(name);
            if self.definitions.iter().any(|(n, _)| n == name) {
                return Ok(Some(name.to_string()));
            }
            return Err(EncodeError(format!("reference not found: {reference}")));
        }
        Err(EncodeError(format!(
            "unsupported reference format: {reference}"
        )))
    }
}

/// A type's description and its allowed constraint keywords, shown as comments.
#[derive(Default)]
struct Doc {
    description: String,
    constraints: Vec<(String, Value)>,
}

impl Doc {
    fn from_schema(schema: &Map<String, Value>, allowed: &[&str]) -> Self {
        let description = match schema.get("description") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => python_str(other),
        };
        let mut constraints: Vec<(String, Value)> = schema
            .iter()
            .filter(|(k, _)| allowed.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        constraints.sort_by(|a, b| a.0.cmp(&b.0));
        Self {
            description,
            constraints,
        }
    }

    fn docstring(&self, indent: &str) -> String {
        let mut lines = Vec::new();
        if !self.description.is_empty() {
            lines.push(format_description(&self.description, indent));
        }
        if !self.constraints.is_empty() {
            let text: Vec<String> = self
                .constraints
                .iter()
                .map(|(k, v)| format!("{k}: {}", python_str(v)))
                .collect();
            lines.push(format!("{indent}// {}", text.join(", ")));
        }
        lines.into_iter().map(|l| l + "\n").collect()
    }
}

enum ParamType {
    Scalar { name: String, doc: Doc },
    Object(ObjectType),
    Array { item: Box<ParamType>, doc: Doc },
    Enum { values: Vec<Value>, doc: Doc },
    AnyOf { types: Vec<ParamType>, doc: Doc },
    Union { names: Vec<&'static str>, doc: Doc },
    Ref { name: String, doc: Doc },
}

struct ObjectType {
    doc: Doc,
    properties: Vec<Parameter>,
    additional: Option<Additional>,
}

enum Additional {
    Any,
    Never,
    Type(Box<ParamType>),
}

struct Parameter {
    name: String,
    ty: ParamType,
    optional: bool,
    default: Option<Value>,
}

fn any_type() -> ParamType {
    ParamType::Scalar {
        name: "any".into(),
        doc: Doc::default(),
    }
}

impl ObjectType {
    fn parse(schema: &Map<String, Value>, registry: &mut Registry) -> Result<Self, EncodeError> {
        let mut object = Self {
            doc: Doc::from_schema(schema, &[]),
            properties: Vec::new(),
            additional: None,
        };
        if schema.is_empty() {
            return Ok(object);
        }
        if let Some(defs) = schema.get("$defs") {
            registry.register(defs);
        }
        object.additional = match schema.get("additionalProperties") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(true)) => Some(Additional::Any),
            Some(Value::Bool(false)) => Some(Additional::Never),
            Some(v @ Value::Object(_)) => {
                Some(Additional::Type(Box::new(parse_type(v, registry)?)))
            }
            Some(other) => {
                return Err(EncodeError(format!(
                    "unknown additionalProperties: {other}"
                )));
            }
        };
        let Some(properties) = schema.get("properties") else {
            return Ok(object);
        };
        let properties = properties
            .as_object()
            .ok_or_else(|| EncodeError("`properties` must be an object".into()))?;
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for (name, property) in properties {
            let default = match property {
                Value::Object(p) => p.get("default").filter(|d| !d.is_null()).cloned(),
                _ => None,
            };
            object.properties.push(Parameter {
                name: name.clone(),
                ty: parse_type(property, registry)?,
                optional: !required.contains(&name.as_str()),
                default,
            });
        }
        Ok(object)
    }

    fn to_typescript(&self, indent: &str) -> Result<String, EncodeError> {
        let inner = format!("{indent}{INDENT}");
        let mut ordered: Vec<&Parameter> = self.properties.iter().filter(|p| !p.optional).collect();
        ordered.sort_by(|a, b| a.name.cmp(&b.name));
        let mut optional: Vec<&Parameter> = self.properties.iter().filter(|p| p.optional).collect();
        optional.sort_by(|a, b| a.name.cmp(&b.name));
        ordered.extend(optional);
        let mut fields: Vec<String> = ordered
            .iter()
            .map(|p| p.to_typescript(&inner))
            .collect::<Result<_, _>>()?;
        if let Some(additional) = &self.additional {
            let ty = match additional {
                Additional::Any => "any".to_string(),
                Additional::Never => "never".to_string(),
                Additional::Type(t) => t.to_typescript(&inner)?,
            };
            fields.push(format!("{inner}[k: string]: {ty}"));
        }
        if fields.is_empty() {
            return Ok("{}".into());
        }
        Ok(format!("{{\n{}\n{indent}}}", fields.join(FIELD_DELIMITER)))
    }
}

impl Parameter {
    fn to_typescript(&self, indent: &str) -> Result<String, EncodeError> {
        let mut comments = self.ty.doc().docstring(indent);
        if let Some(default) = &self.default {
            let shown = match default {
                Value::Number(_) | Value::Bool(_) => python_str(default),
                other => python_json(other),
            };
            let _ = writeln!(comments, "{indent}// Default: {shown}");
        }
        Ok(format!(
            "{comments}{indent}{}{}: {}",
            self.name,
            if self.optional { "?" } else { "" },
            self.ty.to_typescript(indent)?
        ))
    }
}

impl ParamType {
    fn doc(&self) -> &Doc {
        match self {
            Self::Scalar { doc, .. }
            | Self::Array { doc, .. }
            | Self::Enum { doc, .. }
            | Self::AnyOf { doc, .. }
            | Self::Union { doc, .. }
            | Self::Ref { doc, .. } => doc,
            Self::Object(o) => &o.doc,
        }
    }

    fn to_typescript(&self, indent: &str) -> Result<String, EncodeError> {
        Ok(match self {
            Self::Scalar { name, .. } => {
                if name == "integer" {
                    "number".into()
                } else {
                    name.clone()
                }
            }
            Self::Object(o) => o.to_typescript(indent)?,
            Self::Array { item, .. } => {
                let inner = format!("{indent}{INDENT}");
                let item_doc = item.doc().docstring(&inner);
                if item_doc.is_empty() {
                    format!("Array<{}>", item.to_typescript(indent)?)
                } else {
                    format!(
                        "Array<\n{item_doc}{inner}{}\n{indent}>",
                        item.to_typescript(&inner)?
                    )
                }
            }
            Self::Enum { values, .. } => values
                .iter()
                .map(|v| match v {
                    Value::String(s) => format!("\"{s}\""),
                    other => python_str(other),
                })
                .collect::<Vec<_>>()
                .join(" | "),
            Self::AnyOf { types, .. } => types
                .iter()
                .map(|t| t.to_typescript(indent))
                .collect::<Result<Vec<_>, _>>()?
                .join(" | "),
            Self::Union { names, .. } => names.join(" | "),
            Self::Ref { name, .. } => name.clone(),
        })
    }
}

fn parse_type(schema: &Value, registry: &mut Registry) -> Result<ParamType, EncodeError> {
    let map = match schema {
        Value::Bool(true) => return Ok(any_type()),
        Value::Bool(false) => {
            return Ok(ParamType::Scalar {
                name: "null".into(),
                doc: Doc::default(),
            });
        }
        Value::Object(map) => map,
        other => return Err(EncodeError(format!("invalid JSON Schema object: {other}"))),
    };
    if let Some(reference) = map.get("$ref") {
        let reference = reference
            .as_str()
            .ok_or_else(|| EncodeError(format!("`$ref` must be a string: {reference}")))?;
        let name = registry
            .resolve(reference)?
            .unwrap_or_else(|| "parameters".into());
        return Ok(ParamType::Ref {
            name,
            doc: Doc::from_schema(map, &[]),
        });
    }
    if let Some(any_of) = map.get("anyOf") {
        let options = any_of
            .as_array()
            .ok_or_else(|| EncodeError("`anyOf` must be an array".into()))?;
        return Ok(ParamType::AnyOf {
            types: options
                .iter()
                .map(|t| parse_type(t, registry))
                .collect::<Result<_, _>>()?,
            doc: Doc::from_schema(map, &[]),
        });
    }
    if let Some(values) = map.get("enum") {
        let values = values
            .as_array()
            .ok_or_else(|| EncodeError("`enum` must be an array".into()))?;
        check_enum(values, map.get("type"))?;
        return Ok(ParamType::Enum {
            values: values.clone(),
            doc: Doc::from_schema(map, &[]),
        });
    }
    if let Some(ty) = map.get("type") {
        return match ty {
            Value::Array(names) => {
                let names = names
                    .iter()
                    .map(|n| match n.as_str() {
                        Some("string") => Ok("string"),
                        Some("number") | Some("integer") => Ok("number"),
                        Some("boolean") => Ok("boolean"),
                        Some("null") => Ok("null"),
                        Some("object") => Ok("{}"),
                        Some("array") => Ok("Array<any>"),
                        _ => Err(EncodeError(format!("unknown type in a union: {n}"))),
                    })
                    .collect::<Result<_, _>>()?;
                Ok(ParamType::Union {
                    names,
                    doc: Doc::from_schema(map, &[]),
                })
            }
            Value::String(name) if name == "object" => {
                Ok(ParamType::Object(ObjectType::parse(map, registry)?))
            }
            Value::String(name) if name == "array" => {
                let item = match map.get("items") {
                    Some(items) if !is_falsy(items) => parse_type(items, registry)?,
                    _ => any_type(),
                };
                Ok(ParamType::Array {
                    item: Box::new(item),
                    doc: Doc::from_schema(map, &["minItems", "maxItems"]),
                })
            }
            Value::String(name) => {
                let allowed: &[&str] = match name.as_str() {
                    "string" => &["maxLength", "minLength", "pattern"],
                    "number" | "integer" => &["maximum", "minimum"],
                    _ => &[],
                };
                Ok(ParamType::Scalar {
                    name: name.clone(),
                    doc: Doc::from_schema(map, allowed),
                })
            }
            other => Err(EncodeError(format!("invalid `type`: {other}"))),
        };
    }
    if map.is_empty() {
        return Ok(any_type());
    }
    Err(EncodeError(format!(
        "invalid JSON Schema object: {}",
        Value::Object(map.clone())
    )))
}

fn check_enum(values: &[Value], ty: Option<&Value>) -> Result<(), EncodeError> {
    let Some(ty) = ty else { return Ok(()) };
    let ty = match ty {
        Value::Array(types) if types.len() == 1 => types[0].clone(),
        Value::Array(types) if types.len() == 2 => {
            if !types.iter().any(|t| t == "null") {
                return Err(EncodeError(format!("enum type {ty} is not supported")));
            }
            if types[0] != "null" {
                types[0].clone()
            } else {
                types[1].clone()
            }
        }
        Value::Array(_) => return Err(EncodeError(format!("enum type {ty} is not supported"))),
        other => other.clone(),
    };
    for v in values.iter().filter(|v| !v.is_null()) {
        let ok = match ty.as_str() {
            Some("string") => v.is_string(),
            Some("number") => v.is_number(),
            Some("integer") => v.is_i64() || v.is_u64(),
            Some("boolean") => v.is_boolean(),
            _ => true,
        };
        if !ok {
            return Err(EncodeError(format!("enum value {v} is not a {ty}")));
        }
    }
    Ok(())
}

/// Python truthiness of a JSON value.
fn is_falsy(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

fn format_description(description: &str, indent: &str) -> String {
    description
        .split('\n')
        .map(|line| {
            if line.is_empty() {
                String::new()
            } else {
                format!("{indent}// {line}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Python's `str()` of a JSON value (`True`, `None`, `1.5`, `['a', 1]`).
pub fn python_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => python_repr(other),
    }
}

fn python_repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => python_number(n),
        Value::String(s) => {
            let quote = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            let mut out = String::from(quote);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
            out
        }
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(python_repr).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!(
                    "{}: {}",
                    python_repr(&Value::String(k.clone())),
                    python_repr(v)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn python_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    python_float(f)
}

/// Python's `repr(float)`: the shortest round-trip digits, `1e-05` style exponents outside
/// [1e-4, 1e16), and a `.0` on integral values.
pub fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let s = format!("{f:e}");
        let (mantissa, exponent) = s.split_once('e').expect("exponent");
        let exponent: i32 = exponent.parse().expect("exponent digits");
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.abs());
    }
    let s = format!("{f}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

/// Python's `json.dumps(v, ensure_ascii=False)` (separators `, ` and `: `).
pub fn python_json(v: &Value) -> String {
    let mut out = String::new();
    write_python_json(v, &mut out, ", ", ": ");
    out
}

/// Python's `json.dumps` with the given separators and `ensure_ascii=False`.
pub fn write_python_json(v: &Value, out: &mut String, item_sep: &str, key_sep: &str) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if n.is_i64() || n.is_u64() {
                out.push_str(&n.to_string());
            } else {
                out.push_str(&python_float(n.as_f64().unwrap_or(f64::NAN)));
            }
        }
        Value::String(s) => write_json_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_python_json(item, out, item_sep, key_sep);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                write_json_string(k, out);
                out.push_str(key_sep);
                write_python_json(item, out, item_sep, key_sep);
            }
            out.push('}');
        }
    }
}

fn write_json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_spellings() {
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(10.0), "10.0");
        assert_eq!(python_float(1e-5), "1e-05");
        assert_eq!(python_float(2.5e20), "2.5e+20");
        assert_eq!(python_str(&json!(true)), "True");
        assert_eq!(python_str(&json!(["a", 1, null])), "['a', 1, None]");
        assert_eq!(
            python_json(&json!({"a": [1, 2.0], "b": "é\n"})),
            "{\"a\": [1, 2.0], \"b\": \"é\\n\"}"
        );
    }

    #[test]
    fn unresolvable_references_are_errors() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}}});
        let err = encode_tools(&[tool]).unwrap_err();
        assert!(err.0.contains("reference not found"), "{err}");
        assert_eq!(encode_tools(&[json!({"type": "_plugin"})]).unwrap(), "");
    }
}
