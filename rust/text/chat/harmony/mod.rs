//! Reads gpt-oss's Harmony output: messages with a header and a body,
//!
//! ```text
//! <|channel|>analysis<|message|>...<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
//! <|start|>assistant<|channel|>final<|message|>...<|return|>
//! ```
//!
//! The chat template's generation prompt ends with `<|start|>assistant`, so
//! the output opens with the first message's channel. A message's body goes
//! by its header: the `analysis` channel is reasoning; a recipient
//! `to=functions.NAME` (in the channel or the role part of the header)
//! makes the body a call of NAME with the body as its JSON arguments; the
//! `final` channel, a `commentary` message with no recipient (a preamble)
//! and any other message are content. Text outside any message is content
//! too (a grammar-forced answer has no header).
//!
//! The markers are special tokens of gpt-oss's tokenizer; the output must
//! be detokenized with them kept. They are never emitted, and a tail that
//! could still become one is held back. `<|return|>` and `<|call|>` are
//! end-of-sequence tokens, so the last message usually just ends with the
//! output.

use std::collections::HashSet;

use super::partial_marker_len;
use super::tool_calls::CallEvent;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
const CONSTRAIN: &str = "<|constrain|>";
/// Every marker: held back as a partial tail, dropped between messages.
const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];
/// What ends a message body: its end markers, or a new header (a model
/// that skipped `<|end|>`).
const BODY_ENDS: [&str; 5] = [END, CALL, RETURN, START, CHANNEL];
/// The recipient prefix of the functions the request offers.
const FUNCTIONS: &str = "functions.";

/// What one step of output adds: reasoning text, content text, call events.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<CallEvent>,
}

pub struct HarmonyParser {
    /// Names a call may have; None: any. A call of another name is content.
    functions: Option<HashSet<String>>,
    /// Whether recipient messages are calls at all (the request reads them).
    read_calls: bool,
    held: String,
    state: State,
    count: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    /// A call; `started`: whether its arguments have had a non-blank byte.
    Call {
        started: bool,
    },
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    /// Between messages.
    Outside,
    /// In a header, which `held` holds from its start.
    Header,
    Body(Body),
}

impl HarmonyParser {
    /// `functions`: the names calls may have (None: any); `read_calls`:
    /// false leaves recipient messages as content.
    pub fn new(functions: Option<Vec<String>>, read_calls: bool) -> Self {
        HarmonyParser {
            functions: functions.map(|names| names.into_iter().collect()),
            read_calls,
            held: String::new(),
            state: State::Outside,
            count: 0,
        }
    }

    pub fn feed(&mut self, text: &str) -> Parsed {
        self.held.push_str(text);
        let mut out = Parsed::default();
        while self.step(&mut out, false) {}
        out
    }

    /// End of output: an open message ends here, a call with it; a header
    /// that never reached its body is dropped.
    pub fn flush(&mut self) -> Parsed {
        let mut out = Parsed::default();
        while self.step(&mut out, true) {}
        if let State::Body(body) = self.state {
            self.end_body(body, &mut out);
        }
        self.held.clear();
        self.state = State::Outside;
        out
    }

    /// Reads on; false when it must wait for more text.
    fn step(&mut self, out: &mut Parsed, eof: bool) -> bool {
        match self.state {
            State::Outside => self.outside(out, eof),
            State::Header => self.header(out),
            State::Body(body) => self.body(body, out, eof),
        }
    }

    fn outside(&mut self, out: &mut Parsed, eof: bool) -> bool {
        match first_marker(&self.held, &MARKERS) {
            Some((at, marker)) => {
                out.content.extend(self.held.drain(..at));
                if marker == START || marker == CHANNEL {
                    self.state = State::Header;
                } else {
                    self.held.drain(..marker.len()); // a stray end or constrain
                }
                true
            }
            None => {
                let keep = if eof { 0 } else { held_back(&self.held, &MARKERS) };
                out.content.extend(self.held.drain(..self.held.len() - keep));
                false
            }
        }
    }

    fn header(&mut self, out: &mut Parsed) -> bool {
        let Some(at) = self.held.find(MESSAGE) else { return false };
        let header = Header::read(&self.held[..at]);
        self.held.drain(..at + MESSAGE.len());
        let function = header.recipient.as_deref().and_then(|r| r.strip_prefix(FUNCTIONS));
        let body = match function {
            Some(name) if self.read_calls && self.knows(name) => {
                out.calls.push(CallEvent::Start { index: self.count, name: name.to_string() });
                Body::Call { started: false }
            }
            _ if header.channel.as_deref() == Some("analysis") => Body::Reasoning,
            _ => Body::Content,
        };
        self.state = State::Body(body);
        true
    }

    fn body(&mut self, mut body: Body, out: &mut Parsed, eof: bool) -> bool {
        let (text, ended) = match first_marker(&self.held, &BODY_ENDS) {
            Some((at, marker)) => {
                let text: String = self.held.drain(..at).collect();
                if marker != START && marker != CHANNEL {
                    self.held.drain(..marker.len());
                }
                (text, true)
            }
            None => {
                let mut keep = if eof { 0 } else { held_back(&self.held, &BODY_ENDS) };
                if matches!(body, Body::Call { .. }) && !eof {
                    // Arguments end without the blank the model may write before the end marker.
                    let before = &self.held[..self.held.len() - keep];
                    keep += before.len() - before.trim_end().len();
                }
                (self.held.drain(..self.held.len() - keep).collect(), false)
            }
        };
        match body {
            Body::Reasoning => out.reasoning += &text,
            Body::Content => out.content += &text,
            Body::Call { started } => {
                let text = if started { text.as_str() } else { text.trim_start() };
                let text = if ended || eof { text.trim_end() } else { text };
                if !text.is_empty() {
                    out.calls.push(CallEvent::Arguments { index: self.count, text: text.to_string() });
                    body = Body::Call { started: true };
                }
            }
        }
        if ended {
            self.end_body(body, out);
            self.state = State::Outside;
        } else {
            self.state = State::Body(body);
        }
        ended
    }

    fn end_body(&mut self, body: Body, out: &mut Parsed) {
        if let Body::Call { started } = body {
            if !started {
                out.calls.push(CallEvent::Arguments { index: self.count, text: "{}".into() });
            }
            out.calls.push(CallEvent::End { index: self.count });
            self.count += 1;
        }
    }

    fn knows(&self, name: &str) -> bool {
        !name.is_empty() && self.functions.as_ref().is_none_or(|names| names.contains(name))
    }
}

/// What a header says: its channel and recipient, wherever they are.
#[derive(Debug, Default, PartialEq, Eq)]
struct Header {
    channel: Option<String>,
    recipient: Option<String>,
}

impl Header {
    /// `text`: from `<|start|>` or `<|channel|>` up to `<|message|>`.
    fn read(text: &str) -> Self {
        let word = |rest: &str| -> String {
            let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
            rest[..end].to_string()
        };
        let channel = text.find(CHANNEL).map(|at| word(text[at + CHANNEL.len()..].trim_start()));
        let recipient = text.find("to=").map(|at| word(&text[at + 3..])).filter(|r| !r.is_empty());
        Header { channel, recipient }
    }
}

/// The earliest of `markers` in `text`: its offset and which it is.
fn first_marker(text: &str, markers: &[&'static str]) -> Option<(usize, &'static str)> {
    markers.iter().filter_map(|&m| text.find(m).map(|at| (at, m))).min_by_key(|&(at, _)| at)
}

/// Bytes at the end of `text` that could still become one of `markers`.
fn held_back(text: &str, markers: &[&str]) -> usize {
    markers.iter().map(|m| partial_marker_len(text, m)).max().unwrap_or(0)
}

#[cfg(test)]
mod tests;
