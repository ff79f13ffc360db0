//! Stop strings over a stream of text deltas.
//!
//! Generation must end the moment any stop string appears, and the stop
//! string itself is never shown. Text is released as soon as it can no
//! longer be part of a stop: only the longest tail that is a proper prefix
//! of some stop string is held back.
//!
//! The result does not depend on how the text is split into deltas: the stop
//! that wins is the one that ends first (as if fed one character at a time),
//! and of those ending at the same place the longest, then the first listed.

use aho_corasick::AhoCorasick;

pub struct StopMatcher {
    /// None when there is no (non-empty) stop string.
    automaton: Option<AhoCorasick>,
    /// Automaton pattern id -> index in the caller's list (empties skipped).
    indices: Vec<usize>,
    /// The stops, sorted, to test "is this a prefix of some stop" by binary search.
    sorted: Vec<String>,
    longest: usize,
    held: String,
    matched: Option<usize>,
}

impl StopMatcher {
    /// Empty strings are ignored (they would match everywhere); the indices
    /// reported are positions in `stops` as given.
    pub fn new(stops: &[String]) -> Self {
        let (indices, patterns): (Vec<usize>, Vec<&str>) =
            stops.iter().enumerate().filter(|(_, s)| !s.is_empty()).map(|(i, s)| (i, s.as_str())).unzip();
        // Only the standard match kind supports overlapping search, which
        // is what finds the stop that ends first. Building cannot fail for
        // a handful of strings; if it ever did, no stop would be enforced.
        let automaton = if patterns.is_empty() { None } else { AhoCorasick::new(&patterns).ok() };
        let mut sorted: Vec<String> = patterns.iter().map(|s| s.to_string()).collect();
        sorted.sort_unstable();
        let longest = sorted.iter().map(String::len).max().unwrap_or(0);
        StopMatcher { automaton, indices, sorted, longest, held: String::new(), matched: None }
    }

    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Returns the text safe to emit and the index of the stop that matched.
    pub fn feed(&mut self, text: &str) -> (String, Option<usize>) {
        if self.matched.is_some() {
            return (String::new(), self.matched);
        }
        let Some(automaton) = &self.automaton else {
            return (text.to_string(), None);
        };
        self.held.push_str(text);
        // Overlapping matches come in order of where they end.
        let mut matches = automaton.find_overlapping_iter(&self.held);
        if let Some(first) = matches.next() {
            let winner = std::iter::once(first)
                .chain(matches.take_while(|m| m.end() == first.end()))
                .min_by_key(|m| (m.start(), self.indices[m.pattern().as_usize()]))
                .unwrap_or(first);
            let before = self.held[..winner.start()].to_string();
            self.held.clear();
            self.matched = Some(self.indices[winner.pattern().as_usize()]);
            return (before, self.matched);
        }
        let safe_len = self.held.len() - self.partial_stop_len();
        let safe = self.held[..safe_len].to_string();
        self.held.drain(..safe_len);
        (safe, None)
    }

    /// Length in bytes of the longest tail of `held` that starts a stop.
    fn partial_stop_len(&self) -> usize {
        let held = self.held.as_str();
        let shortest_start = held.len().saturating_sub(self.longest - 1);
        (shortest_start..held.len())
            .filter(|&start| held.is_char_boundary(start))
            .map(|start| &held[start..])
            .find(|tail| self.starts_some_stop(tail))
            .map_or(0, str::len)
    }

    /// Whether some stop begins with `prefix`. All strings beginning with
    /// `prefix` sort right after it, so the first stop not below it decides.
    fn starts_some_stop(&self, prefix: &str) -> bool {
        let i = self.sorted.partition_point(|s| s.as_str() < prefix);
        self.sorted.get(i).is_some_and(|s| s.starts_with(prefix))
    }

    /// End of stream without a match: release the held-back tail.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut st = matcher(stops);
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
    fn earliest_ending_stop_wins_whatever_the_split() {
        assert_eq!(run(&["abcd", "bc"], &["a", "b", "c", "d"]), ("a".into(), Some(1)));
        assert_eq!(run(&["abcd", "bc"], &["abcd"]), ("a".into(), Some(1)));
    }

    #[test]
    fn same_end_prefers_longest_then_first_listed() {
        assert_eq!(run(&["c", "bc"], &["abcd"]), ("a".into(), Some(1)));
        assert_eq!(run(&["x", "bc", "bc"], &["abc"]), ("a".into(), Some(1)));
    }

    #[test]
    fn holds_back_only_possible_prefixes() {
        let mut st = matcher(&["xyz"]);
        assert_eq!(st.feed("abx").0, "ab");
        assert_eq!(st.feed("a").0, "xa");
        let mut st = matcher(&["aab"]);
        assert_eq!(st.feed("aaa").0, "a");
        assert_eq!(st.flush(), "aa");
    }

    #[test]
    fn after_a_match_nothing_more() {
        let mut st = matcher(&["!"]);
        assert_eq!(st.feed("hi! there"), ("hi".into(), Some(0)));
        assert_eq!(st.feed("more"), ("".into(), Some(0)));
        assert_eq!(st.flush(), "");
        assert_eq!(st.matched(), Some(0));
    }

    #[test]
    fn multibyte_stops() {
        assert_eq!(run(&["。"], &["你好", "。再见"]), ("你好".into(), Some(0)));
        assert_eq!(run(&["🎉!"], &["x🎉", "y"]), ("x🎉y".into(), None));
        let mut st = matcher(&["好。"]);
        assert_eq!(st.feed("你好").0, "你");
    }

    #[test]
    fn empty_stops_are_ignored() {
        assert_eq!(run(&[""], &["abc"]), ("abc".into(), None));
        assert_eq!(run(&["", "b"], &["abc"]), ("a".into(), Some(1)));
    }
}
