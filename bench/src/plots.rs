//! SVG plots of a benchmark table, written next to it: engine hit rate per policy,
//! TTFT distribution (CDF) per policy and load (share of requests) per backend
//! (`sim --plots DIR`, `real --out FILE`, `load`/`replay --plots DIR`), hit rate
//! against the swept parameter per policy (`sim --sweep ... --plots DIR`), and the
//! edge experiments' SLO attainment and goodput against load and fairness shares
//! (`sim --edge --plots DIR`).
//!
//! plotters with only its SVG backend: no bitmap, font or image libraries (text
//! is sized by plotters' built-in estimate and drawn by the SVG viewer's fonts).

use plotters::coord::Shift;
use plotters::prelude::*;
use std::io;
use std::path::{Path, PathBuf};

const SIZE: (u32, u32) = (880, 480);

/// Points drawn per TTFT distribution, at most (about).
const CDF_POINTS: usize = 1000;

/// One policy's results, as the plots need them.
#[derive(Debug, Clone)]
pub struct Series {
    pub policy: String,
    /// Prompt tokens the engines reported cached, 0-1.
    pub hit_rate: f64,
    /// TTFT of each request, milliseconds (any order).
    pub ttft_ms: Vec<f64>,
    /// Requests per backend id.
    pub per_backend: Vec<(String, u64)>,
}

impl Series {
    /// A load or replay run's results as one series: TTFT at the histogram's
    /// resolution, backends from `X-Router-Backend`, and `hit_rate` (the engines' own,
    /// when known) or else the `cached_tokens` share of the responses that reported
    /// usage.
    pub fn from_stats(label: &str, stats: &crate::report::Stats, hit_rate: Option<f64>) -> Series {
        Series {
            policy: label.to_string(),
            hit_rate: hit_rate.or(stats.cached_share()).unwrap_or(0.0),
            ttft_ms: stats
                .ttft
                .iter_recorded()
                .flat_map(|v| {
                    let ms = v.value_iterated_to() as f64 / 1e3;
                    std::iter::repeat_n(ms, v.count_at_value() as usize)
                })
                .collect(),
            per_backend: stats
                .backends
                .iter()
                .map(|(b, n)| (b.clone(), *n))
                .collect(),
        }
    }
}

/// The plots [`write`] can draw for a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plot {
    HitRate,
    Ttft,
    Load,
}

impl Plot {
    pub const ALL: [Plot; 3] = [Plot::HitRate, Plot::Ttft, Plot::Load];

    fn name(self) -> &'static str {
        match self {
            Plot::HitRate => "hit-rate",
            Plot::Ttft => "ttft",
            Plot::Load => "load",
        }
    }
}

/// One line of a line chart: its label and its (x, y) points in x order.
#[derive(Debug, Clone)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

fn err<E: std::fmt::Display>(e: E) -> io::Error {
    io::Error::other(e.to_string())
}

fn color(i: usize) -> RGBColor {
    const COLORS: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    COLORS[i % COLORS.len()]
}

/// A file-name-safe form of `title`.
pub fn slug(title: &str) -> String {
    let mut out = String::new();
    for c in title.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_string()
}

/// Writes `<stem>-<plot>.svg` in `dir` for each of `plots` (`hit-rate`, `ttft`,
/// `load`); returns their paths.
pub fn write(
    dir: &Path,
    stem: &str,
    title: &str,
    series: &[Series],
    plots: &[Plot],
) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut paths = Vec::with_capacity(plots.len());
    for plot in plots {
        let path = dir.join(format!("{stem}-{}.svg", plot.name()));
        let root = SVGBackend::new(&path, SIZE).into_drawing_area();
        match plot {
            Plot::HitRate => hit_rate(&root, title, series)?,
            Plot::Ttft => ttft(&root, title, series)?,
            Plot::Load => load(&root, title, series)?,
        }
        drop(root);
        paths.push(path);
    }
    Ok(paths)
}

/// A load or replay run's plots in `dir` as `<stem>-*.svg`: TTFT distribution, load
/// per backend (when the target named backends in `X-Router-Backend`) and hit rate
/// (when responses reported cached tokens).
pub fn write_run(
    dir: &Path,
    stem: &str,
    title: &str,
    stats: &crate::report::Stats,
) -> io::Result<Vec<PathBuf>> {
    let mut plots = vec![Plot::Ttft];
    if !stats.backends.is_empty() {
        plots.push(Plot::Load);
    }
    if stats.usage_reports > 0 {
        plots.push(Plot::HitRate);
    }
    write(
        dir,
        stem,
        title,
        &[Series::from_stats(stem, stats, None)],
        &plots,
    )
}

/// Markdown links to the plots written, or a note (also on stderr) that the plots
/// of `what` were not, so the table still prints.
pub fn linked(written: io::Result<Vec<PathBuf>>, what: &str) -> String {
    match written {
        Ok(paths) => links(&paths),
        Err(e) => {
            eprintln!("error: plots for {what} not written: {e}");
            format!("\n(plots not written: {e})\n")
        }
    }
}

/// Markdown image links to `paths`, one per line after a blank line.
pub fn links(paths: &[PathBuf]) -> String {
    let mut out = String::from("\n");
    for p in paths {
        let name = p.file_stem().and_then(|s| s.to_str()).unwrap_or("plot");
        out.push_str(&format!("![{name}]({})\n", p.display()));
    }
    out
}

/// A line chart of shares (y from 0 to 1) against `x_desc`, one line per entry of
/// `lines`, written to `path`.
pub fn lines(
    path: &Path,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    lines: &[Line],
) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let xs = || lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let (lo, hi) = (xs().fold(f64::MAX, f64::min), xs().fold(f64::MIN, f64::max));
    let (lo, hi) = if lo < hi {
        (lo, hi)
    } else {
        (lo.min(0.0), lo.max(0.0) + 1.0)
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(lo..hi, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    for (i, l) in lines.iter().enumerate() {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(l.points.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(l.label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(l.points.iter().map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// A bar chart of shares (0 to 1), one bar per `(label, value)`, written to `path`.
pub fn bars(path: &Path, caption: &str, y_desc: &str, bars: &[(String, f64)]) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    bar_chart(
        &SVGBackend::new(path, SIZE).into_drawing_area(),
        caption,
        y_desc,
        bars,
    )
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// One bar per policy.
fn hit_rate(root: &Area<'_>, title: &str, series: &[Series]) -> io::Result<()> {
    let bars: Vec<(String, f64)> = series
        .iter()
        .map(|s| (s.policy.clone(), s.hit_rate))
        .collect();
    bar_chart(
        root,
        &format!("engine hit rate · {title}"),
        "cached / prompt tokens",
        &bars,
    )
}

fn bar_chart(
    root: &Area<'_>,
    caption: &str,
    y_desc: &str,
    bars: &[(String, f64)],
) -> io::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let n = bars.len().max(1);
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..1f64)
        .map_err(err)?;
    let label = |x: &f64| {
        let i = x.round();
        match bars.get(i as usize) {
            Some((l, _)) if (x - i).abs() < 1e-9 && i >= 0.0 => l.clone(),
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&label)
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let x = i as f64;
            Rectangle::new([(x - 0.35, 0.0), (x + 0.35, *v)], color(i).filled())
        }))
        .map_err(err)?;
    root.present().map_err(err)
}

/// TTFT cumulative distribution, one line per policy.
fn ttft(root: &Area<'_>, title: &str, series: &[Series]) -> io::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let max = series
        .iter()
        .flat_map(|s| s.ttft_ms.iter().copied())
        .fold(0f64, f64::max)
        .max(1e-3);
    let mut chart = ChartBuilder::on(root)
        .caption(format!("TTFT distribution · {title}"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..max * 1.02, 0f64..1f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms)")
        .y_desc("share of requests")
        .draw()
        .map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let mut sorted = s.ttft_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len().max(1) as f64;
        // At most about CDF_POINTS points (and always the last): a long load run's
        // every request would make a path of megabytes.
        let step = sorted.len().div_ceil(CDF_POINTS).max(1);
        let last = sorted.len().saturating_sub(1);
        let points = sorted
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k == last)
            .map(|(k, v)| (*v, (k + 1) as f64 / n));
        let c = color(i);
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))
            .map_err(err)?
            .label(s.policy.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Share of requests per backend, bars grouped by backend, one color per policy.
fn load(root: &Area<'_>, title: &str, series: &[Series]) -> io::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let backends: Vec<String> = series
        .first()
        .map(|s| s.per_backend.iter().map(|(b, _)| b.clone()).collect())
        .unwrap_or_default();
    let nb = backends.len().max(1);
    let mut chart = ChartBuilder::on(root)
        .caption(format!("load per backend · {title}"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..nb as f64 - 0.5, 0f64..1f64)
        .map_err(err)?;
    let label = |x: &f64| {
        let i = x.round();
        match backends.get(i as usize) {
            Some(b) if (x - i).abs() < 1e-9 && i >= 0.0 => b.clone(),
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(nb)
        .x_label_formatter(&label)
        .y_desc("share of requests")
        .draw()
        .map_err(err)?;
    let width = 0.8 / series.len().max(1) as f64;
    for (p, s) in series.iter().enumerate() {
        let total = s.per_backend.iter().map(|(_, n)| n).sum::<u64>().max(1) as f64;
        let c = color(p);
        chart
            .draw_series(s.per_backend.iter().enumerate().map(|(b, (_, n))| {
                let left = b as f64 - 0.4 + p as f64 * width;
                Rectangle::new(
                    [(left, 0.0), (left + width * 0.9, *n as f64 / total)],
                    c.filled(),
                )
            }))
            .map_err(err)?
            .label(s.policy.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
/// The text of every `<text>` element of an SVG written here (for tests).
pub(crate) fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            Some(body[..body.find("</text>")?].trim().to_string())
        })
        .collect()
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "tests read the written files; no shard runs here"
)]
mod tests {
    use super::*;

    #[test]
    fn writes_three_svgs_with_every_policy() {
        let dir = std::env::temp_dir().join(format!("radixgate-plots-{}", std::process::id()));
        let series: Vec<Series> = ["prefix_aware", "round_robin"]
            .iter()
            .enumerate()
            .map(|(i, p)| Series {
                policy: p.to_string(),
                hit_rate: 0.8 - i as f64 * 0.5,
                ttft_ms: (1..=50).map(|k| k as f64 * (i + 1) as f64).collect(),
                per_backend: vec![("e0".into(), 10 + i as u64), ("e1".into(), 20)],
            })
            .collect();
        let paths = write(&dir, "docs-uniform", "docs · uniform", &series, &Plot::ALL).unwrap();
        assert_eq!(paths.len(), 3);
        for p in &paths {
            let svg = std::fs::read_to_string(p).unwrap();
            assert!(svg.starts_with("<svg"), "{}", p.display());
            assert!(svg.trim_end().ends_with("</svg>"));
        }
        let hit = texts(&std::fs::read_to_string(&paths[0]).unwrap());
        for want in [
            "prefix_aware",
            "round_robin",
            "engine hit rate · docs · uniform",
        ] {
            assert!(hit.iter().any(|t| t == want), "{want} not in {hit:?}");
        }
        let ttft = texts(&std::fs::read_to_string(&paths[1]).unwrap());
        assert!(ttft.iter().any(|t| t == "TTFT (ms)"), "{ttft:?}");
        let load = texts(&std::fs::read_to_string(&paths[2]).unwrap());
        for want in ["e0", "e1", "prefix_aware"] {
            assert!(load.iter().any(|t| t == want), "{want} not in {load:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
        // A directory that cannot be made is an error, not a panic.
        assert!(write(Path::new("/dev/null/plots"), "x", "x", &series, &Plot::ALL).is_err());
        assert_eq!(
            slug("docs · zipf(1) (3 backends)"),
            "docs-zipf-1-3-backends"
        );
    }
}
