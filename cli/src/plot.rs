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
    let (w, h, ml, mr, mt, mb) = (720.0, 440.0, 70.0, 190.0, 40.0, 50.0);
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
    y1 *= 1.05;
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
    for i in 0..=5 {
        let xv = x0 + (x1 - x0) * i as f64 / 5.0;
        let yv = y0 + (y1 - y0) * i as f64 / 5.0;
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{}" text-anchor="middle">{:.3}</text><text x="{}" y="{:.1}" text-anchor="end">{:.3}</text><line x1="{ml}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="#ddd"/>"##,
            px(xv),
            h - mb + 18.0,
            trim(xv),
            ml - 6.0,
            py(yv) + 4.0,
            trim(yv),
            py(yv),
            w - mr,
            py(yv)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text><text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{y_label}</text>"#,
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
            se.name
        );
    }
    s.push_str("</svg>\n");
    s
}

fn trim(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
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
    }
}
