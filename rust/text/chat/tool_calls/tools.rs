//! What a request's `tools` tell the parser: which functions a call may
//! name, and the JSON types of their parameters, by which qwen3_coder's
//! text values become integers, numbers, booleans, null, objects and
//! arrays when the text is one.

use std::collections::HashMap;

use serde_json::Value;

use super::json_string;

/// The functions a request offers, with the JSON types of their
/// parameters; by default, any function of unknown parameters.
#[derive(Debug, Default)]
pub struct Tools {
    /// Each function's parameter types; None: any function.
    functions: Option<HashMap<String, HashMap<String, Vec<JsonType>>>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum JsonType {
    String,
    Integer,
    Number,
    Boolean,
    Object,
    Array,
    Null,
}

impl Tools {
    /// From OpenAI `tools` (`[{"type": "function", "function": {"name",
    /// "parameters": {"properties": {KEY: {"type": ...}}}}}]`); what does
    /// not have that shape is skipped.
    pub fn from_openai(tools: &Value) -> Self {
        let mut functions = HashMap::new();
        for tool in tools.as_array().into_iter().flatten() {
            let function = tool.get("function").unwrap_or(tool);
            let Some(name) = function.get("name").and_then(Value::as_str) else { continue };
            let properties = function.pointer("/parameters/properties").and_then(Value::as_object);
            let types =
                properties.into_iter().flatten().map(|(key, schema)| (key.clone(), schema_types(schema))).collect();
            functions.insert(name.to_string(), types);
        }
        Tools { functions: Some(functions) }
    }

    /// Whether a call may name `function`.
    pub(super) fn knows(&self, function: &str) -> bool {
        self.functions.as_ref().is_none_or(|functions| functions.contains_key(function))
    }

    /// The types a parameter's schema allows, in order; none for a string.
    pub(super) fn parameter_types(&self, function: &str, parameter: &str) -> Vec<JsonType> {
        let types = self.functions.as_ref().and_then(|functions| functions.get(function)?.get(parameter));
        types.cloned().unwrap_or_default()
    }
}

/// A schema's `type`, one name or a list; none is a string.
fn schema_types(schema: &Value) -> Vec<JsonType> {
    let names = match schema.get("type") {
        Some(Value::String(name)) => vec![name.as_str()],
        Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    names
        .into_iter()
        .filter_map(|name| {
            Some(match name {
                "string" => JsonType::String,
                "integer" => JsonType::Integer,
                "number" => JsonType::Number,
                "boolean" => JsonType::Boolean,
                "object" => JsonType::Object,
                "array" => JsonType::Array,
                "null" => JsonType::Null,
                _ => return None,
            })
        })
        .collect()
}

impl JsonType {
    /// `text` as a JSON value of this type, if it is one.
    pub(super) fn read(self, text: &str) -> Option<String> {
        let text = text.trim();
        let is_json = |first: u8| {
            text.as_bytes().first() == Some(&first)
                && serde_json::from_str::<&serde_json::value::RawValue>(text).is_ok()
        };
        let json = match self {
            JsonType::String => return Some(json_string(text)),
            JsonType::Integer => {
                let digits = text.strip_prefix('-').unwrap_or(text);
                let canonical = digits == "0" || (!digits.starts_with('0') && !digits.is_empty());
                (canonical && digits.bytes().all(|b| b.is_ascii_digit())).then_some(text)
            }
            JsonType::Number => serde_json::from_str::<serde_json::Number>(text).is_ok().then_some(text),
            JsonType::Boolean if text.eq_ignore_ascii_case("true") => Some("true"),
            JsonType::Boolean if text.eq_ignore_ascii_case("false") => Some("false"),
            JsonType::Boolean => None,
            JsonType::Object => is_json(b'{').then_some(text),
            JsonType::Array => is_json(b'[').then_some(text),
            JsonType::Null => (text == "null").then_some(text),
        };
        json.map(String::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_typed_by_the_schema() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"properties": {
            "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
            "o": {"type": "object"}, "a": {"type": "array"}, "maybe": {"type": ["integer", "null"]},
            "s": {"type": "string"}, "e": {"enum": ["a"]},
        }}}}]);
        let tools = Tools::from_openai(&tools);
        let read = |key: &str, text: &str| {
            let types = tools.parameter_types("f", key);
            types.iter().find_map(|t| t.read(text)).unwrap_or_else(|| json_string(text))
        };
        assert_eq!(read("n", " 42 "), "42");
        assert_eq!(read("n", "4.5"), "\"4.5\"");
        assert_eq!(read("n", "007"), "\"007\"");
        assert_eq!(read("x", "-1.5e3"), "-1.5e3");
        assert_eq!(read("x", "NaN"), "\"NaN\"");
        assert_eq!(read("ok", "True"), "true");
        assert_eq!(read("ok", "yes"), "\"yes\"");
        assert_eq!(read("o", "{\"k\": [1]}"), "{\"k\": [1]}");
        assert_eq!(read("o", "{'k': 1}"), "\"{'k': 1}\"");
        assert_eq!(read("a", "[1, 2]"), "[1, 2]");
        assert_eq!(read("maybe", "null"), "null");
        assert_eq!(read("maybe", "7"), "7");
        assert_eq!(read("s", "42"), "\"42\"");
        assert_eq!(read("e", "a"), "\"a\"");
        assert_eq!(read("unknown", "1"), "\"1\"");
        assert!(tools.knows("f") && !tools.knows("g"));
        assert!(!Tools::from_openai(&serde_json::json!("junk")).knows("f"));
        assert!(Tools::default().knows("anything"));
    }
}
