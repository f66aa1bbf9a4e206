//! The solver against the definition: the best of every passive set's
//! unconstrained solution that stays non-negative.

use super::*;
use proptest::prelude::*;

fn residual(rows: &[Vec<f64>], y: &[f64], x: &[f64]) -> f64 {
    rows.iter().zip(y).map(|(r, yi)| (r.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() - yi).powi(2)).sum::<f64>().sqrt()
}

/// Brute force over all 2^n passive sets; fine for n <= 4.
fn reference(rows: &[Vec<f64>], y: &[f64]) -> Vec<f64> {
    let n = rows[0].len();
    let mut best = vec![0.0; n];
    let mut best_r = residual(rows, y, &best);
    for mask in 1..(1u32 << n) {
        let cols: Vec<usize> = (0..n).filter(|j| mask & (1 << j) != 0).collect();
        let s = solve_on(rows, y, &cols);
        if s.iter().any(|&v| v < 0.0) {
            continue;
        }
        let mut x = vec![0.0; n];
        for (&j, &v) in cols.iter().zip(&s) {
            x[j] = v;
        }
        let r = residual(rows, y, &x);
        if r < best_r {
            best_r = r;
            best = x;
        }
    }
    best
}

#[test]
fn recovers_an_exact_non_negative_solution() {
    let rows: Vec<Vec<f64>> = (1..=6).map(|i| vec![f64::from(i), f64::from(i * i), 1.0]).collect();
    let truth = [0.5, 0.25, 2.0];
    let y: Vec<f64> = rows.iter().map(|r| r.iter().zip(&truth).map(|(a, b)| a * b).sum()).collect();
    let x = match nnls(&rows, &y) {
        Ok(x) => x,
        Err(e) => panic!("{e}"),
    };
    for (got, want) in x.iter().zip(&truth) {
        assert!((got - want).abs() < 1e-9, "{x:?}");
    }
}

#[test]
fn a_column_that_wants_to_be_negative_is_pinned_at_zero() {
    // y = 2 u - 3: the intercept would be negative.
    let rows: Vec<Vec<f64>> = (1..=8).map(|i| vec![f64::from(i), 1.0]).collect();
    let y: Vec<f64> = (1..=8).map(|i| 2.0 * f64::from(i) - 3.0).collect();
    let x = match nnls(&rows, &y) {
        Ok(x) => x,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(x[1], 0.0);
    // The slope through the origin: sum(u y) / sum(u^2).
    let want = (1..=8).map(|i| f64::from(i) * (2.0 * f64::from(i) - 3.0)).sum::<f64>() / (1..=8).map(|i| f64::from(i * i)).sum::<f64>();
    assert!((x[0] - want).abs() < 1e-12, "{x:?} vs {want}");
}

#[test]
fn bad_shapes_are_refused() {
    assert_eq!(nnls(&[], &[]), Err(NnlsError::Shape));
    assert_eq!(nnls(&[vec![1.0], vec![1.0, 2.0]], &[1.0, 2.0]), Err(NnlsError::Shape));
    assert_eq!(nnls(&[vec![1.0]], &[1.0, 2.0]), Err(NnlsError::Targets { rows: 1, targets: 2 }));
    assert_eq!(nnls(&[vec![f64::NAN]], &[1.0]), Err(NnlsError::NonFinite));
}

#[test]
fn all_zero_targets_give_zero() {
    let rows = vec![vec![1.0, 2.0], vec![3.0, 1.0], vec![0.5, 0.5]];
    assert_eq!(nnls(&rows, &[0.0; 3]), Ok(vec![0.0, 0.0]));
}

proptest! {
    #[test]
    fn matches_the_brute_force_optimum(
        m in 3usize..12,
        n in 1usize..4,
        seed in proptest::collection::vec(-10.0f64..10.0, 48),
        ys in proptest::collection::vec(-10.0f64..10.0, 12),
    ) {
        let rows: Vec<Vec<f64>> = (0..m).map(|i| (0..n).map(|j| seed[i * 4 + j]).collect()).collect();
        let y = &ys[..m];
        let x = nnls(&rows, y).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(x.iter().all(|&v| v >= 0.0), "{x:?}");
        let want = reference(&rows, y);
        let (got_r, want_r) = (residual(&rows, y, &x), residual(&rows, y, &want));
        prop_assert!(got_r <= want_r * (1.0 + 1e-9) + 1e-9, "nnls {x:?} ({got_r}) vs reference {want:?} ({want_r})");
    }
}
