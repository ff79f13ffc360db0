//! Stop strings and stop regular expressions over a stream of text deltas.
//!
//! Generation must end the moment any stop appears, and the stop itself is
//! never shown. Text is released as soon as it can no longer be part of a
//! stop: only the longest tail that is a proper prefix of some stop string,
//! or that a stop regex could still match from (see stop_regex.rs), is held
//! back.
//!
//! The result does not depend on how the text is split into deltas: the stop
//! that wins is the one that ends first (as if fed one character at a time),
//! and of those ending at the same place the longest, then the first listed
//! (stop strings are listed before regexes).
//!
//! A matcher built `keeping_stops` releases the stop itself too, and
//! nothing after it (SGLang's no_stop_trim, vLLM's
//! include_stop_str_in_output).

use aho_corasick::AhoCorasick;

use crate::text::stop_regex::StopRegexes;

pub struct StopMatcher {
    /// None when there is no (non-empty) stop string.
    automaton: Option<AhoCorasick>,
    /// Automaton pattern id -> index in the caller's list (empties skipped).
    indices: Vec<usize>,
    /// The stops, sorted, to test "is this a prefix of some stop" by binary search.
    sorted: Vec<String>,
    longest: usize,
    /// None without stop regexes; their indices follow the stop strings'.
    regexes: Option<StopRegexes>,
    regex_base: usize,
    held: String,
    /// Offset of `held` in the stream (bytes released before it).
    held_at: usize,
    matched: Option<usize>,
    /// Whether the text of the stop that matched is released.
    keep: bool,
}

/// A stop found in `held`: (end, start, caller's index), ordered so that the
/// smallest wins.
type Found = (usize, usize, usize);

impl StopMatcher {
    /// Empty strings are ignored (they would match everywhere); the indices
    /// reported are positions in `stops` as given, then `stops.len() + i`
    /// for `regexes[i]`. A regex that does not parse, or that matches the
    /// empty string, is an error naming it.
    pub fn new(stops: &[String], regexes: &[String]) -> Result<Self, String> {
        let (indices, patterns): (Vec<usize>, Vec<&str>) =
            stops.iter().enumerate().filter(|(_, s)| !s.is_empty()).map(|(i, s)| (i, s.as_str())).unzip();
        // Only the standard match kind supports overlapping search, which
        // is what finds the stop that ends first. Building cannot fail for
        // a handful of strings; if it ever did, no stop would be enforced.
        let automaton = if patterns.is_empty() { None } else { AhoCorasick::new(&patterns).ok() };
        let mut sorted: Vec<String> = patterns.iter().map(|s| s.to_string()).collect();
        sorted.sort_unstable();
        let longest = sorted.iter().map(String::len).max().unwrap_or(0);
        let regexes = if regexes.is_empty() { None } else { Some(StopRegexes::new(regexes)?) };
        Ok(StopMatcher {
            automaton,
            indices,
            sorted,
            longest,
            regexes,
            regex_base: stops.len(),
            held: String::new(),
            held_at: 0,
            matched: None,
            keep: false,
        })
    }

    /// The same matcher, releasing each stop's own text when it matches.
    pub fn keeping_stops(mut self) -> Self {
        self.keep = true;
        self
    }

    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Returns the text safe to emit and the index of the stop that matched.
    pub fn feed(&mut self, text: &str) -> (String, Option<usize>) {
        if self.matched.is_some() {
            return (String::new(), self.matched);
        }
        if self.automaton.is_none() && self.regexes.is_none() {
            return (text.to_string(), None);
        }
        self.held.push_str(text);
        let by_regex = self.regexes.as_mut().and_then(|r| r.scan(text)).map(|m| self.regex_found(m));
        if let Some(found) = [self.string_found(), by_regex].into_iter().flatten().min() {
            return self.stop_at(found);
        }
        let mut safe_len = self.held.len() - self.partial_stop_len();
        if let Some(start) = self.regexes.as_ref().and_then(StopRegexes::hold_from) {
            safe_len = safe_len.min(start - self.held_at);
        }
        let safe: String = self.held.drain(..safe_len).collect();
        self.held_at += safe_len;
        (safe, None)
    }

    /// End of stream: the held-back tail, up to a stop regex that matches
    /// at the end of the text (`$`, `\b`...), which then is the stop.
    pub fn flush(&mut self) -> (String, Option<usize>) {
        if self.matched.is_some() {
            return (String::new(), self.matched);
        }
        if let Some(found) = self.regexes.as_mut().and_then(StopRegexes::finish).map(|m| self.regex_found(m)) {
            return self.stop_at(found);
        }
        self.held_at += self.held.len();
        (std::mem::take(&mut self.held), None)
    }

    /// The first stop string to end in `held`. Overlapping matches come in
    /// order of where they end.
    fn string_found(&self) -> Option<Found> {
        let mut matches = self.automaton.as_ref()?.find_overlapping_iter(&self.held);
        let first = matches.next()?;
        std::iter::once(first)
            .chain(matches.take_while(|m| m.end() == first.end()))
            .map(|m| (m.end(), m.start(), self.indices[m.pattern().as_usize()]))
            .min()
    }

    fn regex_found(&self, m: crate::text::stop_regex::RegexMatch) -> Found {
        (m.end - self.held_at, m.start - self.held_at, self.regex_base + m.pattern)
    }

    fn stop_at(&mut self, (end, start, index): Found) -> (String, Option<usize>) {
        let before = self.held[..if self.keep { end } else { start }].to_string();
        self.held.clear();
        self.matched = Some(index);
        (before, self.matched)
    }

    /// Length in bytes of the longest tail of `held` that starts a stop string.
    fn partial_stop_len(&self) -> usize {
        let held = self.held.as_str();
        let shortest_start = held.len().saturating_sub(self.longest.saturating_sub(1));
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&strings(stops), &[]).unwrap()
    }

    fn run_with(mut st: StopMatcher, pieces: &[&str]) -> (String, Option<usize>) {
        let mut out = String::new();
        for p in pieces {
            let (safe, m) = st.feed(p);
            out += &safe;
            if m.is_some() {
                return (out, m);
            }
        }
        let (rest, m) = st.flush();
        (out + &rest, m)
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        run_with(matcher(stops), pieces)
    }

    fn run_regex(stops: &[&str], regexes: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        run_with(StopMatcher::new(&strings(stops), &strings(regexes)).unwrap(), pieces)
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
        assert_eq!(st.flush(), ("aa".into(), None));
    }

    #[test]
    fn after_a_match_nothing_more() {
        let mut st = matcher(&["!"]);
        assert_eq!(st.feed("hi! there"), ("hi".into(), Some(0)));
        assert_eq!(st.feed("more"), ("".into(), Some(0)));
        assert_eq!(st.flush(), ("".into(), Some(0)));
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

    #[test]
    fn a_regex_stops_like_a_string_and_holds_back_what_it_could_still_match() {
        assert_eq!(run_regex(&[], &[r"\d+\."], &["step 1", "2", ". then"]), ("step ".into(), Some(0)));
        let mut st = StopMatcher::new(&[], &strings(&[r"END\."])).unwrap();
        assert_eq!(st.feed("the E"), ("the ".into(), None));
        assert_eq!(st.feed("Nx"), ("ENx".into(), None));
        assert_eq!(st.flush(), ("".into(), None));
    }

    #[test]
    fn strings_and_regexes_race_to_the_first_end() {
        // The string ends first.
        assert_eq!(run_regex(&["bc"], &["ab+c+d"], &["abbccd"]), ("ab".into(), Some(0)));
        // The regex ends first; its index follows the strings'.
        assert_eq!(run_regex(&["xyz", "cd"], &["b+c"], &["abbcd"]), ("a".into(), Some(2)));
        // Same end: the longer match wins.
        assert_eq!(run_regex(&["c"], &["b+c"], &["abbc"]), ("a".into(), Some(1)));
    }

    #[test]
    fn a_regex_that_needs_the_end_of_text_matches_at_flush() {
        assert_eq!(run_regex(&[], &[r"\.$"], &["a.b", "."]), ("a.b".into(), Some(0)));
        assert_eq!(run_regex(&[], &[r"\.$"], &["a.", "b"]), ("a.b".into(), None));
    }

    #[test]
    fn a_matcher_keeping_stops_releases_the_stop_and_nothing_after() {
        let keeping = |stops: &[&str], regexes: &[&str]| {
            StopMatcher::new(&strings(stops), &strings(regexes)).unwrap().keeping_stops()
        };
        assert_eq!(run_with(keeping(&["fox"], &[]), &["the f", "ox jumps"]), ("the fox".into(), Some(0)));
        assert_eq!(run_with(keeping(&["bc"], &[r"\d+\."]), &["a 12", ". bc"]), ("a 12.".into(), Some(1)));
        assert_eq!(run_with(keeping(&[], &[r"\.$"]), &["a.b", "."]), ("a.b.".into(), Some(0)));
        assert_eq!(run_with(keeping(&["。"], &[]), &["你好", "。再见"]), ("你好。".into(), Some(0)));
        assert_eq!(run_with(keeping(&["z"], &[]), &["abc"]), ("abc".into(), None));
    }

    #[test]
    fn bad_regexes_are_errors() {
        assert!(StopMatcher::new(&[], &strings(&["(x"])).is_err());
        assert!(StopMatcher::new(&[], &strings(&["x?"])).is_err());
    }
}
