//! A parameter value written between XML-style tags (qwen3_coder's
//! `<parameter=KEY>`, glm45's `<arg_value>`), read as it streams: text,
//! made a JSON value by the parameter's schema types (see tools.rs), a
//! string without one. String values stream as they are written; typed
//! ones come whole. A missing closing tag is forgiven where the next tag
//! begins.

use super::tools::JsonType;
use super::{json_string, partial_marker_len, push_json_str};

pub(super) struct TaggedValue {
    types: Vec<JsonType>,
    /// Whether the template writes a newline after the opening tag and one
    /// before the closing tag, which are not the value's.
    newlines: bool,
    from: usize,
    /// Whether `from` is past the template's newline.
    trimmed: bool,
    /// The end of the text already written as a streamed string.
    sent: usize,
    /// No tag starts before this offset.
    searched: usize,
}

impl TaggedValue {
    /// The value that starts at `from`, of a parameter of these `types`.
    pub(super) fn new(types: Vec<JsonType>, from: usize, newlines: bool) -> Self {
        TaggedValue { types, newlines, from, trimmed: !newlines, sent: from, searched: from }
    }

    /// Whether the value is a string, streamed: its JSON opens with `"`.
    pub(super) fn streams(&self) -> bool {
        matches!(self.types.first(), None | Some(JsonType::String))
    }

    /// Writes what is known of the value to `json`; the offset after it
    /// once it is complete (at the end of output, it is). `tags`: its
    /// closing tag, read with it, then the tags that may open next without
    /// it, left to be read.
    pub(super) fn read(&mut self, json: &mut String, text: &str, eof: bool, tags: &[&str]) -> Option<usize> {
        let closing = tags[0];
        let found = tags
            .iter()
            .filter_map(|tag| text[self.searched..].find(tag).map(|i| (self.searched + i, *tag)))
            .min_by_key(|&(i, _)| i);
        let (content_end, next) = match found {
            Some((i, tag)) => (i, Some(if tag == closing { i + tag.len() } else { i })),
            None if eof => (text.len(), Some(text.len())),
            None => {
                let partial = tags.iter().map(|tag| partial_marker_len(&text[self.from..], tag)).max().unwrap_or(0);
                (text.len() - partial, None)
            }
        };
        self.searched = content_end;
        if !self.trimmed {
            if content_end == self.from && next.is_none() {
                return None;
            }
            self.from += usize::from(text[self.from..content_end].starts_with('\n'));
            self.sent = self.from;
            self.trimmed = true;
        }
        // The newline before the closing tag is the template's: hold it
        // back until it is known whether one follows.
        let end = content_end.max(self.from);
        let end = end - usize::from(self.newlines && text[self.from..end].ends_with('\n'));
        if self.streams() {
            if end > self.sent {
                push_json_str(json, &text[self.sent..end]);
                self.sent = end;
            }
            if next.is_some() {
                json.push('"');
            }
        } else if next.is_some() {
            let content = text[self.from..end].trim();
            json.push_str(&self.types.iter().find_map(|t| t.read(content)).unwrap_or_else(|| json_string(content)));
        }
        next
    }
}
