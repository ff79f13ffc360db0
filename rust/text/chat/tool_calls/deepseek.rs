//! DeepSeek's calls, as its chat templates write them:
//! `<｜tool▁calls▁begin｜>`, then calls separated by newlines, each
//! `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`
//! (V3) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1),
//! then `<｜tool▁calls▁end｜>`.

use super::events::Calls;
use super::json_scan::StreamedArguments;
use super::{expect, skip_ws, Expect, Step, Stepped};

pub(super) const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_HEAD: &str = "function<｜tool▁sep｜>";
const SEP: &str = "<｜tool▁sep｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const FENCE_OPEN: &str = "```json";
const FENCE_CLOSE: &str = "```";

pub(super) fn call_prefix(name: Option<&str>, v31: bool) -> String {
    if v31 {
        return format!("{CALLS_BEGIN}{CALL_BEGIN}{}", name.map(|name| format!("{name}{SEP}")).unwrap_or_default());
    }
    let named = name.map(|name| format!("{name}\n{FENCE_OPEN}\n")).unwrap_or_default();
    format!("{CALLS_BEGIN}{CALL_BEGIN}{CALL_HEAD}{named}")
}

pub(super) struct DeepSeek {
    /// V3.1's calls: the name, then the arguments after `<｜tool▁sep｜>`, unfenced.
    v31: bool,
    pos: usize,
    state: State,
    /// Where the text of the call being read starts.
    call_from: usize,
    made_calls: bool,
    name: String,
    arguments_from: usize,
    arguments: StreamedArguments,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    BeforeCall,
    Head,
    Name,
    Fence,
    Arguments,
    Tail,
}

impl DeepSeek {
    pub(super) fn new(skip: usize, v31: bool) -> Self {
        DeepSeek {
            v31,
            pos: skip,
            state: State::BeforeCall,
            call_from: skip,
            made_calls: false,
            name: String::new(),
            arguments_from: 0,
            arguments: StreamedArguments::new(),
        }
    }

    /// A call that is not one, before it started: the calls end before it.
    fn not_a_call(&self) -> Step {
        if self.made_calls {
            Step::Done(self.call_from)
        } else {
            Step::Reject
        }
    }
}

impl Stepped for DeepSeek {
    fn step(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Result<(), Step> {
        let bytes = text.as_bytes();
        match self.state {
            State::BeforeCall => {
                self.call_from = self.pos;
                let at = skip_ws(bytes, self.pos);
                match (expect(text, at, CALL_BEGIN, eof), expect(text, at, CALLS_END, eof)) {
                    (Expect::Found(end), _) => self.pos = end,
                    (_, Expect::Found(end)) if self.made_calls => return Err(Step::Done(end)),
                    (Expect::Partial, _) | (_, Expect::Partial) => return Err(Step::Wait),
                    _ => return Err(self.not_a_call()),
                }
                self.state = State::Head;
            }
            State::Head if self.v31 => self.state = State::Name,
            State::Head => match expect(text, self.pos, CALL_HEAD, eof) {
                Expect::Found(end) => {
                    self.pos = end;
                    self.state = State::Name;
                }
                Expect::Partial => return Err(Step::Wait),
                Expect::No => return Err(self.not_a_call()),
            },
            State::Name => {
                let end_of_name = if self.v31 { SEP } else { "\n" };
                let Some(line) = text[self.pos..].find(end_of_name) else {
                    return Err(if eof { self.not_a_call() } else { Step::Wait });
                };
                let name = text[self.pos..self.pos + line].trim();
                if name.is_empty() || name.contains(['<', '`', '{', '\n']) || !calls.knows(name) {
                    return Err(self.not_a_call());
                }
                self.name = name.to_string();
                self.pos += line + end_of_name.len();
                self.state = State::Fence;
            }
            State::Fence => {
                let fence = skip_ws(bytes, self.pos);
                let end = match expect(text, fence, FENCE_OPEN, eof) {
                    _ if self.v31 => self.pos,
                    Expect::Found(end) => end,
                    Expect::Partial => return Err(Step::Wait),
                    Expect::No => return Err(self.not_a_call()),
                };
                let brace = skip_ws(bytes, end);
                match bytes.get(brace) {
                    None if !eof => return Err(Step::Wait),
                    Some(b'{') => {}
                    _ => return Err(self.not_a_call()),
                }
                calls.start(std::mem::take(&mut self.name));
                self.made_calls = true;
                self.arguments_from = brace;
                self.arguments = StreamedArguments::new();
                self.state = State::Arguments;
            }
            State::Arguments => {
                let json = &text[self.arguments_from..];
                let scanned = self.arguments.scan(json);
                self.arguments.send(json, calls);
                self.pos = self.arguments_from
                    + match scanned {
                        Ok(None) if !eof => return Err(Step::Wait),
                        Ok(None) => json.len(),
                        Ok(Some(end)) | Err(end) => end,
                    };
                self.arguments.close(json, calls);
                calls.end();
                self.state = State::Tail;
            }
            State::Tail => {
                // The fence and the call's end marker; without them the
                // calls end here.
                let mut at = skip_ws(bytes, self.pos);
                match expect(text, at, FENCE_CLOSE, eof) {
                    Expect::Found(end) => at = skip_ws(bytes, end),
                    Expect::Partial => return Err(Step::Wait),
                    Expect::No => {}
                }
                match expect(text, at, CALL_END, eof) {
                    Expect::Found(end) => self.pos = end,
                    Expect::Partial => return Err(Step::Wait),
                    Expect::No => return Err(Step::Done(self.pos)),
                }
                self.state = State::BeforeCall;
            }
        }
        Ok(())
    }
}
