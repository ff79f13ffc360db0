//! Stop strings over a stream of text deltas.
//!
//! Generation must end the moment any stop string appears, and the stop
//! string itself is never shown. Text is released as soon as it can no
//! longer be part of a stop: only the longest tail that is a proper prefix
//! of some stop string is held back.

use aho_corasick::AhoCorasick;

pub struct StopState {
    stops: Vec<String>,
    automaton: Option<AhoCorasick>,
    held: String,
    matched: Option<usize>,
}

impl StopState {
    pub fn new(stops: Vec<String>) -> Result<Self, String> {
        if stops.iter().any(|s| s.is_empty()) {
            return Err("stop strings must not be empty".into());
        }
        let automaton = if stops.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&stops).map_err(|e| e.to_string())?)
        };
        Ok(StopState { stops, automaton, held: String::new(), matched: None })
    }

    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Returns the text safe to emit and the index of the stop that matched.
    pub fn feed(&mut self, text: &str) -> (String, Option<usize>) {
        if self.matched.is_some() {
            return (String::new(), self.matched);
        }
        let Some(ac) = &self.automaton else {
            return (text.to_string(), None);
        };
        self.held.push_str(text);
        // The stop that appears first is the one whose end comes first; of
        // those ending together, the longest.
        let first = ac
            .find_overlapping_iter(&self.held)
            .min_by_key(|m| (m.end(), m.start()));
        if let Some(m) = first {
            let before = self.held[..m.start()].to_string();
            self.held.clear();
            self.matched = Some(m.pattern().as_usize());
            return (before, self.matched);
        }
        let keep = self.partial_stop_len();
        let safe = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (safe, None)
    }

    /// Length in bytes of the longest tail of `held` that starts a stop.
    fn partial_stop_len(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stops.iter().map(|s| s.len() - 1).max().unwrap_or(0);
        let mut n = longest.min(held.len());
        while n > 0 {
            let start = held.len() - n;
            if held.is_char_boundary(start) {
                let tail = &held[start..];
                if self.stops.iter().any(|s| s.starts_with(tail)) {
                    return n;
                }
            }
            n -= 1;
        }
        0
    }

    /// End of stream without a match: release the held-back tail.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut st = StopState::new(stops.iter().map(|s| s.to_string()).collect()).unwrap();
        let mut out = String::new();
        for p in pieces {
            let (safe, m) = st.feed(p);
            out += &safe;
            if m.is_some() {
                return (out, m);
            }
        }
        out += &st.flush();
        (out, None)
    }

    #[test]
    fn stop_split_across_deltas() {
        assert_eq!(run(&["THE END"], &["once TH", "E E", "ND after"]), ("once ".into(), Some(0)));
    }

    #[test]
    fn no_match_releases_everything() {
        assert_eq!(run(&["\n\n"], &["a\n", "b\n"]), ("a\nb\n".into(), None));
    }

    #[test]
    fn earliest_ending_stop_wins() {
        assert_eq!(run(&["abcd", "bc"], &["a", "b", "c", "d"]), ("a".into(), Some(1)));
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut st = StopState::new(vec!["xyz".into()]).unwrap();
        assert_eq!(st.feed("abx").0, "ab");
        assert_eq!(st.feed("a").0, "xa");
    }

    #[test]
    fn multibyte_stops() {
        assert_eq!(run(&["。"], &["你好", "。再见"]), ("你好".into(), Some(0)));
        assert_eq!(run(&["🎉!"], &["x🎉", "y"]), ("x🎉y".into(), None));
    }

    #[test]
    fn empty_stop_is_rejected() {
        assert!(StopState::new(vec!["".into()]).is_err());
    }
}
