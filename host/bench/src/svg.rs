//! The report as an SVG chart people read at a glance: one horizontal bar
//! per contender and mode, stacked from its host phases (blue) and guest
//! phases (orange) at their p50s, the total's min-max range as a whisker,
//! and, next to a peer's bar, how many times faster husk is to the
//! endpoint both reach. The time axis is logarithmic (a restore's host work
//! is milliseconds, an emulated cold boot a minute), so a bar's host part
//! runs from the axis's left edge to the host p50 and its guest part from
//! there to the total. Every phase's numbers stay in the table and JSON.

use std::fmt::Write as _;

use super::report::{Report, Side, Status};

const LEFT: f64 = 190.0;
const PLOT: f64 = 560.0;
const RIGHT: f64 = 300.0;
const ROW: f64 = 30.0;
const TOP: f64 = 60.0;
const HOST: &str = "#1f77b4";
const GUEST: &str = "#ff7f0e";

/// One bar: a contender and mode's p50s and the range of its totals.
struct Bar {
    label: String,
    host: f64,
    guest: f64,
    range: (f64, f64),
    note: String,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders `report`.
pub fn render(report: &Report) -> String {
    let mut bars = Vec::new();
    for s in report.series.iter().filter(|s| s.status != Status::Skipped) {
        let Some(total) = s.total else {
            continue;
        };
        let side = |want: Side| -> f64 {
            s.phases
                .iter()
                .filter(|p| p.side == want)
                .map(|p| p.stats.p50)
                .sum()
        };
        let ratio = report
            .ratios
            .iter()
            .find(|r| r.contender == s.contender && r.mode == s.mode)
            .map(|r| match r.p50_over_husk {
                x if x >= 1.0 => format!("; husk {x:.1}x faster"),
                x => format!("; husk {:.1}x slower", 1.0 / x),
            })
            .unwrap_or_default();
        let shared = s
            .comparable
            .map(|c| format!(" (to {}: {})", short_endpoint(&s.mode), format_value(c.p50)))
            .unwrap_or_default();
        bars.push(Bar {
            label: format!("{} {}", s.contender, s.mode.replace('_', " ")),
            host: side(Side::Host),
            guest: side(Side::Guest),
            range: (total.min, total.max),
            note: format!("{}{shared}{ratio}", format_value(total.p50)),
        });
    }
    // The axis: whole decades around every value.
    let values = bars
        .iter()
        .flat_map(|b| [b.host, b.host + b.guest, b.range.0, b.range.1])
        .filter(|v| *v > 0.0);
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo > hi {
        (-1, 3)
    } else {
        (
            lo.log10().floor() as i32,
            (hi.log10().ceil() as i32).max(lo.log10().floor() as i32 + 1),
        )
    };
    let x = |ms: f64| {
        let ms = ms.max(10f64.powi(lo));
        LEFT + (ms.log10() - f64::from(lo)) / f64::from(hi - lo) * PLOT
    };
    let bottom = TOP + bars.len() as f64 * ROW;
    let height = bottom + 48.0;
    let width = LEFT + PLOT + RIGHT;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let l = &report.labels;
    let _ = writeln!(
        out,
        r#"<text x="10" y="18" font-size="13">husk bench: {} ({} CPUs), KVM {}, {} MiB guest, {} runs each</text>"#,
        escape(&l.cpu_model),
        l.cpus,
        escape(&l.kvm),
        l.guest_mem_mib,
        l.iterations
    );
    let _ = writeln!(
        out,
        r##"<text x="10" y="36">p50 from the spawn (pooled: the API call) to the last phase, ms, log scale: <tspan fill="{HOST}">host phases</tspan> then <tspan fill="{GUEST}">guest phases</tspan>; whisker: the total's min-max</text>"##
    );
    for decade in lo..=hi {
        let xd = x(10f64.powi(decade));
        let _ = writeln!(
            out,
            r##"<line x1="{xd:.1}" y1="{:.1}" x2="{xd:.1}" y2="{bottom:.1}" stroke="#ddd"/><text x="{xd:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP - 6.0,
            bottom + 14.0,
            format_ms(10f64.powi(decade))
        );
    }
    for (i, bar) in bars.iter().enumerate() {
        let y = TOP + i as f64 * ROW + ROW / 2.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            y + 4.0,
            escape(&bar.label)
        );
        let (x0, xh, xt) = (LEFT, x(bar.host), x(bar.host + bar.guest));
        let _ = writeln!(
            out,
            r#"<rect x="{x0:.1}" y="{:.1}" width="{:.1}" height="14" fill="{HOST}"/>"#,
            y - 7.0,
            (xh - x0).max(1.0)
        );
        if bar.guest > 0.0 {
            let _ = writeln!(
                out,
                r#"<rect x="{xh:.1}" y="{:.1}" width="{:.1}" height="14" fill="{GUEST}"/>"#,
                y - 7.0,
                (xt - xh).max(1.0)
            );
        }
        let (a, b) = (x(bar.range.0), x(bar.range.1));
        let _ = writeln!(
            out,
            r#"<path d="M{a:.1} {:.1}V{:.1}M{a:.1} {y:.1}H{b:.1}M{b:.1} {:.1}V{:.1}" stroke="black" fill="none"/>"#,
            y - 5.0,
            y + 5.0,
            y - 5.0,
            y + 5.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            LEFT + PLOT + 8.0,
            y + 4.0,
            escape(&bar.note)
        );
    }
    if let Some(w) = &l.warning {
        let _ = writeln!(
            out,
            r#"<text x="10" y="{:.1}" font-size="10">{}</text>"#,
            bottom + 32.0,
            escape(w)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The shared endpoint of a mode, in a word or two.
fn short_endpoint(mode: &str) -> &'static str {
    match mode {
        "restore" => "running",
        "cold_boot" => "ready",
        _ => "endpoint",
    }
}

/// A p50 for people: ms below 10 s, else s.
fn format_value(ms: f64) -> String {
    if ms >= 10_000.0 {
        format!("{:.1} s", ms / 1000.0)
    } else if ms >= 100.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{ms:.1} ms")
    }
}

fn format_ms(ms: f64) -> String {
    if ms >= 1000.0 {
        format!("{} s", ms / 1000.0)
    } else {
        format!("{ms} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{tests::labels, Sample, Segment, Series};

    #[test]
    fn each_series_is_one_stacked_bar_with_its_whisker_and_ratio() {
        let mut series = Series::new("husk", "restore", "");
        for (i, ms) in [(0, 2.0), (1, 3000.0)] {
            let phases = vec![
                Segment {
                    name: "memory".into(),
                    side: Side::Host,
                    ms,
                },
                Segment {
                    name: "first_reply".into(),
                    side: Side::Guest,
                    ms,
                },
            ];
            series.samples.push(Sample {
                iteration: i,
                total_ms: 2.0 * ms,
                phases,
                memory: None,
                snapshot_age_s: None,
                guest_clock_offset_ms: None,
                comparable_ms: Some(ms),
            });
        }
        series.summarize();
        let mut peer = series.clone();
        peer.contender = "firecracker".into();
        let report = Report {
            schema: String::new(),
            labels: labels(),
            series: vec![series, peer, Series::skipped("qemu", "restore", "missing")],
            clones: Vec::new(),
            ratios: vec![crate::report::Ratio {
                contender: "firecracker".into(),
                mode: "restore".into(),
                endpoint: String::new(),
                p50_over_husk: 4.25,
            }],
            parked: None,
            targets: Vec::new(),
        };

        let svg = render(&report);

        assert!(svg.contains(">husk restore</text>"));
        assert!(svg.contains(">firecracker restore</text>"));
        assert!(!svg.contains("qemu"));
        // Two bars of two parts each, two whiskers.
        assert_eq!(svg.matches("<rect x=").count(), 4);
        assert_eq!(svg.matches("<path").count(), 2);
        assert!(svg.contains("husk 4.2x faster") || svg.contains("husk 4.3x faster"));
        assert!(svg.contains("CPU &lt;model&gt; &amp; co"));
        assert!(svg.contains(">1 ms</text>") && svg.contains(">10 s</text>"));
    }
}
