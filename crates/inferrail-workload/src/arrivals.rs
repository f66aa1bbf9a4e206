//! Seeded Poisson arrivals: exponential gaps at a given rate, the schedule
//! every open-loop sender (the harness's, the fleet simulation's) follows.

use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;

/// The next exponential gap, in seconds, at `rate` arrivals per second.
pub fn gap(rng: &mut StdRng, rate: f64) -> f64 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    -u.ln() / rate
}

/// Poisson arrival times (offsets from the start) at `rate` per second
/// before `secs`, drawn from `rng`.
pub fn poisson(rng: &mut StdRng, rate: f64, secs: f64) -> Vec<Duration> {
    let mut t = 0.0;
    let mut out = Vec::with_capacity((rate * secs * 1.1).max(0.0) as usize);
    if rate <= 0.0 {
        return out;
    }
    loop {
        t += gap(rng, rate);
        if t >= secs {
            return out;
        }
        out.push(Duration::from_secs_f64(t));
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn the_schedule_has_the_asked_rate_and_replays_from_its_seed() {
        let draw = |seed| poisson(&mut StdRng::seed_from_u64(seed), 1000.0, 10.0);
        let s = draw(3);
        assert!((9_700..10_300).contains(&s.len()), "{}", s.len());
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(s, draw(3));
        assert_ne!(s, draw(4));
    }

    #[test]
    fn gaps_are_exponential_mean_one_over_rate_and_coefficient_of_variation_one() {
        let mut rng = StdRng::seed_from_u64(11);
        let rate = 4.0;
        let gaps: Vec<f64> = (0..20_000).map(|_| gap(&mut rng, rate)).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (gaps.len() - 1) as f64;
        let cv = var.sqrt() / mean;
        assert!((mean * rate - 1.0).abs() < 0.05, "mean {mean}");
        assert!((cv - 1.0).abs() < 0.05, "cv {cv}");
        assert!(gaps.iter().all(|&g| g > 0.0));
    }
}
