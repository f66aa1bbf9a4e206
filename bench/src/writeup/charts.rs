//! PNG charts with plotters' bitmap backend: grouped bars (with the spread
//! across repetitions as a whisker) and cumulative distributions. Text is
//! drawn with a TTF file registered once at run time (`just setup` installs
//! DejaVu Sans into `.cache/fonts`), so no system fonts are needed.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Every chart's size, pixels.
pub const SIZE: (u32, u32) = (960, 540);

/// Width of the bar charts' legend, beside the plot, pixels.
const LEGEND_WIDTH: u32 = 190;

/// Registers the font file at `path` as plotters' `sans-serif`, once per
/// process (a later call with another path keeps the first font).
pub fn register_font(path: &Path) -> anyhow::Result<()> {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    if REGISTERED.get().is_some() {
        return Ok(());
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading the font {} (run `just setup`)", path.display()))?;
    // plotters keeps fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{} is not a font plotters can read", path.display()))?;
    let _ = REGISTERED.set(());
    Ok(())
}

/// One bar: a value and, when repeated, the lowest and highest repetition.
#[derive(Debug, Clone, Copy)]
pub struct Bar {
    pub value: f64,
    pub spread: Option<(f64, f64)>,
}

/// Bars in groups along the x axis, one colour per series; a missing bar is
/// left out.
pub struct Bars<'a> {
    pub title: &'a str,
    pub y_label: &'a str,
    pub groups: Vec<String>,
    pub series: Vec<String>,
    /// `values[group][series]`.
    pub values: Vec<Vec<Option<Bar>>>,
}

fn colour(i: usize) -> RGBColor {
    // Twelve: one for each contender of the full comparison.
    const PALETTE: [RGBColor; 12] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
        RGBColor(0, 0, 0),
        RGBColor(174, 199, 232),
    ];
    PALETTE[i % PALETTE.len()]
}

fn drawing_error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {e}")
}

/// Draws `bars` to the PNG `out`.
pub fn bars(out: &Path, bars: &Bars) -> anyhow::Result<()> {
    anyhow::ensure!(!bars.groups.is_empty() && !bars.series.is_empty(), "{}: nothing to draw", bars.title);
    let top = bars.values.iter().flatten().flatten().map(|b| b.spread.map_or(b.value, |(_, hi)| hi.max(b.value))).fold(0.0f64, f64::max);
    // A little room above the tallest bar.
    let top = if top > 0.0 { top * 1.1 } else { 1.0 };
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(drawing_error)?;
    // The legend goes beside the plot, one row per series, so it never covers a bar.
    let (plot, side) = root.split_horizontally(SIZE.0 - LEGEND_WIDTH);
    for (s, name) in bars.series.iter().enumerate() {
        let y = 48 + s as i32 * 22;
        side.draw(&Rectangle::new([(4, y), (18, y + 14)], colour(s).filled())).map_err(drawing_error)?;
        side.draw(&Text::new(name.clone(), (24, y - 1), ("sans-serif", 15).into_font())).map_err(drawing_error)?;
    }
    let n = bars.groups.len();
    let mut chart = ChartBuilder::on(&plot)
        .caption(bars.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)
        .map_err(drawing_error)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(bars.y_label)
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(drawing_error)?;
    let width = 0.8 / bars.series.len() as f64;
    for s in 0..bars.series.len() {
        let c = colour(s);
        let mut rects = Vec::new();
        let mut whiskers = Vec::new();
        for (g, row) in bars.values.iter().enumerate() {
            let Some(Some(bar)) = row.get(s) else { continue };
            let x0 = g as f64 + 0.1 + s as f64 * width;
            rects.push(Rectangle::new([(x0, 0.0), (x0 + width * 0.9, bar.value)], c.filled()));
            if let Some((lo, hi)) = bar.spread {
                let mid = x0 + width * 0.45;
                whiskers.push(PathElement::new(vec![(mid, lo), (mid, hi)], BLACK.stroke_width(2)));
            }
        }
        chart.draw_series(rects).map_err(drawing_error)?;
        chart.draw_series(whiskers).map_err(drawing_error)?;
    }
    // Group names under the axis, centred under their bars; many groups take two rows.
    let font = TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in bars.groups.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let row = if n > 8 { (g % 2) as i32 * 16 } else { 0 };
        root.draw(&Text::new(name.clone(), (x, y + 6 + row), font.clone())).map_err(drawing_error)?;
    }
    root.present().map_err(drawing_error)?;
    Ok(())
}

/// Cumulative distributions of samples, one line each, on a log x axis.
pub struct Cdf<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    /// Name and sorted sample (or quantile points as (value, share)).
    pub lines: Vec<(String, Vec<(f64, f64)>)>,
}

/// Draws `cdf` to the PNG `out`.
pub fn cdf(out: &Path, cdf: &Cdf) -> anyhow::Result<()> {
    let xs = || cdf.lines.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x)).filter(|x| *x > 0.0);
    let (lo, hi) = (xs().fold(f64::INFINITY, f64::min), xs().fold(0.0f64, f64::max));
    anyhow::ensure!(lo.is_finite() && hi > 0.0, "{}: no positive values to draw", cdf.title);
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(drawing_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(cdf.title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)
        .map_err(drawing_error)?;
    // Few whole-number ticks: a log axis otherwise crowds its labels into one another.
    chart
        .configure_mesh()
        .x_desc(cdf.x_label)
        .y_desc("share of requests")
        .x_labels(6)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(drawing_error)?;
    for (i, (name, points)) in cdf.lines.iter().enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(points.iter().copied().filter(|(x, _)| *x > 0.0), c.stroke_width(2)))
            .map_err(drawing_error)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(drawing_error)?;
    root.present().map_err(drawing_error)?;
    Ok(())
}
