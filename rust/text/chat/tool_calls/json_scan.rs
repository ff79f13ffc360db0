//! Checks JSON text as it streams in, one value at a time, and knows the
//! last point up to which the text can be closed into a complete value:
//! a call's arguments stream out up to that point, so that a call cut
//! short or broken off can always be closed into valid JSON.

use super::events::Calls;

/// One JSON value read incrementally: fed the value's text so far (each
/// time a longer prefix of the same text), it says whether the value is
/// complete, not yet, or where it stopped being JSON.
#[derive(Clone, Debug)]
pub(super) struct JsonScanner {
    state: State,
    /// The closing bracket of every open container, innermost last.
    closers: Vec<u8>,
    scanned: usize,
    closable: usize,
    closable_in_string: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// A value must come (the start, after `:`, after `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object.
    Key,
    Str {
        key: bool,
        escape: Escape,
    },
    Colon,
    Number(Number),
    Literal {
        rest: &'static [u8],
    },
    /// After a value in a container: `,` or its closer.
    After,
    Complete,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Escape {
    None,
    Backslash,
    /// Hex digits of a `\u` escape still to come.
    Unicode(u8),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Number {
    Minus,
    Zero,
    Int,
    Dot,
    Fraction,
    Exponent,
    ExponentSign,
    ExponentDigits,
}

impl Number {
    fn next(self, b: u8) -> Option<Number> {
        use Number::*;
        Some(match (self, b) {
            (Minus, b'0') => Zero,
            (Minus, b'1'..=b'9') | (Int, b'0'..=b'9') => Int,
            (Zero | Int, b'.') => Dot,
            (Dot | Fraction, b'0'..=b'9') => Fraction,
            (Zero | Int | Fraction, b'e' | b'E') => Exponent,
            (Exponent, b'+' | b'-') => ExponentSign,
            (Exponent | ExponentSign | ExponentDigits, b'0'..=b'9') => ExponentDigits,
            _ => return None,
        })
    }

    fn is_complete(self) -> bool {
        matches!(self, Number::Zero | Number::Int | Number::Fraction | Number::ExponentDigits)
    }
}

impl JsonScanner {
    pub(super) fn new() -> Self {
        JsonScanner { state: State::Value, closers: Vec::new(), scanned: 0, closable: 0, closable_in_string: false }
    }

    /// Reads on in `text`, the value's text from its first byte: Ok(Some(end))
    /// once the value is complete (`text[..end]`; a number ends before the
    /// byte that ends it), Ok(None) while it could go on, Err(offset) at the
    /// first byte that is not JSON. Only whitespace may precede the value.
    pub(super) fn scan(&mut self, text: &str) -> Result<Option<usize>, usize> {
        let bytes = text.as_bytes();
        while self.scanned < bytes.len() {
            let b = bytes[self.scanned];
            // Whitespace between tokens goes out with the token after it.
            let spacing = is_ws(b) && self.between_tokens();
            let consumed = self.step(b).map_err(|()| self.scanned)?;
            if consumed {
                self.scanned += 1;
                if self.is_closable() && !spacing {
                    self.closable = self.scanned;
                    self.closable_in_string = matches!(self.state, State::Str { .. });
                }
            }
            if self.state == State::Complete {
                return Ok(Some(self.scanned));
            }
        }
        Ok(None)
    }

    pub(super) fn is_complete(&self) -> bool {
        self.state == State::Complete
    }

    /// How much of the text scanned so far `closing()` completes.
    pub(super) fn closable(&self) -> usize {
        self.closable
    }

    /// What completes `text[..closable()]` into one JSON value: a closing
    /// quote if it ends inside a string, then the open containers' closers.
    pub(super) fn closing(&self) -> String {
        let quote = if self.closable_in_string { "\"" } else { "" };
        quote.chars().chain(self.closers.iter().rev().map(|&b| b as char)).collect()
    }

    fn is_closable(&self) -> bool {
        match self.state {
            State::Str { key, escape } => !key && escape == Escape::None,
            State::Number(number) => number.is_complete(),
            State::ValueOrClose | State::KeyOrClose | State::After | State::Complete => true,
            State::Value | State::Key | State::Colon | State::Literal { .. } => false,
        }
    }

    /// Takes one byte; Ok(false) when it ended a number and must be read
    /// again in the state that follows.
    fn step(&mut self, b: u8) -> Result<bool, ()> {
        match self.state {
            _ if is_ws(b) && self.between_tokens() => {}
            State::ValueOrClose if b == b']' => self.close(b)?,
            State::Value | State::ValueOrClose => self.begin_value(b)?,
            State::KeyOrClose if b == b'}' => self.close(b)?,
            State::KeyOrClose | State::Key if b == b'"' => self.state = State::Str { key: true, escape: Escape::None },
            State::Str { key, escape } => self.string_byte(key, escape, b)?,
            State::Colon if b == b':' => self.state = State::Value,
            State::Number(number) => match number.next(b) {
                Some(next) => self.state = State::Number(next),
                None if number.is_complete() => {
                    self.value_done();
                    return Ok(false);
                }
                None => return Err(()),
            },
            State::Literal { rest } if rest.first() == Some(&b) => {
                self.state = State::Literal { rest: &rest[1..] };
                if rest.len() == 1 {
                    self.value_done();
                }
            }
            State::After if b == b',' => {
                self.state = if self.closers.last() == Some(&b'}') { State::Key } else { State::Value }
            }
            State::After if b == b'}' || b == b']' => self.close(b)?,
            _ => return Err(()),
        }
        Ok(true)
    }

    fn between_tokens(&self) -> bool {
        matches!(
            self.state,
            State::Value | State::ValueOrClose | State::KeyOrClose | State::Key | State::Colon | State::After
        )
    }

    fn begin_value(&mut self, b: u8) -> Result<(), ()> {
        self.state = match b {
            b'{' => {
                self.closers.push(b'}');
                State::KeyOrClose
            }
            b'[' => {
                self.closers.push(b']');
                State::ValueOrClose
            }
            b'"' => State::Str { key: false, escape: Escape::None },
            b'-' => State::Number(Number::Minus),
            b'0' => State::Number(Number::Zero),
            b'1'..=b'9' => State::Number(Number::Int),
            b't' => State::Literal { rest: b"rue" },
            b'f' => State::Literal { rest: b"alse" },
            b'n' => State::Literal { rest: b"ull" },
            _ => return Err(()),
        };
        Ok(())
    }

    fn string_byte(&mut self, key: bool, escape: Escape, b: u8) -> Result<(), ()> {
        let escape = match (escape, b) {
            (Escape::None, b'"') => {
                if key {
                    self.state = State::Colon;
                } else {
                    self.value_done();
                }
                return Ok(());
            }
            (Escape::None, b'\\') => Escape::Backslash,
            (Escape::None, 0..=0x1f) => return Err(()),
            (Escape::None, _) => Escape::None,
            (Escape::Backslash, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Escape::None,
            (Escape::Backslash, b'u') => Escape::Unicode(4),
            (Escape::Unicode(left), _) if b.is_ascii_hexdigit() => match left {
                1 => Escape::None,
                _ => Escape::Unicode(left - 1),
            },
            _ => return Err(()),
        };
        self.state = State::Str { key, escape };
        Ok(())
    }

    fn close(&mut self, b: u8) -> Result<(), ()> {
        if self.closers.last() != Some(&b) {
            return Err(());
        }
        self.closers.pop();
        self.value_done();
        Ok(())
    }

    fn value_done(&mut self) {
        self.state = if self.closers.is_empty() { State::Complete } else { State::After };
    }
}

/// A call's arguments, JSON object text streamed as it arrives, up to
/// where it can be closed.
#[derive(Clone, Debug)]
pub(super) struct StreamedArguments {
    scanner: JsonScanner,
    sent: usize,
}

impl StreamedArguments {
    pub(super) fn new() -> Self {
        StreamedArguments { scanner: JsonScanner::new(), sent: 0 }
    }

    /// Reads on in `json`, the arguments' text so far from their `{` (see
    /// `JsonScanner::scan`).
    pub(super) fn scan(&mut self, json: &str) -> Result<Option<usize>, usize> {
        self.scanner.scan(json)
    }

    /// Sends the text scanned so far that can be closed, and not sent yet.
    pub(super) fn send(&mut self, json: &str, calls: &mut Calls) {
        let mut end = self.scanner.closable();
        while !json.is_char_boundary(end) {
            end -= 1;
        }
        if end > self.sent {
            calls.arguments(&json[self.sent..end]);
            self.sent = end;
        }
    }

    /// Ends arguments that broke off (or are complete): what can be
    /// closed, then what closes it.
    pub(super) fn close(&mut self, json: &str, calls: &mut Calls) {
        self.send(json, calls);
        if !self.scanner.is_complete() {
            calls.arguments(&self.scanner.closing());
        }
    }
}

pub(super) fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(text: &str) -> Result<Option<usize>, usize> {
        JsonScanner::new().scan(text)
    }

    /// Scanned byte by byte: the result, and the text closed at the end.
    fn closed(text: &str) -> String {
        let mut scanner = JsonScanner::new();
        for end in (1..=text.len()).filter(|&end| text.is_char_boundary(end)) {
            if scanner.scan(&text[..end]).is_err() {
                break;
            }
        }
        format!("{}{}", &text[..scanner.closable()], scanner.closing())
    }

    #[test]
    fn complete_values_and_where_they_end() {
        assert_eq!(scan(r#"{"a": [1, -2.5e+3, true, null, "x\"\u00e9"]} tail"#), Ok(Some(44)));
        assert_eq!(scan(r#" "name","#), Ok(Some(7)));
        assert_eq!(scan("12,"), Ok(Some(2)));
        assert_eq!(scan("[]"), Ok(Some(2)));
        assert_eq!(scan(r#"{"a": {"b": "#), Ok(None));
        assert_eq!(scan("12"), Ok(None));
    }

    #[test]
    fn the_first_byte_that_is_not_json() {
        assert_eq!(scan(r#"{"a": 1]"#), Err(7));
        assert_eq!(scan(r#"{"a" 1}"#), Err(5));
        assert_eq!(scan("[01]"), Err(2));
        assert_eq!(scan("[1,]"), Err(3));
        assert_eq!(scan("{,}"), Err(1));
        assert_eq!(scan("[tru]"), Err(4));
        assert_eq!(scan("\"a\nb\""), Err(2));
        assert_eq!(scan(r#""\x""#), Err(2));
        assert_eq!(scan("[NaN]"), Err(1));
    }

    #[test]
    fn cut_text_closes_at_the_last_complete_point() {
        for (text, want) in [
            (r#"{"city": "Par"#, r#"{"city": "Par"}"#),
            (r#"{"a": 1, "b"#, r#"{"a": 1}"#),
            (r#"{"a": 1, "b": "#, r#"{"a": 1}"#),
            (r#"{"a": [1, 2."#, r#"{"a": [1, 2]}"#),
            (r#"{"a": [1, 2.5"#, r#"{"a": [1, 2.5]}"#),
            (r#"{"a": "x\u00"#, r#"{"a": "x"}"#),
            (r#"{"a": {"b": tr"#, r#"{"a": {}}"#),
            (r#"{"a": "é"#, r#"{"a": "é"}"#),
            (r#"{"a": 1]"#, r#"{"a": 1}"#),
            ("{", "{}"),
        ] {
            assert_eq!(closed(text), want, "{text}");
            serde_json::from_str::<serde_json::Value>(want).expect("closes into JSON");
        }
    }

    #[test]
    fn deep_nesting_needs_no_recursion() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert_eq!(scan(&deep), Ok(Some(deep.len())));
    }
}
