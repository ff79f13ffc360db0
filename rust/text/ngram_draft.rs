//! NGRAM draft trees, read from any store of continuations: the trie of
//! every request's tokens (ngram_trie.rs) and operators' corpora
//! (ngram_corpus.rs).
//!
//! A store's matches are the suffixes of a request's tokens, `min_window`
//! to `max_window` long, that it has seen go on; the nodes below a match
//! are its candidate drafts. A longer match is more specific, so it drafts
//! first, and the trees of the matches merge where they draft the same
//! tokens:
//!
//! - breadth first: level by level below each match, children most
//!   recently seen first; a match of the shortest length takes
//!   `max_breadth` children at its first level, one of the longest
//!   `min_breadth`, the lengths between in proportion; each level below
//!   takes half the breadth of the one above (at least 1).
//! - by probability: the candidates of highest estimated probability (a
//!   node's is its parent's times its share of the parent's count), over
//!   every match.

use std::collections::{BinaryHeap, HashMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftShape {
    pub min_window: usize,
    pub max_window: usize,
    pub min_breadth: usize,
    pub max_breadth: usize,
    pub by_probability: bool,
}

impl DraftShape {
    pub fn check(&self) -> Result<(), String> {
        if !(1 <= self.min_window && self.min_window <= self.max_window) {
            return Err("the match windows need 1 <= min_window <= max_window".into());
        }
        if !(1 <= self.min_breadth && self.min_breadth <= self.max_breadth) {
            return Err("the breadths need 1 <= min_breadth <= max_breadth".into());
        }
        Ok(())
    }

    /// First-level breadth below a match `length` tokens long.
    fn breadth(&self, length: usize) -> usize {
        let DraftShape { min_window, max_window, min_breadth, max_breadth, .. } = *self;
        if max_window == min_window {
            return min_breadth;
        }
        let share = (max_window - length.min(max_window)) as f64 / (max_window - min_window) as f64;
        min_breadth + (share * (max_breadth - min_breadth) as f64).round() as usize
    }
}

/// A store of continuations, its nodes named by u32 indices.
pub trait Continuations {
    /// (length, node) of each suffix of `ids` between the shape's windows
    /// that the store has seen go on, the longest first.
    fn matches(&self, ids: &[u32], shape: &DraftShape) -> Vec<(usize, u32)>;
    /// `node`'s children, the most recently seen first.
    fn children(&self, node: u32) -> impl Iterator<Item = u32> + '_;
    fn token(&self, node: u32) -> u32;
    /// Times the node's path occurred.
    fn count(&self, node: u32) -> u32;
}

/// A draft tree: per node its token and its parent's index (-1: the
/// root, the request's newest token), parents before children.
pub type Draft = (Vec<u32>, Vec<i32>);

/// A draft tree being built from one store or several: a node drafted
/// twice is kept once, and no node is added past the size limit.
pub struct TreeBuilder {
    tokens: Vec<u32>,
    parents: Vec<i32>,
    index: HashMap<(i32, u32), i32>, // (parent's index, token) -> node index
    limit: usize,
}

impl TreeBuilder {
    pub fn new(limit: usize) -> Self {
        TreeBuilder { tokens: Vec::new(), parents: Vec::new(), index: HashMap::new(), limit }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Let the tree grow to `limit` nodes.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    pub fn full(&self) -> bool {
        self.tokens.len() >= self.limit
    }

    pub fn into_draft(self) -> Draft {
        (self.tokens, self.parents)
    }

    /// The index of `parent`'s node for `token`, added if new; None when
    /// it is new and the tree is full.
    fn add(&mut self, parent: i32, token: u32) -> Option<i32> {
        if let Some(&at) = self.index.get(&(parent, token)) {
            return Some(at);
        }
        if self.full() {
            return None;
        }
        let at = self.tokens.len() as i32;
        self.index.insert((parent, token), at);
        self.tokens.push(token);
        self.parents.push(parent);
        Some(at)
    }
}

/// Add `store`'s drafts after `ids` to `tree`, up to its limit.
pub fn draft_into<C: Continuations>(store: &C, shape: &DraftShape, ids: &[u32], tree: &mut TreeBuilder) {
    if tree.full() {
        return;
    }
    let matches = store.matches(ids, shape);
    if shape.by_probability {
        by_probability(store, &matches, tree);
    } else {
        breadth_first(store, shape, &matches, tree);
    }
}

fn breadth_first<C: Continuations>(store: &C, shape: &DraftShape, matches: &[(usize, u32)], tree: &mut TreeBuilder) {
    for &(length, node) in matches {
        let mut level = vec![(node, -1)];
        let mut breadth = shape.breadth(length);
        while !level.is_empty() && !tree.full() {
            let mut below = Vec::new();
            'level: for &(node, parent) in &level {
                for child in store.children(node).take(breadth) {
                    match tree.add(parent, store.token(child)) {
                        Some(at) => below.push((child, at)),
                        None => break 'level,
                    }
                }
            }
            level = below;
            breadth = (breadth / 2).max(1);
        }
        if tree.full() {
            return;
        }
    }
}

fn by_probability<C: Continuations>(store: &C, matches: &[(usize, u32)], tree: &mut TreeBuilder) {
    // (probability's bits, earlier first, node, its parent's index); a
    // positive f64's bits order as the number does.
    let mut heap: BinaryHeap<(u64, std::cmp::Reverse<usize>, u32, i32)> = BinaryHeap::new();
    let mut order = 0;
    let mut push_children = |heap: &mut BinaryHeap<_>, node: u32, probability: f64, parent: i32, room: usize| {
        let total = store.count(node).max(1) as f64;
        let mut children: Vec<u32> = store.children(node).collect();
        if children.len() > room {
            children.select_nth_unstable_by_key(room, |&c| std::cmp::Reverse(store.count(c)));
            children.truncate(room);
        }
        for child in children {
            let p = probability * store.count(child) as f64 / total;
            heap.push((p.to_bits(), std::cmp::Reverse(order), child, parent));
            order += 1;
        }
    };
    let room = tree.limit - tree.len();
    for &(_, node) in matches {
        push_children(&mut heap, node, 1.0, -1, room);
    }
    while let Some((bits, _, node, parent)) = heap.pop() {
        let Some(at) = tree.add(parent, store.token(node)) else { break };
        let room = tree.limit.saturating_sub(tree.len());
        if room > 0 {
            push_children(&mut heap, node, f64::from_bits(bits), at, room);
        }
    }
}

/// The tests' seeded numbers: each call, one below `n`.
#[cfg(test)]
pub(crate) fn test_numbers(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % n
    }
}
