//! GLM-4.5's (and 4.6's, 4.7's) calls, one a section, as their chat
//! templates write them:
//!
//! ```text
//! <tool_call>NAME
//! <arg_key>KEY</arg_key>
//! <arg_value>VALUE</arg_value>
//! </tool_call>
//! ```
//!
//! GLM-4.7 writes no newlines between the tags. The template writes a
//! string value as it is and any other as JSON; values are read as
//! tagged_value.rs reads them.

use super::built_call::{self, BuiltCall};
use super::events::Calls;
use super::tagged_value::TaggedValue;
use super::tools::JsonType;
use super::{expect, is_name_byte, skip_ws, Expect, Step, Stepped};

const KEY_START: &str = "<arg_key>";
const KEY_END: &str = "</arg_key>";
const VALUE_START: &str = "<arg_value>";
const VALUE_END: &str = "</arg_value>";
const CALL_END: &str = "</tool_call>";

pub(super) struct Glm45 {
    pos: usize,
    state: State,
    call: Option<BuiltCall>,
}

enum State {
    Name,
    Arguments,
    /// A key's text from the offset.
    Key(usize),
    /// The value of this key, of a parameter of these types, comes next.
    BeforeValue(String, Vec<JsonType>),
    Value(TaggedValue),
}

impl Glm45 {
    pub(super) fn new(skip: usize) -> Self {
        Glm45 { pos: skip, state: State::Name, call: None }
    }

    /// The text stopped being a call at `at`.
    fn fail(&mut self, at: usize, calls: &mut Calls) -> Step {
        built_call::fail(self.call.take(), at, false, 0, calls)
    }
}

impl Stepped for Glm45 {
    fn step(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Result<(), Step> {
        let at = skip_ws(text.as_bytes(), self.pos);
        match &mut self.state {
            State::Name => {
                let Some(end) = text[self.pos..].find(['\n', '<']).map(|i| self.pos + i) else {
                    return Err(if eof { self.fail(text.len(), calls) } else { Step::Wait });
                };
                let name = text[self.pos..end].trim();
                // A function's name, so that other text in a section, such as
                // hermes's JSON, stays text.
                let named = !name.is_empty() && name.bytes().all(is_name_byte);
                if !named || !calls.knows(name) {
                    return Err(self.fail(self.pos, calls));
                }
                self.call = Some(BuiltCall::new(name.to_string()));
                self.pos = end;
                self.state = State::Arguments;
            }
            State::Arguments => match (expect(text, at, KEY_START, eof), expect(text, at, CALL_END, eof)) {
                (Expect::Found(end), _) => {
                    self.pos = end;
                    self.state = State::Key(end);
                }
                (_, Expect::Found(end)) => {
                    self.call.take().expect("a call is open").end(calls);
                    return Err(Step::Done(end));
                }
                (Expect::Partial, _) | (_, Expect::Partial) => return Err(Step::Wait),
                _ => return Err(self.fail(at, calls)),
            },
            State::Key(from) => {
                let from = *from;
                let Some(end) = text[from..].find(KEY_END).map(|i| from + i) else {
                    return Err(if eof { self.fail(text.len(), calls) } else { Step::Wait });
                };
                let key = text[from..end].trim();
                if key.is_empty() || key.contains('<') {
                    return Err(self.fail(from, calls));
                }
                let call = self.call.as_ref().expect("a key belongs to a call");
                let types = calls.tools().parameter_types(&call.name, key);
                self.pos = end + KEY_END.len();
                self.state = State::BeforeValue(key.to_string(), types);
            }
            State::BeforeValue(key, types) => match expect(text, at, VALUE_START, eof) {
                Expect::Found(end) => {
                    // The call starts with its first key, once that key's value begins.
                    let call = self.call.as_mut().expect("a value belongs to a call");
                    call.key(key, calls);
                    let value = TaggedValue::new(std::mem::take(types), end, false);
                    if value.streams() {
                        call.json.push('"');
                    }
                    call.send(calls);
                    self.pos = end;
                    self.state = State::Value(value);
                }
                Expect::Partial => return Err(Step::Wait),
                Expect::No => return Err(self.fail(at, calls)),
            },
            State::Value(value) => {
                let call = self.call.as_mut().expect("a value belongs to a call");
                let next = value.read(&mut call.json, text, eof, &[VALUE_END, KEY_START, CALL_END]);
                call.send(calls);
                match next {
                    Some(next) => {
                        self.pos = next;
                        self.state = State::Arguments;
                    }
                    None => return Err(Step::Wait),
                }
            }
        }
        Ok(())
    }
}
