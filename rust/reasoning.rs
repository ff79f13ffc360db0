//! Splits a model's `<think>...</think>` reasoning from its answer in a text
//! stream. Markers are never emitted; a tail that could still become a
//! marker is held back. Only the first reasoning block is recognised, as
//! reasoning models produce one at the start.

pub struct ReasoningState {
    start: String,
    end: String,
    in_reasoning: bool,
    done: bool,
    held: String,
}

fn partial_marker_len(text: &str, marker: &str) -> usize {
    let mut n = (marker.len() - 1).min(text.len());
    while n > 0 {
        let start = text.len() - n;
        if text.is_char_boundary(start) && marker.starts_with(&text[start..]) {
            return n;
        }
        n -= 1;
    }
    0
}

impl ReasoningState {
    pub fn new(start: String, end: String, in_reasoning: bool) -> Result<Self, String> {
        if start.is_empty() || end.is_empty() {
            return Err("reasoning markers must not be empty".into());
        }
        Ok(ReasoningState { start, end, in_reasoning, done: false, held: String::new() })
    }

    /// Returns (reasoning delta, content delta).
    pub fn feed(&mut self, text: &str) -> (String, String) {
        let (mut reasoning, mut content) = (String::new(), String::new());
        self.held.push_str(text);
        loop {
            if self.done {
                content.push_str(&std::mem::take(&mut self.held));
                break;
            }
            let marker = if self.in_reasoning { &self.end } else { &self.start };
            let out = if self.in_reasoning { &mut reasoning } else { &mut content };
            if let Some(pos) = self.held.find(marker.as_str()) {
                out.push_str(&self.held[..pos]);
                self.held.drain(..pos + marker.len());
                if self.in_reasoning {
                    self.done = true;
                }
                self.in_reasoning = !self.in_reasoning;
                continue;
            }
            let keep = partial_marker_len(&self.held, marker);
            out.push_str(&self.held[..self.held.len() - keep]);
            self.held.drain(..self.held.len() - keep);
            break;
        }
        (reasoning, content)
    }

    /// End of stream: the held-back tail goes where the stream was.
    pub fn flush(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        if self.in_reasoning {
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
        let mut st = ReasoningState::new("<think>".into(), "</think>".into(), in_reasoning).unwrap();
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let (a, b) = st.feed(p);
            r += &a;
            c += &b;
        }
        let (a, b) = st.flush();
        (r + &a, c + &b)
    }

    #[test]
    fn splits_markers_across_deltas() {
        let got = split(&["<th", "ink>why", " so</thi", "nk>answer"], false);
        assert_eq!(got, ("why so".into(), "answer".into()));
    }

    #[test]
    fn template_opened_reasoning() {
        assert_eq!(split(&["a</think>b"], true), ("a".into(), "b".into()));
    }

    #[test]
    fn no_markers_is_all_content() {
        assert_eq!(split(&["plain <b>text</b>"], false), ("".into(), "plain <b>text</b>".into()));
    }

    #[test]
    fn unterminated_reasoning_stays_reasoning() {
        assert_eq!(split(&["<think>still thinking <"], false), ("still thinking <".into(), "".into()));
    }

    #[test]
    fn second_block_is_content() {
        assert_eq!(split(&["<think>a</think>b<think>c"], false), ("a".into(), "b<think>c".into()));
    }
}
