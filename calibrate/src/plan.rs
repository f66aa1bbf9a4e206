//! Which prompts to send: a grid of cached and uncached lengths, made of fresh tokens.
//!
//! Every probe is `prefix + suffix`: `c` cached tokens, then `u` tokens the
//! engine has never seen. A group shares one prefix: it is sent alone first
//! (so the engine caches it), then each of the group's probes follows with
//! its own fresh suffix. A group without a prefix (`c = 0`) sends its probes
//! straight away. Repeats get new prefixes, so no probe finds more cached
//! than its own group's prefix. Token ids are drawn from a seeded RNG within
//! a range every common vocabulary holds, and a different seed gives prompts
//! no earlier run can have left in the cache.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Lengths to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grid {
    /// Cached prefix lengths, tokens.
    pub cached: Vec<usize>,
    /// Fresh suffix lengths, tokens.
    pub uncached: Vec<usize>,
    /// Times each grid point is probed.
    pub repeats: usize,
    /// Unmeasured requests sent first: an engine's first requests are slow (allocation, compilation).
    pub warmup: usize,
}

impl Default for Grid {
    fn default() -> Self {
        Self { cached: vec![0, 512, 1024, 2048, 4096], uncached: vec![16, 256, 1024, 2048], repeats: 2, warmup: 4 }
    }
}

/// Token ids probes are made of, `lo..hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRange {
    /// Smallest id used.
    pub lo: u32,
    /// One past the largest id used.
    pub hi: u32,
}

impl Default for TokenRange {
    /// Clear of the special tokens at the start of most vocabularies and
    /// inside the smallest common ones (32,000 ids).
    fn default() -> Self {
        Self { lo: 1000, hi: 30_000 }
    }
}

/// One probe prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Tokens the plan expects cached: its group's prefix.
    pub cached: usize,
    /// Tokens the plan expects computed: the fresh suffix.
    pub uncached: usize,
    /// The whole prompt, prefix then suffix.
    pub prompt: Vec<u32>,
}

/// Probes that share one cached prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Sent alone before the probes; empty for uncached probes.
    pub prefix: Vec<u32>,
    /// The probes, each `prefix` plus fresh tokens.
    pub probes: Vec<Probe>,
}

/// Every prompt of a calibration run, in sending order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Unmeasured prompts sent first, each fresh and as long as the longest probe that fits.
    pub warmup: Vec<Vec<u32>>,
    /// Groups in order.
    pub groups: Vec<Group>,
    /// Grid points left out because prompt and one output token exceed the context, as (cached, uncached).
    pub skipped: Vec<(usize, usize)>,
}

impl Plan {
    /// Probes in the plan.
    pub fn probes(&self) -> usize {
        self.groups.iter().map(|g| g.probes.len()).sum()
    }

    /// Requests the plan sends: probes and prefixes.
    pub fn requests(&self) -> usize {
        self.warmup.len() + self.probes() + self.groups.iter().filter(|g| !g.prefix.is_empty()).count()
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No lengths, no repeats, or a zero uncached length.
    #[error("the grid needs at least one cached length, one uncached length (each at least 1) and one repeat")]
    EmptyGrid,
    /// The token range is empty.
    #[error("token id range {lo}..{hi} is empty")]
    EmptyTokenRange {
        /// Smallest id.
        lo: u32,
        /// One past the largest.
        hi: u32,
    },
    /// Fewer than three grid points fit the context.
    #[error("only {usable} grid points fit a context of {max_model_len} tokens; at least 3 are needed")]
    TooFewPoints {
        /// Points that fit.
        usable: usize,
        /// The engine's context length.
        max_model_len: usize,
    },
}

/// Lays out the probes of `grid` for an engine with context `max_model_len`.
pub fn plan(grid: &Grid, max_model_len: usize, tokens: TokenRange, seed: u64) -> Result<Plan, PlanError> {
    if grid.cached.is_empty() || grid.uncached.is_empty() || grid.repeats == 0 || grid.uncached.contains(&0) {
        return Err(PlanError::EmptyGrid);
    }
    if tokens.lo >= tokens.hi {
        return Err(PlanError::EmptyTokenRange { lo: tokens.lo, hi: tokens.hi });
    }
    let mut cached = grid.cached.clone();
    cached.sort_unstable();
    cached.dedup();
    let mut uncached = grid.uncached.clone();
    uncached.sort_unstable();
    uncached.dedup();
    // One output token must fit after the prompt.
    let fits = |c: usize, u: usize| c + u < max_model_len;
    let skipped: Vec<(usize, usize)> =
        cached.iter().flat_map(|&c| uncached.iter().map(move |&u| (c, u))).filter(|&(c, u)| !fits(c, u)).collect();
    let usable = cached.len() * uncached.len() - skipped.len();
    if usable < 3 {
        return Err(PlanError::TooFewPoints { usable, max_model_len });
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut fresh = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(tokens.lo..tokens.hi)).collect() };
    let longest = cached.iter().flat_map(|&c| uncached.iter().map(move |&u| (c, u))).filter(|&(c, u)| fits(c, u)).map(|(c, u)| c + u).max();
    let warmup = (0..grid.warmup).map(|_| fresh(longest.unwrap_or(1))).collect();
    let mut groups = Vec::new();
    for _ in 0..grid.repeats {
        for &c in &cached {
            let sizes: Vec<usize> = uncached.iter().copied().filter(|&u| fits(c, u)).collect();
            if sizes.is_empty() {
                continue;
            }
            let prefix = fresh(c);
            let probes = sizes
                .into_iter()
                .map(|u| {
                    let mut prompt = prefix.clone();
                    prompt.extend(fresh(u));
                    Probe { cached: c, uncached: u, prompt }
                })
                .collect();
            groups.push(Group { prefix, probes });
        }
    }
    Ok(Plan { warmup, groups, skipped })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn probes_share_their_prefix_and_nothing_else() {
        let grid = Grid { cached: vec![0, 64], uncached: vec![8, 16], repeats: 2, warmup: 1 };
        let p = match plan(&grid, 1000, TokenRange::default(), 7) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(p.groups.len(), 4);
        assert_eq!(p.probes(), 8);
        assert_eq!(p.requests(), 11, "8 probes, 2 prefixes and a warm-up");
        assert_eq!(p.warmup.iter().map(Vec::len).collect::<Vec<_>>(), [80], "as long as the longest probe");
        for g in &p.groups {
            for probe in &g.probes {
                assert_eq!(probe.prompt.len(), probe.cached + probe.uncached);
                assert_eq!(&probe.prompt[..probe.cached], &g.prefix[..]);
            }
        }
        // Fresh tokens: no two probes start with the same 8 tokens after their prefix.
        let starts: HashSet<&[u32]> = p.groups.iter().flat_map(|g| g.probes.iter().map(|p| &p.prompt[p.cached..p.cached + 8])).collect();
        assert_eq!(starts.len(), 8);
        assert!(p.groups.iter().flat_map(|g| g.probes.iter()).flat_map(|p| p.prompt.iter()).all(|t| (1000..30_000).contains(t)));
    }

    #[test]
    fn the_seed_decides_the_tokens() {
        let g = Grid::default();
        let a = plan(&g, 32768, TokenRange::default(), 1);
        assert_eq!(a, plan(&g, 32768, TokenRange::default(), 1));
        assert_ne!(a, plan(&g, 32768, TokenRange::default(), 2));
    }

    #[test]
    fn points_past_the_context_are_skipped() {
        let p = match plan(&Grid::default(), 4096, TokenRange::default(), 0) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
        assert!(p.skipped.contains(&(4096, 16)) && p.skipped.contains(&(2048, 2048)) && !p.skipped.contains(&(2048, 1024)));
        assert!(p.groups.iter().flat_map(|g| g.probes.iter()).all(|p| p.prompt.len() < 4096));
        assert_eq!(plan(&Grid::default(), 20, TokenRange::default(), 0), Err(PlanError::TooFewPoints { usable: 1, max_model_len: 20 }));
        assert_eq!(plan(&Grid { repeats: 0, ..Grid::default() }, 4096, TokenRange::default(), 0), Err(PlanError::EmptyGrid));
    }
}
