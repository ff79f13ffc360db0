//! Stop regular expressions over a stream of text (SGLang's `stop_regex`).
//!
//! The stream is searched as it arrives, byte by byte, with a lazy DFA
//! (regex-automata): one anchored search starts at every character, and
//! each search lives until its DFA state is dead. A match ends generation
//! as soon as it is complete; the output ends where it began. The searches
//! still alive say how much text must be held back: everything from the
//! earliest of them on could still turn out to be part of a match.
//!
//! Two searches in the same DFA state behave alike from then on, so only
//! the earlier (whose match would be longer) is kept: the live searches
//! never outnumber the DFA's states. A search older than `MAX_HOLD` bytes
//! is dropped, so a match must fit in that much text.
//!
//! A DFA reports a match one byte late (after the byte that follows it),
//! since an assertion such as `$` or `\b` may depend on that byte. For
//! patterns without such look-ahead, a match that ends where the text so far
//! ends is taken at once, without waiting for the next byte.

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::hybrid::LazyStateID;
use regex_automata::nfa::thompson;
use regex_automata::util::start;
use regex_automata::util::syntax;
use regex_automata::Anchored;
use regex_syntax::hir::Look;

/// Bytes of text a match may span (and the most text held back for one).
pub const MAX_HOLD: usize = 2048;
const NEST_LIMIT: u32 = 64;
const NFA_SIZE_LIMIT: usize = 1 << 20;
const CACHE_BYTES: usize = 1 << 20;

/// A stop found: the pattern's index and the match's byte offsets in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegexMatch {
    pub pattern: usize,
    pub start: usize,
    pub end: usize,
}

pub struct StopRegexes {
    dfa: DFA,
    cache: Cache,
    /// Searches alive: (stream offset where it started, DFA state), oldest first.
    live: Vec<(usize, LazyStateID)>,
    /// Bytes of the stream searched so far.
    scanned: usize,
    last_byte: Option<u8>,
    /// No pattern looks past a match's end: a match at the end of the text
    /// so far is final.
    final_at_end: bool,
}

impl StopRegexes {
    /// Errors name the pattern (by index) and what is wrong with it.
    pub fn new(patterns: &[String]) -> Result<Self, String> {
        let config = syntax::Config::new().nest_limit(NEST_LIMIT);
        let mut hirs = Vec::with_capacity(patterns.len());
        for (i, pattern) in patterns.iter().enumerate() {
            let hir = syntax::parse_with(pattern, &config).map_err(|e| format!("stop_regex[{i}]: {e}"))?;
            if hir.properties().minimum_len() == Some(0) {
                return Err(format!("stop_regex[{i}] matches the empty string: it would stop at once"));
            }
            hirs.push(hir);
        }
        let final_at_end = hirs.iter().all(|hir| {
            hir.properties().look_set().iter().all(|look| matches!(look, Look::Start | Look::StartLF | Look::StartCRLF))
        });
        let nfa = thompson::Compiler::new()
            .configure(thompson::Config::new().nfa_size_limit(Some(NFA_SIZE_LIMIT)))
            .build_many_from_hir(&hirs)
            .map_err(|e| format!("stop_regex: {e}"))?;
        let dfa = DFA::builder()
            .configure(DFA::config().unicode_word_boundary(true).cache_capacity(CACHE_BYTES))
            .build_from_nfa(nfa)
            .map_err(|e| format!("stop_regex: {e}"))?;
        let cache = dfa.create_cache();
        Ok(StopRegexes { dfa, cache, live: Vec::new(), scanned: 0, last_byte: None, final_at_end })
    }

    /// Searches the stream's next bytes; returns the first match to end
    /// (of those ending together, the longest). After a match, the caller
    /// stops feeding.
    pub fn scan(&mut self, text: &str) -> Option<RegexMatch> {
        for &byte in text.as_bytes() {
            // A search may start at every character, not inside one.
            if byte & 0xC0 != 0x80 {
                self.start_search();
            }
            if let Some(found) = self.step(byte) {
                return Some(found);
            }
        }
        if self.final_at_end {
            return self.match_at_end();
        }
        None
    }

    /// End of stream: a match that ends with the text.
    pub fn finish(&mut self) -> Option<RegexMatch> {
        self.match_at_end()
    }

    /// Where the earliest search still alive started: text from there on
    /// must be held back.
    pub fn hold_from(&self) -> Option<usize> {
        self.live.first().map(|&(start, _)| start)
    }

    fn start_search(&mut self) {
        let config = start::Config::new().anchored(Anchored::Yes).look_behind(self.last_byte);
        if let Ok(state) = self.dfa.start_state(&mut self.cache, &config) {
            self.live.push((self.scanned, state));
        }
    }

    fn step(&mut self, byte: u8) -> Option<RegexMatch> {
        let mut found: Option<RegexMatch> = None;
        let mut next: Vec<(usize, LazyStateID)> = Vec::with_capacity(self.live.len());
        for &(start, state) in &self.live {
            let Ok(state) = self.dfa.next_state(&mut self.cache, state, byte) else { continue };
            if state.is_match() && found.is_none() {
                // Delayed by one byte: the match ended before this one.
                found = Some(RegexMatch {
                    pattern: self.dfa.match_pattern(&self.cache, state, 0).as_usize(),
                    start,
                    end: self.scanned,
                });
            }
            // Dead, quit (a Unicode word boundary beside non-ASCII text),
            // too old and repeated states end a search; the oldest is first.
            let too_old = self.scanned + 1 - start > MAX_HOLD;
            if state.is_dead() || state.is_quit() || too_old || next.iter().any(|&(_, s)| s == state) {
                continue;
            }
            next.push((start, state));
        }
        self.scanned += 1;
        self.last_byte = Some(byte);
        self.live = next;
        found
    }

    fn match_at_end(&mut self) -> Option<RegexMatch> {
        for &(start, state) in &self.live {
            let Ok(state) = self.dfa.next_eoi_state(&mut self.cache, state) else { continue };
            if state.is_match() {
                let pattern = self.dfa.match_pattern(&self.cache, state, 0).as_usize();
                return Some(RegexMatch { pattern, start, end: self.scanned });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regexes(patterns: &[&str]) -> StopRegexes {
        StopRegexes::new(&patterns.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn first_match(patterns: &[&str], pieces: &[&str]) -> Option<RegexMatch> {
        let mut r = regexes(patterns);
        for piece in pieces {
            if let Some(m) = r.scan(piece) {
                return Some(m);
            }
        }
        r.finish()
    }

    #[test]
    fn a_match_is_found_however_the_text_is_split() {
        let want = Some(RegexMatch { pattern: 0, start: 6, end: 11 });
        assert_eq!(first_match(&[r"\d{3}-\d"], &["call: 555-1 now"]), want);
        assert_eq!(first_match(&[r"\d{3}-\d"], &["call: 5", "55", "-", "1 now"]), want);
    }

    #[test]
    fn the_first_match_to_end_wins_and_of_those_the_longest() {
        assert_eq!(first_match(&["abcd", "bc"], &["xabcd"]), Some(RegexMatch { pattern: 1, start: 2, end: 4 }));
        assert_eq!(first_match(&["c", "x?bc"], &["abc"]), Some(RegexMatch { pattern: 1, start: 1, end: 3 }));
    }

    #[test]
    fn text_is_held_back_from_the_earliest_search_that_could_still_match() {
        let mut r = regexes(&[r"END\."]);
        assert_eq!(r.scan("so E"), None);
        assert_eq!(r.hold_from(), Some(3));
        assert_eq!(r.scan("X"), None);
        assert_eq!(r.hold_from(), None);
        assert_eq!(r.scan("EN"), None);
        assert_eq!(r.hold_from(), Some(5));
    }

    #[test]
    fn look_ahead_waits_for_the_next_byte_or_the_end() {
        let mut r = regexes(&[r"\bcat\b"]);
        assert_eq!(r.scan("a cat"), None);
        assert_eq!(r.scan("s"), None); // "cats": no word boundary after "cat"
        assert_eq!(r.scan(" cat"), None);
        assert_eq!(r.finish(), Some(RegexMatch { pattern: 0, start: 7, end: 10 }));
        assert_eq!(first_match(&[r"\bcat\b"], &["a cat", "!"]), Some(RegexMatch { pattern: 0, start: 2, end: 5 }));
    }

    #[test]
    fn start_anchors_see_what_came_before() {
        assert_eq!(first_match(&["^no"], &["a no"]), None);
        assert_eq!(first_match(&["^no"], &["no"]), Some(RegexMatch { pattern: 0, start: 0, end: 2 }));
        assert_eq!(first_match(&["(?m)^no"], &["a\nno"]), Some(RegexMatch { pattern: 0, start: 2, end: 4 }));
    }

    #[test]
    fn matches_start_on_characters_and_see_unicode() {
        assert_eq!(first_match(&["é+"], &["caf", "\u{e9}\u{e9}!"]), Some(RegexMatch { pattern: 0, start: 3, end: 5 }));
        assert_eq!(first_match(&[r"\p{Han}"], &["x你"]), Some(RegexMatch { pattern: 0, start: 1, end: 4 }));
    }

    #[test]
    fn patterns_that_match_nothing_or_do_not_parse_are_refused() {
        let err = |p: &str| StopRegexes::new(&[p.to_string()]).err().unwrap();
        assert!(err("a*").contains("empty string"));
        assert!(err("(a").contains("stop_regex[0]"));
        assert!(err(&"(".repeat(100)).contains("stop_regex[0]"));
    }

    #[test]
    fn a_match_longer_than_the_hold_is_not_found() {
        let long = "a".repeat(MAX_HOLD + 10);
        let found = first_match(&["a+b"], &[&long, "b"]).unwrap();
        assert!(found.end == long.len() + 1 && found.end - found.start <= MAX_HOLD, "{found:?}");
        assert_eq!(first_match(&["<a+>"], &["<", &long, ">"]), None);
    }
}
