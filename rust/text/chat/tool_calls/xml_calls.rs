//! XML-style calls, several in a section, in two formats.
//!
//! Qwen3-Coder's, as its chat template writes them:
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=KEY>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! where one newline after `>` and one before `</parameter>` are the
//! template's, not the value's; and MiniMax-M2's:
//!
//! ```text
//! <minimax:tool_call>
//! <invoke name="NAME">
//! <parameter name="KEY">VALUE</parameter>
//! </invoke>
//! </minimax:tool_call>
//! ```
//!
//! Values are read as tagged_value.rs reads them: typed by the
//! parameter's schema, strings streamed as they are written.

use super::built_call::{self, BuiltCall};
use super::events::Calls;
use super::tagged_value::TaggedValue;
use super::{expect, skip_ws, Expect, Step, Stepped};

/// A format's tags.
pub(super) struct Tags {
    function_start: &'static str,
    function_end: &'static str,
    parameter_start: &'static str,
    parameter_end: &'static str,
    /// What ends a function's or parameter's name in its opening tag.
    name_end: &'static str,
    calls_end: &'static str,
    /// Whether the template writes a newline around each value.
    newlines: bool,
}

pub(super) const QWEN3_CODER: Tags = Tags {
    function_start: "<function=",
    function_end: "</function>",
    parameter_start: "<parameter=",
    parameter_end: "</parameter>",
    name_end: ">",
    calls_end: "</tool_call>",
    newlines: true,
};

pub(super) const MINIMAX_M2: Tags = Tags {
    function_start: "<invoke name=\"",
    function_end: "</invoke>",
    parameter_start: "<parameter name=\"",
    parameter_end: "</parameter>",
    name_end: "\">",
    calls_end: "</minimax:tool_call>",
    newlines: false,
};

pub(super) const MINIMAX_M2_START: &str = "<minimax:tool_call>";

pub(super) struct XmlCalls {
    tags: &'static Tags,
    pos: usize,
    state: State,
    /// Where the text of the function being read starts.
    call_from: usize,
    made_calls: bool,
    call: Option<Call>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    BeforeFunction,
    /// A tag's name (function or parameter) from the offset, up to its `name_end`.
    Name(usize),
    Parameters,
    Value,
    AfterFunction,
}

struct Call {
    built: BuiltCall,
    /// The parameter being read.
    value: Option<TaggedValue>,
}

impl XmlCalls {
    pub(super) fn new(tags: &'static Tags, skip: usize) -> Self {
        XmlCalls { tags, pos: skip, state: State::BeforeFunction, call_from: skip, made_calls: false, call: None }
    }

    /// The text stopped being calls at `at`.
    fn fail(&mut self, at: usize, calls: &mut Calls) -> Step {
        built_call::fail(self.call.take().map(|call| call.built), at, self.made_calls, self.call_from, calls)
    }
}

impl Stepped for XmlCalls {
    fn step(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Result<(), Step> {
        let at = skip_ws(text.as_bytes(), self.pos);
        let tags = self.tags;
        match self.state {
            State::BeforeFunction | State::AfterFunction => {
                self.call_from = self.pos;
                let done = self.state == State::AfterFunction;
                match (expect(text, at, tags.function_start, eof), expect(text, at, tags.calls_end, eof)) {
                    (Expect::Found(end), _) => {
                        self.pos = end;
                        self.state = State::Name(end);
                    }
                    (_, Expect::Found(end)) if done => return Err(Step::Done(end)),
                    (Expect::Partial, _) | (_, Expect::Partial) => return Err(Step::Wait),
                    _ if done => return Err(Step::Done(self.pos)),
                    _ => return Err(self.fail(at, calls)),
                }
            }
            State::Name(from) => {
                let Some(end) = text[from..].find(['>', '<', '\n', '"']).map(|i| from + i) else {
                    return Err(if eof { self.fail(text.len(), calls) } else { Step::Wait });
                };
                let name = text[from..end].trim();
                let after = match expect(text, end, tags.name_end, eof) {
                    Expect::Found(after) => after,
                    Expect::Partial => return Err(Step::Wait),
                    Expect::No => return Err(self.fail(from, calls)),
                };
                if name.is_empty() || (self.call.is_none() && !calls.knows(name)) {
                    return Err(self.fail(from, calls));
                }
                self.pos = after;
                match &mut self.call {
                    None => {
                        self.call = Some(Call { built: BuiltCall::new(name.to_string()), value: None });
                        self.state = State::Parameters;
                    }
                    Some(call) => {
                        call.built.key(name, calls);
                        self.made_calls = true;
                        let types = calls.tools().parameter_types(&call.built.name, name);
                        let value = TaggedValue::new(types, after, tags.newlines);
                        if value.streams() {
                            call.built.json.push('"');
                        }
                        call.value = Some(value);
                        self.state = State::Value;
                    }
                }
            }
            State::Parameters => {
                match (expect(text, at, tags.parameter_start, eof), expect(text, at, tags.function_end, eof)) {
                    (Expect::Found(end), _) => {
                        self.pos = end;
                        self.state = State::Name(end);
                    }
                    (_, Expect::Found(end)) => {
                        self.call.take().expect("a function is open").built.end(calls);
                        self.made_calls = true;
                        self.pos = end;
                        self.state = State::AfterFunction;
                    }
                    (Expect::Partial, _) | (_, Expect::Partial) => return Err(Step::Wait),
                    _ => return Err(self.fail(at, calls)),
                }
            }
            State::Value => {
                let call = self.call.as_mut().expect("a value belongs to a call");
                let value = call.value.as_mut().expect("a value is open");
                let next = value.read(
                    &mut call.built.json,
                    text,
                    eof,
                    &[tags.parameter_end, tags.parameter_start, tags.function_end],
                );
                call.built.send(calls);
                match next {
                    Some(next) => {
                        call.value = None;
                        self.pos = next;
                        self.state = State::Parameters;
                    }
                    None if eof => return Err(self.fail(text.len(), calls)),
                    None => return Err(Step::Wait),
                }
            }
        }
        Ok(())
    }
}
