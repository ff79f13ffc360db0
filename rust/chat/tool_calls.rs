//! Finds tool calls in a model's output stream, in the formats SGLang's
//! `--tool-call-parser` names. Fed text deltas, the parser returns the
//! plain text that is safe to emit now and each call once it is complete;
//! a tail that could still open a call is held back.
//!
//! - `hermes` (also `qwen25`): `<tool_call>{"name", "arguments"}</tool_call>`,
//!   anywhere in the output, as often as the model likes.
//! - `llama3`: `<|python_tag|>` then `{"name", "parameters"}`, more calls
//!   after `;`.
//! - `mistral`: `[TOOL_CALLS]` then `[{"name", "arguments"}, ...]`.
//!
//! The llama3 and mistral markers are special tokens, which detokenizing
//! skips by default, so for them bare JSON at the very start of the output
//! opens calls too. A section that does not hold valid calls (bad JSON, no
//! name) stays text exactly as the model wrote it; whitespace that only
//! separates text from calls is dropped.

use std::collections::HashMap;

use serde_json::value::RawValue;

use super::partial_marker_len;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Hermes,
    Llama3,
    Mistral,
}

const HERMES_END: &str = "</tool_call>";

impl Format {
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "qwen25" | "hermes" => Ok(Format::Hermes),
            "llama3" => Ok(Format::Llama3),
            "mistral" => Ok(Format::Mistral),
            _ => Err(format!("unknown tool call parser {name:?}: expected qwen25, hermes, llama3 or mistral")),
        }
    }

    fn marker(self) -> &'static str {
        match self {
            Format::Hermes => "<tool_call>",
            Format::Llama3 => "<|python_tag|>",
            Format::Mistral => "[TOOL_CALLS]",
        }
    }

    /// The start of a call, for a prompt that makes the model go on with
    /// one: up to the opening quote of the name, or given `name`, up to
    /// the arguments. The parser reads it like output.
    pub fn call_prefix(self, name: Option<&str>) -> String {
        let (open, arguments) = match self {
            Format::Hermes => ("<tool_call>\n{", "arguments"),
            Format::Llama3 => ("{", "parameters"),
            Format::Mistral => ("[TOOL_CALLS] [{", "arguments"),
        };
        match name {
            None => format!("{open}\"name\": \""),
            Some(name) => format!("{open}\"name\": {}, \"{arguments}\":", json_string(name)),
        }
    }

    /// Where bare JSON opens a section in `text`, which starts at the start
    /// of the output or (llama3) right after a call.
    fn bare_opener(self, text: &str, after_call: bool) -> Opener {
        let bytes = text.as_bytes();
        let start = skip_ws(bytes, 0);
        let mut i = start;
        match self {
            Format::Hermes => return Opener::No,
            Format::Llama3 => {
                if after_call && bytes.get(i) == Some(&b';') {
                    i = skip_ws(bytes, i + 1);
                }
            }
            Format::Mistral => match bytes.get(i) {
                None => return Opener::Maybe,
                Some(b'[') => i = skip_ws(bytes, i + 1),
                Some(_) => return Opener::No,
            },
        }
        match bytes.get(i) {
            None => Opener::Maybe,
            Some(b'{') => Opener::At(start),
            Some(_) => Opener::No,
        }
    }
}

enum Opener {
    /// A section starts at this byte offset.
    At(usize),
    /// Not yet known: the text so far could still open one.
    Maybe,
    No,
}

/// A complete tool call: the function's name and its arguments as JSON
/// text, as the model wrote them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

pub struct ToolCallParser {
    format: Format,
    held: String,
    state: State,
}

#[derive(Clone, Copy, Debug)]
enum State {
    /// Plain text. `opening`: bare JSON could open a section here.
    /// `after_call`: whitespace here follows a call and is dropped.
    Text {
        opening: bool,
        after_call: bool,
    },
    Section(Section),
}

/// A section that starts at `held[ws..]`; `held[..ws]` is whitespace that
/// goes if the section holds calls.
#[derive(Clone, Copy, Debug)]
struct Section {
    ws: usize,
    marked: bool,
    progress: Progress,
}

#[derive(Clone, Copy, Debug)]
enum Progress {
    /// Looking for the JSON value after the opener.
    Seeking,
    /// Inside the JSON value (llama3, mistral).
    Json(JsonScan),
    /// Looking for the end marker from this offset on (hermes).
    EndMarker(usize),
}

/// What a section came to: its calls and where it ends, or nothing valid.
type Outcome = Result<(Vec<ToolCall>, usize), ()>;

impl ToolCallParser {
    pub fn new(format: Format) -> Self {
        ToolCallParser {
            format,
            held: String::new(),
            state: State::Text { opening: format != Format::Hermes, after_call: false },
        }
    }

    /// Returns (text safe to emit now, calls completed by this delta).
    pub fn feed(&mut self, text: &str) -> (String, Vec<ToolCall>) {
        self.held.push_str(text);
        self.run(false)
    }

    /// End of stream: an unfinished section is read as it stands (a
    /// hermes call may lack its end marker), or else stays text.
    pub fn flush(&mut self) -> (String, Vec<ToolCall>) {
        self.run(true)
    }

    fn run(&mut self, eof: bool) -> (String, Vec<ToolCall>) {
        let (mut text, mut calls) = (String::new(), Vec::new());
        loop {
            let waiting = match self.state {
                State::Text { opening, after_call } => self.text_step(opening, after_call, eof, &mut text),
                State::Section(section) => self.section_step(section, eof, &mut text, &mut calls),
            };
            if waiting {
                return (text, calls);
            }
        }
    }

    /// Emits plain text up to the next section; true when it must wait for
    /// more text.
    fn text_step(&mut self, mut opening: bool, after_call: bool, eof: bool, out: &mut String) -> bool {
        if after_call {
            let ws = skip_ws(self.held.as_bytes(), 0);
            self.held.drain(..ws);
            if self.held.is_empty() {
                return true;
            }
        }
        if opening {
            match self.format.bare_opener(&self.held, after_call) {
                Opener::At(ws) => {
                    self.state = State::Section(Section { ws, marked: false, progress: Progress::Seeking });
                    return false;
                }
                Opener::Maybe if !eof => {
                    self.state = State::Text { opening, after_call };
                    return true;
                }
                _ => opening = false,
            }
        }
        let marker = self.format.marker();
        if let Some(at) = self.held.find(marker) {
            let text_end = trim_ws_end(&self.held[..at]).len();
            out.push_str(&self.held[..text_end]);
            self.held.drain(..text_end);
            let progress = match self.format {
                Format::Hermes => Progress::EndMarker(0),
                _ => Progress::Seeking,
            };
            self.state = State::Section(Section { ws: at - text_end, marked: true, progress });
            return false;
        }
        // Hold back what could still become a marker, with the whitespace
        // before it, which goes if a call follows.
        let keep = if eof {
            0
        } else {
            let partial = partial_marker_len(&self.held, marker);
            self.held.len() - trim_ws_end(&self.held[..self.held.len() - partial]).len()
        };
        out.extend(self.held.drain(..self.held.len() - keep));
        self.state = State::Text { opening, after_call: false };
        true
    }

    /// Reads a section once it is complete; true when it must wait.
    fn section_step(&mut self, mut section: Section, eof: bool, out: &mut String, calls: &mut Vec<ToolCall>) -> bool {
        let outcome = match self.format {
            Format::Hermes => self.hermes_outcome(&mut section, eof),
            Format::Llama3 | Format::Mistral => self.json_outcome(&mut section, eof),
        };
        match outcome {
            None => {
                self.state = State::Section(section);
                return true;
            }
            Some(Ok((found, end))) => {
                calls.extend(found);
                self.held.drain(..end);
                // Llama 3 separates further calls with `;` and no marker.
                self.state = State::Text { opening: self.format == Format::Llama3, after_call: true };
            }
            Some(Err(())) => {
                // The opener goes out as text; the rest is read again, as it
                // may hold a section of its own.
                let opener = if section.marked { self.format.marker().len() } else { 1 };
                out.extend(self.held.drain(..section.ws + opener));
                self.state = State::Text { opening: false, after_call: false };
            }
        }
        false
    }

    fn hermes_outcome(&self, section: &mut Section, eof: bool) -> Option<Outcome> {
        let body = section.ws + self.format.marker().len();
        let Progress::EndMarker(searched) = section.progress else {
            unreachable!("hermes sections search an end marker")
        };
        let mut from = searched.max(body);
        while !self.held.is_char_boundary(from) {
            from -= 1;
        }
        let (json, end) = match self.held[from..].find(HERMES_END) {
            Some(i) => (&self.held[body..from + i], from + i + HERMES_END.len()),
            None if eof => (&self.held[body..], self.held.len()),
            None => {
                section.progress = Progress::EndMarker(self.held.len().saturating_sub(HERMES_END.len() - 1));
                return None;
            }
        };
        Some(parse_call(json).map(|call| (vec![call], end)).ok_or(()))
    }

    fn json_outcome(&self, section: &mut Section, eof: bool) -> Option<Outcome> {
        let bytes = self.held.as_bytes();
        if let Progress::Seeking = section.progress {
            let mut i = section.ws + if section.marked { self.format.marker().len() } else { 0 };
            i = skip_ws(bytes, i);
            if !section.marked && bytes.get(i) == Some(&b';') {
                i = skip_ws(bytes, i + 1);
            }
            let open = if self.format == Format::Llama3 { b'{' } else { b'[' };
            match bytes.get(i) {
                None if eof => return Some(Err(())),
                None => return None,
                Some(&b) if b != open => return Some(Err(())),
                Some(_) => section.progress = Progress::Json(JsonScan::new(i)),
            }
        }
        let Progress::Json(ref mut scan) = section.progress else { unreachable!("the JSON value was found above") };
        match scan.advance(bytes) {
            Some(end) => {
                let json = &self.held[scan.start..end];
                let found = match self.format {
                    Format::Llama3 => parse_call(json).map(|call| vec![call]),
                    _ => parse_call_list(json),
                };
                Some(found.map(|calls| (calls, end)).ok_or(()))
            }
            None if eof => Some(Err(())),
            None => None,
        }
    }
}

/// Finds where a JSON object or array ends by balancing its brackets
/// outside strings, picking up where the previous call stopped. Whether
/// the text in between is valid JSON is serde_json's to say.
#[derive(Clone, Copy, Debug)]
struct JsonScan {
    start: usize,
    pos: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    fn new(start: usize) -> Self {
        JsonScan { start, pos: start, depth: 0, in_string: false, escaped: false }
    }

    /// The end offset of the value, once its brackets balance.
    fn advance(&mut self, bytes: &[u8]) -> Option<usize> {
        while self.pos < bytes.len() {
            let b = bytes[self.pos];
            self.pos += 1;
            if self.in_string {
                match b {
                    _ if self.escaped => self.escaped = false,
                    b'\\' => self.escaped = true,
                    b'"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return Some(self.pos);
                    }
                }
                _ => {}
            }
        }
        None
    }
}

/// One call from a JSON object: a non-empty string `name`, and
/// `arguments` (or llama3's `parameters`) as an object, an object encoded
/// in a string (some fine-tunes do that), null or absent (no arguments).
fn parse_call(json: &str) -> Option<ToolCall> {
    let fields: HashMap<String, &RawValue> = serde_json::from_str(json).ok()?;
    let name: String = serde_json::from_str(fields.get("name")?.get()).ok()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match fields.get("arguments").or_else(|| fields.get("parameters")) {
        None => "{}".to_string(),
        Some(raw) => arguments_text(raw.get())?,
    };
    Some(ToolCall { name, arguments })
}

fn arguments_text(raw: &str) -> Option<String> {
    match raw.as_bytes().first()? {
        b'{' => Some(raw.to_string()),
        b'n' => Some("{}".to_string()),
        b'"' => {
            let inner: String = serde_json::from_str(raw).ok()?;
            let value: &RawValue = serde_json::from_str(&inner).ok()?;
            value.get().starts_with('{').then(|| value.get().to_string())
        }
        _ => None,
    }
}

/// A non-empty JSON array of calls, all valid.
fn parse_call_list(json: &str) -> Option<Vec<ToolCall>> {
    let items: Vec<&RawValue> = serde_json::from_str(json).ok()?;
    if items.is_empty() {
        return None;
    }
    items.iter().map(|item| parse_call(item.get())).collect()
}

fn json_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string always serializes")
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Offset of the first non-whitespace byte at or after `from`.
fn skip_ws(bytes: &[u8], from: usize) -> usize {
    from + bytes[from.min(bytes.len())..].iter().take_while(|&&b| is_ws(b)).count()
}

fn trim_ws_end(text: &str) -> &str {
    text.trim_end_matches([' ', '\t', '\n', '\r'])
}


#[cfg(test)]
mod tests {
    use super::*;

    fn parse(format: Format, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut parser = ToolCallParser::new(format);
        let (mut text, mut calls) = (String::new(), Vec::new());
        for piece in pieces {
            let (t, c) = parser.feed(piece);
            text += &t;
            calls.extend(c);
        }
        let (t, c) = parser.flush();
        (text + &t, [calls, c].concat())
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: arguments.into() }
    }

    fn every_split(format: Format, text: &str, want: &(String, Vec<ToolCall>)) {
        for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            assert_eq!(&parse(format, &[&text[..i], &text[i..]]), want, "split at {i}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(&parse(format, &pieces), want, "char by char");
    }

    #[test]
    fn hermes_text_then_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let want = ("Let me check.".to_string(), vec![call("get_weather", "{\"city\": \"Paris\"}"), call("now", "{}")]);
        every_split(Format::Hermes, text, &want);
    }

    #[test]
    fn calls_come_out_as_soon_as_complete() {
        let mut parser = ToolCallParser::new(Format::Hermes);
        assert_eq!(parser.feed("Sure.\n<tool"), ("Sure.".to_string(), vec![]));
        assert_eq!(parser.feed("_call>{\"name\": \"f\"}</tool_ca"), (String::new(), vec![]));
        assert_eq!(parser.feed("ll>\n"), (String::new(), vec![call("f", "{}")]));
        assert_eq!(parser.feed("\nDone"), ("Done".to_string(), vec![]));
        assert_eq!(parser.flush(), (String::new(), vec![]));
    }

    #[test]
    fn malformed_calls_stay_text() {
        for text in [
            "<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call> after",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"\"}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
            "<tool_call>{\"name\": \"f\"} extra</tool_call>",
            "a <tool_call> never closed",
        ] {
            every_split(Format::Hermes, text, &(text.to_string(), vec![]));
        }
    }

    #[test]
    fn a_failed_block_is_read_again_for_a_later_start() {
        let text = "<tool_call>oops <tool_call>{\"name\": \"f\"}</tool_call>";
        every_split(Format::Hermes, text, &("<tool_call>oops".to_string(), vec![call("f", "{}")]));
    }

    #[test]
    fn hermes_unterminated_call_at_the_end_of_output() {
        every_split(
            Format::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n",
            &(String::new(), vec![call("f", "{\"x\": 1}")]),
        );
    }

    #[test]
    fn arguments_keep_the_models_text_or_are_decoded_once() {
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"z\": 1.50, \"a\": [\"}\\\"\"]}}</tool_call>";
        assert_eq!(parse(Format::Hermes, &[text]).1, vec![call("f", "{\"z\": 1.50, \"a\": [\"}\\\"\"]}")]);
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
        assert_eq!(parse(Format::Hermes, &[text]).1, vec![call("f", "{\"a\": 1}")]);
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": null}</tool_call>";
        assert_eq!(parse(Format::Hermes, &[text]).1, vec![call("f", "{}")]);
        let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"not json\"}</tool_call>";
        assert_eq!(parse(Format::Hermes, &[text]), (text.to_string(), vec![]));
    }

    #[test]
    fn llama3_bare_json_and_python_tag() {
        let text = " {\"name\": \"a\", \"parameters\": {\"q\": \"x;y\"}}; {\"name\": \"b\", \"parameters\": {}}";
        every_split(Format::Llama3, text, &(String::new(), vec![call("a", "{\"q\": \"x;y\"}"), call("b", "{}")]));
        let text = "Calling.<|python_tag|>{\"name\": \"a\", \"parameters\": {}}";
        every_split(Format::Llama3, text, &("Calling.".to_string(), vec![call("a", "{}")]));
    }

    #[test]
    fn llama3_json_that_is_not_a_call_is_text() {
        for text in ["{\"answer\": 4}", "{\"name\": \"a\", \"parameters\": {}", "{oops} {\"name\": \"a\"}"] {
            every_split(Format::Llama3, text, &(text.to_string(), vec![]));
        }
        // Bare JSON counts only at the start.
        let text = "The call is {\"name\": \"a\", \"parameters\": {}}";
        every_split(Format::Llama3, text, &(text.to_string(), vec![]));
        let text = "{\"name\": \"a\"}; and then";
        every_split(Format::Llama3, text, &("; and then".to_string(), vec![call("a", "{}")]));
    }

    #[test]
    fn mistral_marked_and_bare_arrays() {
        let calls = vec![call("a", "{\"x\": [1, 2]}"), call("b", "{}")];
        let text =
            "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}, {\"name\": \"b\", \"arguments\": {}}]";
        every_split(Format::Mistral, text, &(String::new(), calls.clone()));
        every_split(Format::Mistral, &text["[TOOL_CALLS]".len()..], &(String::new(), calls));
        // An array with one bad call stays text, and so does a plain list.
        for text in ["[TOOL_CALLS] [{\"name\": \"a\"}, {\"x\": 1}]", "[1] is a footnote", "[{\"name\": \"a\"}"] {
            every_split(Format::Mistral, text, &(text.to_string(), vec![]));
        }
    }

    #[test]
    fn plain_text_passes_through_with_only_the_tail_held() {
        let mut parser = ToolCallParser::new(Format::Hermes);
        assert_eq!(parser.feed("a <b> c"), ("a <b> c".to_string(), vec![]));
        assert_eq!(parser.feed(" 想 \n"), (" 想".to_string(), vec![]));
        assert_eq!(parser.feed("<tool_"), (String::new(), vec![]));
        assert_eq!(parser.flush(), (" \n<tool_".to_string(), vec![]));
        let mut parser = ToolCallParser::new(Format::Mistral);
        assert_eq!(parser.feed(" [ "), (String::new(), vec![]));
        assert_eq!(parser.feed("x"), (" [ x".to_string(), vec![]));
    }

    #[test]
    fn call_prefixes_parse_as_output() {
        for format in [Format::Hermes, Format::Llama3, Format::Mistral] {
            let args = if format == Format::Llama3 { "parameters" } else { "arguments" };
            let end = match format {
                Format::Hermes => "}\n</tool_call>",
                Format::Llama3 => "}",
                Format::Mistral => "}]",
            };
            let named = format!("{} {{\"a\": 1}}{end}", format.call_prefix(Some("say \"hi\"")));
            assert_eq!(parse(format, &[&named]), (String::new(), vec![call("say \"hi\"", "{\"a\": 1}")]));
            let open = format!("{}f\", \"{args}\": {{}}{end}", format.call_prefix(None));
            assert_eq!(parse(format, &[&open]), (String::new(), vec![call("f", "{}")]));
        }
    }

    #[test]
    fn names_and_unknown_names() {
        assert_eq!(Format::from_name("qwen25"), Ok(Format::Hermes));
        assert_eq!(Format::from_name("hermes"), Ok(Format::Hermes));
        assert!(Format::from_name("pythonic").is_err());
    }
}
