//! SVG plots of a benchmark table: engine hit rate per policy, TTFT distribution
//! (CDF) per policy and load (share of requests) per backend, written next to the
//! table by `sim --plots DIR` and `real --out FILE`.
//!
//! plotters with only its SVG backend: no bitmap, font or image libraries (text
//! is sized by plotters' built-in estimate and drawn by the SVG viewer's fonts).

use plotters::coord::Shift;
use plotters::prelude::*;
use std::io;
use std::path::{Path, PathBuf};

const SIZE: (u32, u32) = (880, 480);

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

/// Writes `<stem>-hit-rate.svg`, `<stem>-ttft.svg` and `<stem>-load.svg` in `dir`;
/// returns their paths.
pub fn write(dir: &Path, stem: &str, title: &str, series: &[Series]) -> io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let paths: Vec<PathBuf> = ["hit-rate", "ttft", "load"]
        .iter()
        .map(|kind| dir.join(format!("{stem}-{kind}.svg")))
        .collect();
    hit_rate(
        &SVGBackend::new(&paths[0], SIZE).into_drawing_area(),
        title,
        series,
    )?;
    ttft(
        &SVGBackend::new(&paths[1], SIZE).into_drawing_area(),
        title,
        series,
    )?;
    load(
        &SVGBackend::new(&paths[2], SIZE).into_drawing_area(),
        title,
        series,
    )?;
    Ok(paths)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// One bar per policy.
fn hit_rate(root: &Area<'_>, title: &str, series: &[Series]) -> io::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let n = series.len().max(1);
    let mut chart = ChartBuilder::on(root)
        .caption(format!("engine hit rate · {title}"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..1f64)
        .map_err(err)?;
    let label = |x: &f64| {
        let i = x.round();
        match series.get(i as usize) {
            Some(s) if (x - i).abs() < 1e-9 && i >= 0.0 => s.policy.clone(),
            _ => String::new(),
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&label)
        .y_desc("cached / prompt tokens")
        .draw()
        .map_err(err)?;
    chart
        .draw_series(series.iter().enumerate().map(|(i, s)| {
            let x = i as f64;
            Rectangle::new([(x - 0.35, 0.0), (x + 0.35, s.hit_rate)], color(i).filled())
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
        let points = sorted
            .iter()
            .enumerate()
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
#[allow(
    clippy::disallowed_methods,
    reason = "tests read the written files; no shard runs here"
)]
mod tests {
    use super::*;

    /// The text of every `<text>` element.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..];
                Some(body[..body.find("</text>")?].trim().to_string())
            })
            .collect()
    }

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
        let paths = write(&dir, "docs-uniform", "docs · uniform", &series).unwrap();
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
        assert!(write(Path::new("/dev/null/plots"), "x", "x", &series).is_err());
        assert_eq!(
            slug("docs · zipf(1) (3 backends)"),
            "docs-zipf-1-3-backends"
        );
    }
}
