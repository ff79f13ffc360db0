//! An operator's corpus for NGRAM draft trees (SGLang's external corpus):
//! documents given before the requests that echo them (a code base, the
//! answers to last week's questions), read-only once built.
//!
//! It is a suffix automaton of the documents, one automaton over them all
//! (a generalized one: no match runs from one document into the next).
//! Its states are the corpus's distinct substrings grouped by where they
//! end, so a request's longest suffix that occurs anywhere in the corpus is
//! found in as many steps as the suffix is long, and the state's
//! transitions are every token that followed it there. Each state knows
//! how often its strings occur and where they last ended, so its
//! continuations can be ranked by count or by recency (a later document
//! counts as more recent) as the request trie's are. About 55 bytes a
//! corpus token once built.

use crate::text::ngram_draft::{draft_into, Continuations, Draft, DraftShape, TreeBuilder};
use crate::text::ngram_trie::NgramTrie;

const NONE: u32 = u32::MAX;
const ROOT: u32 = 0;

pub struct Corpus {
    length: Vec<u32>, // of a state's longest string
    link: Vec<u32>,   // the state of its longest suffix in another state
    token: Vec<u32>,  // the last token of its strings (they all end in one)
    count: Vec<u32>,  // times its strings occur
    // Transitions, state by state: state s's are edges[first_edge[s]..first_edge[s + 1]],
    // sorted by token; by_recency holds the same edges' indices, the most
    // recently seen target first.
    first_edge: Vec<u32>,
    edge_token: Vec<u32>,
    edge_target: Vec<u32>,
    by_recency: Vec<u32>,
    tokens: usize,
}

/// The automaton while documents go in; a state's transitions are a
/// vector sorted by token.
struct Builder {
    length: Vec<u32>,
    link: Vec<u32>,
    token: Vec<u32>,
    next: Vec<Vec<(u32, u32)>>,
    count: Vec<u32>,
    last_end: Vec<u64>, // the latest position (over all documents) its strings end at
}

impl Builder {
    fn new() -> Self {
        Builder {
            length: vec![0],
            link: vec![NONE],
            token: vec![NONE],
            next: vec![Vec::new()],
            count: vec![0],
            last_end: vec![0],
        }
    }

    fn get(&self, state: u32, token: u32) -> Option<u32> {
        let edges = &self.next[state as usize];
        edges.binary_search_by_key(&token, |e| e.0).ok().map(|i| edges[i].1)
    }

    fn set(&mut self, state: u32, token: u32, target: u32) {
        let edges = &mut self.next[state as usize];
        match edges.binary_search_by_key(&token, |e| e.0) {
            Ok(i) => edges[i].1 = target,
            Err(i) => edges.insert(i, (token, target)),
        }
    }

    fn new_state(&mut self, length: u32, link: u32, token: u32, next: Vec<(u32, u32)>) -> u32 {
        self.length.push(length);
        self.link.push(link);
        self.token.push(token);
        self.next.push(next);
        self.count.push(0);
        self.last_end.push(0);
        (self.length.len() - 1) as u32
    }

    /// A copy of `q`, `length` long, that takes over its shorter strings;
    /// the transitions to `q` on `token` from `from` and its suffixes move to it.
    fn split(&mut self, q: u32, length: u32, from: u32, token: u32) -> u32 {
        let clone = self.new_state(length, self.link[q as usize], token, self.next[q as usize].clone());
        let mut p = from;
        while p != NONE && self.get(p, token) == Some(q) {
            self.set(p, token, clone);
            p = self.link[p as usize];
        }
        self.link[q as usize] = clone;
        clone
    }

    /// The state of the document so far after `last`'s, `token` on.
    fn extend(&mut self, last: u32, token: u32, position: u64) -> u32 {
        let length = self.length[last as usize] + 1;
        let end = match self.get(last, token) {
            // An earlier document had this prefix: its state, or the part of it this long.
            Some(q) if self.length[q as usize] == length => q,
            Some(q) => self.split(q, length, last, token),
            None => {
                let cur = self.new_state(length, ROOT, token, Vec::new());
                let mut p = last;
                while p != NONE && self.get(p, token).is_none() {
                    self.set(p, token, cur);
                    p = self.link[p as usize];
                }
                if p != NONE {
                    let q = self.get(p, token).unwrap();
                    self.link[cur as usize] = if self.length[p as usize] + 1 == self.length[q as usize] {
                        q
                    } else {
                        self.split(q, self.length[p as usize] + 1, p, token)
                    };
                }
                cur
            }
        };
        self.count[end as usize] += 1;
        self.last_end[end as usize] = position;
        end
    }

    /// The read-only corpus: counts and last ends summed up the suffix
    /// links, transitions packed.
    fn finish(mut self, tokens: usize) -> Corpus {
        let states = self.length.len();
        let mut by_length: Vec<u32> = (1..states as u32).collect();
        by_length.sort_unstable_by_key(|&s| std::cmp::Reverse(self.length[s as usize]));
        for s in by_length {
            let link = self.link[s as usize] as usize;
            self.count[link] = self.count[link].saturating_add(self.count[s as usize]);
            self.last_end[link] = self.last_end[link].max(self.last_end[s as usize]);
        }
        let edges: usize = self.next.iter().map(Vec::len).sum();
        let mut corpus = Corpus {
            length: self.length,
            link: self.link,
            token: self.token,
            count: self.count,
            first_edge: Vec::with_capacity(states + 1),
            edge_token: Vec::with_capacity(edges),
            edge_target: Vec::with_capacity(edges),
            by_recency: Vec::with_capacity(edges),
            tokens,
        };
        for next in &mut self.next {
            let first = corpus.edge_token.len() as u32;
            corpus.first_edge.push(first);
            corpus.edge_token.extend(next.iter().map(|e| e.0));
            corpus.edge_target.extend(next.iter().map(|e| e.1));
            let mut order: Vec<u32> = (first..first + next.len() as u32).collect();
            order.sort_by_key(|&e| std::cmp::Reverse(self.last_end[corpus.edge_target[e as usize] as usize]));
            corpus.by_recency.extend(order);
            *next = Vec::new();
        }
        corpus.first_edge.push(corpus.edge_token.len() as u32);
        corpus
    }
}

impl Corpus {
    /// The automaton of `documents`, in order (a later one counts as more recent).
    pub fn build(documents: &[Vec<u32>]) -> Self {
        let mut builder = Builder::new();
        let mut position: u64 = 0;
        for document in documents {
            let mut last = ROOT;
            for &token in document {
                position += 1;
                last = builder.extend(last, token, position);
            }
        }
        builder.finish(position as usize)
    }

    /// Corpus tokens it was built from.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn states(&self) -> usize {
        self.length.len()
    }

    /// Bytes its arrays hold.
    pub fn nbytes(&self) -> usize {
        4 * (self.length.len() * 4 + self.first_edge.len() + self.edge_token.len() * 3)
    }

    fn edges(&self, state: u32) -> std::ops::Range<usize> {
        self.first_edge[state as usize] as usize..self.first_edge[state as usize + 1] as usize
    }

    fn next(&self, state: u32, token: u32) -> Option<u32> {
        let range = self.edges(state);
        let tokens = &self.edge_token[range.clone()];
        tokens.binary_search(&token).ok().map(|i| self.edge_target[range.start + i])
    }
}

impl Continuations for Corpus {
    fn matches(&self, ids: &[u32], shape: &DraftShape) -> Vec<(usize, u32)> {
        // The longest suffix of the last max_window tokens that occurs.
        let (mut state, mut length) = (ROOT, 0usize);
        for &token in &ids[ids.len().saturating_sub(shape.max_window)..] {
            while state != ROOT && self.next(state, token).is_none() {
                state = self.link[state as usize];
                length = self.length[state as usize] as usize;
            }
            match self.next(state, token) {
                Some(n) => {
                    state = n;
                    length += 1;
                }
                None => length = 0,
            }
        }
        // Shorter suffixes are in the states up its suffix links.
        let mut found = Vec::new();
        while state != ROOT && length >= shape.min_window {
            if !self.edges(state).is_empty() {
                found.push((length, state));
            }
            state = self.link[state as usize];
            length = self.length[state as usize] as usize;
        }
        found
    }

    fn children(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        self.by_recency[self.edges(node)].iter().map(|&e| self.edge_target[e as usize])
    }

    fn token(&self, node: u32) -> u32 {
        self.token[node as usize]
    }

    fn count(&self, node: u32) -> u32 {
        self.count[node as usize]
    }
}

/// Up to `k` drafts after `ids` from the request trie and the corpora:
/// the trie's first, up to `k - reserved`; then each corpus's, in turn,
/// up to an even share of the `reserved` nodes more (with whatever room
/// the trie left); then the trie's again, to `k`, in any room the corpora
/// left. Nodes two stores draft alike are kept once.
pub fn draft_with_corpora(trie: &NgramTrie, corpora: &[&Corpus], ids: &[u32], k: usize, reserved: usize) -> Draft {
    let shape = &trie.shape().draft;
    let reserved = if corpora.is_empty() { 0 } else { reserved.min(k) };
    let mut tree = TreeBuilder::new(k - reserved);
    draft_into(trie, shape, ids, &mut tree);
    for (i, corpus) in corpora.iter().enumerate() {
        tree.set_limit(k - reserved + reserved * (i + 1) / corpora.len());
        draft_into(*corpus, shape, ids, &mut tree);
    }
    tree.set_limit(k);
    draft_into(trie, shape, ids, &mut tree);
    tree.into_draft()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::ngram_trie::{Cursor, TrieShape};
    use std::collections::{HashMap, HashSet};

    fn shape(by_probability: bool) -> DraftShape {
        DraftShape { min_window: 1, max_window: 12, min_breadth: 1, max_breadth: 10, by_probability }
    }

    fn draft(corpus: &Corpus, shape: DraftShape, ids: &[u32], k: usize) -> Draft {
        let mut tree = TreeBuilder::new(k);
        draft_into(corpus, &shape, ids, &mut tree);
        tree.into_draft()
    }

    /// The state `text` leads to from the root, if it occurs.
    fn walk(corpus: &Corpus, text: &[u32]) -> Option<u32> {
        text.iter().try_fold(ROOT, |state, &t| corpus.next(state, t))
    }

    #[test]
    fn every_substring_is_found_with_its_count_and_continuations() {
        let mut next = crate::text::ngram_draft::test_numbers(11);
        for _ in 0..20 {
            let documents: Vec<Vec<u32>> =
                (0..1 + next(4)).map(|_| (0..next(40)).map(|_| next(4) as u32).collect()).collect();
            let corpus = Corpus::build(&documents);
            // Brute force: each substring up to 5 long, its occurrences and what followed them.
            let mut seen: HashMap<Vec<u32>, (u32, HashSet<u32>)> = HashMap::new();
            for document in &documents {
                for start in 0..document.len() {
                    for end in start + 1..=(start + 5).min(document.len()) {
                        let entry = seen.entry(document[start..end].to_vec()).or_default();
                        entry.0 += 1;
                        if let Some(&after) = document.get(end) {
                            entry.1.insert(after);
                        }
                    }
                }
            }
            for (text, (count, after)) in &seen {
                let state = walk(&corpus, text).expect("a substring of the corpus is a path");
                assert_eq!(corpus.count(state), *count, "{text:?}");
                assert_eq!(corpus.token(state), *text.last().unwrap());
                let children: HashSet<u32> = corpus.children(state).map(|c| corpus.token(c)).collect();
                assert_eq!(&children, after, "{text:?}");
            }
            // Nothing else is: a string across two documents, or made up.
            for _ in 0..200 {
                let text: Vec<u32> = (0..1 + next(5)).map(|_| next(4) as u32).collect();
                assert_eq!(walk(&corpus, &text).is_some(), seen.contains_key(&text), "{text:?}");
            }
            assert_eq!(corpus.tokens(), documents.iter().map(Vec::len).sum::<usize>());
            assert!(corpus.states() <= 2 * corpus.tokens() + 1);
        }
    }

    #[test]
    fn drafts_follow_the_longest_match_then_shorter_ones() {
        let corpus = Corpus::build(&[vec![1, 2, 3, 4, 5], vec![9, 3, 7, 8]]);
        // "2 3" went on with 4 5; "3" also with 7 8, seen later.
        assert_eq!(draft(&corpus, shape(false), &[6, 2, 3], 4), (vec![4, 5, 7, 8], vec![-1, 0, -1, 2]));
        // A match never runs across documents: 5 then 9 never occurred.
        assert_eq!(draft(&corpus, shape(false), &[4, 5], 3), (vec![], vec![]));
        assert_eq!(draft(&corpus, shape(false), &[42], 3), (vec![], vec![]));
        let mut narrow = shape(false);
        narrow.min_window = 2;
        assert_eq!(draft(&corpus, narrow, &[5, 3], 4), (vec![], vec![]));
        assert_eq!(draft(&corpus, narrow, &[9, 3], 4), (vec![7, 8], vec![-1, 0]));
    }

    #[test]
    fn recency_puts_later_documents_first_and_probability_the_commoner() {
        let corpus = Corpus::build(&[vec![1, 5, 6], vec![1, 5, 6], vec![1, 7, 8]]);
        assert_eq!(draft(&corpus, shape(false), &[1], 2), (vec![7, 5], vec![-1, -1]));
        assert_eq!(draft(&corpus, shape(true), &[1], 3), (vec![5, 6, 7], vec![-1, 0, -1]));
    }

    #[test]
    fn the_corpora_get_their_share_and_any_room_the_trie_leaves() {
        let trie_shape = TrieShape { branch_length: 18, capacity: 1000, draft: shape(false) };
        let mut trie = NgramTrie::new(trie_shape).unwrap();
        trie.extend(&mut Cursor::default(), &[1, 2, 3, 4, 5, 6]);
        let a = Corpus::build(&[vec![1, 2, 30, 31, 32]]);
        let b = Corpus::build(&[vec![1, 2, 40, 41, 42]]);
        // Without corpora, or none reserved, the trie alone.
        assert_eq!(draft_with_corpora(&trie, &[], &[1, 2], 4, 2), trie.draft(&[1, 2], 4));
        // Two reserved, one each; the trie's chain first.
        assert_eq!(draft_with_corpora(&trie, &[&a, &b], &[1, 2], 4, 2), (vec![3, 4, 30, 40], vec![-1, 0, -1, -1]));
        // A store with nothing to say leaves its room to the others.
        assert_eq!(draft_with_corpora(&trie, &[&a], &[9, 1, 2], 6, 3).0, vec![3, 4, 5, 30, 31, 32]);
        assert_eq!(draft_with_corpora(&trie, &[&a], &[7, 30], 4, 1), (vec![31, 32], vec![-1, 0]));
        assert_eq!(draft_with_corpora(&trie, &[&a], &[7, 3], 4, 3), (vec![4, 5, 6], vec![-1, 0, 1]));
        // What both draft is kept once.
        let same = Corpus::build(&[vec![1, 2, 3, 4, 9]]);
        assert_eq!(draft_with_corpora(&trie, &[&same], &[1, 2], 5, 2), (vec![3, 4, 5, 9, 6], vec![-1, 0, 1, 1, 2]));
    }
}
