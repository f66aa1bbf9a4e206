//! `sglang_cache_aware`: a stand-in for SGLang's router `cache_aware`
//! policy (sgl-project/sglang, `sgl-router/src/policies/cache_aware.rs` and
//! `tree.rs`), so that it runs on the same traffic as the others.
//!
//! One character-level radix tree per policy instance (SGLang keeps one per
//! model, shared by all its workers) holds the text of past requests, each
//! node with the workers that own it and when each last used it. The text is
//! [`crate::Request::text`] as [`TextKind::Contents`]: the messages' contents
//! joined by single spaces, as SGLang's router reads them.
//!
//! A decision, with load = the router's own requests in flight:
//! - imbalanced pool (`max - min > balance_abs_threshold` and `max > min *
//!   balance_rel_threshold`, over every candidate as SGLang does over every
//!   worker): the least loaded offered worker;
//! - else, when the deepest match owned by an offered worker covers more
//!   than `cache_threshold` of the text's characters: that worker;
//! - else (or without text): the least loaded offered worker.
//!
//! Ties go to the first in list order, as SGLang's `min_by_key` does: the
//! winner scores 0 and the others follow by load then list position, so the
//! scores never tie and `order`'s tie-break never applies. After a
//! committed decision ([`RoutingPolicy::picked`]) the winner owns the whole
//! text (SGLang inserts it on both paths). Every `eviction_interval_secs`
//! (checked at commits; 0 = at every commit) each worker holding more than
//! `max_tree_size` characters loses its least recently used leaves until it
//! is under, as SGLang's eviction thread does.
//!
//! Defaults, those of SGLang's launcher (`launch_router` / `router_args.py`
//! and the `main.rs` CLI; the library's own `CacheAwareConfig::default` is
//! different): `cache_threshold` 0.3, `balance_abs_threshold` 64,
//! `balance_rel_threshold` 1.5, `eviction_interval_secs` 120,
//! `max_tree_size` 2^26 characters per worker.
//!
//! Deviations: SGLang's match returns one arbitrary owner of the deepest
//! node (a hash map's first key) and ignores whether it is offered; here
//! each offered worker's own deepest match counts and ties go to list
//! order. The version read sends a miss to the worker with the smallest
//! tree; here a miss goes to the least loaded (the stand-in asked for).
//! Access times are a logical clock, not milliseconds, and only the winner's
//! path is refreshed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::{Candidate, Request, RoutingPolicy, Score, TextKind};

/// `sglang_cache_aware` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Share of the text's characters a match must exceed to route by cache.
    pub cache_threshold: f64,
    /// Load spread (`max - min`) above which the pool may be imbalanced.
    pub balance_abs_threshold: u32,
    /// Load ratio (`max > min * this`) above which the pool may be imbalanced.
    pub balance_rel_threshold: f64,
    /// Seconds between evictions (0: at every commit).
    pub eviction_interval_secs: u64,
    /// Characters of the tree a worker may own before eviction.
    pub max_tree_size: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 120,
            max_tree_size: 1 << 26,
        }
    }
}

impl Config {
    pub(crate) fn validate(&self, at: &str, p: &mut Vec<String>) {
        if !(self.cache_threshold.is_finite() && (0.0..=1.0).contains(&self.cache_threshold)) {
            p.push(format!("{at}.cache_threshold: {} is not between 0 and 1", self.cache_threshold));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 0.0) {
            p.push(format!("{at}.balance_rel_threshold: {} is not a non-negative number", self.balance_rel_threshold));
        }
        if self.max_tree_size == 0 {
            p.push(format!("{at}.max_tree_size: must be at least 1"));
        }
    }
}

#[derive(Debug, Default)]
struct Node {
    /// The edge's characters from the parent (empty only at the root).
    label: Vec<char>,
    parent: usize,
    children: HashMap<char, usize>,
    /// Worker key to last access.
    owners: HashMap<u64, u64>,
    alive: bool,
}

/// A multi-owner character radix tree with per-owner LRU eviction.
#[derive(Debug)]
struct Tree {
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// Characters each owner holds.
    chars: HashMap<u64, usize>,
    clock: u64,
    last_eviction: Option<Duration>,
}

const ROOT: usize = 0;

impl Tree {
    fn new() -> Self {
        Self {
            nodes: vec![Node { alive: true, ..Node::default() }],
            free: Vec::new(),
            chars: HashMap::new(),
            clock: 0,
            last_eviction: None,
        }
    }

    fn alloc(&mut self, node: Node) -> usize {
        if let Some(i) = self.free.pop() {
            self.nodes[i] = node;
            i
        } else {
            self.nodes.push(node);
            self.nodes.len() - 1
        }
    }

    /// The nodes the text runs through, each with the characters matched once through it.
    fn path(&self, text: &[char]) -> Vec<(usize, usize)> {
        let mut path = Vec::new();
        let (mut at, mut i) = (ROOT, 0);
        while i < text.len() {
            let Some(&child) = self.nodes[at].children.get(&text[i]) else { break };
            let label = &self.nodes[child].label;
            let shared = label.iter().zip(&text[i..]).take_while(|(a, b)| a == b).count();
            i += shared;
            path.push((child, i));
            if shared < label.len() {
                break;
            }
            at = child;
        }
        path
    }

    /// Characters of `text` that `owner` holds: its deepest node on the text's path.
    fn matched(path: &[(usize, usize)], nodes: &[Node], owner: u64) -> usize {
        path.iter().rev().find(|(n, _)| nodes[*n].owners.contains_key(&owner)).map_or(0, |p| p.1)
    }

    fn own(&mut self, node: usize, owner: u64) {
        let stamp = self.clock;
        if self.nodes[node].owners.insert(owner, stamp).is_none() {
            *self.chars.entry(owner).or_default() += self.nodes[node].label.len();
        }
    }

    fn insert(&mut self, text: &[char], owner: u64) {
        self.clock += 1;
        self.own(ROOT, owner);
        let (mut at, mut i) = (ROOT, 0);
        while i < text.len() {
            let Some(&child) = self.nodes[at].children.get(&text[i]) else {
                let leaf = self.alloc(Node { label: text[i..].to_vec(), parent: at, alive: true, ..Node::default() });
                self.nodes[at].children.insert(text[i], leaf);
                self.own(leaf, owner);
                return;
            };
            let shared = self.nodes[child].label.iter().zip(&text[i..]).take_while(|(a, b)| a == b).count();
            let next = if shared < self.nodes[child].label.len() {
                // Split: [at] -> [mid: shared part] -> [child: the rest].
                let rest = self.nodes[child].label.split_off(shared);
                let head = std::mem::replace(&mut self.nodes[child].label, rest);
                let owners = self.nodes[child].owners.clone();
                let first_rest = self.nodes[child].label[0];
                let mid = self.alloc(Node { label: head, parent: at, children: HashMap::from([(first_rest, child)]), owners, alive: true });
                self.nodes[child].parent = mid;
                self.nodes[at].children.insert(text[i], mid);
                mid
            } else {
                child
            };
            self.own(next, owner);
            i += shared;
            at = next;
        }
    }

    fn held(&self, owner: u64) -> usize {
        self.chars.get(&owner).copied().unwrap_or(0)
    }

    fn leaf_for(&self, node: usize, owner: u64) -> bool {
        self.nodes[node].owners.contains_key(&owner)
            && self.nodes[node].children.values().all(|&c| !self.nodes[c].owners.contains_key(&owner))
    }

    /// Removes the least recently used leaves of each owner above `max` characters until it is not.
    fn evict(&mut self, max: usize) {
        if self.chars.values().all(|&c| c <= max) {
            return;
        }
        let mut heap = BinaryHeap::new();
        for (n, node) in self.nodes.iter().enumerate() {
            if n == ROOT || !node.alive {
                continue;
            }
            for (&owner, &stamp) in &node.owners {
                if self.held(owner) > max && self.leaf_for(n, owner) {
                    heap.push(Reverse((stamp, owner, n)));
                }
            }
        }
        while let Some(Reverse((_, owner, n))) = heap.pop() {
            if self.held(owner) <= max || !self.nodes[n].alive || self.nodes[n].owners.remove(&owner).is_none() {
                continue;
            }
            let len = self.nodes[n].label.len();
            self.chars.entry(owner).and_modify(|x| *x = x.saturating_sub(len));
            let parent = self.nodes[n].parent;
            if self.nodes[n].owners.is_empty() && self.nodes[n].children.is_empty() {
                let first = self.nodes[n].label[0];
                self.nodes[parent].children.remove(&first);
                self.nodes[n] = Node::default();
                self.free.push(n);
            }
            if parent != ROOT
                && self.leaf_for(parent, owner)
                && let Some(&stamp) = self.nodes[parent].owners.get(&owner)
            {
                heap.push(Reverse((stamp, owner, parent)));
            }
        }
    }
}

/// See the module doc.
#[derive(Debug)]
pub struct SglangCacheAware {
    config: Config,
    tree: Mutex<Tree>,
}

impl SglangCacheAware {
    /// With its parameters.
    pub fn new(config: Config) -> Self {
        Self { config, tree: Mutex::new(Tree::new()) }
    }

    fn imbalanced(&self, c: &[Candidate]) -> bool {
        let max = c.iter().map(|x| x.in_flight).max().unwrap_or(0);
        let min = c.iter().map(|x| x.in_flight).min().unwrap_or(0);
        max - min > self.config.balance_abs_threshold && f64::from(max) > f64::from(min) * self.config.balance_rel_threshold
    }
}

impl RoutingPolicy for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang_cache_aware"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["match", "load"]
    }

    fn wants_text(&self) -> TextKind {
        TextKind::Contents
    }

    fn score(&self, req: &Request, c: &[Candidate], offered: &[usize], _rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        // The least loaded, first in list order on equal load.
        let least = (0..offered.len()).min_by_key(|&k| (c[offered[k]].in_flight, k)).unwrap_or(0);
        let text: Option<Vec<char>> = req.text.map(|t| t.chars().collect());
        let mut matched = vec![0usize; offered.len()];
        if let Some(text) = &text {
            let tree = self.tree.lock().unwrap_or_else(|e| e.into_inner());
            let path = tree.path(text);
            for (m, &i) in matched.iter_mut().zip(offered) {
                *m = Tree::matched(&path, &tree.nodes, c[i].key);
            }
        }
        let (winner, why) = if self.imbalanced(c) {
            (least, Some("imbalanced"))
        } else if let Some(text) = text.as_ref().filter(|t| !t.is_empty()) {
            // The deepest match, first in list order on equal depth.
            let best = (0..offered.len()).min_by_key(|&k| (Reverse(matched[k]), k)).unwrap_or(0);
            if matched[best] as f64 / text.len() as f64 > self.config.cache_threshold { (best, None) } else { (least, Some("cache_miss")) }
        } else {
            (least, Some("no_text"))
        };
        let mut rest: Vec<usize> = (0..offered.len()).filter(|&k| k != winner).collect();
        rest.sort_by_key(|&k| (c[offered[k]].in_flight, k));
        let chars = text.as_ref().map_or(0, Vec::len).max(1) as f64;
        for (rank, k) in std::iter::once(winner).chain(rest).enumerate() {
            out[k] = Score {
                total: rank as f64,
                terms: [matched[k] as f64 / chars, f64::from(c[offered[k]].in_flight), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            };
        }
        why
    }

    fn picked(&self, req: &Request, c: &[Candidate], winner: usize) {
        let Some(text) = req.text else { return };
        let text: Vec<char> = text.chars().collect();
        let mut tree = self.tree.lock().unwrap_or_else(|e| e.into_inner());
        tree.insert(&text, c[winner].key);
        let interval = Duration::from_secs(self.config.eviction_interval_secs);
        let due = match tree.last_eviction {
            None => {
                tree.last_eviction = Some(req.now);
                interval.is_zero()
            }
            Some(last) => req.now.saturating_sub(last) >= interval,
        };
        if due {
            tree.last_eviction = Some(req.now);
            tree.evict(self.config.max_tree_size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide;
    use crate::testing::{fleet, rng};

    fn text_req(text: &str) -> Request<'_> {
        Request { text: Some(text), ..Request::default() }
    }

    fn route(p: &SglangCacheAware, text: &str, c: &[Candidate]) -> usize {
        let req = text_req(text);
        let o = decide(p, &req, c, &mut rng(0)).unwrap();
        assert_eq!(decide(p, &req, c, &mut rng(1)).unwrap(), o, "planning twice changes nothing");
        p.picked(&req, c, o[0]);
        o[0]
    }

    #[test]
    fn a_text_goes_to_its_owner_above_the_threshold_and_misses_to_the_first_least_loaded() {
        let p = SglangCacheAware::new(Config::default());
        let c = fleet(&[3, 3, 3]);
        // Misses at equal load all go to the first in list order.
        assert_eq!(route(&p, "you are a helpful assistant. hello", &c), 0);
        assert_eq!(route(&p, "something else entirely", &c), 0);
        // A lighter replica takes the misses.
        let c = fleet(&[3, 1, 3]);
        assert_eq!(route(&p, "a third conversation, never seen", &c), 1);
        // Above the threshold, the owner wins despite its load.
        assert_eq!(route(&p, "you are a helpful assistant. how are you?", &c), 0);
        assert_eq!(route(&p, "a third conversation, never seen, continued", &c), 1);
        // Below the threshold (10 of 40 characters), the least loaded.
        assert_eq!(route(&p, "you are a different thing altogether!!!!", &fleet(&[3, 3, 1])), 2);
        // The owner not offered: its match does not count.
        let mut c = fleet(&[3, 3, 3]);
        c[0].healthy = false;
        assert_eq!(route(&p, "you are a helpful assistant. goodbye and thanks", &c), 1, "10 of 47 matched on 2");
    }

    #[test]
    fn ties_in_match_go_to_the_first_owner_in_list_order() {
        let p = SglangCacheAware::new(Config::default());
        let c = fleet(&[0, 0, 0]);
        let req = text_req("shared system prompt");
        p.picked(&req, &c, 2);
        p.picked(&req, &c, 1);
        assert_eq!(route(&p, "shared system prompt and more", &c), 1);
    }

    #[test]
    fn imbalance_overrides_the_cache() {
        let fleet =
            |loads: &[u32]| -> Vec<Candidate> { fleet(loads).into_iter().map(|x| Candidate { max_concurrency: 1000, ..x }).collect() };
        let p = SglangCacheAware::new(Config::default());
        let c = fleet(&[10, 10]);
        assert_eq!(route(&p, "the long shared prefix of a conversation", &c), 0);
        // 100 - 40 = 60: not imbalanced, the owner keeps it.
        assert_eq!(route(&p, "the long shared prefix of a conversation, turn 3", &fleet(&[100, 40])), 0);
        // 200 - 140 > 64 but 200 < 210: not imbalanced either.
        assert_eq!(route(&p, "the long shared prefix of a conversation, turn 4", &fleet(&[200, 140])), 0);
        // 100 - 10 > 64 and 100 > 15: least loaded, whatever the cache.
        assert_eq!(route(&p, "the long shared prefix of a conversation, turn 2", &fleet(&[100, 10])), 1);
    }

    #[test]
    fn eviction_drops_the_least_recently_used_characters_of_a_worker_over_its_size() {
        let config = Config { max_tree_size: 30, eviction_interval_secs: 0, ..Config::default() };
        let p = SglangCacheAware::new(config);
        let c = fleet(&[0, 0]);
        p.picked(&text_req("aaaaaaaaaa-old"), &c, 0);
        p.picked(&text_req("aaaaaaaaaa-new"), &c, 0);
        p.picked(&text_req("bbbbbbbbbbbbbbbbbbbb"), &c, 1);
        // "aaaaaaaaaa-" + "old" + "new".
        assert_eq!(p.tree.lock().unwrap().chars[&c[0].key], 17);
        // 17 + 20 > 30: "old" goes (34), then "new" (31), then their parent, now a leaf (20).
        p.picked(&text_req("cccccccccccccccccccc"), &c, 0);
        {
            let tree = p.tree.lock().unwrap();
            assert_eq!(tree.chars[&c[0].key], 20, "{:?}", tree.chars);
            assert_eq!(tree.chars[&c[1].key], 20, "another worker's characters stay");
        }
        // The evicted text matches no more; the newest still does.
        assert_eq!(route(&p, "cccccccccccccccccccc!", &fleet(&[5, 0])), 0);
        assert_eq!(route(&p, "aaaaaaaaaa-old", &fleet(&[5, 0])), 1);
        // Long texts are linear: 10 KB twice stays fast.
        let long: String = (0..10_000).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let p = SglangCacheAware::new(Config::default());
        assert_eq!(route(&p, &long, &c), 0);
        assert_eq!(route(&p, &format!("{long} more"), &fleet(&[1, 0])), 0);
    }
}
