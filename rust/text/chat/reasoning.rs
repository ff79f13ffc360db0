//! Splits a model's `<think>...</think>` reasoning from its answer in a text
//! stream. Markers are never emitted; a tail that could still become a
//! marker is held back.
//!
//! Reasoning models open their one reasoning block at the very start of the
//! output, so the start marker is recognised only there (after optional
//! whitespace): an answer that mentions `<think>` later stays content. When
//! the chat template already opened the block (`in_reasoning`), the output
//! starts inside it, and a repeated start marker there is dropped.

use super::partial_marker_len;

pub struct ReasoningSplitter {
    start: String,
    end: String,
    phase: Phase,
    held: String,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Phase {
    /// Nothing but whitespace and maybe part of the start marker seen yet;
    /// `reasoning` says where that text goes if no marker follows.
    Opening {
        reasoning: bool,
    },
    Reasoning,
    Content,
}

impl ReasoningSplitter {
    pub fn new(start: &str, end: &str, in_reasoning: bool) -> Result<Self, String> {
        if start.is_empty() || end.is_empty() {
            return Err("reasoning markers must not be empty".into());
        }
        Ok(ReasoningSplitter {
            start: start.to_string(),
            end: end.to_string(),
            phase: Phase::Opening { reasoning: in_reasoning },
            held: String::new(),
        })
    }

    /// Whether text fed now would be reasoning.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.phase, Phase::Reasoning | Phase::Opening { reasoning: true })
    }

    /// Returns (reasoning delta, content delta).
    pub fn feed(&mut self, text: &str) -> (String, String) {
        let (mut reasoning, mut content) = (String::new(), String::new());
        self.held.push_str(text);
        loop {
            match self.phase {
                Phase::Opening { reasoning: default } => {
                    let rest = self.held.trim_start();
                    if rest.starts_with(self.start.as_str()) {
                        let after = self.held.len() - rest.len() + self.start.len();
                        self.held.drain(..after);
                        self.phase = Phase::Reasoning;
                    } else if self.start.starts_with(rest) {
                        break; // Still could be the marker: wait.
                    } else {
                        self.phase = if default { Phase::Reasoning } else { Phase::Content };
                    }
                }
                Phase::Reasoning => {
                    if let Some(pos) = self.held.find(self.end.as_str()) {
                        reasoning.push_str(&self.held[..pos]);
                        self.held.drain(..pos + self.end.len());
                        self.phase = Phase::Content;
                    } else {
                        let keep = partial_marker_len(&self.held, &self.end);
                        reasoning.extend(self.held.drain(..self.held.len() - keep));
                        break;
                    }
                }
                Phase::Content => {
                    content.push_str(&self.held);
                    self.held.clear();
                    break;
                }
            }
        }
        (reasoning, content)
    }

    /// End of stream: the held-back tail goes where the stream was.
    pub fn flush(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        if self.in_reasoning() {
            (rest, String::new())
        } else {
            (String::new(), rest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pieces: &[&str], in_reasoning: bool) -> (String, String) {
        let mut st = ReasoningSplitter::new("<think>", "</think>", in_reasoning).unwrap();
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let (a, b) = st.feed(p);
            r += &a;
            c += &b;
        }
        let (a, b) = st.flush();
        (r + &a, c + &b)
    }

    fn pair(r: &str, c: &str) -> (String, String) {
        (r.to_string(), c.to_string())
    }

    #[test]
    fn splits_markers_across_deltas() {
        assert_eq!(split(&["<th", "ink>why", " so</thi", "nk>answer"], false), pair("why so", "answer"));
    }

    #[test]
    fn every_split_point_gives_the_same_result() {
        let text = "\n<think>a<b</thin</think>\n\nc</think>";
        for i in 0..=text.len() {
            assert_eq!(split(&[&text[..i], &text[i..]], false), pair("a<b</thin", "\n\nc</think>"), "split {i}");
        }
    }

    #[test]
    fn template_opened_reasoning() {
        assert_eq!(split(&["a</think>b"], true), pair("a", "b"));
        assert_eq!(split(&["<think>a</think>b"], true), pair("a", "b"));
        assert_eq!(split(&["no end"], true), pair("no end", ""));
    }

    #[test]
    fn no_markers_is_all_content() {
        assert_eq!(split(&["plain <b>text</b>"], false), pair("", "plain <b>text</b>"));
        assert_eq!(split(&["  <thi"], false), pair("", "  <thi"));
    }

    #[test]
    fn start_marker_only_at_the_start() {
        assert_eq!(split(&["use <think> tags"], false), pair("", "use <think> tags"));
        assert_eq!(split(&["<think>a</think>b<think>c"], false), pair("a", "b<think>c"));
    }

    #[test]
    fn unterminated_reasoning_stays_reasoning() {
        assert_eq!(split(&["<think>still thinking <"], false), pair("still thinking <", ""));
    }

    #[test]
    fn multibyte_text_near_markers() {
        assert_eq!(split(&["<think>想", "</thi", "nk>答"], false), pair("想", "答"));
    }

    #[test]
    fn empty_markers_are_rejected() {
        assert!(ReasoningSplitter::new("", "</think>", false).is_err());
    }
}
