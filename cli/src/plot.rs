//! Minimal SVG line plots for benchmark output (no plotting dependency).

use std::fmt::Write;

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Renders `series` as an SVG line chart with axes, ticks and a legend.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    // Text from the command line (a model path may hold `&` or `<`) is escaped for XML.
    let (title, x_label, y_label) = (xml(title), xml(x_label), xml(y_label));
    let (w, h, ml, mr, mt, mb) = (720.0, 440.0, 78.0, 190.0, 40.0, 50.0);
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 0.0f64, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 >= x1 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    // Round ticks (1, 2, 2.5 or 5 × 10^n apart), the axes stretched to the outermost ones.
    let xt = nice_ticks(x0, x1);
    let yt = nice_ticks(y0, y1);
    let (x0, x1) = (
        xt.first().map_or(x0, |t| t.0),
        xt.last().map_or(x1, |t| t.0),
    );
    let (y0, y1) = (
        yt.first().map_or(y0, |t| t.0),
        yt.last().map_or(y1, |t| t.0),
    );
    let px = |x: f64| ml + (x - x0) / (x1 - x0) * (w - ml - mr);
    let py = |y: f64| h - mb - (y - y0) / (y1 - y0) * (h - mt - mb);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{title}</text>"#,
        (ml + w - mr) / 2.0
    );
    let _ = write!(
        s,
        r#"<line x1="{ml}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{ml}" y1="{mt}" x2="{ml}" y2="{}" stroke="black"/>"#,
        h - mb,
        w - mr,
        h - mb,
        h - mb
    );
    for (xv, label) in &xt {
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{label}</text>"#,
            px(*xv),
            h - mb + 18.0,
        );
    }
    for (yv, label) in &yt {
        let _ = write!(
            s,
            r##"<text x="{}" y="{:.1}" text-anchor="end">{label}</text><line x1="{ml}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="#ddd"/>"##,
            ml - 6.0,
            py(*yv) + 4.0,
            py(*yv),
            w - mr,
            py(*yv)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text><text x="14" y="{}" text-anchor="middle" transform="rotate(-90 14 {})">{y_label}</text>"#,
        (ml + w - mr) / 2.0,
        h - 12.0,
        (mt + h - mb) / 2.0,
        (mt + h - mb) / 2.0
    );
    for (i, se) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = se
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for &(x, y) in &se.points {
            let _ = write!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = mt + 10.0 + 18.0 * i as f64;
        let _ = write!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            w - mr + 10.0,
            w - mr + 30.0,
            w - mr + 36.0,
            ly + 4.0,
            xml(&se.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn xml(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Tick values and labels covering `[lo, hi]`: four to ten ticks at a round step (1, 2, 2.5 or
/// 5 × 10^n), the first at or below `lo` and the last at or above `hi`, labelled with just the
/// decimals the step needs.
fn nice_ticks(lo: f64, hi: f64) -> Vec<(f64, String)> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo {
        return Vec::new();
    }
    let raw = (hi - lo) / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&st| st >= raw)
        .unwrap_or(10.0 * mag);
    let decimals = if step >= 1.0 {
        0
    } else {
        // 2.5 × 10^-n needs one digit more than 10^-n.
        let d = (-step.log10()).ceil() as usize;
        if ((step / 10f64.powi(-(d as i32))) - 2.5).abs() < 1e-9 {
            d + 1
        } else {
            d
        }
    };
    let first = (lo / step).floor() as i64;
    let last = (hi / step).ceil() as i64;
    (first..=last)
        .map(|i| {
            let v = i as f64 * step;
            // -0 prints as "-0": a zero tick is "0".
            let v = if v == 0.0 { 0.0 } else { v };
            (v, format!("{v:.decimals$}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn chart_contains_every_series() {
        let s = line_chart(
            "t",
            "x",
            "y",
            &[
                Series {
                    name: "a".into(),
                    points: vec![(1.0, 1.0), (2.0, 3.0)],
                },
                Series {
                    name: "b".into(),
                    points: vec![(1.0, 2.0)],
                },
            ],
        );
        assert!(s.starts_with("<svg") && s.contains(">a</text>") && s.contains(">b</text>"));
        assert_eq!(s.matches("<polyline").count(), 2);
        let odd = line_chart(
            "/m/a&b<c>.gguf",
            "x",
            "y",
            &[Series {
                name: "\"q\"".into(),
                points: vec![(1.0, 1.0)],
            }],
        );
        assert!(odd.contains("/m/a&amp;b&lt;c&gt;.gguf") && odd.contains("&quot;q&quot;"));
        assert!(!odd.contains("a&b"));
    }

    #[test]
    fn ticks_are_round_cover_the_range_and_print_short() {
        for &(lo, hi) in &[
            (0.0, 457.469),
            (5.838, 334.597),
            (0.0, 1.0),
            (0.013, 0.087),
            (-3.0, 17.0),
            (1000.0, 1001.0),
            (0.0, 0.25),
        ] {
            let t = nice_ticks(lo, hi);
            assert!((4..=11).contains(&t.len()), "{lo}..{hi}: {} ticks", t.len());
            assert!(
                t[0].0 <= lo + 1e-9 && t[t.len() - 1].0 >= hi - 1e-9,
                "{lo}..{hi}"
            );
            let step = t[1].0 - t[0].0;
            let mant = step / 10f64.powf(step.log10().floor());
            assert!(
                [1.0, 2.0, 2.5, 5.0].iter().any(|m| (mant - m).abs() < 1e-6),
                "{lo}..{hi}: step {step}"
            );
            for (v, label) in &t {
                let back: f64 = label.parse().unwrap();
                assert!((back - v).abs() < 1e-9, "{lo}..{hi}: {v} printed {label}");
                assert!(label.len() <= 7, "{label}");
            }
        }
        assert_eq!(
            nice_ticks(0.0, 457.469)
                .iter()
                .map(|t| t.1.as_str())
                .collect::<Vec<_>>(),
            ["0", "100", "200", "300", "400", "500"]
        );
        assert!(nice_ticks(1.0, 1.0).is_empty() && nice_ticks(f64::NAN, 1.0).is_empty());
    }
}
