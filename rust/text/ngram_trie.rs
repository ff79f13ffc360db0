//! NGRAM draft trees' trie of every request's token stretches, shared by
//! the requests (ngram_draft.rs reads draft trees from it).
//!
//! From each position of each request's tokens, the trie holds the next
//! `branch_length` tokens as a path from its root; a node counts the times
//! its path occurred. A request's matches are its suffixes that are paths
//! with continuations.
//!
//! The trie keeps at most `capacity` nodes: past it, the least recently
//! touched node goes, with the nodes below it. Nodes live in one arena;
//! a request's cursor names the ends of its growing paths by index and
//! generation, so a path whose end was evicted (and its slot reused) stops.

use std::collections::HashMap;

use crate::text::ngram_draft::{draft_into, Continuations, Draft, DraftShape, TreeBuilder};

const NONE: u32 = u32::MAX;
const ROOT: u32 = 0;
/// Most nodes a trie may be asked to keep: nodes are u32 indices, and a
/// call may add up to branch_length nodes a token past the capacity.
pub const MAX_CAPACITY: usize = (u32::MAX / 2) as usize;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrieShape {
    pub branch_length: u32,
    pub capacity: usize,
    pub draft: DraftShape,
}

impl TrieShape {
    pub fn check(&self) -> Result<(), String> {
        self.draft.check()?;
        if (self.branch_length as usize) <= self.draft.max_window {
            return Err("branch_length must exceed max_window, or no draft follows a match".into());
        }
        if self.capacity < self.branch_length as usize {
            return Err("capacity must hold one branch".into());
        }
        if self.capacity > MAX_CAPACITY {
            return Err(format!("capacity must be at most {MAX_CAPACITY}"));
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct Node {
    token: u32,
    parent: u32,
    depth: u32,
    count: u32,
    generation: u32,
    // Children, a list from the least to the most recently seen.
    first_child: u32,
    last_child: u32,
    prev_sibling: u32,
    next_sibling: u32,
    // The recency list of every node but the root.
    older: u32,
    newer: u32,
}

impl Node {
    fn new(token: u32, parent: u32, depth: u32, generation: u32) -> Self {
        Node {
            token,
            parent,
            depth,
            count: 0,
            generation,
            first_child: NONE,
            last_child: NONE,
            prev_sibling: NONE,
            next_sibling: NONE,
            older: NONE,
            newer: NONE,
        }
    }
}

/// One request's place in the trie: how many of its tokens are in, and
/// the ends (index, generation) of its paths still growing.
#[derive(Debug, Default)]
pub struct Cursor {
    pub indexed: usize,
    open: Vec<(u32, u32)>,
}

pub struct NgramTrie {
    shape: TrieShape,
    nodes: Vec<Node>,
    free: Vec<u32>,
    child_of: HashMap<(u32, u32), u32>, // (parent, token) -> child
    oldest: u32,
    newest: u32,
    size: usize, // nodes below the root
}

impl NgramTrie {
    pub fn new(shape: TrieShape) -> Result<Self, String> {
        shape.check()?;
        Ok(NgramTrie {
            shape,
            nodes: vec![Node::new(NONE, NONE, 0, 0)],
            free: Vec::new(),
            child_of: HashMap::new(),
            oldest: NONE,
            newest: NONE,
            size: 0,
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Drop every node; the cursors' paths end.
    pub fn clear(&mut self) {
        while self.oldest != NONE {
            self.evict(self.oldest);
        }
    }

    /// Add a request's next `tokens` (after the cursor's) to the trie.
    pub fn extend(&mut self, cursor: &mut Cursor, tokens: &[u32]) {
        for &token in tokens {
            cursor.open.push((ROOT, self.nodes[ROOT as usize].generation));
            let mut growing = Vec::with_capacity(cursor.open.len());
            for &(node, generation) in &cursor.open {
                if self.nodes.get(node as usize).map(|n| n.generation) != Some(generation) {
                    continue; // evicted (or another trie's): the path ends there
                }
                let child = self.touch_child(node, token);
                let c = &mut self.nodes[child as usize];
                c.count = c.count.saturating_add(1);
                if c.depth < self.shape.branch_length {
                    growing.push((child, c.generation));
                }
            }
            cursor.open = growing;
        }
        cursor.indexed += tokens.len();
        while self.size > self.shape.capacity {
            self.evict(self.oldest);
        }
    }

    /// `node`'s child for `token`, made the most recently seen child and node.
    fn touch_child(&mut self, node: u32, token: u32) -> u32 {
        let child = match self.child_of.get(&(node, token)) {
            Some(&child) => {
                self.unlink_sibling(child);
                self.unlink_recent(child);
                child
            }
            None => {
                let depth = self.nodes[node as usize].depth + 1;
                let child = self.alloc(token, node, depth);
                self.child_of.insert((node, token), child);
                self.size += 1;
                child
            }
        };
        self.append_child(node, child);
        self.push_newest(child);
        child
    }

    fn alloc(&mut self, token: u32, parent: u32, depth: u32) -> u32 {
        match self.free.pop() {
            Some(id) => {
                let generation = self.nodes[id as usize].generation;
                self.nodes[id as usize] = Node::new(token, parent, depth, generation);
                id
            }
            None => {
                self.nodes.push(Node::new(token, parent, depth, 0));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn append_child(&mut self, parent: u32, child: u32) {
        let last = self.nodes[parent as usize].last_child;
        self.nodes[child as usize].prev_sibling = last;
        self.nodes[child as usize].next_sibling = NONE;
        if last == NONE {
            self.nodes[parent as usize].first_child = child;
        } else {
            self.nodes[last as usize].next_sibling = child;
        }
        self.nodes[parent as usize].last_child = child;
    }

    fn unlink_sibling(&mut self, child: u32) {
        let Node { parent, prev_sibling: prev, next_sibling: next, .. } = self.nodes[child as usize];
        if prev == NONE {
            self.nodes[parent as usize].first_child = next;
        } else {
            self.nodes[prev as usize].next_sibling = next;
        }
        if next == NONE {
            self.nodes[parent as usize].last_child = prev;
        } else {
            self.nodes[next as usize].prev_sibling = prev;
        }
    }

    fn push_newest(&mut self, node: u32) {
        self.nodes[node as usize].older = self.newest;
        self.nodes[node as usize].newer = NONE;
        if self.newest == NONE {
            self.oldest = node;
        } else {
            self.nodes[self.newest as usize].newer = node;
        }
        self.newest = node;
    }

    fn unlink_recent(&mut self, node: u32) {
        let Node { older, newer, .. } = self.nodes[node as usize];
        if older == NONE {
            self.oldest = newer;
        } else {
            self.nodes[older as usize].newer = newer;
        }
        if newer == NONE {
            self.newest = older;
        } else {
            self.nodes[newer as usize].older = older;
        }
    }

    /// Drop `node` and every node below it.
    fn evict(&mut self, node: u32) {
        self.unlink_sibling(node);
        let mut stack = vec![node];
        while let Some(n) = stack.pop() {
            let mut child = self.nodes[n as usize].first_child;
            while child != NONE {
                stack.push(child);
                child = self.nodes[child as usize].next_sibling;
            }
            let Node { parent, token, .. } = self.nodes[n as usize];
            self.child_of.remove(&(parent, token));
            self.unlink_recent(n);
            let entry = &mut self.nodes[n as usize];
            entry.generation = entry.generation.wrapping_add(1);
            entry.first_child = NONE;
            entry.last_child = NONE;
            self.free.push(n);
            self.size -= 1;
        }
    }

    /// Up to `k` draft tokens after `ids`, as a tree.
    pub fn draft(&self, ids: &[u32], k: usize) -> Draft {
        let mut tree = TreeBuilder::new(k);
        draft_into(self, &self.shape.draft, ids, &mut tree);
        tree.into_draft()
    }

    pub fn shape(&self) -> &TrieShape {
        &self.shape
    }
}

impl Continuations for NgramTrie {
    fn matches(&self, ids: &[u32], shape: &DraftShape) -> Vec<(usize, u32)> {
        let mut found = Vec::new();
        for length in (shape.min_window..=shape.max_window.min(ids.len())).rev() {
            let mut node = Some(ROOT);
            for &token in &ids[ids.len() - length..] {
                node = node.and_then(|n| self.child_of.get(&(n, token)).copied());
            }
            if let Some(n) = node {
                if self.nodes[n as usize].first_child != NONE {
                    found.push((length, n));
                }
            }
        }
        found
    }

    fn children(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        let mut child = self.nodes[node as usize].last_child;
        std::iter::from_fn(move || {
            (child != NONE).then(|| {
                let this = child;
                child = self.nodes[this as usize].prev_sibling;
                this
            })
        })
    }

    fn token(&self, node: u32) -> u32 {
        self.nodes[node as usize].token
    }

    fn count(&self, node: u32) -> u32 {
        self.nodes[node as usize].count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(by_probability: bool) -> TrieShape {
        TrieShape {
            branch_length: 18,
            capacity: 1_000_000,
            draft: DraftShape { min_window: 1, max_window: 12, min_breadth: 1, max_breadth: 10, by_probability },
        }
    }

    fn trie_of(shape: TrieShape, texts: &[&[u32]]) -> NgramTrie {
        let mut trie = NgramTrie::new(shape).unwrap();
        for text in texts {
            trie.extend(&mut Cursor::default(), text);
        }
        trie
    }

    #[test]
    fn the_longest_match_drafts_first_and_shorter_ones_add_branches() {
        let trie = trie_of(shape(false), &[&[1, 2, 3, 4, 5, 3, 8]]);
        // "1 2 3" went on with 4 5 3 8; "3" alone also with 8, seen last.
        assert_eq!(trie.draft(&[1, 2, 3], 6), (vec![4, 5, 3, 8, 8], vec![-1, 0, 1, 2, -1]));
        assert_eq!(trie.draft(&[1, 2, 3], 2), (vec![4, 5], vec![-1, 0]));
        // One match: the children most recently seen first, up to its breadth.
        let trie = trie_of(shape(false), &[&[7, 1, 7, 2, 7, 3, 7]]);
        assert_eq!(trie.draft(&[7], 3), (vec![3, 2, 1], vec![-1, -1, -1]));
    }

    #[test]
    fn a_request_reads_what_another_wrote() {
        let mut trie = NgramTrie::new(shape(false)).unwrap();
        trie.extend(&mut Cursor::default(), &[10, 11, 12, 13, 14, 15]);
        let mut other = Cursor::default();
        trie.extend(&mut other, &[10, 11]);
        assert_eq!(other.indexed, 2);
        assert_eq!(trie.draft(&[10, 11], 4), (vec![12, 13, 14, 15], vec![-1, 0, 1, 2]));
        assert_eq!(trie.draft(&[99], 4), (vec![], vec![]));
    }

    #[test]
    fn by_probability_takes_the_likeliest_continuations() {
        let trie = trie_of(shape(true), &[&[1, 2, 5, 6], &[1, 2, 5, 6], &[1, 2, 7, 8]]);
        let (tokens, parents) = trie.draft(&[1, 2], 3);
        assert_eq!((tokens, parents), (vec![5, 6, 7], vec![-1, 0, -1]));
    }

    #[test]
    fn past_capacity_the_least_recent_paths_go_and_cursors_stop_there() {
        let mut s = shape(false);
        s.capacity = 40;
        s.branch_length = 4;
        s.draft.max_window = 3;
        let mut trie = NgramTrie::new(s).unwrap();
        let mut cursor = Cursor::default();
        let text: Vec<u32> = (100..160).collect();
        trie.extend(&mut cursor, &text);
        assert!(trie.size() <= 40);
        assert_eq!(trie.draft(&[101, 102], 2), (vec![], vec![])); // the oldest text went
        assert_eq!(trie.draft(&[157, 158], 1), (vec![159], vec![-1]));
        // Slots are reused: the cursor's growing paths stay consistent.
        trie.extend(&mut cursor, &[1, 2, 3]);
        trie.extend(&mut Cursor::default(), &[1, 2]);
        assert_eq!(trie.draft(&[1, 2], 1), (vec![3], vec![-1]));
        assert!(trie.size() <= 40);
        assert_eq!(trie.nodes.len() - 1 - trie.free.len(), trie.size());
        assert_eq!(trie.child_of.len(), trie.size());
    }

    #[test]
    fn many_requests_under_a_small_capacity_keep_the_trie_whole() {
        // A small vocabulary and capacity: paths recur, branch and are evicted
        // while cursors still hold their ends.
        let mut next = crate::text::ngram_draft::test_numbers(7);
        for by_probability in [false, true] {
            let mut s = shape(by_probability);
            s.capacity = 200;
            s.branch_length = 6;
            s.draft.max_window = 4;
            let mut trie = NgramTrie::new(s).unwrap();
            let mut cursors: Vec<Cursor> = (0..8).map(|_| Cursor::default()).collect();
            let mut texts: Vec<Vec<u32>> = vec![Vec::new(); 8];
            for _ in 0..3000 {
                let r = next(8) as usize;
                let tokens: Vec<u32> = (0..1 + next(5)).map(|_| next(12) as u32).collect();
                trie.extend(&mut cursors[r], &tokens);
                texts[r].extend(&tokens);
                assert!(trie.size() <= 200);
                let (drafted, parents) = trie.draft(&texts[r], 1 + next(8) as usize);
                assert_eq!(drafted.len(), parents.len());
                for (i, &p) in parents.iter().enumerate() {
                    assert!(-1 <= p && p < i as i32);
                }
                assert_eq!(cursors[r].indexed, texts[r].len());
            }
            assert_eq!(trie.nodes.len() - 1 - trie.free.len(), trie.size());
            assert_eq!(trie.child_of.len(), trie.size());
            // Every live node is on the recency list once.
            let (mut n, mut at) = (0, trie.oldest);
            while at != NONE {
                n += 1;
                at = trie.nodes[at as usize].newer;
            }
            assert_eq!(n, trie.size());
        }
    }

    #[test]
    fn a_cleared_trie_drafts_nothing_and_fills_again() {
        let mut trie = trie_of(shape(false), &[&[1, 2, 3, 4], &[5, 6, 7]]);
        let mut cursor = Cursor::default();
        trie.extend(&mut cursor, &[1, 2]);
        trie.clear();
        assert_eq!((trie.size(), trie.draft(&[1, 2], 4)), (0, (vec![], vec![])));
        trie.extend(&mut cursor, &[8, 9]); // its paths ended with the nodes
        assert_eq!(trie.draft(&[2], 4), (vec![], vec![]));
        assert_eq!(trie.draft(&[8], 4), (vec![9], vec![-1]));
        assert_eq!(trie.child_of.len(), trie.size());
    }

    #[test]
    fn another_tries_cursor_starts_its_paths_afresh() {
        let mut big = NgramTrie::new(shape(false)).unwrap();
        let mut cursor = Cursor::default();
        big.extend(&mut cursor, &(0..100).collect::<Vec<u32>>());
        let mut small = NgramTrie::new(shape(false)).unwrap();
        small.extend(&mut cursor, &[5, 6]);
        assert_eq!(small.draft(&[5], 1), (vec![6], vec![-1]));
    }

    #[test]
    fn shapes_that_cannot_draft_are_refused() {
        let mut s = shape(false);
        s.branch_length = 12;
        assert!(NgramTrie::new(s).is_err());
        let mut s = shape(false);
        s.draft.min_breadth = 0;
        assert!(NgramTrie::new(s).is_err());
        let mut s = shape(false);
        s.capacity = 1 << 40;
        assert!(NgramTrie::new(s).is_err());
    }
}
