//! The report as an SVG chart: one row per contender, mode and phase (and
//! the total), each run a dot on a logarithmic time axis (phases range from
//! microseconds of host work to minutes of emulated guest boot), the
//! min-max range as a line and the p50 as a bar. Host phases are blue,
//! guest phases orange, totals black.

use std::fmt::Write as _;

use super::report::{Report, Side, Status};

const LEFT: f64 = 330.0;
const PLOT: f64 = 600.0;
const ROW: f64 = 16.0;
const TOP: f64 = 56.0;

/// One row: a label, a colour and the values (ms).
struct Row {
    label: String,
    colour: &'static str,
    values: Vec<f64>,
    p50: f64,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders `report`.
pub fn render(report: &Report) -> String {
    let mut rows = Vec::new();
    for s in report.series.iter().filter(|s| s.status != Status::Skipped) {
        for p in &s.phases {
            let values = s
                .samples
                .iter()
                .flat_map(|x| &x.phases)
                .filter(|seg| seg.name == p.name)
                .map(|seg| seg.ms)
                .collect();
            rows.push(Row {
                label: format!("{} {}: {}", s.contender, s.mode, p.name),
                colour: match p.side {
                    Side::Host => "#1f77b4",
                    Side::Guest => "#ff7f0e",
                },
                values,
                p50: p.stats.p50,
            });
        }
        if let Some(t) = s.total {
            rows.push(Row {
                label: format!("{} {}: total", s.contender, s.mode),
                colour: "#000000",
                values: s.samples.iter().map(|x| x.total_ms).collect(),
                p50: t.p50,
            });
        }
    }
    // The axis: whole decades around every positive value.
    let positive = rows.iter().flat_map(|r| &r.values).filter(|v| **v > 0.0);
    let (lo, hi) = positive.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    let (lo, hi) = if lo > hi {
        (-2, 3)
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
    let height = TOP + rows.len() as f64 * ROW + 40.0;
    let width = LEFT + PLOT + 20.0;
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
        r##"<text x="10" y="34">ms, log scale; dots: runs, bar: p50, line: min-max; <tspan fill="#1f77b4">host</tspan>, <tspan fill="#ff7f0e">guest</tspan> phases</text>"##
    );
    let bottom = TOP + rows.len() as f64 * ROW;
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
    for (i, row) in rows.iter().enumerate() {
        let y = TOP + i as f64 * ROW + ROW / 2.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            y + 4.0,
            escape(&row.label)
        );
        let (min, max) = row
            .values
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
        if min <= max {
            let _ = writeln!(
                out,
                r#"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-opacity="0.5"/>"#,
                x(min),
                x(max),
                row.colour
            );
        }
        for v in &row.values {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{y:.1}" r="2.5" fill="{}" fill-opacity="0.6"/>"#,
                x(*v),
                row.colour
            );
        }
        let _ = writeln!(
            out,
            r#"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="{3}" stroke-width="2"/>"#,
            x(row.p50),
            y - 5.0,
            y + 5.0,
            row.colour
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
    use crate::report::{Labels, Sample, Segment, Series};

    fn labels() -> Labels {
        Labels {
            cpu_model: "CPU <model> & co".into(),
            cpus: 2,
            kvm: "hardware".into(),
            host_kernel: "6.1".into(),
            guest_kernel: "vmlinux".into(),
            guest_kernel_bytes: 1,
            initramfs: "initramfs".into(),
            initramfs_bytes: 1,
            guest_mem_mib: 128,
            guest_vcpus: 1,
            guest_clocksource: None,
            husk_version: "0".into(),
            commit: "c".into(),
            started_unix_s: 0,
            iterations: 2,
            warning: None,
        }
    }

    #[test]
    fn every_phase_and_total_gets_a_row_with_a_dot_per_run() {
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
                comparable_ms: None,
            });
        }
        series.summarize();
        let report = Report {
            schema: String::new(),
            labels: labels(),
            series: vec![series, Series::skipped("qemu", "restore", "missing")],
            clones: Vec::new(),
            ratios: Vec::new(),
        };

        let svg = render(&report);

        for row in [
            "husk restore: memory",
            "husk restore: first_reply",
            "husk restore: total",
        ] {
            assert!(svg.contains(&format!(">{row}</text>")), "{row}");
        }
        assert!(!svg.contains("qemu"));
        assert_eq!(svg.matches("<circle").count(), 6);
        assert!(svg.contains("CPU &lt;model&gt; &amp; co"));
        assert!(svg.contains(">1 ms</text>") && svg.contains(">10 s</text>"));
    }
}
