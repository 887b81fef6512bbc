//! The chart of `kvrelay sweep --plot`: prefix reuse (%) and tokens computed against the CPU
//! pool, one line per series (a policy, or a policy and GPU pool), as SVG or PNG.
//!
//! Drawn with plotters, with no system library: text is laid out (and, in a PNG, rasterized)
//! with an embedded subset of DejaVu Sans (`assets/`), the PNG encoded by the `png` crate.

use std::path::Path;
use std::sync::Once;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::FontStyle;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// DejaVu Sans, cut to printable ASCII and a few signs (µ, ×, dashes, …): 20 KB. Its licence
/// (Bitstream Vera's, with DejaVu's changes in the public domain) is in its name table and in
/// `assets/README.md`.
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");

/// The font family the chart's text asks for (registered as [`FONT`]).
const FAMILY: &str = "sans-serif";

/// Pixels (PNG) or user units (SVG) of the whole chart.
const SIZE: (u32, u32) = (960, 800);

/// One line per series, in the order they first appear.
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// The chart's file format.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub(crate) enum PlotFormat {
    Png,
    Svg,
}

/// One configuration's figures on the chart.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PlotPoint {
    /// The line it belongs to (its legend entry).
    pub series: String,
    pub cpu_blocks: u32,
    pub reuse_pct: f64,
    pub tokens_computed: u64,
}

/// Draws `points` into `path`: prefix reuse above, tokens computed below, CPU blocks across
/// (a log axis when the pools span 8× or more).
pub(crate) fn write(
    path: &Path,
    format: PlotFormat,
    title: &str,
    points: &[PlotPoint],
) -> Result<(), String> {
    if points.is_empty() {
        return Err("no configuration finished: nothing to draw".into());
    }
    register_font()?;
    match format {
        PlotFormat::Svg => {
            let root = SVGBackend::new(path, SIZE).into_drawing_area();
            draw(&root, title, points)?;
            root.present().map_err(|e| e.to_string())
        }
        PlotFormat::Png => {
            let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
            {
                let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
                draw(&root, title, points)?;
                root.present().map_err(|e| e.to_string())?;
            }
            write_png(path, &rgb)
        }
    }
}

/// Registers [`FONT`] once per process (plotters keeps fonts in a global table).
fn register_font() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut outcome = Ok(());
    ONCE.call_once(|| {
        outcome = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT)
            .map_err(|_| "the embedded font does not parse".to_owned());
    });
    outcome
}

fn write_png(path: &Path, rgb: &[u8]) -> Result<(), String> {
    let file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), SIZE.0, SIZE.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())
}

/// Height of the title and legend band at the top.
const HEADER: u32 = 64;

/// The whole chart on `root`: the title and a legend of the series on top, then the two panels.
fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    points: &[PlotPoint],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let (header, body) = root.split_vertically(HEADER);
    let (top, bottom) = body.split_vertically((SIZE.1 - HEADER) / 2);

    let mut series: Vec<&str> = Vec::new();
    for p in points {
        if !series.contains(&p.series.as_str()) {
            series.push(&p.series);
        }
    }
    legend(&header, title, &series).map_err(err)?;

    let mut cpus: Vec<u32> = points.iter().map(|p| p.cpu_blocks).collect();
    cpus.sort_unstable();
    cpus.dedup();
    let lo = cpus.first().copied().unwrap_or(1).max(1);
    let hi = cpus.last().copied().unwrap_or(1).max(lo);
    let ticks: Vec<f64> = cpus.iter().map(|&c| f64::from(c)).collect();
    let reuse: Vec<f64> = points.iter().map(|p| p.reuse_pct).collect();
    let computed: Vec<f64> = points.iter().map(|p| p.tokens_computed as f64).collect();
    let (reuse_range, computed_range) = (padded(&reuse), padded(&computed));
    let computed_step = (computed_range.end - computed_range.start) / 8.0;
    let panels = [
        Panel {
            area: &top,
            caption: "Prefix reuse: prompt tokens not computed (%)",
            y_range: reuse_range,
            y_label: "reuse (%)",
            value: &|p: &PlotPoint| p.reuse_pct,
            y_format: &|v: &f64| format!("{v:.1}"),
        },
        Panel {
            area: &bottom,
            caption: "Tokens computed by forward passes",
            y_range: computed_range,
            y_label: "tokens computed",
            value: &|p: &PlotPoint| p.tokens_computed as f64,
            y_format: &|v: &f64| short(*v, computed_step),
        },
    ];
    // A log axis when the pools span 8× or more (the usual doubling grids), ticks at the pools
    // swept; a linear one with plotters' ticks otherwise (its f64 axis has no formatter for
    // chosen ticks). A little room either side keeps the end points off the frame.
    let log = u64::from(hi) >= 8 * u64::from(lo);
    for panel in &panels {
        if log {
            let x = (f64::from(lo) / 1.25..f64::from(hi) * 1.25)
                .log_scale()
                .with_key_points(ticks.clone());
            panel.draw(x, &series, points, err)?;
        } else {
            let pad = (f64::from(hi - lo) * 0.06).max(1.0);
            let x = (f64::from(lo) - pad).max(0.0)..f64::from(hi) + pad;
            panel.draw(x, &series, points, err)?;
        }
    }
    Ok(())
}

/// How series `i` is drawn: lines narrower and markers smaller as `i` grows, so that lines
/// that coincide (two policies that did the same) all stay visible, one inside the other.
fn style(i: usize) -> (RGBColor, u32, u32) {
    let color = COLORS[i % COLORS.len()];
    let width = 7u32.saturating_sub(2 * i as u32).max(1);
    (color, width, width + 2)
}

/// The title, and a legend entry per series under it.
fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    series: &[&str],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let width = SIZE.0 as i32;
    let title_font = TextStyle::from((FAMILY, 20).into_font());
    let (tw, _) = area.estimate_text_size(title, &title_font)?;
    area.draw(&Text::new(
        title.to_owned(),
        ((width - tw as i32) / 2, 8),
        title_font,
    ))?;
    let font = TextStyle::from((FAMILY, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let sizes = series
        .iter()
        .map(|s| area.estimate_text_size(s, &font).map(|(w, _)| w as i32))
        .collect::<Result<Vec<i32>, _>>()?;
    let entry = |w: i32| 36 + w + 28;
    let total: i32 = sizes.iter().map(|&w| entry(w)).sum();
    let (mut x, y) = ((width - total).max(8) / 2, 46);
    for (i, (name, w)) in series.iter().zip(&sizes).enumerate() {
        let (color, stroke, radius) = style(i);
        area.draw(&PathElement::new(
            vec![(x, y), (x + 28, y)],
            color.stroke_width(stroke),
        ))?;
        area.draw(&Circle::new((x + 14, y), radius, color.filled()))?;
        area.draw(&Text::new(name.to_string(), (x + 36, y), font.clone()))?;
        x += entry(*w);
    }
    Ok(())
}

/// One of the two charts.
struct Panel<'a, DB: DrawingBackend> {
    area: &'a DrawingArea<DB, Shift>,
    caption: &'a str,
    y_range: std::ops::Range<f64>,
    y_label: &'a str,
    value: &'a dyn Fn(&PlotPoint) -> f64,
    y_format: &'a dyn Fn(&f64) -> String,
}

impl<DB: DrawingBackend> Panel<'_, DB> {
    fn draw<X>(
        &self,
        x: X,
        series: &[&str],
        points: &[PlotPoint],
        err: impl Fn(DrawingAreaErrorKind<DB::ErrorType>) -> String + Copy,
    ) -> Result<(), String>
    where
        X: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
    {
        let mut chart = ChartBuilder::on(self.area)
            .caption(self.caption, (FAMILY, 17))
            .margin(12)
            .margin_right(28)
            .x_label_area_size(44)
            .y_label_area_size(84)
            .build_cartesian_2d(x, self.y_range.clone())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("CPU pool (blocks per rank)")
            .y_desc(self.y_label)
            .x_label_formatter(&|v: &f64| format!("{v:.0}"))
            .y_label_formatter(self.y_format)
            .y_labels(8)
            .label_style((FAMILY, 13))
            .axis_desc_style((FAMILY, 14))
            .bold_line_style(RGBColor(215, 215, 215))
            .light_line_style(RGBColor(240, 240, 240))
            .draw()
            .map_err(err)?;
        for (i, name) in series.iter().enumerate() {
            let (color, stroke, radius) = style(i);
            let mut line: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.series == *name)
                .map(|p| (f64::from(p.cpu_blocks), (self.value)(p)))
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(stroke)))
                .map_err(err)?;
            chart
                .draw_series(
                    line.iter()
                        .map(|&(x, y)| Circle::new((x, y), radius, color.filled())),
                )
                .map_err(err)?;
        }
        Ok(())
    }
}

/// `values`' range with a tenth of its span either side (never below 0), or around a flat line.
fn padded(values: &[f64]) -> std::ops::Range<f64> {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() || !hi.is_finite() {
        return 0.0..1.0;
    }
    let pad = if hi > lo {
        (hi - lo) * 0.1
    } else {
        (hi.abs() * 0.05).max(1.0)
    };
    (lo - pad).max(0.0)..hi + pad
}

/// `950`, `65.5K`, `2.751M`: an axis label, with as many decimals as labels `step` apart need
/// to differ.
fn short(v: f64, step: f64) -> String {
    let (unit, suffix) = match v.abs() {
        a if a >= 1e9 => (1e9, "G"),
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e4 => (1e3, "K"),
        _ => (1.0, ""),
    };
    let step = (step / unit).abs();
    let decimals = if step > 0.0 && step < 1.0 {
        (-step.log10()).ceil().clamp(0.0, 4.0) as usize
    } else {
        0
    };
    format!("{:.decimals$}{suffix}", v / unit)
}
