//! What the parser reports about calls, read as OpenAI stream deltas (and,
//! in tests, as whole calls).

use super::tools::Tools;

/// A step in the life of one call. Calls are numbered from 0 in the order
/// they start; each starts once, then gets argument text, then ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallEvent {
    Start {
        index: usize,
        name: String,
    },
    /// More of the arguments' JSON text, to append to what came before.
    Arguments {
        index: usize,
        text: String,
    },
    End {
        index: usize,
    },
}

/// A complete tool call: the function's name and its arguments as JSON
/// object text (the tests read calls whole).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// One entry of an OpenAI stream chunk's `delta.tool_calls`: the name only
/// in a call's first delta, and the argument text that arrived since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallDelta {
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

/// The events of one step as deltas: one per call they touch, in order.
pub fn deltas(events: Vec<CallEvent>) -> Vec<CallDelta> {
    let mut out: Vec<CallDelta> = Vec::new();
    for event in events {
        let index = match &event {
            CallEvent::Start { index, .. } | CallEvent::Arguments { index, .. } | CallEvent::End { index } => *index,
        };
        if out.last().is_none_or(|delta| delta.index != index) {
            if let CallEvent::End { .. } = event {
                continue;
            }
            out.push(CallDelta { index, name: None, arguments: String::new() });
        }
        let delta = out.last_mut().expect("pushed above");
        match event {
            CallEvent::Start { name, .. } => delta.name = Some(name),
            CallEvent::Arguments { text, .. } => delta.arguments += &text,
            CallEvent::End { .. } => {}
        }
    }
    out
}

/// Whole calls out of events, each once it has ended.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct CallAssembler {
    open: Option<ToolCall>,
}

#[cfg(test)]
impl CallAssembler {
    pub fn take(&mut self, events: Vec<CallEvent>) -> Vec<ToolCall> {
        let mut calls = Vec::new();
        for event in events {
            match event {
                CallEvent::Start { name, .. } => self.open = Some(ToolCall { name, arguments: String::new() }),
                CallEvent::Arguments { text, .. } => {
                    self.open.as_mut().expect("arguments follow a start").arguments += &text
                }
                CallEvent::End { .. } => calls.push(self.open.take().expect("an end follows a start")),
            }
        }
        calls
    }
}

/// The calls of one output as the section readers find them: the tools
/// they may name, their events, their count.
#[derive(Debug, Default)]
pub(super) struct Calls {
    tools: Tools,
    events: Vec<CallEvent>,
    count: usize,
}

impl Calls {
    pub(super) fn new(tools: Tools) -> Self {
        Calls { tools, ..Calls::default() }
    }

    pub(super) fn tools(&self) -> &Tools {
        &self.tools
    }

    /// Whether a call may name `function` (a name no tool has is no call).
    pub(super) fn knows(&self, function: &str) -> bool {
        self.tools.knows(function)
    }

    pub(super) fn start(&mut self, name: String) {
        self.events.push(CallEvent::Start { index: self.count, name });
    }

    pub(super) fn arguments(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        if let Some(CallEvent::Arguments { text: last, .. }) = self.events.last_mut() {
            last.push_str(text);
        } else {
            self.events.push(CallEvent::Arguments { index: self.count, text: text.to_string() });
        }
    }

    pub(super) fn end(&mut self) {
        self.events.push(CallEvent::End { index: self.count });
        self.count += 1;
    }

    pub(super) fn take(&mut self) -> Vec<CallEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events() -> Vec<CallEvent> {
        vec![
            CallEvent::Arguments { index: 0, text: "1}".into() },
            CallEvent::End { index: 0 },
            CallEvent::Start { index: 1, name: "g".into() },
            CallEvent::Arguments { index: 1, text: "{}".into() },
            CallEvent::End { index: 1 },
            CallEvent::Start { index: 2, name: "h".into() },
        ]
    }

    #[test]
    fn deltas_are_one_per_call_touched() {
        let delta = |index, name: Option<&str>, arguments: &str| CallDelta {
            index,
            name: name.map(String::from),
            arguments: arguments.into(),
        };
        assert_eq!(deltas(events()), vec![delta(0, None, "1}"), delta(1, Some("g"), "{}"), delta(2, Some("h"), "")]);
        assert_eq!(deltas(vec![CallEvent::End { index: 3 }]), vec![]);
    }

    #[test]
    fn whole_calls_come_out_once_ended() {
        let mut assembler = CallAssembler::default();
        let first = vec![
            CallEvent::Start { index: 0, name: "f".into() },
            CallEvent::Arguments { index: 0, text: "{\"a\": ".into() },
        ];
        assert_eq!(assembler.take(first), vec![]);
        let call = |name: &str, arguments: &str| ToolCall { name: name.into(), arguments: arguments.into() };
        assert_eq!(assembler.take(events()), vec![call("f", "{\"a\": 1}"), call("g", "{}")]);
    }
}
