//! Writes a benchmark's results: `report.md`, `results.json` and SVG charts.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use super::oracle::Replayed;
use super::stats::{median, Slo, Summary, TagSummary};
use super::{BenchConfig, RunResult};

/// Where and how the benchmark ran.
#[derive(Debug, Clone, Serialize)]
pub struct Facts {
    /// The exact command.
    pub command: String,
    /// `git rev-parse HEAD` (with `-dirty` if the tree had changes).
    pub commit: String,
    /// CPU model, core count, kernel.
    pub machine: String,
    /// UTC start time.
    pub started: String,
}

/// What a table compares policies under: a workload, a number of gateways, an arrival rate.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// Workload.
    pub workload: String,
    /// Gateway pods (or peer router instances).
    pub gateways: usize,
    /// Arrival rate, for QPS-driven workloads.
    pub qps: Option<f64>,
}

impl Setting {
    fn of(r: &RunResult) -> Setting {
        Setting { workload: r.workload.clone(), gateways: r.gateways, qps: r.qps }
    }

    fn has(&self, r: &RunResult) -> bool {
        r.workload == self.workload && r.gateways == self.gateways && r.qps == self.qps
    }

    fn has_point(&self, p: &Point) -> bool {
        p.workload == self.workload && p.gateways == self.gateways && p.qps == self.qps
    }

    /// `shared-prefix, 2 gateways, at 8 req/s` (one gateway goes unsaid).
    fn title(&self) -> String {
        let gateways = if self.gateways > 1 { format!(", {} gateways", self.gateways) } else { String::new() };
        let qps = self.qps.map_or(String::new(), |q| format!(" at {q} req/s"));
        format!("{}{gateways}{qps}", self.workload)
    }

    /// `shared-prefix-2gw-8qps`, for file names.
    fn slug(&self) -> String {
        let gateways = if self.gateways > 1 { format!("-{}gw", self.gateways) } else { String::new() };
        let qps = self.qps.map_or(String::new(), |q| format!("-{q}qps"));
        format!("{}{gateways}{qps}", self.workload)
    }
}

/// One (workload, gateways, QPS, policy) point: medians over repeats, and ratios against Envoy
/// round robin taken within each repeat.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Workload.
    pub workload: String,
    /// Gateway pods (or peer router instances).
    pub gateways: usize,
    /// Arrival rate, for QPS-driven workloads.
    pub qps: Option<f64>,
    /// Policy.
    pub policy: String,
    /// Median of each repeat's summary value.
    pub median: Summary,
    /// Median over repeats of round robin's TTFT p90 ÷ this policy's (> 1: better).
    pub ttft_p90_vs_round_robin: Option<f64>,
    /// The same for TTFT p50.
    pub ttft_p50_vs_round_robin: Option<f64>,
    /// Total failed requests over all repeats.
    pub errors_total: usize,
}

const BASELINE: &str = "envoy-round-robin";

/// Groups the runs into points.
pub fn points(results: &[RunResult]) -> Vec<Point> {
    let mut keys: Vec<(Setting, String)> = Vec::new();
    for r in results {
        let key = (Setting::of(r), r.policy.clone());
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys.into_iter()
        .map(|(setting, policy)| {
            let runs: Vec<&RunResult> = results.iter().filter(|r| setting.has(r) && r.policy == policy).collect();
            let med = |f: &dyn Fn(&Summary) -> Option<f64>| {
                median(&runs.iter().filter_map(|r| f(&r.summary)).collect::<Vec<_>>())
            };
            let ratio = |f: &dyn Fn(&Summary) -> Option<f64>| {
                let ratios: Vec<f64> = runs
                    .iter()
                    .filter_map(|r| {
                        let base =
                            results.iter().find(|b| setting.has(b) && b.repeat == r.repeat && b.policy == BASELINE)?;
                        Some(f(&base.summary)? / f(&r.summary)?)
                    })
                    .collect();
                median(&ratios)
            };
            let median = Summary {
                requests: med(&|s| Some(s.requests as f64)).unwrap_or(0.0) as usize,
                ok: med(&|s| Some(s.ok as f64)).unwrap_or(0.0) as usize,
                errors: med(&|s| Some(s.errors as f64)).unwrap_or(0.0) as usize,
                status_503: med(&|s| Some(s.status_503 as f64)).unwrap_or(0.0) as usize,
                status_429: med(&|s| Some(s.status_429 as f64)).unwrap_or(0.0) as usize,
                shed_share: med(&|s| Some(s.shed_share)).unwrap_or(0.0),
                ttft_p50: med(&|s| s.ttft_p50),
                ttft_p90: med(&|s| s.ttft_p90),
                ttft_p99: med(&|s| s.ttft_p99),
                itl_p50: med(&|s| s.itl_p50),
                itl_p90: med(&|s| s.itl_p90),
                itl_p99: med(&|s| s.itl_p99),
                e2e_p50: med(&|s| s.e2e_p50),
                e2e_p99: med(&|s| s.e2e_p99),
                output_tps: med(&|s| Some(s.output_tps)).unwrap_or(0.0),
                goodput: med(&|s| Some(s.goodput)).unwrap_or(0.0),
                slo_attainment: med(&|s| Some(s.slo_attainment)).unwrap_or(0.0),
                ttft_error_p50: med(&|s| s.ttft_error_p50),
                ttft_error_p90: med(&|s| s.ttft_error_p90),
                ttft_checks: med(&|s| Some(s.ttft_checks as f64)).unwrap_or(0.0) as usize,
                hit_ratio: med(&|s| s.hit_ratio),
                hit_ceiling: med(&|s| s.hit_ceiling),
                hit_ratio_served: med(&|s| s.hit_ratio_served),
                load_max_over_mean: med(&|s| s.load_max_over_mean),
                load_floor: med(&|s| s.load_floor),
                decision_us_p50: med(&|s| s.decision_us_p50),
                decision_us_p90: med(&|s| s.decision_us_p90),
                tokenize_us_p50: med(&|s| s.tokenize_us_p50),
                router_cpu_ms: med(&|s| s.router_cpu_ms),
                sim_clock_lag: med(&|s| s.sim_clock_lag),
                replayed: Replayed::median(&runs.iter().filter_map(|r| r.summary.replayed).collect::<Vec<_>>()),
            };
            Point {
                ttft_p90_vs_round_robin: ratio(&|s| s.ttft_p90),
                ttft_p50_vs_round_robin: ratio(&|s| s.ttft_p50),
                errors_total: runs.iter().map(|r| r.summary.errors).sum(),
                workload: setting.workload,
                gateways: setting.gateways,
                qps: setting.qps,
                policy,
                median,
            }
        })
        .collect()
}

/// A ratio where more is better for the router measured (a gain), to two decimals, rounded
/// down: a report never rounds in its own favour (7.7475 is 7.74×, not 7.75×).
pub fn gain(ratio: f64) -> String {
    if !ratio.is_finite() {
        return "–".into();
    }
    // The nudge keeps a ratio that is exactly on a hundredth (8.56) from flooring below it.
    format!("{:.2}×", ((ratio * 100.0) + 1e-9).floor() / 100.0)
}

fn secs(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| if v < 1.0 { format!("{:.0} ms", v * 1000.0) } else { format!("{v:.2} s") })
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".into(), |v| format!("{v:.digits$}"))
}

/// Requests shed (429) and their share of those sent: `141 (18.8 %)`. TTFT percentiles are
/// over the requests served, so every table that shows them shows this beside them.
fn shed(s: &Summary) -> String {
    format!("{} ({:.1} %)", s.status_429, s.shed_share * 100.0)
}

/// The markdown table of one setting: a row per policy, medians over repeats.
pub fn table(points: &[Point], setting: &Setting) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "| policy | TTFT p50 | TTFT p90 | TTFT p99 | shed (429) | p90 vs RR | ITL p50 | ITL p90 | ITL p99 | E2E p50 | E2E p99 | out tok/s | goodput | errors (503, 429) | hit ratio | load max/mean (floor) | router CPU ms/req | kvgate decision p50 / p90 (in-filter tokenizing p50) | sim clock lag |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for q in points.iter().filter(|q| setting.has_point(q)) {
        let m = &q.median;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.2} | {} ({}, {}) | {} | {}{} | {} | {} | {} |",
            q.policy,
            secs(m.ttft_p50),
            secs(m.ttft_p90),
            secs(m.ttft_p99),
            shed(m),
            q.ttft_p90_vs_round_robin.map_or("–".into(), gain),
            secs(m.itl_p50),
            secs(m.itl_p90),
            secs(m.itl_p99),
            secs(m.e2e_p50),
            secs(m.e2e_p99),
            m.output_tps,
            m.goodput,
            q.errors_total,
            m.status_503,
            m.status_429,
            num(m.hit_ratio, 3),
            num(m.load_max_over_mean, 2),
            m.load_floor.map_or(String::new(), |f| format!(" (≥ {f:.2})")),
            num(m.router_cpu_ms, 2),
            match (m.decision_us_p50, m.decision_us_p90) {
                (Some(p50), Some(p90)) => format!(
                    "{:.2} / {:.2} ms{}",
                    p50 / 1000.0,
                    p90 / 1000.0,
                    m.tokenize_us_p50.map_or(String::new(), |t| format!(" ({:.2})", t / 1000.0))
                ),
                _ => "–".into(),
            },
            m.sim_clock_lag.map_or("–".into(), |l| format!("{:.1} %", l * 100.0)),
        );
    }
    md
}

/// The SLOs in one setting, a row per policy: requests sent that met both (TTFT and ITL), those
/// shed, and kvgate's TTFT predictions against its filter's measurements.
pub fn slo_table(points: &[Point], setting: &Setting, slo: Slo) -> String {
    let mut md = format!(
        "\nSLOs: TTFT ≤ {} and mean ITL ≤ {} (simulated), of every request sent (a shed or failed one is a miss). \
         TTFT prediction error: kvgate's predictions against its filter's measurements, |predicted − measured| / \
         measured, over the decisions checked.\n\n\
         | policy | SLO attainment | goodput (TTFT only) | shed (429) | TTFT prediction error p50 / p90 (checks) |\n\
         |---|---|---|---|---|\n",
        secs(Some(slo.ttft_s)),
        secs(Some(slo.itl_s))
    );
    for q in points.iter().filter(|q| setting.has_point(q)) {
        let m = &q.median;
        let errors = match (m.ttft_error_p50, m.ttft_error_p90) {
            (Some(p50), Some(p90)) => format!("{:.1} % / {:.1} % ({})", p50 * 100.0, p90 * 100.0, m.ttft_checks),
            _ => "–".into(),
        };
        let _ = writeln!(md, "| {} | {:.3} | {:.3} | {} | {errors} |", q.policy, m.slo_attainment, m.goodput, shed(m));
    }
    md
}

/// What there was to win in one setting, a row per policy (empty when nothing was replayed):
/// the hit ratio against its ceiling, and the TTFT p90 of the requests served replayed in
/// simulated time under the router's placement, round robin and the greedy one.
pub fn bounds_table(points: &[Point], setting: &Setting) -> String {
    let rows: Vec<&Point> = points.iter().filter(|q| setting.has_point(q) && q.median.replayed.is_some()).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\nWhat there was to win. Hit ratio: the engines' count over the requests served, against one infinite cache \
         shared by the fleet on the same prompts. Replayed: the requests served, at the times they were sent, on \
         engines of this fleet in simulated time, under this router's placement (against the measured p90: the \
         replay's fidelity), round robin, and a greedy placement that sends each request where its own first token \
         comes soonest, knowing every engine's state (a reference, not a bound). The floor is a bound: each request \
         alone on an idle engine holding all the ceiling's cache holds for it. The share is of the p90 gain from \
         round robin to the floor, which no placement reaches when requests overlap.\n\n",
    );
    let _ = writeln!(
        md,
        "| policy | hit ratio served / ceiling | TTFT p90 measured | replayed p50: own / RR / greedy / floor | replayed p90: own / RR / greedy / floor | share of the p90 gain | requests replayed |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for q in rows {
        let (m, r) = (&q.median, q.median.replayed.expect("filtered"));
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} / {} / {} / {} | {} / {} / {} / {} | {} | {} |",
            q.policy,
            match (m.hit_ratio_served, m.hit_ceiling) {
                (Some(served), Some(ceiling)) =>
                    format!("{served:.3} / {ceiling:.3} ({:.1} %)", served / ceiling * 100.0),
                _ => "–".into(),
            },
            secs(m.ttft_p90),
            secs(Some(r.own[0])),
            secs(Some(r.round_robin[0])),
            secs(Some(r.greedy[0])),
            secs(Some(r.floor[0])),
            secs(Some(r.own[1])),
            secs(Some(r.round_robin[1])),
            secs(Some(r.greedy[1])),
            secs(Some(r.floor[1])),
            r.share_of_p90_gain().map_or("–".into(), |s| format!("{:.0} %", s * 100.0)),
            r.requests,
        );
    }
    md
}

/// Writes each run's outcomes, one JSON object per request and line, into `dir`: the same
/// request under two policies can then be compared (`request` names it in every run).
fn write_requests(dir: &Path, results: &[RunResult]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for run in results {
        let mut lines = String::new();
        for o in &run.outcomes {
            lines.push_str(&serde_json::to_string(o)?);
            lines.push('\n');
        }
        std::fs::write(dir.join(run.requests_file()), lines)?;
    }
    Ok(())
}

/// Writes `report.md`, `results.json`, `requests/` and the charts into `dir`; returns the
/// report's text.
pub fn write(dir: &Path, config: &BenchConfig, facts: &Facts, results: &[RunResult]) -> anyhow::Result<String> {
    std::fs::create_dir_all(dir)?;
    let points = points(results);
    let json = serde_json::json!({"facts": facts, "config": config, "points": points, "runs": results});
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(&json)?)?;
    write_requests(&dir.join("requests"), results)?;

    let mut md = String::new();
    let _ = writeln!(md, "# kvgate benchmark\n");
    let _ = writeln!(md, "- command: `{}`", facts.command);
    let _ = writeln!(md, "- commit: `{}`", facts.commit);
    let _ = writeln!(md, "- machine: {}", facts.machine);
    let _ = writeln!(md, "- started: {}", facts.started);
    let f = &config.fleet;
    let _ = writeln!(
        md,
        "- fleet: {} × kvgate-sim, preset `{}`, speedup {}×, blocks of {} tokens, max-num-seqs {}, max-num-batched-tokens {}",
        f.replicas, f.preset, f.speedup, f.block_size, f.max_num_seqs, f.max_num_batched_tokens
    );
    let _ = writeln!(
        md,
        "- {} repeat(s) per point, medians shown; TTFT SLO for goodput {} s; latencies in simulated time, over the requests served: a shed (429) or failed request has none, is counted beside them, and is a miss in goodput",
        config.repeats, config.slo_ttft_s
    );
    if config.pin {
        let _ = writeln!(
            md,
            "- pinned (`taskset`): the routers' processes on core 0, the engines and the load generator on core 1"
        );
    }
    if let Some(nice) = config.engines_nice {
        let _ = writeln!(md, "- the engines' threads at nice {nice}: the routers and the load generator run first");
    }
    let commands: std::collections::BTreeSet<(&str, &str)> =
        results.iter().filter_map(|r| Some((r.policy.as_str(), r.router_command.as_deref()?))).collect();
    if !commands.is_empty() {
        let _ = writeln!(md, "Peer routers ran as (on loopback, installed from PyPI by the harness):\n");
        for (policy, command) in commands {
            let _ = writeln!(md, "- {policy}: `{command}`");
        }
        let _ = writeln!(md);
    }
    for w in &config.workloads {
        let _ =
            writeln!(md, "- workload `{}`: {}; {} GPU blocks per engine", w.name(), w.describe(), f.gpu_blocks_for(w));
    }
    let _ = writeln!(md);
    let mut seen: Vec<Setting> = Vec::new();
    for r in results {
        let setting = Setting::of(r);
        if seen.contains(&setting) {
            continue;
        }
        seen.push(setting.clone());
        let _ = writeln!(md, "## {}\n", setting.title());
        md.push_str(&table(&points, &setting));
        md.push_str(&slo_table(&points, &setting, config.slo()));
        md.push_str(&bounds_table(&points, &setting));
        md.push_str(&tag_table(results, &setting));
        let chart = format!("ttft-cdf-{}.svg", setting.slug());
        ttft_cdf(&dir.join(&chart), &format!("TTFT CDF — {}", setting.title()), results, &setting)?;
        let _ = writeln!(md, "\n![TTFT CDF]({chart})\n");
    }
    let ladders: std::collections::BTreeSet<(&String, usize)> =
        points.iter().filter(|p| p.qps.is_some()).map(|p| (&p.workload, p.gateways)).collect();
    for (w, gateways) in ladders {
        if config.qps.len() > 1 {
            let name = Setting { workload: w.clone(), gateways, qps: None };
            let chart = format!("throughput-{}.svg", name.slug());
            throughput_vs_qps(&dir.join(&chart), &name, &points)?;
            let _ = writeln!(md, "## {}: throughput vs offered load\n\n![throughput]({chart})\n", name.title());
        }
    }
    std::fs::write(dir.join("report.md"), &md)?;
    Ok(md)
}

/// Per priority class and tenant, every repeat (empty when the runs tagged nothing).
pub fn tag_table(results: &[RunResult], setting: &Setting) -> String {
    let runs: Vec<&RunResult> = results.iter().filter(|r| setting.has(r) && !r.by_tag.is_empty()).collect();
    if runs.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\nBy priority class and tenant:\n\n| policy | repeat | tag | requests | completed | shed (429) | TTFT p50 | TTFT p90 | goodput |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        for TagSummary { tag, summary: s } in &r.by_tag {
            let _ = writeln!(
                md,
                "| {} | {} | {tag} | {} | {} | {} | {} | {} | {:.2} |",
                r.policy,
                r.repeat,
                s.requests,
                s.ok,
                shed(s),
                secs(s.ttft_p50),
                secs(s.ttft_p90),
                s.goodput
            );
        }
    }
    md
}

const COLORS: [RGBColor; 7] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

/// The fraction of a run's requests sent with TTFT ≤ each served request's TTFT, in order:
/// shed and failed requests have none, so the line ends below 1 by their share.
fn cdf(run: &RunResult) -> Vec<(f64, f64)> {
    let mut v = run.ttfts();
    v.sort_by(f64::total_cmp);
    let sent = run.outcomes.len().max(1) as f64;
    v.into_iter().enumerate().map(|(k, t)| (t, (k + 1) as f64 / sent)).collect()
}

/// One line per policy: the fraction of requests sent with TTFT ≤ x (repeat 0).
fn ttft_cdf(path: &Path, title: &str, results: &[RunResult], setting: &Setting) -> anyhow::Result<()> {
    let runs: Vec<&RunResult> = results.iter().filter(|r| setting.has(r) && r.repeat == 0).collect();
    let max = runs.iter().flat_map(|r| r.ttfts()).fold(0.0, f64::max).max(1e-3);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1e-3..max * 1.05).log_scale(), 0.0..1.0)?;
    chart.configure_mesh().x_desc("TTFT (simulated seconds, log scale)").y_desc("fraction of requests sent").draw()?;
    for (i, run) in runs.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                cdf(run).into_iter().map(|(t, share)| (t.max(1e-3), share)),
                color.stroke_width(2),
            ))?
            .label(run.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Output tokens/s against offered QPS, one line per policy (`ladder`: a workload and a
/// number of gateways, any QPS).
fn throughput_vs_qps(path: &Path, ladder: &Setting, points: &[Point]) -> anyhow::Result<()> {
    let pts: Vec<&Point> = points
        .iter()
        .filter(|p| p.workload == ladder.workload && p.gateways == ladder.gateways && p.qps.is_some())
        .collect();
    let max_q = pts.iter().filter_map(|p| p.qps).fold(0.0, f64::max).max(1e-3);
    let max_t = pts.iter().map(|p| p.median.output_tps).fold(0.0, f64::max).max(1.0);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Output throughput vs offered load — {}", ladder.title()), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_q * 1.05, 0.0..max_t * 1.1)?;
    chart.configure_mesh().x_desc("offered load (requests per simulated second)").y_desc("output tokens / s").draw()?;
    let mut policies: Vec<&String> = pts.iter().map(|p| &p.policy).collect();
    policies.dedup();
    for (i, policy) in policies.into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let line: Vec<(f64, f64)> =
            pts.iter().filter(|p| &p.policy == policy).filter_map(|p| Some((p.qps?, p.median.output_tps))).collect();
        chart
            .draw_series(LineSeries::new(line, color.stroke_width(2)))?
            .label(policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gains_are_rounded_down() {
        assert_eq!(gain(7.7475), "7.74×");
        assert_eq!(gain(8.56), "8.56×");
        assert_eq!(gain(0.999), "0.99×");
        assert_eq!(gain(f64::NAN), "–");
    }
    use crate::bench::loadgen::Outcome;

    fn run(policy: &str, repeat: usize, p90: f64) -> RunResult {
        RunResult {
            workload: "w".into(),
            policy: policy.into(),
            gateways: 1,
            qps: Some(1.0),
            repeat,
            kvgate_routed: None,
            router_command: None,
            summary: Summary { ttft_p90: Some(p90), ttft_p50: Some(p90 / 2.0), ..Summary::default() },
            outcomes: vec![Outcome::served("0", "a", p90 / 2.0), Outcome::served("1", "b", p90)],
            by_tag: Vec::new(),
        }
    }

    #[test]
    fn ratios_are_taken_within_each_repeat_then_the_median() {
        let results = vec![
            run(BASELINE, 0, 4.0),
            run("kvgate-kv-aware", 0, 1.0),
            run(BASELINE, 1, 9.0),
            run("kvgate-kv-aware", 1, 1.0),
            run(BASELINE, 2, 2.0),
            run("kvgate-kv-aware", 2, 1.0),
        ];
        let pts = points(&results);
        let kv = pts.iter().find(|p| p.policy == "kvgate-kv-aware").unwrap();
        assert_eq!(kv.ttft_p90_vs_round_robin, Some(4.0), "median of 4, 9, 2");
        assert_eq!(kv.median.ttft_p90, Some(1.0));
        let rr = pts.iter().find(|p| p.policy == BASELINE).unwrap();
        assert_eq!(rr.ttft_p90_vs_round_robin, Some(1.0));
    }

    /// A run that shed a third of its requests draws a TTFT line that ends at two thirds.
    #[test]
    fn the_ttft_cdf_is_over_requests_sent() {
        let mut r = run("kvgate-kv-aware-admission", 0, 2.0);
        r.outcomes.push(Outcome { status: 429, ttft: None, ..Outcome::served("2", "", 0.0) });
        assert_eq!(cdf(&r), [(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0)]);
    }

    #[test]
    fn writes_a_report_with_tables_json_and_charts() {
        let dir = std::env::temp_dir().join(format!("kvgate-report-{}", std::process::id()));
        let config = BenchConfig {
            workloads: vec![],
            policies: vec![],
            qps: vec![1.0, 2.0],
            gateways: vec![1, 2],
            repeats: 1,
            fleet: super::super::Fleet {
                replicas: 2,
                block_size: 16,
                preset: "test".into(),
                speedup: 1.0,
                gpu_blocks: 10,
                max_num_seqs: 1,
                max_num_batched_tokens: 1,
            },
            max_duration_s: 1.0,
            slo_ttft_s: 1.0,
            slo_itl_s: 0.05,
            mix: super::super::workloads::Mix::Priorities,
            trace: "t".into(),
            seed: 0,
            peers_venv: "v".into(),
            pin: false,
            engines_nice: None,
            replay: true,
        };
        let facts = Facts { command: "c".into(), commit: "x".into(), machine: "m".into(), started: "s".into() };
        let mut results = vec![run(BASELINE, 0, 4.0), run("kvgate-kv-aware", 0, 1.0)];
        results[1].summary = Summary {
            requests: 4,
            status_429: 1,
            shed_share: 0.25,
            goodput: 0.75,
            slo_attainment: 0.5,
            ttft_error_p50: Some(0.041),
            ttft_error_p90: Some(0.2),
            ttft_checks: 3,
            ..results[1].summary.clone()
        };
        let mut more = results.clone();
        for r in &mut more {
            r.qps = Some(2.0);
        }
        results.extend(more);
        let mut two: Vec<RunResult> = results[..2].to_vec();
        for r in &mut two {
            r.gateways = 2;
            r.summary.ttft_p90 = r.summary.ttft_p90.map(|p| p * 2.0);
        }
        results.extend(two);
        results[1].by_tag = vec![TagSummary {
            tag: "priority=interactive".into(),
            summary: Summary {
                requests: 3,
                ok: 2,
                status_429: 1,
                shed_share: 1.0 / 3.0,
                ttft_p50: Some(0.2),
                ttft_p90: Some(1.5),
                goodput: 0.5,
                ..Summary::default()
            },
        }];
        let md = write(&dir, &config, &facts, &results).unwrap();
        assert!(md.contains("| policy | TTFT p50 | TTFT p90 | TTFT p99 | shed (429) | p90 vs RR |"), "{md}");
        assert!(
            md.contains("| kvgate-kv-aware | 500 ms | 1.00 s | – | 1 (25.0 %) | 4.00× |"),
            "shed beside TTFT: {md}"
        );
        assert!(md.contains("| envoy-round-robin | 2.00 s | 4.00 s | – | 0 (0.0 %) | 1.00× |"), "{md}");
        assert!(md.contains("SLOs: TTFT ≤ 1.00 s and mean ITL ≤ 50 ms"), "{md}");
        assert!(md.contains("| kvgate-kv-aware | 0.500 | 0.750 | 1 (25.0 %) | 4.1 % / 20.0 % (3) |"), "{md}");
        assert!(md.contains("| envoy-round-robin | 0.000 | 0.000 | 0 (0.0 %) | – |"), "{md}");
        assert!(
            md.contains("| kvgate-kv-aware | 0 | priority=interactive | 3 | 2 | 1 (33.3 %) | 200 ms | 1.50 s | 0.50 |"),
            "{md}"
        );
        assert!(md.contains("4.00×"));
        assert!(md.contains("## w, 2 gateways at 1 req/s\n\n"), "{md}");
        assert!(md.contains("| kvgate-kv-aware | 500 ms | 2.00 s |"), "the two-gateway row: {md}");
        for file in ["results.json", "report.md", "ttft-cdf-w-1qps.svg", "throughput-w.svg", "ttft-cdf-w-2gw-1qps.svg"]
        {
            let body = std::fs::read_to_string(dir.join(file)).unwrap();
            assert!(body.len() > 100, "{file} written");
        }
        assert!(std::fs::read_to_string(dir.join("ttft-cdf-w-1qps.svg")).unwrap().contains("kvgate-kv-aware"));
        let requests = std::fs::read_to_string(dir.join("requests/w-kvgate-kv-aware-2gw-1qps-r0.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = requests.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "one line per request: {requests}");
        assert_eq!((lines[1]["request"].as_str(), lines[1]["ttft"].as_f64()), (Some("1"), Some(1.0)), "{requests}");
    }
}
