//! The soak: the gateway under a fixed moderate load for a long time, with churn (one engine
//! restarted every `churn_every`), sampling the resident memory of the sidecar and of Envoy,
//! and the sidecar's index size beside the engines' own prefix caches.
//!
//! Promises checked ([`SoakReport::pass`]): no failed request beyond those an engine restart
//! cut; after warm-up each process's RSS stays within ±5 % of its post-warm-up median; and
//! once the load stops the index holds exactly what each engine's cache holds. The engines
//! get a small cache (1024 blocks), so eviction runs all the time.
//!
//! `cargo xtask soak [--minutes N]` runs it (1 hour by default); `cargo xtask test` runs a
//! 3-minute version (CI must stay under 30 minutes on 2 cores).

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use plotters::prelude::*;

use crate::bench::stats::median;
use crate::faults::Load;
use crate::process::wait_for;
use crate::{Artifacts, Stack, StackOptions};

/// How long, and how hard.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// The whole run.
    pub duration: Duration,
    /// One engine is restarted this often (round robin over the engines).
    pub churn_every: Duration,
    /// Samples before this are not held to the RSS band.
    pub warmup: Duration,
    /// Time between samples.
    pub sample_every: Duration,
    /// Requests per second.
    pub rate: f64,
}

impl SoakConfig {
    /// `minutes` long; churn every 10 minutes (every 2 for runs under half an hour), warm-up
    /// a quarter of the run (at most 10 minutes).
    pub fn minutes(minutes: u64) -> SoakConfig {
        let duration = Duration::from_secs(minutes * 60);
        SoakConfig {
            duration,
            churn_every: Duration::from_secs(if minutes < 30 { 120 } else { 600 }),
            warmup: (duration / 4).min(Duration::from_secs(600)),
            sample_every: Duration::from_secs(if minutes < 30 { 5 } else { 15 }),
            rate: 10.0,
        }
    }
}

/// One sample.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Seconds since the start.
    pub t: f64,
    /// Sidecar RSS, bytes.
    pub sidecar_rss: u64,
    /// Envoy RSS, bytes.
    pub envoy_rss: u64,
    /// Blocks in the sidecar's index, all engines.
    pub indexed: u64,
    /// Blocks in the engines' own prefix caches.
    pub engine_cached: u64,
}

/// What the soak measured.
#[derive(Debug, Clone)]
pub struct SoakReport {
    /// Every sample.
    pub samples: Vec<Sample>,
    /// Requests sent, and those that failed.
    pub requests: usize,
    /// Failed requests that no engine restart explains.
    pub failures: usize,
    /// Failed requests cut by an engine restart.
    pub cut_by_restarts: usize,
    /// Engine restarts.
    pub restarts: usize,
    /// Largest deviation of a post-warm-up sample from the post-warm-up median, per process
    /// (sidecar, Envoy), as a fraction.
    pub rss_deviation: (f64, f64),
    /// Per engine after the load stopped: (id, indexed blocks, blocks in its cache).
    pub final_index: Vec<(String, u64, u64)>,
}

impl SoakReport {
    /// Whether every promise held.
    pub fn pass(&self) -> bool {
        self.failures == 0
            && self.rss_deviation.0 <= 0.05
            && self.rss_deviation.1 <= 0.05
            && self.final_index.iter().all(|(_, indexed, cached)| indexed == cached)
    }

    /// The report, in Markdown.
    pub fn markdown(&self, config: &SoakConfig) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let post: Vec<&Sample> = self.samples.iter().filter(|s| s.t >= config.warmup.as_secs_f64()).collect();
        let range = |f: Field| {
            let v: Vec<u64> = post.iter().map(|s| f(s)).collect();
            (v.iter().copied().min().unwrap_or(0), v.iter().copied().max().unwrap_or(0))
        };
        let (smin, smax) = range(|s| s.sidecar_rss);
        let (emin, emax) = range(|s| s.envoy_rss);
        let mut out = format!(
            "# kvgate soak\n\n{:.0} minutes at {} requests/s, one engine restarted every {:.0} minutes ({} restarts), \
             3 engines with 1024-block caches; warm-up {:.0} s. Result: **{}**.\n\n\
             | promise | measured |\n|---|---|\n\
             | no failed request beyond those cut by an engine restart | {} requests, {} cut by restarts, {} other failures |\n\
             | sidecar RSS within ±5 % after warm-up | {:.1}–{:.1} MiB, largest deviation from the median {:.1} % |\n\
             | Envoy RSS within ±5 % after warm-up | {:.1}–{:.1} MiB, largest deviation from the median {:.1} % |\n\
             | the index holds what the engines' caches hold (after the load) | {} |\n\n\
             The RSS curve: `rss.svg`; every sample: `samples.csv`.\n",
            config.duration.as_secs_f64() / 60.0,
            config.rate,
            config.churn_every.as_secs_f64() / 60.0,
            self.restarts,
            config.warmup.as_secs_f64(),
            if self.pass() { "pass" } else { "FAIL" },
            self.requests,
            self.cut_by_restarts,
            self.failures,
            mib(smin),
            mib(smax),
            self.rss_deviation.0 * 100.0,
            mib(emin),
            mib(emax),
            self.rss_deviation.1 * 100.0,
            self.final_index
                .iter()
                .map(|(id, indexed, cached)| format!("{id}: {indexed} indexed / {cached} cached"))
                .collect::<Vec<_>>()
                .join("; "),
        );
        out.push('\n');
        out
    }
}

/// Sums `kvgate_sim:cached_blocks` of one engine.
fn engine_cached(stack: &Stack, id: &str) -> u64 {
    stack.sim(id).metric("kvgate_sim:cached_blocks").map_or(0, |v| v as u64)
}

/// Runs the soak and writes `report.md`, `samples.csv` and `rss.svg` into `out`.
pub fn run(config: &SoakConfig, artifacts: &Artifacts, out: &Path) -> anyhow::Result<SoakReport> {
    std::fs::create_dir_all(out)?;
    let mut opts = StackOptions { name: "soak".into(), ..Default::default() };
    opts.sim_args.extend(["--num-gpu-blocks-override".to_owned(), "1024".to_owned()]);
    let mut stack = Stack::start(&opts, artifacts)?;
    let ids: Vec<String> = stack.sims.iter().map(|s| s.id.clone()).collect();
    let load = Load::start_with(&stack, config.rate, 400)?;
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut restarts = Vec::new();
    let mut next_churn = config.churn_every;
    while started.elapsed() < config.duration {
        std::thread::sleep(config.sample_every.min(config.duration.saturating_sub(started.elapsed())));
        if started.elapsed() >= next_churn && started.elapsed() < config.duration {
            let id = &ids[restarts.len() % ids.len()];
            let at = load.elapsed();
            stack.restart_sim(id)?;
            restarts.push((id.clone(), at, load.elapsed()));
            next_churn += config.churn_every;
        }
        let (sidecar, envoy) = stack.rss();
        let indexed = ids.iter().map(|id| stack.indexed_blocks(id).unwrap_or(0)).sum();
        let engine: u64 = ids.iter().map(|id| engine_cached(&stack, id)).sum();
        samples.push(Sample {
            t: started.elapsed().as_secs_f64(),
            sidecar_rss: sidecar.unwrap_or(0),
            envoy_rss: envoy.unwrap_or(0),
            indexed,
            engine_cached: engine,
        });
    }
    let outcomes = load.finish();
    let failed: Vec<_> = outcomes.iter().filter(|o| !o.ok()).collect();
    // A request under way on an engine when it was killed fails, as under any balancer.
    let cut = |o: &&&crate::bench::loadgen::Outcome| {
        restarts.iter().any(|(id, from, to)| o.replica == *id || (o.sent_at <= to + 0.1 && o.sent_at + o.e2e >= *from))
    };
    let cut_by_restarts = failed.iter().filter(cut).count();
    // Once the load stops the last events arrive; the index must then equal the caches.
    let final_index = wait_for("the index to settle", Duration::from_secs(20), || {
        let pairs: Vec<(String, u64, u64)> = ids
            .iter()
            .map(|id| (id.clone(), stack.indexed_blocks(id).unwrap_or(0), engine_cached(&stack, id)))
            .collect();
        pairs.iter().all(|(_, i, c)| i == c).then_some(pairs)
    })
    .unwrap_or_else(|_| {
        ids.iter().map(|id| (id.clone(), stack.indexed_blocks(id).unwrap_or(0), engine_cached(&stack, id))).collect()
    });
    let deviation = |f: Field| {
        let post: Vec<f64> =
            samples.iter().filter(|s| s.t >= config.warmup.as_secs_f64()).map(|s| f(s) as f64).collect();
        let Some(mid) = median(&post) else { return f64::INFINITY };
        post.iter().map(|v| (v - mid).abs() / mid).fold(0.0, f64::max)
    };
    let report = SoakReport {
        requests: outcomes.len(),
        failures: failed.len() - cut_by_restarts,
        cut_by_restarts,
        restarts: restarts.len(),
        rss_deviation: (deviation(|s| s.sidecar_rss), deviation(|s| s.envoy_rss)),
        final_index,
        samples,
    };
    let mut csv = std::fs::File::create(out.join("samples.csv"))?;
    writeln!(csv, "seconds,sidecar_rss_bytes,envoy_rss_bytes,indexed_blocks,engine_cached_blocks")?;
    for s in &report.samples {
        writeln!(csv, "{:.1},{},{},{},{}", s.t, s.sidecar_rss, s.envoy_rss, s.indexed, s.engine_cached)?;
    }
    chart(&out.join("rss.svg"), &report.samples, config.warmup)?;
    std::fs::write(out.join("report.md"), report.markdown(config))?;
    Ok(report)
}

/// One figure of a sample.
type Field = fn(&Sample) -> u64;

/// RSS of both processes over time, the end of warm-up marked.
fn chart(path: &Path, samples: &[Sample], warmup: Duration) -> anyhow::Result<()> {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let t_max = samples.last().map_or(1.0, |s| s.t).max(1.0);
    let y_max = samples.iter().map(|s| mib(s.sidecar_rss.max(s.envoy_rss))).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("resident memory during the soak", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
    chart.configure_mesh().x_desc("seconds").y_desc("RSS (MiB)").draw()?;
    let sidecar: Field = |s| s.sidecar_rss;
    let envoy: Field = |s| s.envoy_rss;
    for (name, color, f) in [("sidecar", RGBColor(31, 119, 180), sidecar), ("Envoy", RGBColor(255, 127, 14), envoy)] {
        chart
            .draw_series(LineSeries::new(samples.iter().map(|s| (s.t, mib(f(s)))), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    let w = warmup.as_secs_f64();
    chart.draw_series(LineSeries::new([(w, 0.0), (w, y_max)], BLACK.stroke_width(1)))?.label("end of warm-up");
    chart.configure_series_labels().position(SeriesLabelPosition::LowerRight).background_style(WHITE).draw()?;
    root.present()?;
    Ok(())
}
