//! A decaying count-min sketch: how much of something (here, requests for
//! a root prefix) was asked for recently, and of everything together.
//!
//! `DEPTH` rows of `WIDTH` counters; an item adds its amount to one counter
//! per row, chosen by an independent hash, and its estimate is the smallest
//! of its counters, so it never underestimates (collisions only add). Every
//! counter decays exponentially with the same half-life: decay is applied to
//! the whole table lazily, at most once per eighth of a half-life, so
//! estimates stay upper bounds of the decayed true sums at any time (they
//! are read as of the last decay, at most an eighth of a half-life early).
//! Time is passed in.

use std::time::Duration;

const DEPTH: usize = 4;
const WIDTH: usize = 1024;

/// See the module doc.
#[derive(Debug, Clone)]
pub struct Sketch {
    rows: Vec<[f64; WIDTH]>,
    half_life: f64,
    /// When the table last decayed, seconds.
    decayed_at: f64,
    /// The decayed sum of every amount added, as of the last decay (exact: one row's sum).
    total: f64,
}

fn slot(item: u128, row: usize) -> usize {
    let seed = [0x9e37_79b9_7f4a_7c15u64, 0xc2b2_ae3d_27d4_eb4f, 0x1656_67b1_9e37_79f9, 0x27d4_eb2f_1656_67c5][row];
    let mut z = (item as u64 ^ seed).wrapping_add(((item >> 64) as u64).wrapping_mul(seed | 1));
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    z = (z ^ (z >> 33)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    ((z ^ (z >> 33)) % WIDTH as u64) as usize
}

impl Sketch {
    /// An empty sketch whose counts halve every `half_life`.
    pub fn new(half_life: Duration) -> Self {
        Self { rows: vec![[0.0; WIDTH]; DEPTH], half_life: half_life.as_secs_f64().max(1e-3), decayed_at: 0.0, total: 0.0 }
    }

    fn decay_to(&mut self, now: Duration) {
        let now = now.as_secs_f64();
        let elapsed = now - self.decayed_at;
        if elapsed < self.half_life / 8.0 {
            return;
        }
        let factor = 0.5f64.powf(elapsed / self.half_life);
        for row in &mut self.rows {
            for v in row.iter_mut() {
                *v *= factor;
            }
        }
        self.total *= factor;
        self.decayed_at = now;
    }

    /// Adds `amount` of `item` at `now`.
    pub fn add(&mut self, item: u128, amount: f64, now: Duration) {
        self.decay_to(now);
        // Counters hold values as of the last decay: an amount added since
        // counts more there, so that the next decay leaves it right.
        let amount = amount * 2f64.powf((now.as_secs_f64() - self.decayed_at) / self.half_life);
        for (r, row) in self.rows.iter_mut().enumerate() {
            row[slot(item, r)] += amount;
        }
        self.total += amount;
    }

    /// The decayed sum of every item as of the last decay.
    pub fn total(&self) -> f64 {
        self.total
    }

    /// The decayed amount of `item` as of the last decay, never below the truth.
    pub fn estimate(&self, item: u128) -> f64 {
        self.rows.iter().enumerate().map(|(r, row)| row[slot(item, r)]).fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn never_underestimates_the_decayed_true_sum(
            adds in proptest::collection::vec((0u128..3000, 0.0f64..5.0, 0u64..400), 1..400),
        ) {
            let mut s = Sketch::new(Duration::from_secs(10));
            let mut truth: std::collections::HashMap<u128, (f64, f64)> = Default::default();
            let mut now = 0u64;
            for (item, amount, step_ms) in adds {
                now += step_ms;
                let t = Duration::from_millis(now);
                s.add(item, amount, t);
                let e = truth.entry(item).or_insert((0.0, 0.0));
                // Exact decay of the true sum since its last update.
                e.0 = e.0 * 0.5f64.powf((t.as_secs_f64() - e.1) / 10.0) + amount;
                e.1 = t.as_secs_f64();
                for (&k, &(v, at)) in &truth {
                    let exact = v * 0.5f64.powf((t.as_secs_f64() - at) / 10.0);
                    prop_assert!(s.estimate(k) >= exact * (1.0 - 1e-9) - 1e-12, "item {k}: {} < {exact}", s.estimate(k));
                }
            }
        }
    }

    #[test]
    fn counts_decay_by_half_each_half_life_and_items_stay_apart() {
        let mut s = Sketch::new(Duration::from_secs(10));
        s.add(1, 8.0, Duration::ZERO);
        s.add(2, 1.0, Duration::ZERO);
        assert_eq!(s.estimate(1), 8.0);
        assert_eq!(s.estimate(2), 1.0);
        s.add(3, 0.0, Duration::from_secs(20));
        assert!((s.estimate(1) - 2.0).abs() < 1e-9);
    }
}
