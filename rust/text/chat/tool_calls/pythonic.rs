//! Pythonic calls, as Llama 3.2 and Llama 4 write them:
//! `[get_weather(city="Paris", days=3), now()]`, keyword arguments whose
//! values are Python literals (strings, numbers, True/False/None, lists,
//! dicts), converted to a JSON object as they stream in. Llama 4 may wrap
//! the list in `<|python_start|>` ... `<|python_end|>`.

use super::built_call::{self, BuiltCall};
use super::events::Calls;
use super::{expect, is_name_byte, push_json_str, skip_ws, Expect, Step, Stepped};

pub(super) const START: &str = "<|python_start|>";
const END: &str = "<|python_end|>";

pub(super) enum Search {
    Found(usize),
    /// A `[` at this offset could still open calls.
    Partial(usize),
    None,
}

/// Where calls open in `text`: the first `[` followed by a name and `(`.
pub(super) fn find_call_list(text: &str) -> Search {
    let bytes = text.as_bytes();
    for (at, _) in text.match_indices('[') {
        let mut i = skip_ws(bytes, at + 1);
        match bytes.get(i) {
            None => return Search::Partial(at),
            Some(&b) if is_name_start(b) => {}
            Some(_) => continue,
        }
        i += bytes[i..].iter().take_while(|&&b| is_name_byte(b)).count();
        match bytes.get(skip_ws(bytes, i)) {
            None => return Search::Partial(at),
            Some(b'(') => return Search::Found(at),
            Some(_) => continue,
        }
    }
    Search::None
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

pub(super) struct Pythonic {
    pos: usize,
    state: State,
    /// Where the text of the call being read starts.
    call_from: usize,
    made_calls: bool,
    call: Option<Call>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Open,
    Call,
    Name(usize),
    Paren,
    Keyword,
    Key(usize),
    Equals,
    Value,
    AfterValue,
    AfterCall,
    /// After the list, which ended at the offset: `<|python_end|>` may follow.
    Tail(usize),
}

/// The call being read: its arguments as JSON built so far.
struct Call {
    built: BuiltCall,
    key: String,
    literal: Literal,
}

impl Pythonic {
    pub(super) fn new(skip: usize) -> Self {
        Pythonic { pos: skip, state: State::Open, call_from: skip, made_calls: false, call: None }
    }

    /// The text stopped being calls at `at`.
    fn fail(&mut self, at: usize, calls: &mut Calls) -> Step {
        built_call::fail(self.call.take().map(|call| call.built), at, self.made_calls, self.call_from, calls)
    }

    fn wait(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Step {
        match self.state {
            _ if !eof => Step::Wait,
            State::AfterCall => Step::Done(text.len()),
            _ => self.fail(text.len(), calls),
        }
    }
}

impl Stepped for Pythonic {
    fn step(&mut self, text: &str, eof: bool, calls: &mut Calls) -> Result<(), Step> {
        let bytes = text.as_bytes();
        if let State::Value = self.state {
            let call = self.call.as_mut().expect("a value belongs to a call");
            let scanned = call.literal.scan(text, &mut self.pos, &mut call.built.json);
            if eof && scanned == Ok(false) {
                call.literal.finish_token(text, &mut call.built.json);
            }
            call.built.send(calls);
            return match scanned {
                Ok(true) => {
                    self.state = State::AfterValue;
                    Ok(())
                }
                Ok(false) => Err(self.wait(text, eof, calls)),
                Err(()) => Err(self.fail(self.pos, calls)),
            };
        }
        if let State::Name(from) | State::Key(from) = self.state {
            let end = from + bytes[from..].iter().take_while(|&&b| is_name_byte(b)).count();
            if end == text.len() {
                return Err(self.wait(text, eof, calls));
            }
            let word = text[from..end].to_string();
            self.pos = end;
            if let State::Name(_) = self.state {
                if !calls.knows(&word) {
                    return Err(self.fail(from, calls));
                }
                self.call = Some(Call { built: BuiltCall::new(word), key: String::new(), literal: Literal::default() });
                self.state = State::Paren;
            } else if word.contains(['-', '.']) {
                return Err(self.fail(from, calls));
            } else {
                self.call.as_mut().expect("a keyword belongs to a call").key = word;
                self.state = State::Equals;
            }
            return Ok(());
        }
        if let State::Tail(end) = self.state {
            return Err(match expect(text, skip_ws(bytes, end), END, eof) {
                Expect::Found(end) => Step::Done(end),
                Expect::Partial => Step::Wait,
                Expect::No => Step::Done(end),
            });
        }
        let at = skip_ws(bytes, self.pos);
        let Some(&b) = bytes.get(at) else { return Err(self.wait(text, eof, calls)) };
        self.pos = at + 1;
        self.state = match (self.state, b) {
            (State::Open, b'[') => State::Call,
            (State::Open, _) => return Err(Step::Reject),
            (State::Call, b) if is_name_start(b) => State::Name(at),
            (State::Call, b']') if self.made_calls => State::Tail(at + 1),
            (State::Paren, b'(') => State::Keyword,
            (State::Keyword, b) if is_name_start(b) => State::Key(at),
            (State::Keyword, b')') | (State::AfterValue, b')') => {
                self.call.take().expect("a call is open").built.end(calls);
                self.made_calls = true;
                State::AfterCall
            }
            (State::Equals, b'=') => {
                let call = self.call.as_mut().expect("a keyword belongs to a call");
                call.built.key(&call.key, calls);
                call.literal = Literal::default();
                State::Value
            }
            (State::AfterValue, b',') => State::Keyword,
            (State::AfterCall, b',') => {
                self.call_from = at + 1;
                State::Call
            }
            (State::AfterCall, b']') => State::Tail(at + 1),
            (State::AfterCall, _) => return Err(Step::Done(at)),
            _ => return Err(self.fail(at, calls)),
        };
        Ok(())
    }
}

/// One Python literal converted to JSON text as it streams in.
#[derive(Debug, Default)]
struct Literal {
    /// Open lists and dicts, innermost last.
    frames: Vec<Frame>,
    state: LiteralState,
}

#[derive(Debug)]
struct Frame {
    dict: bool,
    empty: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum LiteralState {
    #[default]
    Value,
    Key,
    Str {
        quote: char,
        key: bool,
        escape: Escape,
    },
    /// A number or a name (True, False, None) from this offset.
    Token(usize),
    Colon,
    After,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Escape {
    None,
    Backslash,
    Hex { left: u8, value: u32 },
    Octal { left: u8, value: u32 },
}

impl Literal {
    /// Reads on from `*pos`, writing JSON to `out`: Ok(true) once the
    /// literal is complete (`*pos` after it), Ok(false) when `text` runs
    /// out first, Err at `*pos` when it is not a literal.
    fn scan(&mut self, text: &str, pos: &mut usize, out: &mut String) -> Result<bool, ()> {
        use LiteralState as S;
        while let Some(c) = text[*pos..].chars().next() {
            if let S::Token(from) = self.state {
                if is_token_char(c, &text[from..*pos]) {
                    *pos += 1;
                    continue;
                }
                let Some(json) = token_json(&text[from..*pos]) else {
                    *pos = from;
                    return Err(());
                };
                self.begin_element(false, out);
                out.push_str(&json);
                if self.value_done() {
                    return Ok(true);
                }
                continue;
            }
            if let S::Str { quote, key, escape } = self.state {
                *pos += c.len_utf8();
                match self.string_char(quote, key, escape, c, out) {
                    Ok(true) => *pos -= c.len_utf8(),
                    Ok(false) => {}
                    Err(()) => {
                        *pos -= c.len_utf8();
                        return Err(());
                    }
                }
                if self.state == S::After && self.frames.is_empty() {
                    return Ok(true);
                }
                continue;
            }
            let top_is_dict = self.frames.last().map(|frame| frame.dict);
            match (self.state, c) {
                (_, ' ' | '\t' | '\n' | '\r') => {}
                (S::Value, '\'' | '"') => {
                    self.begin_element(false, out);
                    out.push('"');
                    self.state = S::Str { quote: c, key: false, escape: Escape::None };
                }
                (S::Key, '\'' | '"') => {
                    self.begin_element(true, out);
                    out.push('"');
                    self.state = S::Str { quote: c, key: true, escape: Escape::None };
                }
                (S::Value, '[' | '{') => {
                    self.begin_element(false, out);
                    out.push(c);
                    self.frames.push(Frame { dict: c == '{', empty: true });
                    self.state = if c == '{' { S::Key } else { S::Value };
                }
                (S::Value, c) if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '+' | '.') => {
                    self.state = S::Token(*pos)
                }
                (S::Value, ']') | (S::After, ']') if top_is_dict == Some(false) => self.close(out),
                (S::Key, '}') | (S::After, '}') if top_is_dict == Some(true) => self.close(out),
                (S::Colon, ':') => {
                    out.push_str(": ");
                    self.state = S::Value;
                }
                (S::After, ',') if top_is_dict.is_some() => {
                    self.state = if top_is_dict == Some(true) { S::Key } else { S::Value }
                }
                _ => return Err(()),
            }
            *pos += c.len_utf8();
            if self.state == S::After && self.frames.is_empty() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// At the end of output: a number or name that runs to the end is
    /// complete.
    fn finish_token(&mut self, text: &str, out: &mut String) {
        if let LiteralState::Token(from) = self.state {
            if let Some(json) = token_json(&text[from..]) {
                self.begin_element(false, out);
                out.push_str(&json);
                self.value_done();
            }
        }
    }

    /// A list item or a dict key begins: the separator before it.
    fn begin_element(&mut self, key: bool, out: &mut String) {
        if let Some(frame) = self.frames.last_mut() {
            if frame.dict == key {
                if !frame.empty {
                    out.push_str(", ");
                }
                frame.empty = false;
            }
        }
    }

    fn close(&mut self, out: &mut String) {
        let frame = self.frames.pop().expect("a container is open");
        out.push(if frame.dict { '}' } else { ']' });
        self.value_done();
    }

    /// True when the whole literal is complete.
    fn value_done(&mut self) -> bool {
        self.state = LiteralState::After;
        self.frames.is_empty()
    }

    /// One character of a string; Ok(true) when it must be read again.
    fn string_char(&mut self, quote: char, key: bool, escape: Escape, c: char, out: &mut String) -> Result<bool, ()> {
        let (escape, decoded, again) = match escape {
            Escape::None if c == quote => {
                out.push('"');
                if key {
                    self.state = LiteralState::Colon;
                } else {
                    self.value_done();
                }
                return Ok(false);
            }
            Escape::None if c == '\\' => (Escape::Backslash, None, false),
            Escape::None if c == '\n' || c == '\r' => return Err(()),
            Escape::None => (Escape::None, Some(c), false),
            Escape::Backslash => match c {
                'x' => (Escape::Hex { left: 2, value: 0 }, None, false),
                'u' => (Escape::Hex { left: 4, value: 0 }, None, false),
                'U' => (Escape::Hex { left: 8, value: 0 }, None, false),
                '0'..='7' => (Escape::Octal { left: 2, value: c as u32 - '0' as u32 }, None, false),
                '\n' => (Escape::None, None, false),
                _ => match simple_escape(c) {
                    Some(decoded) => (Escape::None, Some(decoded), false),
                    // Python keeps an unknown escape as written.
                    None => {
                        push_json_str(out, "\\");
                        (Escape::None, Some(c), false)
                    }
                },
            },
            Escape::Hex { left, value } => {
                let value = value * 16 + c.to_digit(16).ok_or(())?;
                match left {
                    1 => (Escape::None, Some(char::from_u32(value).ok_or(())?), false),
                    _ => (Escape::Hex { left: left - 1, value }, None, false),
                }
            }
            Escape::Octal { left, value } => match c.to_digit(8) {
                Some(digit) if left > 1 => (Escape::Octal { left: left - 1, value: value * 8 + digit }, None, false),
                Some(digit) => (Escape::None, char::from_u32(value * 8 + digit), false),
                None => (Escape::None, char::from_u32(value), true),
            },
        };
        if let Some(decoded) = decoded {
            push_json_str(out, decoded.encode_utf8(&mut [0; 4]));
        }
        self.state = LiteralState::Str { quote, key, escape };
        Ok(again)
    }
}

fn simple_escape(c: char) -> Option<char> {
    Some(match c {
        'n' => '\n',
        't' => '\t',
        'r' => '\r',
        'b' => '\u{8}',
        'f' => '\u{c}',
        'v' => '\u{b}',
        'a' => '\u{7}',
        '\\' | '\'' | '"' => c,
        _ => return None,
    })
}

/// Whether `c` goes on the number or name `token`.
fn is_token_char(c: char, token: &str) -> bool {
    let numeric = !token.starts_with(|first: char| first.is_ascii_alphabetic() || first == '_');
    c.is_ascii_alphanumeric()
        || c == '_'
        || c == '.'
        || (numeric && matches!(c, '+' | '-') && token.ends_with(['e', 'E']))
}

fn token_json(token: &str) -> Option<String> {
    match token {
        "True" => Some("true".into()),
        "False" => Some("false".into()),
        "None" => Some("null".into()),
        _ => python_number(token),
    }
}

/// A Python int or float literal as a JSON number: `1_000` is 1000, `.5`
/// is 0.5, `5.` is 5.0, `0x1f` is 31.
fn python_number(token: &str) -> Option<String> {
    let (sign, body) = match token.strip_prefix('-') {
        Some(body) => ("-", body),
        None => ("", token.strip_prefix('+').unwrap_or(token)),
    };
    let body = body.replace('_', "").to_ascii_lowercase();
    for (prefix, radix) in [("0x", 16), ("0o", 8), ("0b", 2)] {
        if let Some(digits) = body.strip_prefix(prefix) {
            return u128::from_str_radix(digits, radix).ok().map(|value| format!("{sign}{value}"));
        }
    }
    let digits = |text: &str| text.bytes().all(|b| b.is_ascii_digit());
    let (mantissa, exponent) = match body.split_once('e') {
        Some((mantissa, exponent)) => (mantissa, Some(exponent)),
        None => (body.as_str(), None),
    };
    let (int, fraction) = match mantissa.split_once('.') {
        Some((int, fraction)) => (int, Some(fraction)),
        None => (mantissa, None),
    };
    let exponent_ok = exponent.is_none_or(|e| {
        let e = e.strip_prefix(['+', '-']).unwrap_or(e);
        !e.is_empty() && digits(e)
    });
    let has_digits = !int.is_empty() || fraction.is_some_and(|f| !f.is_empty());
    if !(digits(int) && fraction.is_none_or(digits) && exponent_ok && has_digits) {
        return None;
    }
    let int = match int.trim_start_matches('0') {
        "" => "0",
        int => int,
    };
    let mut json = format!("{sign}{int}");
    if let Some(fraction) = fraction {
        json = format!("{json}.{}", if fraction.is_empty() { "0" } else { fraction });
    }
    if let Some(exponent) = exponent {
        json = format!("{json}e{exponent}");
    }
    Some(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn literal(text: &str) -> Result<(String, usize), usize> {
        let (mut literal, mut pos, mut out) = (Literal::default(), 0, String::new());
        match literal.scan(text, &mut pos, &mut out) {
            Ok(true) => Ok((out, pos)),
            Ok(false) => Err(usize::MAX),
            Err(()) => Err(pos),
        }
    }

    #[test]
    fn python_literals_as_json() {
        for (text, json) in [
            ("'it''s'", "\"it\""),
            (r#""say \"hi\"\n""#, r#""say \"hi\"\n""#),
            (r"'\x41\u00e9\U0001F600\101\0\q'", r#""Aé😀A\u0000\\q""#),
            ("'東京'", "\"東京\""),
            (
                "[1, -2.5, 1_000, .5, 5., 1e3, 0x1F, True, False, None]",
                "[1, -2.5, 1000, 0.5, 5.0, 1e3, 31, true, false, null]",
            ),
            ("{'a': [1, {\"b\": 'c'}], 'd': {},}", r#"{"a": [1, {"b": "c"}], "d": {}}"#),
            ("[ 1 ,\n 2 , ]", "[1, 2]"),
        ] {
            let end = text.len() - usize::from(text == "'it''s'") * 3;
            assert_eq!(literal(text), Ok((json.to_string(), end)), "{text}");
            serde_json::from_str::<serde_json::Value>(json).expect("valid JSON");
        }
        assert_eq!(literal("12)"), Ok(("12".into(), 2)));
    }

    #[test]
    fn what_is_not_a_literal() {
        assert_eq!(literal("foo)"), Err(0));
        assert_eq!(literal("1j)"), Err(0));
        assert_eq!(literal("{1: 2}"), Err(1));
        assert_eq!(literal("[1 2]"), Err(3));
        assert_eq!(literal("'a\nb'"), Err(2));
        assert_eq!(literal("'\\ud800'"), Err(6));
        assert_eq!(literal("'open"), Err(usize::MAX));
    }

    #[test]
    fn where_calls_open() {
        assert!(matches!(find_call_list("see [1] and [f (x=1)]"), Search::Found(12)));
        assert!(matches!(find_call_list("text [get_wea"), Search::Partial(5)));
        assert!(matches!(find_call_list("[link](url) [a b]"), Search::None));
    }
}
