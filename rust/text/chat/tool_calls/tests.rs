//! The parser on each format's fixtures, written as the models' chat
//! templates write calls, fed whole and split at every point.

use super::*;

/// Feeds `pieces` and flushes: the text and whole calls, after checking
/// that the events tell a proper story (each call starts once, gets
/// arguments, ends, in index order) and that arguments are JSON objects.
fn parse_with(parser: &mut ToolCallParser, pieces: &[&str]) -> (String, Vec<ToolCall>) {
    let (mut text, mut events) = (String::new(), Vec::new());
    for piece in pieces {
        let (t, e) = parser.feed(piece);
        text += &t;
        events.extend(e);
    }
    let (t, e) = parser.flush();
    text += &t;
    events.extend(e);
    let mut open = None;
    let mut next = 0;
    for event in &events {
        match *event {
            CallEvent::Start { index, .. } => {
                assert_eq!((open, index), (None, next), "{events:?}");
                open = Some(index);
            }
            CallEvent::Arguments { index, .. } => assert_eq!(open, Some(index), "{events:?}"),
            CallEvent::End { index } => {
                assert_eq!(open.take(), Some(index), "{events:?}");
                next += 1;
            }
        }
    }
    assert_eq!(open, None, "every call ends: {events:?}");
    let calls = CallAssembler::default().take(events);
    for call in &calls {
        let arguments: Result<serde_json::Map<String, serde_json::Value>, _> = serde_json::from_str(&call.arguments);
        assert!(arguments.is_ok(), "arguments are an object: {:?}", call.arguments);
    }
    (text, calls)
}

fn parse(format: Format, pieces: &[&str]) -> (String, Vec<ToolCall>) {
    parse_with(&mut ToolCallParser::new(format), pieces)
}

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall { name: name.into(), arguments: arguments.into() }
}

fn out(text: &str, calls: &[ToolCall]) -> (String, Vec<ToolCall>) {
    (text.to_string(), calls.to_vec())
}

/// The same result however `text` is split: whole, at every point in two,
/// at pseudo-random points in several pieces, and one char at a time.
fn every_split_with(new: impl Fn() -> ToolCallParser, text: &str, want: &(String, Vec<ToolCall>)) {
    let boundaries: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    for &i in &boundaries {
        assert_eq!(&parse_with(&mut new(), &[&text[..i], &text[i..]]), want, "split at {i} of {text:?}");
    }
    let mut seed = 0x9e37_79b9_u32;
    for _ in 0..20 {
        let mut cuts: Vec<usize> = boundaries
            .iter()
            .copied()
            .filter(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                seed >> 29 == 0
            })
            .collect();
        cuts.insert(0, 0);
        cuts.push(text.len());
        let pieces: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
        assert_eq!(&parse_with(&mut new(), &pieces), want, "pieces {pieces:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(&parse_with(&mut new(), &pieces), want, "char by char: {text:?}");
}

fn every_split(format: Format, text: &str, want: &(String, Vec<ToolCall>)) {
    every_split_with(|| ToolCallParser::new(format), text, want);
}

/// Argument events of a call fed one char at a time.
fn argument_pieces(format: Format, text: &str) -> usize {
    let mut parser = ToolCallParser::new(format);
    let mut events: Vec<CallEvent> = text.chars().flat_map(|c| parser.feed(&c.to_string()).1).collect();
    events.extend(parser.flush().1);
    events.iter().filter(|e| matches!(e, CallEvent::Arguments { index: 0, .. })).count()
}

#[test]
fn hermes_text_then_parallel_calls() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    let want =
        out("Let me check.", &[call("get_weather", "{\"city\": \"東京\", \"unit\": \"celsius\"}"), call("now", "{}")]);
    every_split(Format::Hermes, text, &want);
    assert!(argument_pieces(Format::Hermes, text) >= 5, "arguments stream as they are written");
}

#[test]
fn events_come_as_soon_as_they_are_known() {
    let mut parser = ToolCallParser::new(Format::Hermes);
    let start = CallEvent::Start { index: 0, name: "f".into() };
    let arguments = |text: &str| CallEvent::Arguments { index: 0, text: text.into() };
    assert_eq!(parser.feed("Sure.\n<tool"), ("Sure.".to_string(), vec![]));
    assert_eq!(parser.feed("_call>{\"name\": \"f\", \"arguments\": "), (String::new(), vec![]));
    assert_eq!(parser.feed("{\"q\": \"Par"), (String::new(), vec![start, arguments("{\"q\": \"Par")]));
    assert_eq!(parser.feed("is\", \"n\": 1"), (String::new(), vec![arguments("is\", \"n\": 1")]));
    assert_eq!(parser.feed("2"), (String::new(), vec![arguments("2")]));
    assert_eq!(parser.feed(", \"l"), (String::new(), vec![]));
    assert_eq!(parser.feed("\": [tr"), (String::new(), vec![arguments(", \"l\": [")]));
    assert_eq!(parser.feed("ue]}}</tool_ca"), (String::new(), vec![arguments("true]}"), CallEvent::End { index: 0 }]));
    assert_eq!(parser.feed("ll>\n\nDone"), ("Done".to_string(), vec![]));
    assert_eq!(parser.flush(), (String::new(), vec![]));
}

#[test]
fn sections_that_fail_before_a_call_starts_stay_text() {
    for text in [
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"\"}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": \"not json\"}</tool_call>",
        "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
        "<tool_call>{name: \"f\"}</tool_call> after",
        "a <tool_call> never closed",
        "<tool_call>\n{\"name\": \"f\", \"argu",
    ] {
        every_split(Format::Hermes, text, &out(text, &[]));
    }
    let text = "<tool_call>oops <tool_call>{\"name\": \"f\"}</tool_call>";
    every_split(Format::Hermes, text, &out("<tool_call>oops", &[call("f", "{}")]));
}

#[test]
fn calls_that_break_off_keep_what_was_streamed_closed() {
    for (text, want) in [
        // Cut short by the end of output.
        ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n", out("", &[call("f", "{\"x\": 1}")])),
        ("<tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"Par", out("", &[call("f", "{\"q\": \"Par\"}")])),
        ("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, 2.", out("", &[call("f", "{\"a\": [1, 2]}")])),
        // The end marker where the JSON breaks off.
        ("<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call> after", out("after", &[call("f", "{}")])),
        ("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>", out("", &[call("f", "{\"a\": 1}")])),
        // Anything else: text from the failing byte on.
        (
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1]}</tool_call>",
            out("]}</tool_call>", &[call("f", "{\"a\": 1}")]),
        ),
        ("<tool_call>{\"name\": \"f\"} extra</tool_call>", out("extra</tool_call>", &[call("f", "{}")])),
    ] {
        every_split(Format::Hermes, text, &want);
    }
}

#[test]
fn arguments_keep_the_models_text_or_are_decoded_once() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": {\"z\": 1.50, \"a\": [\"}\\\"\"]}}</tool_call>";
    assert_eq!(parse(Format::Hermes, &[text]).1, vec![call("f", "{\"z\": 1.50, \"a\": [\"}\\\"\"]}")]);
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
    every_split(Format::Hermes, text, &out("", &[call("f", "{\"a\": 1}")]));
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": null}</tool_call>";
    assert_eq!(parse(Format::Hermes, &[text]).1, vec![call("f", "{}")]);
    // Arguments before the name, and other keys, as some fine-tunes write.
    let text =
        "<tool_call>{\"type\": \"function\", \"parameters\": {\"a\": 1}, \"name\": \"f\", \"name\": \"g\"}</tool_call>";
    every_split(Format::Hermes, text, &out("", &[call("f", "{\"a\": 1}")]));
}

#[test]
fn llama3_bare_json_and_python_tag() {
    let text = " {\"name\": \"a\", \"parameters\": {\"q\": \"x;y\"}}; {\"name\": \"b\", \"parameters\": {}}";
    every_split(Format::Llama3, text, &out("", &[call("a", "{\"q\": \"x;y\"}"), call("b", "{}")]));
    let text = "Calling.<|python_tag|>{\"name\": \"a\", \"parameters\": {\"city\": \"Zürich\"}}";
    every_split(Format::Llama3, text, &out("Calling.", &[call("a", "{\"city\": \"Zürich\"}")]));
}

#[test]
fn llama3_json_that_is_not_a_call_is_text() {
    for text in ["{\"answer\": 4}", "{oops} {\"name\": \"a\"}", "The call is {\"name\": \"a\", \"parameters\": {}}"] {
        every_split(Format::Llama3, text, &out(text, &[]));
    }
    let text = "{\"name\": \"a\"}; and then";
    every_split(Format::Llama3, text, &out("; and then", &[call("a", "{}")]));
    let text = "{\"name\": \"a\", \"parameters\": {}";
    every_split(Format::Llama3, text, &out("", &[call("a", "{}")]));
}

#[test]
fn mistral_marked_and_bare_arrays() {
    let calls = [call("a", "{\"x\": [1, 2]}"), call("b", "{}")];
    let text = "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}, {\"name\": \"b\", \"arguments\": {}}]";
    every_split(Format::Mistral, text, &out("", &calls));
    every_split(Format::Mistral, &text["[TOOL_CALLS]".len()..], &out("", &calls));
    for text in ["[1] is a footnote", "[TOOL_CALLS] [{\"x\": 1}]", "[TOOL_CALLS] oops"] {
        every_split(Format::Mistral, text, &out(text, &[]));
    }
    // A later element that is no call ends the calls; it is text.
    let text = "[TOOL_CALLS] [{\"name\": \"a\"}, {\"x\": 1}]";
    every_split(Format::Mistral, text, &out("{\"x\": 1}]", &[call("a", "{}")]));
}

const DEEPSEEK_CALLS: &str = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Paris\", \"note\": \"é 🎉\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

#[test]
fn deepseek_text_then_calls() {
    let calls = [
        call("get_weather", "{\"location\": \"Tokyo\"}"),
        call("get_weather", "{\"location\": \"Paris\", \"note\": \"é 🎉\"}"),
    ];
    every_split(Format::DeepSeekV3, &format!("Let me look.\n\n{DEEPSEEK_CALLS}"), &out("Let me look.", &calls));
    every_split(Format::DeepSeekV3, &format!("{DEEPSEEK_CALLS}\nMore text"), &out("More text", &calls));
    assert!(argument_pieces(Format::DeepSeekV3, DEEPSEEK_CALLS) >= 3);
}

#[test]
fn deepseek_sections_that_are_not_calls() {
    for text in [
        "<｜tool▁calls▁begin｜>oops",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{\"a\": 1}",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f",
    ] {
        every_split(Format::DeepSeekV3, text, &out(text, &[]));
    }
    let cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": \"b";
    every_split(Format::DeepSeekV3, cut, &out("", &[call("f", "{\"a\": \"b\"}")]));
    let no_fence = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1\n<｜tool▁call▁end｜> ok";
    every_split(Format::DeepSeekV3, no_fence, &out("ok", &[call("f", "{\"a\": 1}")]));
}

const DEEPSEEK_V31_CALLS: &str = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Paris\", \"note\": \"é 🎉\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

#[test]
fn deepseek_v31_text_then_calls() {
    let calls = [
        call("get_weather", "{\"location\": \"Tokyo\"}"),
        call("get_weather", "{\"location\": \"Paris\", \"note\": \"é 🎉\"}"),
    ];
    every_split(Format::DeepSeekV31, &format!("Let me look.\n\n{DEEPSEEK_V31_CALLS}"), &out("Let me look.", &calls));
    every_split(Format::DeepSeekV31, &format!("{DEEPSEEK_V31_CALLS}\nMore text"), &out("More text", &calls));
    assert!(argument_pieces(Format::DeepSeekV31, DEEPSEEK_V31_CALLS) >= 3);
    for text in [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f\n",
    ] {
        every_split(Format::DeepSeekV31, text, &out(text, &[]));
    }
    let cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": \"b";
    every_split(Format::DeepSeekV31, cut, &out("", &[call("f", "{\"a\": \"b\"}")]));
}

#[test]
fn pythonic_calls_become_json() {
    let text = "[get_weather(city=\"San Francisco\", days=3, units='metric'), get_time(tz=\"Asia/Tokyo\"), now()]";
    let want = out(
        "",
        &[
            call("get_weather", "{\"city\": \"San Francisco\", \"days\": 3, \"units\": \"metric\"}"),
            call("get_time", "{\"tz\": \"Asia/Tokyo\"}"),
            call("now", "{}"),
        ],
    );
    every_split(Format::Pythonic, text, &want);
    every_split(Format::Pythonic, &format!("<|python_start|>{text}<|python_end|>"), &want);
    assert!(argument_pieces(Format::Pythonic, text) >= 4);
    let text = "Checking. [search(query='東京 \\'tower\\'', filters={'year': [2020, 2021], 'exact': True}, limit=None,)] Done.";
    let want = out(
        "Checking.Done.",
        &[call(
            "search",
            "{\"query\": \"東京 'tower'\", \"filters\": {\"year\": [2020, 2021], \"exact\": true}, \"limit\": null}",
        )],
    );
    every_split(Format::Pythonic, text, &want);
}

#[test]
fn pythonic_text_that_is_not_calls() {
    for text in ["see [1] and [link](url)", "[f(x)]", "[f(1, 2)]", "[f]", "a [f (", "[f(a=b)]"] {
        let calls = if text == "[f(a=b)]" { vec![call("f", "{}")] } else { vec![] };
        let rest = if text == "[f(a=b)]" { "b)]" } else { text };
        every_split(Format::Pythonic, text, &out(rest, &calls));
    }
    let text = "[f(a=1), 42]";
    every_split(Format::Pythonic, text, &out("42]", &[call("f", "{\"a\": 1}")]));
    let text = "[f(a='cut";
    every_split(Format::Pythonic, text, &out("", &[call("f", "{\"a\": \"cut\"}")]));
    let text = "[f(a=[1, 2";
    every_split(Format::Pythonic, text, &out("", &[call("f", "{\"a\": [1, 2]}")]));
}

const QWEN3_CODER_CALLS: &str = "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\nprint(\"héllo\")\n\nx = 1 < 2\n</parameter>\n<parameter=mode>\n644\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=list_files>\n</function>\n</tool_call>";

fn qwen3_tools() -> Tools {
    Tools::from_openai(&serde_json::json!([
        {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "list_files"}},
    ]))
}

#[test]
fn qwen3_coder_values_by_schema() {
    let content = "\"print(\\\"héllo\\\")\\n\\nx = 1 < 2\"";
    let typed = out(
        "I will write it.",
        &[
            call("write_file", &format!("{{\"path\": \"/tmp/a.py\", \"content\": {content}, \"mode\": 644}}")),
            call("list_files", "{}"),
        ],
    );
    let text = format!("I will write it.\n{QWEN3_CODER_CALLS}");
    every_split_with(|| ToolCallParser::with_tools(Format::Qwen3Coder, qwen3_tools()), &text, &typed);
    let untyped = out(
        "I will write it.",
        &[
            call("write_file", &format!("{{\"path\": \"/tmp/a.py\", \"content\": {content}, \"mode\": \"644\"}}")),
            call("list_files", "{}"),
        ],
    );
    every_split(Format::Qwen3Coder, &text, &untyped);
    assert!(argument_pieces(Format::Qwen3Coder, QWEN3_CODER_CALLS) >= 5);
}

const MINIMAX_M2_CALLS: &str = "<minimax:tool_call>\n<invoke name=\"write_file\">\n<parameter name=\"path\">/tmp/a.py</parameter>\n<parameter name=\"content\">print(\"héllo\")\n\nx = 1 < 2</parameter>\n<parameter name=\"mode\">644</parameter>\n</invoke>\n<invoke name=\"list_files\">\n</invoke>\n</minimax:tool_call>";

#[test]
fn minimax_m2_values_by_schema() {
    let content = "\"print(\\\"héllo\\\")\\n\\nx = 1 < 2\"";
    let calls = |mode: &str| {
        vec![
            call("write_file", &format!("{{\"path\": \"/tmp/a.py\", \"content\": {content}, \"mode\": {mode}}}")),
            call("list_files", "{}"),
        ]
    };
    let text = format!("I will write it.\n{MINIMAX_M2_CALLS}\nDone.");
    every_split_with(
        || ToolCallParser::with_tools(Format::MiniMaxM2, qwen3_tools()),
        &text,
        &out("I will write it.Done.", &calls("644")),
    );
    every_split(Format::MiniMaxM2, &text, &out("I will write it.Done.", &calls("\"644\"")));
    assert!(argument_pieces(Format::MiniMaxM2, MINIMAX_M2_CALLS) >= 5);
    for text in [
        "<minimax:tool_call>\n<invoke name=write_file>\n</invoke>\n</minimax:tool_call>",
        "<minimax:tool_call>\n<tool_call>\n</minimax:tool_call>",
    ] {
        every_split(Format::MiniMaxM2, text, &out(text, &[]));
    }
}

#[test]
fn qwen3_coder_sections_that_are_not_calls_and_forgiven_tags() {
    for text in [
        "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
        "<tool_call>\n<function=>\n</function>",
        "<tool_call>\n<function=f\n",
    ] {
        every_split(Format::Qwen3Coder, text, &out(text, &[]));
    }
    let text = "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</function>\n</tool_call>";
    every_split(Format::Qwen3Coder, text, &out("", &[call("f", "{\"a\": \"x\", \"b\": \"y\"}")]));
    let text = "<tool_call>\n<function=f>\n<parameter=a>\ncut sho";
    every_split(Format::Qwen3Coder, text, &out("", &[call("f", "{\"a\": \"cut sho\"}")]));
}

const GLM45_CALLS: &str = "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>/tmp/a.py</arg_value>\n<arg_key>content</arg_key>\n<arg_value>print(\"héllo\")\n\nx = 1 < 2</arg_value>\n<arg_key>mode</arg_key>\n<arg_value>644</arg_value>\n</tool_call>\n<tool_call>list_files\n</tool_call>";

#[test]
fn glm45_values_by_schema() {
    let content = "\"print(\\\"héllo\\\")\\n\\nx = 1 < 2\"";
    let calls = |mode: &str| {
        vec![
            call("write_file", &format!("{{\"path\": \"/tmp/a.py\", \"content\": {content}, \"mode\": {mode}}}")),
            call("list_files", "{}"),
        ]
    };
    let text = format!("I will write it.\n{GLM45_CALLS}");
    let typed = out("I will write it.", &calls("644"));
    every_split_with(|| ToolCallParser::with_tools(Format::Glm45, qwen3_tools()), &text, &typed);
    every_split(Format::Glm45, &text, &out("I will write it.", &calls("\"644\"")));
    // GLM-4.7 writes no newlines between the tags.
    let glm47 =
        GLM45_CALLS.replace(">\n<", "><").replace("write_file\n", "write_file").replace("list_files\n", "list_files");
    every_split_with(|| ToolCallParser::with_tools(Format::Glm45, qwen3_tools()), &glm47, &out("", &calls("644")));
    assert!(argument_pieces(Format::Glm45, GLM45_CALLS) >= 5);
}

#[test]
fn glm45_sections_that_are_not_calls_and_forgiven_tags() {
    for text in [
        "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
        "<tool_call>\n</tool_call>",
        "<tool_call>f\n<arg_key></arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        "<tool_call>f\n<arg_value>1</arg_value>\n</tool_call>",
    ] {
        every_split(Format::Glm45, text, &out(text, &[]));
    }
    let text = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>x\n<arg_key>b</arg_key>\n<arg_value>y</arg_value>\n</tool_call>";
    every_split(Format::Glm45, text, &out("", &[call("f", "{\"a\": \"x\\n\", \"b\": \"y\"}")]));
    let text = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>cut sho";
    every_split(Format::Glm45, text, &out("", &[call("f", "{\"a\": \"cut sho\"}")]));
}

#[test]
fn given_tools_calls_must_name_one() {
    let tools = || Tools::from_openai(&serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]));
    // A call of a given tool, then one of a function no tool has: text.
    let cases = [
        (Format::Hermes, "<tool_call>{\"name\": \"get_weather\"}</tool_call>", "<tool_call>{\"name\": \"Paris\"}</tool_call>"),
        (Format::Pythonic, "[get_weather()]", "[Paris(a=1)]"),
        (
            Format::DeepSeekV3,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>Paris\n```json\n{}",
        ),
        (
            Format::Qwen3Coder,
            "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
            "<tool_call>\n<function=Paris>\n</function>\n</tool_call>",
        ),
    ];
    for (format, known, unknown) in cases {
        let want = out(unknown, &[call("get_weather", "{}")]);
        every_split_with(|| ToolCallParser::with_tools(format, tools()), &format!("{known} {unknown}"), &want);
        let anything = parse(format, &[&format!("{known} {unknown}")]).1;
        assert_eq!(anything.len(), 2, "without tools, any name: {format:?}");
    }
}

#[test]
fn plain_text_passes_through_with_only_the_tail_held() {
    let mut parser = ToolCallParser::new(Format::Hermes);
    assert_eq!(parser.feed("a <b> c"), ("a <b> c".to_string(), vec![]));
    assert_eq!(parser.feed(" 想 \n"), (" 想".to_string(), vec![]));
    assert_eq!(parser.feed("<tool_"), (String::new(), vec![]));
    assert_eq!(parser.flush(), (" \n<tool_".to_string(), vec![]));
    let mut parser = ToolCallParser::new(Format::Mistral);
    assert_eq!(parser.feed(" [ "), (String::new(), vec![]));
    assert_eq!(parser.feed("x"), (" [ x".to_string(), vec![]));
    let mut parser = ToolCallParser::new(Format::Pythonic);
    assert_eq!(parser.feed("See [get_wea"), ("See".to_string(), vec![]));
    assert_eq!(parser.feed("ther is"), (" [get_weather is".to_string(), vec![]));
}

#[test]
fn call_prefixes_start_no_call_and_parse_as_output() {
    let formats = [
        Format::Hermes,
        Format::Llama3,
        Format::Mistral,
        Format::DeepSeekV3,
        Format::DeepSeekV31,
        Format::Pythonic,
        Format::Qwen3Coder,
        Format::MiniMaxM2,
        Format::Glm45,
    ];
    for format in formats {
        let (arguments, end) = match format {
            Format::Hermes => (" {\"a\": 1}", "}\n</tool_call>"),
            Format::Llama3 => (" {\"a\": 1}", "}"),
            Format::Mistral => (" {\"a\": 1}", "}]"),
            Format::DeepSeekV3 => ("{\"a\": 1}", "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            Format::DeepSeekV31 => ("{\"a\": 1}", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            Format::Pythonic => ("a=1", ")]"),
            Format::Qwen3Coder => ("<parameter=a>\n1\n</parameter>\n", "</function>\n</tool_call>"),
            Format::Glm45 => ("<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n", "</tool_call>"),
            Format::MiniMaxM2 => ("<parameter name=\"a\">1</parameter>\n", "</invoke>\n</minimax:tool_call>"),
        };
        let a = if matches!(format, Format::Qwen3Coder | Format::Glm45 | Format::MiniMaxM2) {
            "{\"a\": \"1\"}"
        } else {
            "{\"a\": 1}"
        };
        let mut parser = ToolCallParser::new(format);
        assert_eq!(parser.feed(&format.call_prefix(Some("get_weather"))), (String::new(), vec![]), "{format:?}");
        assert_eq!(parse_with(&mut parser, &[arguments, end]), out("", &[call("get_weather", a)]), "{format:?}");
        let named = match format {
            Format::Hermes | Format::Mistral => "now\", \"arguments\":",
            Format::Llama3 => "now\", \"parameters\":",
            Format::DeepSeekV3 => "now\n```json\n",
            Format::DeepSeekV31 => "now<｜tool▁sep｜>",
            Format::Pythonic => "now(",
            Format::Qwen3Coder => "now>\n",
            Format::Glm45 => "now\n",
            Format::MiniMaxM2 => "now\">\n",
        };
        let mut parser = ToolCallParser::new(format);
        assert_eq!(parser.feed(&format.call_prefix(None)), (String::new(), vec![]), "{format:?}");
        assert_eq!(parse_with(&mut parser, &[named, arguments, end]), out("", &[call("now", a)]), "{format:?}");
    }
    assert_eq!(
        Format::Hermes.call_prefix(Some("say \"hi\"")),
        "<tool_call>\n{\"name\": \"say \\\"hi\\\"\", \"arguments\":"
    );
}

#[test]
fn names_and_unknown_names() {
    for (name, format) in [
        ("qwen25", Format::Hermes),
        ("hermes", Format::Hermes),
        ("llama3", Format::Llama3),
        ("mistral", Format::Mistral),
        ("deepseekv3", Format::DeepSeekV3),
        ("deepseekv31", Format::DeepSeekV31),
        ("pythonic", Format::Pythonic),
        ("qwen3_coder", Format::Qwen3Coder),
        ("minimax-m2", Format::MiniMaxM2),
        ("glm45", Format::Glm45),
        ("glm47", Format::Glm45),
    ] {
        assert_eq!(Format::from_name(name), Ok(format));
    }
    assert!(Format::from_name("kimi_k2").is_err());
}
