//! The table drawn as an SVG bar chart: one horizontal bar per configuration, its length the
//! messages per second on one linear scale, tether, the brokers and the bounds in their own
//! colours. The scale fits the fastest row that is not the raw network bound (raw iroh frames
//! run an order of magnitude past everything durable); a bar past the scale is cut, marked
//! with a break, and labelled with its value.

use std::fmt::Write as _;
use std::path::Path;

use crate::Row;

const WIDTH: f64 = 960.0;
const LABEL: f64 = 470.0;
const BAR: f64 = 22.0;
const GAP: f64 = 8.0;
const TOP: f64 = 56.0;

/// Writes the chart of `rows` to `path`.
pub(crate) fn write(path: &Path, rows: &[&Row], size: usize) -> std::io::Result<()> {
    std::fs::write(path, svg(rows, size))
}

fn colour(what: &str) -> &'static str {
    if what.starts_with("tether over Iroh") {
        "#2f6fb3"
    } else if what.starts_with("tether over Tcp") {
        "#6aa0d8"
    } else if what.starts_with("raw") {
        "#9a9a9a"
    } else {
        "#d9822b"
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn svg(rows: &[&Row], size: usize) -> String {
    let max = rows
        .iter()
        .filter(|row| !row.what.starts_with("raw iroh"))
        .map(|row| row.rate())
        .fold(1.0, f64::max);
    let span = WIDTH - LABEL - 110.0;
    let height = TOP + rows.len() as f64 * (BAR + GAP) + 40.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="12" y="24" font-size="16" font-weight="bold">tether-bench: {size}-byte messages, end-to-end msg/s (tether fsyncs before every ack)</text>"#
    );
    let _ = writeln!(
        out,
        r##"<text x="12" y="42" fill="#555">blue: tether (dark: iroh, light: TCP) · orange: brokers · grey: raw bounds (SQLite rows, iroh frames)</text>"##
    );
    for (i, row) in rows.iter().enumerate() {
        let y = TOP + i as f64 * (BAR + GAP);
        let cut = row.rate() > max;
        let length = (row.rate() / max * span).clamp(1.0, span);
        let mark = if row.verdict == "ok" { "" } else { " ✗" };
        let _ = writeln!(
            out,
            r#"<text x="{x}" y="{ty}" text-anchor="end">{label}{mark}</text><rect x="{LABEL}" y="{y}" width="{length:.1}" height="{BAR}" fill="{fill}"/><text x="{vx:.1}" y="{ty}">{rate:.0}</text>"#,
            x = LABEL - 8.0,
            ty = y + BAR * 0.72,
            label = escape(&row.what),
            fill = colour(&row.what),
            vx = LABEL + length + 6.0,
            rate = row.rate(),
        );
        if cut {
            let _ = writeln!(
                out,
                r#"<path d="M{a:.1} {y} l6 {h:.1} M{b:.1} {y} l6 {h:.1}" stroke="white" stroke-width="3"/>"#,
                a = LABEL + span * 0.8,
                b = LABEL + span * 0.8 + 6.0,
                h = BAR,
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(what: &str, messages: u64, seconds: f64) -> Row {
        Row {
            what: what.into(),
            messages,
            seconds,
            p50_ms: 0.0,
            p99_ms: 0.0,
            verdict: "ok".into(),
            fsyncs_per_message: None,
            cpu_us_per_message: None,
            store_busy: None,
            written_kb_per_message: None,
        }
    }

    #[test]
    fn draws_one_bar_per_row_scaled_to_the_fastest() {
        let rows = [
            row("tether over Iroh, 16 queue(s), window 32", 100, 1.0),
            row("mosquitto <qos 2>", 200, 1.0),
        ];
        let svg = svg(&rows.each_ref(), 1024);
        assert_eq!(svg.matches("<rect x=").count(), 2);
        assert!(!svg.contains("<path"), "no bar is past the scale");
        assert!(svg.contains("mosquitto &lt;qos 2&gt;"));
        // The fastest row spans the whole scale; the other half of it.
        let span = WIDTH - LABEL - 110.0;
        assert!(svg.contains(&format!(r#"width="{:.1}""#, span)));
        assert!(svg.contains(&format!(r#"width="{:.1}""#, span / 2.0)));
    }

    #[test]
    fn the_raw_network_bound_is_cut_at_the_scale_of_the_rest() {
        let rows = [
            row("tether over Iroh, 16 queue(s), window 32", 100, 1.0),
            row("raw iroh stream, 1024-byte frames", 5_000, 1.0),
        ];
        let svg = svg(&rows.each_ref(), 1024);
        let span = WIDTH - LABEL - 110.0;
        // Both bars span the scale (tether is the fastest durable row); the raw one is cut.
        assert_eq!(svg.matches(&format!(r#"width="{span:.1}""#)).count(), 2);
        assert_eq!(svg.matches("<path").count(), 1);
        assert!(svg.contains(">5000</text>"));
    }
}
