//! Finds tool calls in a model's output stream, in the formats SGLang's
//! `--tool-call-parser` names. Fed text deltas, the parser returns the
//! plain text that is safe to emit now and events: a call started (its
//! name), more of its arguments' JSON text, the call ended. Text that could
//! still open a call is held back, and so is argument text until it can be
//! closed into valid JSON.
//!
//! - `hermes` (also `qwen25`): `<tool_call>{"name", "arguments"}</tool_call>`,
//!   anywhere in the output, as often as the model likes.
//! - `llama3`: `<|python_tag|>` then `{"name", "parameters"}`, more calls
//!   after `;`.
//! - `mistral`: `[TOOL_CALLS]` then `[{"name", "arguments"}, ...]`.
//! - `deepseekv3`: `<｜tool▁calls▁begin｜>`, then per call
//!   `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`,
//!   then `<｜tool▁calls▁end｜>`.
//! - `deepseekv31`: the same, each call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
//! - `pythonic` (Llama 3.2 / 4): `[f(a="x", b=2), g()]` anywhere, Python
//!   literals as arguments, converted to JSON; `<|python_start|>` and
//!   `<|python_end|>` around it are dropped.
//! - `qwen3_coder`: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`,
//!   values typed by the function's JSON schema when the tools are given.
//! - `minimax-m2`: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n</invoke>\n</minimax:tool_call>`,
//!   values typed as qwen3_coder's.
//! - `glm45` (also `glm47`): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`,
//!   a call a section, values typed as qwen3_coder's.
//!
//! The llama3 and mistral markers are special tokens, which detokenizing
//! skips by default, so for them bare JSON at the very start of the output
//! opens calls too.
//!
//! Arguments are the model's own JSON text (the object, as written) in the
//! JSON formats, and JSON built as Python's `json.dumps` writes it
//! (`{"a": 1, "b": "x"}`) from the pythonic, qwen3_coder and glm45 formats. Their
//! streamed pieces concatenate to exactly what the whole call reports.
//!
//! What cannot be taken back is never sent early: a call starts only once
//! its name is complete (and, when the request's tools are given, one of
//! theirs) and its arguments have begun in the format's shape (or it ended
//! without any). A section that fails before that stays text
//! exactly as the model wrote it, and reading goes on right after its
//! opener. A call that breaks off after it started (bad JSON, the output
//! ends) keeps what was streamed and is closed into a valid object at its
//! last complete value; the section ends there and the text from the
//! failing byte on is plain text again (an end marker right there, such as
//! hermes's `</tool_call>`, still ends the section). A later call of a
//! section that fails before it starts ends the section where it begins.
//! Whitespace that only separates text from calls is dropped.

mod built_call;
mod deepseek;
mod events;
mod glm45;
mod json_calls;
mod json_scan;
mod pythonic;
mod tagged_value;
mod tools;
mod xml_calls;

pub use events::{deltas, CallDelta, CallEvent};
#[cfg(test)]
pub use events::{CallAssembler, ToolCall};
pub use tools::Tools;

use super::partial_marker_len;
use events::Calls;
use json_scan::is_ws;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Hermes,
    Llama3,
    Mistral,
    DeepSeekV3,
    DeepSeekV31,
    Pythonic,
    Qwen3Coder,
    MiniMaxM2,
    Glm45,
}

impl Format {
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "qwen25" | "hermes" => Ok(Format::Hermes),
            "llama3" => Ok(Format::Llama3),
            "mistral" => Ok(Format::Mistral),
            "deepseekv3" => Ok(Format::DeepSeekV3),
            "deepseekv31" => Ok(Format::DeepSeekV31),
            "pythonic" => Ok(Format::Pythonic),
            "qwen3_coder" => Ok(Format::Qwen3Coder),
            "minimax-m2" => Ok(Format::MiniMaxM2),
            "glm45" | "glm47" => Ok(Format::Glm45),
            _ => Err(format!(
                "unknown tool call parser {name:?}: expected qwen25, hermes, llama3, mistral, deepseekv3, deepseekv31, pythonic, \
                 qwen3_coder, minimax-m2, glm45 or glm47"
            )),
        }
    }

    fn marker(self) -> &'static str {
        match self {
            Format::Hermes | Format::Qwen3Coder | Format::Glm45 => "<tool_call>",
            Format::Llama3 => "<|python_tag|>",
            Format::Mistral => "[TOOL_CALLS]",
            Format::DeepSeekV3 | Format::DeepSeekV31 => deepseek::CALLS_BEGIN,
            Format::Pythonic => pythonic::START,
            Format::MiniMaxM2 => xml_calls::MINIMAX_M2_START,
        }
    }

    /// The start of a call, for a prompt that makes the model go on with
    /// one: up to the name, or given `name`, up to its arguments. Every
    /// format has one. Fed to a parser, it starts no call yet.
    pub fn call_prefix(self, name: Option<&str>) -> String {
        let json_call = |open: &str, arguments: &str| match name {
            None => format!("{open}\"name\": \""),
            Some(name) => format!("{open}\"name\": {}, \"{arguments}\":", json_string(name)),
        };
        match self {
            Format::Hermes => json_call("<tool_call>\n{", "arguments"),
            Format::Llama3 => json_call("{", "parameters"),
            Format::Mistral => json_call("[TOOL_CALLS] [{", "arguments"),
            Format::DeepSeekV3 => deepseek::call_prefix(name, false),
            Format::DeepSeekV31 => deepseek::call_prefix(name, true),
            Format::Pythonic => format!("[{}", name.map(|name| format!("{name}(")).unwrap_or_default()),
            Format::Qwen3Coder => {
                format!("<tool_call>\n<function={}", name.map(|name| format!("{name}>\n")).unwrap_or_default())
            }
            Format::MiniMaxM2 => format!(
                "{}\n<invoke name=\"{}",
                xml_calls::MINIMAX_M2_START,
                name.map(|name| format!("{name}\">\n")).unwrap_or_default()
            ),
            Format::Glm45 => format!("<tool_call>{}", name.map(|name| format!("{name}\n")).unwrap_or_default()),
        }
    }

    /// Where bare JSON opens a section in `text`, which starts at the start
    /// of the output or (llama3) right after a call.
    fn bare_opener(self, text: &str, after_call: bool) -> Opener {
        let bytes = text.as_bytes();
        let start = skip_ws(bytes, 0);
        let mut i = start;
        match self {
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
            _ => return Opener::No,
        }
        match bytes.get(i) {
            None => Opener::Maybe,
            Some(b'{') => Opener::At(start),
            Some(_) => Opener::No,
        }
    }

    fn section(self, marked: bool) -> Box<dyn Section> {
        let skip = if marked { self.marker().len() } else { 0 };
        match self {
            Format::Hermes => Box::new(json_calls::Hermes::new(skip)),
            Format::Llama3 => Box::new(json_calls::Llama3::new(skip)),
            Format::Mistral => Box::new(json_calls::Mistral::new(skip)),
            Format::DeepSeekV3 => Box::new(deepseek::DeepSeek::new(skip, false)),
            Format::DeepSeekV31 => Box::new(deepseek::DeepSeek::new(skip, true)),
            Format::Pythonic => Box::new(pythonic::Pythonic::new(skip)),
            Format::Qwen3Coder => Box::new(xml_calls::XmlCalls::new(&xml_calls::QWEN3_CODER, skip)),
            Format::MiniMaxM2 => Box::new(xml_calls::XmlCalls::new(&xml_calls::MINIMAX_M2, skip)),
            Format::Glm45 => Box::new(glm45::Glm45::new(skip)),
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

/// Reads one section of calls as its text streams in.
trait Section: Send + Sync {
    /// Reads on in `text`, the section from its opener (the same text,
    /// longer at each call), sending call events as they are known.
    fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step;
}

/// A section read in steps, each taking what it can of the text; the
/// first that cannot go on says how the read ends.
trait Stepped: Send + Sync {
    fn step(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Result<(), Step>;
}

impl<T: Stepped> Section for T {
    fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step {
        loop {
            if let Err(step) = self.step(text, eof, calls) {
                return step;
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// More text is needed (never at the end of output).
    Wait,
    /// The section, which made calls, ends at this offset.
    Done(usize),
    /// The section made no call: it is text.
    Reject,
}

pub struct ToolCallParser {
    format: Format,
    held: String,
    mode: Mode,
    calls: Calls,
}

enum Mode {
    /// Plain text. `opening`: bare JSON could open a section here.
    /// `after_call`: whitespace here follows a call and is dropped.
    Text { opening: bool, after_call: bool },
    /// A section that starts at `held[ws..]` with an opener `opener` bytes
    /// long; `held[..ws]` is whitespace that goes if the section holds calls.
    Section { ws: usize, opener: usize, reader: Box<dyn Section> },
}

impl ToolCallParser {
    pub fn new(format: Format) -> Self {
        Self::with_tools(format, Tools::default())
    }

    /// A parser for calls of the given tools only: a section whose call
    /// names another function is text. qwen3_coder types parameter values
    /// by their schemas.
    pub fn with_tools(format: Format, tools: Tools) -> Self {
        let opening = matches!(format, Format::Llama3 | Format::Mistral);
        ToolCallParser {
            format,
            held: String::new(),
            mode: Mode::Text { opening, after_call: false },
            calls: Calls::new(tools),
        }
    }

    /// Returns (text safe to emit now, call events of this delta).
    pub fn feed(&mut self, text: &str) -> (String, Vec<CallEvent>) {
        self.held.push_str(text);
        self.run(false)
    }

    /// End of output: an open call is closed, a section that made no call
    /// yet is text, and held text comes out.
    pub fn flush(&mut self) -> (String, Vec<CallEvent>) {
        self.run(true)
    }

    fn run(&mut self, eof: bool) -> (String, Vec<CallEvent>) {
        let mut text = String::new();
        loop {
            let waiting = match self.mode {
                Mode::Text { opening, after_call } => self.text_step(opening, after_call, eof, &mut text),
                Mode::Section { .. } => self.section_step(eof, &mut text),
            };
            if waiting {
                return (text, self.calls.take());
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
                    self.open_section(ws, false);
                    return false;
                }
                Opener::Maybe if !eof => {
                    self.mode = Mode::Text { opening, after_call };
                    return true;
                }
                _ => opening = false,
            }
        }
        let marker = self.format.marker();
        let marked = self.held.find(marker);
        let (bare, partial_bare) = match self.format {
            Format::Pythonic => match pythonic::find_call_list(&self.held) {
                pythonic::Search::Found(at) => (Some(at), None),
                pythonic::Search::Partial(at) => (None, Some(at)),
                pythonic::Search::None => (None, None),
            },
            _ => (None, None),
        };
        let found = match (marked, bare) {
            (Some(m), Some(b)) if b < m => Some((b, false)),
            (Some(m), _) => Some((m, true)),
            (None, b) => b.map(|b| (b, false)),
        };
        if let Some((at, marked)) = found {
            let text_end = trim_ws_end(&self.held[..at]).len();
            out.push_str(&self.held[..text_end]);
            self.held.drain(..text_end);
            self.open_section(at - text_end, marked);
            return false;
        }
        // Hold back what could still open a section, with the whitespace
        // before it, which goes if a call follows.
        let keep = if eof {
            0
        } else {
            let hold_from =
                (self.held.len() - partial_marker_len(&self.held, marker)).min(partial_bare.unwrap_or(usize::MAX));
            self.held.len() - trim_ws_end(&self.held[..hold_from]).len()
        };
        out.extend(self.held.drain(..self.held.len() - keep));
        self.mode = Mode::Text { opening, after_call: false };
        true
    }

    fn open_section(&mut self, ws: usize, marked: bool) {
        let opener = if marked { self.format.marker().len() } else { 1 };
        let reader = self.format.section(marked);
        self.mode = Mode::Section { ws, opener, reader };
    }

    /// Reads the open section; true when it must wait.
    fn section_step(&mut self, eof: bool, out: &mut String) -> bool {
        let Mode::Section { ws, opener, reader } = &mut self.mode else { unreachable!("called in a section") };
        let (ws, opener) = (*ws, *opener);
        match reader.read(&self.held[ws..], eof, &mut self.calls) {
            Step::Wait => {
                debug_assert!(!eof, "sections end at the end of output");
                return true;
            }
            Step::Done(end) => {
                self.held.drain(..ws + end);
                // Llama 3 separates further calls with `;` and no marker.
                self.mode = Mode::Text { opening: self.format == Format::Llama3, after_call: true };
            }
            Step::Reject => {
                // The opener goes out as text; the rest is read again, as it
                // may hold a section of its own.
                out.extend(self.held.drain(..ws + opener));
                self.mode = Mode::Text { opening: false, after_call: false };
            }
        }
        false
    }
}

/// Whether `text[at..]` starts with `literal`, could still (more text to
/// come), or does not.
#[derive(Debug, PartialEq, Eq)]
enum Expect {
    Found(usize),
    Partial,
    No,
}

fn expect(text: &str, at: usize, literal: &str, eof: bool) -> Expect {
    let rest = &text.as_bytes()[at.min(text.len())..];
    if rest.starts_with(literal.as_bytes()) {
        Expect::Found(at + literal.len())
    } else if !eof && literal.as_bytes().starts_with(rest) {
        Expect::Partial
    } else {
        Expect::No
    }
}

fn json_string(text: &str) -> String {
    let mut json = String::from('"');
    push_json_str(&mut json, text);
    json.push('"');
    json
}

/// Appends `text` to the contents of a JSON string, escaped as
/// serde_json and Python's json module escape it.
fn push_json_str(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c < ' ' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
}

/// Function names may hold what OpenAI's allow (`-`) and dots.
fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')
}

/// Offset of the first non-whitespace byte at or after `from`.
fn skip_ws(bytes: &[u8], from: usize) -> usize {
    from + bytes[from.min(bytes.len())..].iter().take_while(|&&b| is_ws(b)).count()
}

fn trim_ws_end(text: &str) -> &str {
    text.trim_end_matches([' ', '\t', '\n', '\r'])
}

#[cfg(test)]
mod tests;
