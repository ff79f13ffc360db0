//! Qwen3-Coder's XML-style calls, as its chat template writes them:
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
//! A value is text (one newline after `>` and one before `</parameter>`
//! are the template's). It becomes a JSON value by the parameter's schema
//! type (see tools.rs): a string without one. String values stream as
//! they are written; typed ones come whole. A missing `</parameter>` is
//! forgiven where the next tag begins.

use super::built_call::{self, BuiltCall};
use super::events::Calls;
use super::tagged_value::TaggedValue;
use super::{expect, skip_ws, Expect, Section, Step};

const FUNCTION_START: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_START: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";
const CALLS_END: &str = "</tool_call>";

pub(super) struct Qwen3Coder {
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
    /// A tag's name (function or parameter) from the offset, up to `>`.
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

impl Qwen3Coder {
    pub(super) fn new(skip: usize) -> Self {
        Qwen3Coder { pos: skip, state: State::BeforeFunction, call_from: skip, made_calls: false, call: None }
    }

    /// The text stopped being calls at `at`.
    fn fail(&mut self, at: usize, calls: &mut Calls) -> Step {
        built_call::fail(self.call.take().map(|call| call.built), at, self.made_calls, self.call_from, calls)
    }

    fn step(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Result<(), Step> {
        let at = skip_ws(text.as_bytes(), self.pos);
        match self.state {
            State::BeforeFunction | State::AfterFunction => {
                self.call_from = self.pos;
                let done = self.state == State::AfterFunction;
                match (expect(text, at, FUNCTION_START, eof), expect(text, at, CALLS_END, eof)) {
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
                let Some(end) = text[from..].find(['>', '<', '\n']).map(|i| from + i) else {
                    return Err(if eof { self.fail(text.len(), calls) } else { Step::Wait });
                };
                let name = text[from..end].trim();
                if !text[end..].starts_with('>') || name.is_empty() || (self.call.is_none() && !calls.knows(name)) {
                    return Err(self.fail(from, calls));
                }
                self.pos = end + 1;
                match &mut self.call {
                    None => {
                        self.call = Some(Call { built: BuiltCall::new(name.to_string()), value: None });
                        self.state = State::Parameters;
                    }
                    Some(call) => {
                        call.built.key(name, calls);
                        self.made_calls = true;
                        let types = calls.tools().parameter_types(&call.built.name, name);
                        let value = TaggedValue::new(types, end + 1, true);
                        if value.streams() {
                            call.built.json.push('"');
                        }
                        call.value = Some(value);
                        self.state = State::Value;
                    }
                }
            }
            State::Parameters => match (expect(text, at, PARAMETER_START, eof), expect(text, at, FUNCTION_END, eof)) {
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
            },
            State::Value => {
                let call = self.call.as_mut().expect("a value belongs to a call");
                let value = call.value.as_mut().expect("a value is open");
                let next = value.read(&mut call.built.json, text, eof, &[PARAMETER_END, PARAMETER_START, FUNCTION_END]);
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

impl Section for Qwen3Coder {
    fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step {
        loop {
            if let Err(step) = self.step(text, eof, calls) {
                return step;
            }
        }
    }
}
