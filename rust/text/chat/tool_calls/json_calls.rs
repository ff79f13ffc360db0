//! The formats whose calls are JSON objects `{"name": ..., "arguments":
//! {...}}`: hermes, llama3 and mistral.

use super::events::Calls;
use super::json_scan::{is_ws, JsonScanner, StreamedArguments};
use super::{expect, skip_ws, Expect, Section, Step};

/// How reading one call came out.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unit {
    Wait,
    /// The call ended at this offset.
    Done(usize),
    /// The call stopped being one at this offset (closed, if it started).
    Failed(usize),
}

/// One call object read as it streams in: the name, the arguments (under
/// `arguments`, or llama3's `parameters`) streamed as written, other keys
/// skipped. It starts once the name is known and the arguments object has
/// begun, or the object ended: arguments absent or null are `{}`, and an
/// object encoded in a string (some fine-tunes write that) is decoded.
#[derive(Debug)]
pub(super) struct CallObject {
    pos: usize,
    state: Object,
    /// Where the key or value being scanned starts.
    token: usize,
    scanner: JsonScanner,
    name: Option<String>,
    arguments: Arguments,
    started: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Object {
    Open,
    Key { first: bool },
    InKey,
    Colon(Field),
    Value(Field),
    InValue(Field),
    InArguments,
    After,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Name,
    Arguments,
    Other,
}

#[derive(Debug)]
enum Arguments {
    Absent,
    /// The object as the model writes it, from this offset.
    Streamed(usize, StreamedArguments),
    /// Decoded from a string, or `{}` for null.
    Given(String),
}

impl CallObject {
    /// A call whose object (after whitespace) starts at offset `pos`.
    pub(super) fn new(pos: usize) -> Self {
        CallObject {
            pos,
            state: Object::Open,
            token: 0,
            scanner: JsonScanner::new(),
            name: None,
            arguments: Arguments::Absent,
            started: false,
        }
    }

    pub(super) fn started(&self) -> bool {
        self.started
    }

    pub(super) fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Unit {
        let bytes = text.as_bytes();
        loop {
            match self.state {
                Object::InKey | Object::InValue(_) => match self.scanner.scan(&text[self.token..]) {
                    Ok(Some(end)) => {
                        let token = &text[self.token..self.token + end];
                        self.pos = self.token + end;
                        if self.state == Object::InKey {
                            self.state = Object::Colon(self.field(serde_json::from_str(token).ok()));
                        } else if let Object::InValue(field) = self.state {
                            if self.take_value(field, token, calls).is_err() {
                                return self.fail(self.token, text, calls);
                            }
                            self.state = Object::After;
                            self.start_when_ready(text, calls);
                        }
                    }
                    Ok(None) => return self.wait(text, eof, calls),
                    Err(at) => return self.fail(self.token + at, text, calls),
                },
                Object::InArguments => {
                    let Arguments::Streamed(from, arguments) = &mut self.arguments else {
                        unreachable!("streamed arguments are being read")
                    };
                    let from = *from;
                    match arguments.scan(&text[from..]) {
                        Ok(Some(end)) => {
                            self.pos = from + end;
                            self.state = Object::After;
                            self.start_when_ready(text, calls);
                        }
                        Ok(None) => {
                            self.start_when_ready(text, calls);
                            return self.wait(text, eof, calls);
                        }
                        Err(at) => return self.fail(from + at, text, calls),
                    }
                }
                state => {
                    let Some(&b) = bytes.get(self.pos) else { return self.wait(text, eof, calls) };
                    if is_ws(b) {
                        self.pos += 1;
                        continue;
                    }
                    self.state = match (state, b) {
                        (Object::Open, b'{') => Object::Key { first: true },
                        (Object::Key { first: true }, b'}') | (Object::After, b'}') => {
                            return self.finish(text, calls);
                        }
                        (Object::Key { .. }, b'"') => self.begin_token(Object::InKey),
                        (Object::Colon(field), b':') => Object::Value(field),
                        (Object::Value(Field::Arguments), b'{') => {
                            self.arguments = Arguments::Streamed(self.pos, StreamedArguments::new());
                            self.start_when_ready(text, calls);
                            Object::InArguments
                        }
                        (Object::Value(field), _) => self.begin_token(Object::InValue(field)),
                        (Object::After, b',') => Object::Key { first: false },
                        _ => return self.fail(self.pos, text, calls),
                    };
                    if !matches!(self.state, Object::InKey | Object::InValue(_) | Object::InArguments) {
                        self.pos += 1;
                    }
                }
            }
        }
    }

    fn begin_token(&mut self, state: Object) -> Object {
        self.token = self.pos;
        self.scanner = JsonScanner::new();
        state
    }

    /// What a key stands for: the first `name`, the first arguments key.
    fn field(&self, key: Option<String>) -> Field {
        match key.as_deref() {
            Some("name") if self.name.is_none() => Field::Name,
            Some("arguments" | "parameters") if matches!(self.arguments, Arguments::Absent) => Field::Arguments,
            _ => Field::Other,
        }
    }

    fn take_value(&mut self, field: Field, json: &str, calls: &Calls) -> Result<(), ()> {
        match field {
            Field::Name => {
                let name: String = serde_json::from_str(json).map_err(|_| ())?;
                if name.is_empty() || !calls.knows(&name) {
                    return Err(());
                }
                self.name = Some(name);
            }
            Field::Arguments => self.arguments = Arguments::Given(given_arguments(json).ok_or(())?),
            Field::Other => {}
        }
        Ok(())
    }

    /// Starts the call once its name is known and its arguments have begun,
    /// then sends what it can of them.
    fn start_when_ready(&mut self, text: &str, calls: &mut Calls) {
        if !self.started {
            let Some(name) = &self.name else { return };
            if let Arguments::Absent = self.arguments {
                return;
            }
            calls.start(name.clone());
            self.started = true;
            if let Arguments::Given(json) = &self.arguments {
                calls.arguments(json);
            }
        }
        if let Arguments::Streamed(from, arguments) = &mut self.arguments {
            arguments.send(&text[*from..], calls);
        }
    }

    fn wait(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Unit {
        if eof {
            return self.fail(text.len(), text, calls);
        }
        Unit::Wait
    }

    /// The object closed at `pos`.
    fn finish(&mut self, text: &str, calls: &mut Calls) -> Unit {
        if self.name.is_none() {
            return self.fail(self.pos, text, calls);
        }
        if let Arguments::Absent = self.arguments {
            self.arguments = Arguments::Given("{}".into());
        }
        self.start_when_ready(text, calls);
        calls.end();
        Unit::Done(self.pos + 1)
    }

    fn fail(&mut self, at: usize, text: &str, calls: &mut Calls) -> Unit {
        if self.started {
            if let Arguments::Streamed(from, arguments) = &mut self.arguments {
                arguments.close(&text[*from..], calls);
            }
            calls.end();
        }
        Unit::Failed(at)
    }
}

/// Arguments that are not an object as written: null, or an object encoded
/// in a string.
fn given_arguments(json: &str) -> Option<String> {
    if json == "null" {
        return Some("{}".into());
    }
    let inner: String = serde_json::from_str(json).ok()?;
    let value: &serde_json::value::RawValue = serde_json::from_str(&inner).ok()?;
    value.get().starts_with('{').then(|| value.get().to_string())
}

const HERMES_END: &str = "</tool_call>";

/// `<tool_call>` + a call object + `</tool_call>` (which may be missing at
/// the end of output, or may come where the object breaks off).
pub(super) struct Hermes {
    call: CallObject,
    /// Where the call ended or broke off.
    call_end: Option<usize>,
}

impl Hermes {
    pub(super) fn new(skip: usize) -> Self {
        Hermes { call: CallObject::new(skip), call_end: None }
    }
}

impl Section for Hermes {
    fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step {
        let call_end = match self.call_end {
            Some(end) => end,
            None => match self.call.read(text, eof, calls) {
                Unit::Wait => return Step::Wait,
                _ if !self.call.started() => return Step::Reject,
                Unit::Done(end) | Unit::Failed(end) => *self.call_end.insert(end),
            },
        };
        match expect(text, skip_ws(text.as_bytes(), call_end), HERMES_END, eof) {
            Expect::Found(end) => Step::Done(end),
            Expect::Partial => Step::Wait,
            Expect::No => Step::Done(call_end),
        }
    }
}

/// One call object, after `<|python_tag|>`, at the start, or after `;`.
pub(super) struct Llama3 {
    call: Option<CallObject>,
    skip: usize,
}

impl Llama3 {
    pub(super) fn new(skip: usize) -> Self {
        Llama3 { call: None, skip }
    }
}

impl Section for Llama3 {
    fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step {
        let skip = self.skip + usize::from(self.skip == 0 && text.starts_with(';'));
        let call = self.call.get_or_insert_with(|| CallObject::new(skip));
        match call.read(text, eof, calls) {
            Unit::Wait => Step::Wait,
            _ if !call.started() => Step::Reject,
            Unit::Done(end) | Unit::Failed(end) => Step::Done(end),
        }
    }
}

/// A JSON array of call objects.
pub(super) struct Mistral {
    state: MistralState,
    made_calls: bool,
}

enum MistralState {
    Open(usize),
    /// A call whose text starts at the offset.
    Call(Box<CallObject>, usize),
    AfterCall(usize),
}

impl Mistral {
    pub(super) fn new(skip: usize) -> Self {
        Mistral { state: MistralState::Open(skip), made_calls: false }
    }
}

impl Section for Mistral {
    fn read(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step {
        let bytes = text.as_bytes();
        loop {
            self.state = match &mut self.state {
                MistralState::Open(pos) => match bytes.get(skip_ws(bytes, *pos)) {
                    None if !eof => return Step::Wait,
                    Some(b'[') => {
                        let i = skip_ws(bytes, *pos) + 1;
                        MistralState::Call(Box::new(CallObject::new(i)), i)
                    }
                    _ => return Step::Reject,
                },
                MistralState::AfterCall(pos) => {
                    let i = skip_ws(bytes, *pos);
                    match bytes.get(i) {
                        None if !eof => return Step::Wait,
                        Some(b',') => MistralState::Call(Box::new(CallObject::new(i + 1)), i + 1),
                        Some(b']') => return Step::Done(i + 1),
                        // Anything else ends the calls; it is text.
                        _ => return Step::Done(*pos),
                    }
                }
                MistralState::Call(call, from) => match call.read(text, eof, calls) {
                    Unit::Wait => return Step::Wait,
                    Unit::Done(end) => {
                        self.made_calls = true;
                        MistralState::AfterCall(end)
                    }
                    Unit::Failed(at) if call.started() => return Step::Done(at),
                    Unit::Failed(_) if self.made_calls => return Step::Done(*from),
                    Unit::Failed(_) => return Step::Reject,
                },
            }
        }
    }
}
