//! How the report writes numbers, table cells and the files a section came from.

use std::collections::BTreeMap;
use std::path::Path;

use super::charts::Bar;

/// `mean` or `mean (lo–hi)`.
pub(super) fn cell(b: Bar, unit: impl Fn(f64) -> String) -> String {
    match b.spread {
        Some((lo, hi)) => format!("{} ({}–{})", unit(b.value), unit(lo), unit(hi)),
        None => unit(b.value),
    }
}

pub(super) fn ms(x: f64) -> String {
    format!("{x:.0}")
}

/// A number to three decimals at most, without trailing zeros (`200`, `0.1`, `2.345`).
pub(super) fn num(x: f64) -> String {
    format!("{}", (x * 1e3).round() / 1e3)
}

pub(super) fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// `path (commit c)` lines for a set of files.
pub(super) fn sources<'a>(files: impl Iterator<Item = (&'a Path, &'a str)>) -> String {
    let mut by_commit: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (path, commit) in files {
        by_commit.entry(commit).or_default().push(path.display().to_string());
    }
    by_commit
        .iter()
        .map(|(c, paths)| format!("commit `{c}`: {}", paths.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}
