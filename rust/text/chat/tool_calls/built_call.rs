//! A call whose arguments the parser builds as JSON (pythonic literals,
//! qwen3_coder values) instead of passing on the model's own JSON text.
//! It starts once its first argument (or its end) is known, streams as its
//! JSON grows, and is closed at its last complete value if the text breaks
//! off.

use super::events::Calls;
use super::json_scan::StreamedArguments;
use super::{json_string, Step};

pub(super) struct BuiltCall {
    pub(super) name: String,
    started: bool,
    /// The arguments object so far.
    pub(super) json: String,
    arguments: StreamedArguments,
}

impl BuiltCall {
    pub(super) fn new(name: String) -> Self {
        BuiltCall { name, started: false, json: String::new(), arguments: StreamedArguments::new() }
    }

    fn start(&mut self, calls: &mut Calls) {
        if !self.started {
            calls.start(self.name.clone());
            self.started = true;
            self.json.push('{');
        }
    }

    /// Opens the argument `key`: its value's JSON follows in `json`.
    pub(super) fn key(&mut self, key: &str, calls: &mut Calls) {
        self.start(calls);
        if self.json.len() > 1 {
            self.json.push_str(", ");
        }
        self.json += &json_string(key);
        self.json.push_str(": ");
    }

    /// Streams what `json` gained that can no longer be taken back.
    pub(super) fn send(&mut self, calls: &mut Calls) {
        let scanned = self.arguments.scan(&self.json);
        debug_assert!(scanned.is_ok(), "built JSON is valid: {}", self.json);
        self.arguments.send(&self.json, calls);
    }

    /// The call is complete: its object closes.
    pub(super) fn end(mut self, calls: &mut Calls) {
        self.start(calls);
        self.json.push('}');
        self.send(calls);
        calls.end();
    }
}

/// The text stopped being calls at `at`, with `open` the call being read:
/// one that started is closed and the section ends at `at`; otherwise it
/// ends where that call's text began (`call_from`) after earlier calls, or
/// was never calls.
pub(super) fn fail(open: Option<BuiltCall>, at: usize, made_calls: bool, call_from: usize, calls: &mut Calls) -> Step {
    match open {
        Some(mut call) if call.started => {
            call.arguments.close(&call.json, calls);
            calls.end();
            Step::Done(at)
        }
        _ if made_calls => Step::Done(call_from),
        _ => Step::Reject,
    }
}
