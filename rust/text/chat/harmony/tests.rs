//! The parser on gpt-oss's output, fed whole, split at every point, and a
//! character at a time.

use super::*;

type Call = (String, String);

/// Feeds `pieces` to a fresh parser and flushes: (reasoning, content,
/// calls), after checking that each call starts once, then gets its
/// arguments, then ends, in index order.
fn parse_with(mut parser: HarmonyParser, pieces: &[&str]) -> (String, String, Vec<Call>) {
    let mut all = Parsed::default();
    let mut steps: Vec<Parsed> = pieces.iter().map(|piece| parser.feed(piece)).collect();
    steps.push(parser.flush());
    for step in steps {
        all.reasoning += &step.reasoning;
        all.content += &step.content;
        all.calls.extend(step.calls);
    }
    let mut calls: Vec<Call> = Vec::new();
    let mut open = false;
    for event in all.calls {
        match event {
            CallEvent::Start { index, name } => {
                assert!(!open && index == calls.len(), "a call starts after the last one ended");
                calls.push((name, String::new()));
                open = true;
            }
            CallEvent::Arguments { index, text } => {
                assert!(open && index + 1 == calls.len(), "arguments of the open call");
                calls[index].1 += &text;
            }
            CallEvent::End { index } => {
                assert!(open && index + 1 == calls.len(), "the open call ends");
                open = false;
            }
        }
    }
    assert!(!open, "every call ends");
    (all.reasoning, all.content, calls)
}

fn parse(pieces: &[&str]) -> (String, String, Vec<Call>) {
    parse_with(HarmonyParser::new(None, true), pieces)
}

fn call(name: &str, arguments: &str) -> Call {
    (name.to_string(), arguments.to_string())
}

fn result(reasoning: &str, content: &str, calls: Vec<Call>) -> (String, String, Vec<Call>) {
    (reasoning.to_string(), content.to_string(), calls)
}

const ANALYSIS_THEN_CALL: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}";

#[test]
fn analysis_is_reasoning_and_a_commentary_call_is_a_tool_call() {
    assert_eq!(
        parse(&[ANALYSIS_THEN_CALL]),
        result("Need the weather.", "", vec![call("get_weather", "{\"city\":\"Paris\"}")])
    );
    // The call's end token, when the detokenized text has it.
    assert_eq!(parse(&[ANALYSIS_THEN_CALL, "<|call|>"]).2, vec![call("get_weather", "{\"city\":\"Paris\"}")]);
}

#[test]
fn final_channel_is_content() {
    let text = "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>It is 9.8.";
    assert_eq!(parse(&[text]), result("Simple.", "It is 9.8.", vec![]));
    assert_eq!(parse(&[text, "<|return|>"]), result("Simple.", "It is 9.8.", vec![]));
}

#[test]
fn a_commentary_message_without_recipient_is_a_preamble_in_content() {
    let text = "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>commentary \
                to=functions.get_weather<|constrain|>json<|message|>{}<|call|>";
    assert_eq!(parse(&[text]), result("", "Checking the weather.", vec![call("get_weather", "{}")]));
}

#[test]
fn every_split_point_gives_the_same_result() {
    let text = "<|channel|>analysis<|message|>a < b, <|x|> c.<|end|><|start|>assistant<|channel|>commentary \
                to=functions.f <|constrain|>json<|message|> {\"q\": \"<|\"} <|call|><|start|>assistant<|channel|>\
                commentary to=functions.g<|message|>{}<|call|><|start|>assistant<|channel|>final<|message|>Done <|";
    let whole = parse(&[text]);
    assert_eq!(whole, result("a < b, <|x|> c.", "Done <|", vec![call("f", "{\"q\": \"<|\"}"), call("g", "{}")]));
    for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        assert_eq!(parse(&[&text[..i], &text[i..]]), whole, "split at {i}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(parse(&pieces), whole, "a character at a time");
}

#[test]
fn several_complete_calls_in_one_delta_all_come_out() {
    let mut parser = HarmonyParser::new(None, true);
    let step = parser.feed(
        "<|channel|>commentary to=functions.f<|message|>{\"a\":1}<|call|>\
         <|start|>assistant<|channel|>commentary to=functions.g<|message|>{\"b\":2}<|call|>",
    );
    let starts: Vec<&CallEvent> = step.calls.iter().filter(|e| matches!(e, CallEvent::Start { .. })).collect();
    let ends = step.calls.iter().filter(|e| matches!(e, CallEvent::End { .. })).count();
    assert_eq!(starts.len(), 2);
    assert_eq!(ends, 2);
    assert_eq!(parser.flush(), Parsed::default());
}

#[test]
fn arguments_stream_as_they_arrive() {
    let mut parser = HarmonyParser::new(None, true);
    let first = parser.feed("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"city\": \"Pa");
    assert_eq!(
        first.calls,
        vec![
            CallEvent::Start { index: 0, name: "f".into() },
            CallEvent::Arguments { index: 0, text: "{\"city\": \"Pa".into() }
        ]
    );
    // A blank before a possible end is held until the arguments go on.
    assert_eq!(parser.feed("ris\"} ").calls, vec![CallEvent::Arguments { index: 0, text: "ris\"}".into() }]);
    assert_eq!(parser.feed("<|call|>").calls, vec![CallEvent::End { index: 0 }]);
}

#[test]
fn recipient_in_the_role_part_of_the_header() {
    let text = "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{\"id\": 3}<|call|>";
    assert_eq!(parse(&[text]), result("", "", vec![call("lookup", "{\"id\": 3}")]));
}

#[test]
fn calls_of_functions_not_offered_or_not_read_are_content() {
    let offered = HarmonyParser::new(Some(vec!["get_weather".into()]), true);
    let text = "<|channel|>commentary to=functions.rm_rf<|message|>{}<|call|>";
    assert_eq!(parse_with(offered, &[text]), result("", "{}", vec![]));
    let unread = HarmonyParser::new(None, false);
    assert_eq!(parse_with(unread, &[ANALYSIS_THEN_CALL]), result("Need the weather.", "{\"city\":\"Paris\"}", vec![]));
}

#[test]
fn a_built_in_tool_call_in_analysis_stays_reasoning() {
    let text = "<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>";
    assert_eq!(parse(&[text]), result("{\"query\": \"x\"}", "", vec![]));
}

#[test]
fn text_outside_messages_is_content() {
    assert_eq!(
        parse(&["[{\"name\": \"f\", ", "\"arguments\": {}}]"]),
        result("", "[{\"name\": \"f\", \"arguments\": {}}]", vec![])
    );
    assert_eq!(parse(&["plain <|", "end|> text"]), result("", "plain  text", vec![]));
}

#[test]
fn output_that_ends_mid_message() {
    // A call cut off keeps what came; one with no arguments yet gets {}.
    assert_eq!(parse(&["<|channel|>commentary to=functions.f<|message|>{\"a\": "]).2, vec![call("f", "{\"a\":")]);
    assert_eq!(parse(&["<|channel|>commentary to=functions.f<|message|> "]).2, vec![call("f", "{}")]);
    // A partial marker at the end is text; a header never finished is dropped.
    assert_eq!(parse(&["<|channel|>final<|message|>ok <|ret"]), result("", "ok <|ret", vec![]));
    assert_eq!(parse(&["<|channel|>analysis<|message|>hm.<|end|><|start|>assistant<|chan"]), result("hm.", "", vec![]));
}

#[test]
fn multibyte_text_next_to_markers() {
    let text = "<|channel|>analysis<|message|>想<|end|><|start|>assistant<|channel|>final<|message|>答え";
    for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        assert_eq!(parse(&[&text[..i], &text[i..]]), result("想", "答え", vec![]), "split at {i}");
    }
}
