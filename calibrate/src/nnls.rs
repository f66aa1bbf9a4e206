//! Non-negative least squares: minimise `|A x - y|` subject to `x >= 0`.
//!
//! Lawson and Hanson's active-set method (*Solving Least Squares Problems*,
//! 1974, chapter 23). Columns start in the active set, pinned at zero; the
//! column whose gradient most wants to grow joins the passive set, the
//! unconstrained problem over the passive set is solved, and any passive
//! variable that would turn negative is walked back to zero and returned to
//! the active set. The sub-problems are solved by Householder QR rather than
//! normal equations, so conditioning is not squared. Meant for the handful of
//! columns the cost model has; every step is dense and allocates freely.

/// Why a problem could not be solved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NnlsError {
    /// The matrix has no rows, no columns, or rows of different lengths.
    #[error("the design matrix is empty or ragged")]
    Shape,
    /// `y` has a different number of entries than `A` has rows.
    #[error("{rows} rows but {targets} targets")]
    Targets {
        /// Rows of `A`.
        rows: usize,
        /// Entries of `y`.
        targets: usize,
    },
    /// An entry of `A` or `y` is NaN or infinite.
    #[error("the problem has a non-finite entry")]
    NonFinite,
}

/// Solves `min |A x - y|` over `x >= 0`; `rows` are the rows of `A`.
pub fn nnls(rows: &[Vec<f64>], y: &[f64]) -> Result<Vec<f64>, NnlsError> {
    let n = rows.first().map(Vec::len).unwrap_or(0);
    if n == 0 || rows.iter().any(|r| r.len() != n) {
        return Err(NnlsError::Shape);
    }
    if rows.len() != y.len() {
        return Err(NnlsError::Targets { rows: rows.len(), targets: y.len() });
    }
    if rows.iter().flatten().chain(y).any(|v| !v.is_finite()) {
        return Err(NnlsError::NonFinite);
    }
    // A gradient entry this small is rounding noise, not a direction.
    let amax = rows.iter().flatten().map(|v| v.abs()).fold(0.0, f64::max);
    let tol = 1e-10 * amax * norm(y) * (rows.len() as f64).sqrt();

    let mut x = vec![0.0; n];
    let mut passive = vec![false; n];
    for _ in 0..3 * n + 3 {
        let w = gradient(rows, y, &x);
        let Some(t) = (0..n).filter(|&j| !passive[j] && w[j] > tol).max_by(|&i, &j| w[i].total_cmp(&w[j])) else { break };
        passive[t] = true;
        // Inner loop: step towards the passive set's unconstrained optimum,
        // stopping at the first variable that would cross zero.
        for _ in 0..3 * n + 3 {
            let cols: Vec<usize> = (0..n).filter(|&j| passive[j]).collect();
            let s = solve_on(rows, y, &cols);
            if cols.iter().zip(&s).all(|(_, &v)| v > 0.0) {
                x = vec![0.0; n];
                for (&j, &v) in cols.iter().zip(&s) {
                    x[j] = v;
                }
                break;
            }
            // The first passive variable to reach zero on the way to s.
            let Some((hit, alpha)) =
                cols.iter().zip(&s).filter(|(_, v)| **v <= 0.0).map(|(&j, &v)| (j, x[j] / (x[j] - v))).min_by(|p, q| p.1.total_cmp(&q.1))
            else {
                break;
            };
            let alpha = alpha.clamp(0.0, 1.0);
            let mut full = vec![0.0; n];
            for (&j, &v) in cols.iter().zip(&s) {
                full[j] = v;
            }
            for j in 0..n {
                x[j] += alpha * (full[j] - x[j]);
                if passive[j] && (j == hit || x[j] <= 0.0) {
                    x[j] = 0.0;
                    passive[j] = false;
                }
            }
            if !passive.iter().any(|&p| p) {
                break;
            }
        }
    }
    Ok(x)
}

/// `Aᵀ (y - A x)`: how much each column would reduce the residual.
fn gradient(rows: &[Vec<f64>], y: &[f64], x: &[f64]) -> Vec<f64> {
    let mut w = vec![0.0; x.len()];
    for (r, &yi) in rows.iter().zip(y) {
        let res = yi - r.iter().zip(x).map(|(a, b)| a * b).sum::<f64>();
        for (wj, aj) in w.iter_mut().zip(r) {
            *wj += aj * res;
        }
    }
    w
}

/// Unconstrained least squares over the columns `cols` of `A`, by Householder QR.
/// A column that is (numerically) dependent on earlier ones gets zero.
pub fn solve_on(rows: &[Vec<f64>], y: &[f64], cols: &[usize]) -> Vec<f64> {
    let m = rows.len();
    let k = cols.len();
    // Column-major copy of the chosen columns, and a copy of y.
    let mut a: Vec<Vec<f64>> = cols.iter().map(|&j| rows.iter().map(|r| r[j]).collect()).collect();
    let mut b = y.to_vec();
    let norms: Vec<f64> = a.iter().map(|c| norm(c)).collect();
    let mut diag = vec![0.0; k];
    for j in 0..k.min(m) {
        let alpha = norm(&a[j][j..]);
        if alpha <= 1e-13 * norms[j].max(f64::MIN_POSITIVE) {
            continue;
        }
        let alpha = if a[j][j] > 0.0 { -alpha } else { alpha };
        // v = x - alpha e1, kept in a[j][j..]; R's diagonal entry is alpha.
        a[j][j] -= alpha;
        let vnorm2: f64 = a[j][j..].iter().map(|v| v * v).sum();
        diag[j] = alpha;
        if vnorm2 == 0.0 {
            continue;
        }
        let (head, tail) = a.split_at_mut(j + 1);
        let v = &head[j][j..];
        for col in tail.iter_mut() {
            reflect(v, vnorm2, &mut col[j..]);
        }
        reflect(v, vnorm2, &mut b[j..]);
    }
    // Back substitution on R (upper triangle of a, diagonal in diag).
    let mut s = vec![0.0; k];
    for j in (0..k.min(m)).rev() {
        if diag[j] == 0.0 {
            continue;
        }
        let mut acc = b[j];
        for (l, sl) in s.iter().enumerate().skip(j + 1) {
            acc -= a[l][j] * sl;
        }
        s[j] = acc / diag[j];
    }
    s
}

/// Applies `I - 2 v vᵀ / |v|²` to `x`.
fn reflect(v: &[f64], vnorm2: f64, x: &mut [f64]) {
    let dot: f64 = v.iter().zip(x.iter()).map(|(a, b)| a * b).sum();
    let f = 2.0 * dot / vnorm2;
    for (xi, vi) in x.iter_mut().zip(v) {
        *xi -= f * vi;
    }
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

#[cfg(test)]
mod tests;
