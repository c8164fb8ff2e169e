//! From a run's outcomes to the numbers in the report.

use serde::{Deserialize, Serialize};

use super::loadgen::{Outcome, OUTSIDE};

/// Nearest-rank percentile of unsorted values (`p` in 0..=100); `None` if empty.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    Some(v[rank.min(v.len()) - 1])
}

/// The median of unsorted values.
pub fn median(values: &[f64]) -> Option<f64> {
    percentile(values, 50.0)
}

/// What a request must meet to count as served well (simulated seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Its time to first token at most this: goodput counts these.
    pub ttft_s: f64,
    /// And its mean inter-token latency at most this: SLO attainment counts those meeting
    /// both.
    pub itl_s: f64,
}

/// One (workload, policy, QPS, repeat) run, summarised. Latencies in simulated seconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that completed with 200 and at least one token.
    pub ok: usize,
    /// Requests that failed (status ≠ 200, transport error or timeout).
    pub errors: usize,
    /// Of those, 503s.
    pub status_503: usize,
    /// Of those, 429s: shed by admission control.
    pub status_429: usize,
    /// `status_429` over `requests`: the share shed, which the TTFT percentiles do not see.
    pub shed_share: f64,
    /// TTFT percentiles over the requests served: a shed or failed request has no TTFT, so
    /// they say nothing of it (`status_429`, `shed_share` and `goodput` do).
    pub ttft_p50: Option<f64>,
    /// .
    pub ttft_p90: Option<f64>,
    /// .
    pub ttft_p99: Option<f64>,
    /// Median over requests of their mean inter-token latency.
    pub itl_p50: Option<f64>,
    /// The 90th percentile of the same.
    pub itl_p90: Option<f64>,
    /// The 99th percentile of the same.
    pub itl_p99: Option<f64>,
    /// End-to-end percentiles.
    pub e2e_p50: Option<f64>,
    /// .
    pub e2e_p99: Option<f64>,
    /// Output tokens per simulated second, over the run's span.
    pub output_tps: f64,
    /// Fraction of requests sent that completed with TTFT within the SLO: a shed or failed
    /// request counts as a miss.
    pub goodput: f64,
    /// Fraction of requests sent that completed within both SLOs, TTFT and mean ITL (a
    /// request of one output token has no ITL and meets that one): a shed or failed request
    /// counts as a miss.
    #[serde(default)]
    pub slo_attainment: f64,
    /// kvgate's TTFT predictions against what its filter measured, over the run's checked
    /// decisions (every gateway's last `explain_keep`, none older than `explain_max_age_secs`:
    /// a long run's last minutes): the relative error's p50 and p90, and
    /// how many were checked. `None` for routers without them.
    #[serde(default)]
    pub ttft_error_p50: Option<f64>,
    /// .
    #[serde(default)]
    pub ttft_error_p90: Option<f64>,
    /// .
    #[serde(default)]
    pub ttft_checks: usize,
    /// Prefix-cache hits / queries, from the engines' `/metrics`.
    pub hit_ratio: Option<f64>,
    /// The most any placement could reach on the same prompts in the same order: one
    /// infinite cache shared by the fleet ([`super::ceiling`]), over the requests served.
    #[serde(default)]
    pub hit_ceiling: Option<f64>,
    /// Cached prompt tokens over prompt tokens, from the engines' `usage` of the requests
    /// served: the hit ratio over the same requests as `hit_ceiling` (the engines' counters
    /// also count recomputed prompts).
    #[serde(default)]
    pub hit_ratio_served: Option<f64>,
    /// Max over mean of per-engine token load (uncached prompt + output tokens computed).
    pub load_max_over_mean: Option<f64>,
    /// A floor under this run's max/mean set by the traffic no router saw (tenant `outside`,
    /// all on one engine): that engine's outside load over this run's mean engine load, at
    /// least 1. The mean is this run's, so a router that leaves more uncached work raises it
    /// and lowers its own floor: floors of different routers are not one bound. `None`
    /// without such traffic.
    pub load_floor: Option<f64>,
    /// kvgate's routing decision on the request path (`x-kvgate-decision-us`: the filter's
    /// body-to-destination time, tokenizing and scoring included), wall µs, median and p90;
    /// `None` for routers without it.
    pub decision_us_p50: Option<f64>,
    /// .
    pub decision_us_p90: Option<f64>,
    /// The median of the decisions' rendering and tokenizing in Envoy (`x-kvgate-tokenize-us`),
    /// wall µs; a prompt offloaded to the sidecar is tokenized there, in the rest of the decision.
    pub tokenize_us_p50: Option<f64>,
    /// CPU time the routers' processes used (every gateway's Envoy and sidecar, or every
    /// instance of a peer router) per request sent, in wall-clock milliseconds.
    pub router_cpu_ms: Option<f64>,
    /// The engines' simulated clocks' lag: wall time lost behind the clock over wall time
    /// stepped, all engines together (0: the host kept up; a few % or more: the run measures
    /// the host's CPU as much as the routing).
    pub sim_clock_lag: Option<f64>,
    /// The requests served, replayed in simulated time under this router's placement, round
    /// robin and a greedy clairvoyant one ([`super::oracle`]); `None` for a disaggregated
    /// fleet.
    pub replayed: Option<super::oracle::Replayed>,
}

/// One engine's counters over a run (differences of its `/metrics` before and after).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineWork {
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up (recomputes included).
    pub queried: f64,
    /// `vllm:prefix_cache_hits_total`: of those, found in the cache.
    pub hits: f64,
    /// `vllm:generation_tokens_total`: output tokens.
    pub generated: f64,
    /// `kvgate_sim:step_wall_seconds_total`: wall time its steps were given.
    pub stepped_s: f64,
    /// `kvgate_sim:clock_lost_seconds_total`: of that, time its clock fell behind and lost.
    pub lost_s: f64,
}

impl EngineWork {
    /// Tokens the engine computed: uncached prompt tokens plus output tokens.
    pub fn load(&self) -> f64 {
        self.queried - self.hits + self.generated
    }
}

/// Summarises outcomes, with each engine's counters (idle engines count in the balance).
pub fn summarize(outcomes: &[Outcome], slo: Slo, engines: &[EngineWork]) -> Summary {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
    let ttfts: Vec<f64> = ok.iter().filter_map(|o| o.ttft).collect();
    // Per-request mean ITL: SSE chunks can arrive coalesced, so single gaps are noise.
    let itls: Vec<f64> = ok.iter().filter_map(|o| o.itl_mean).collect();
    let e2es: Vec<f64> = ok.iter().map(|o| o.e2e).collect();
    let start = outcomes.iter().map(|o| o.sent_at).fold(f64::INFINITY, f64::min);
    let end = ok.iter().map(|o| o.sent_at + o.e2e).fold(f64::NEG_INFINITY, f64::max);
    let tokens: u64 = ok.iter().map(|o| o.output_tokens).sum();
    let span = end - start;
    let loads: Vec<f64> = engines.iter().map(EngineWork::load).collect();
    let queried: f64 = engines.iter().map(|e| e.queried).sum();
    let hit_ratio = (queried > 0.0).then(|| engines.iter().map(|e| e.hits).sum::<f64>() / queried);
    let stepped: f64 = engines.iter().map(|e| e.stepped_s).sum();
    let sim_clock_lag = (stepped > 0.0).then(|| engines.iter().map(|e| e.lost_s).sum::<f64>() / stepped);
    let mean_load = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    let decisions: Vec<f64> = ok.iter().filter_map(|o| o.decision_us).map(|us| us as f64).collect();
    let tokenizing: Vec<f64> = ok.iter().filter_map(|o| o.tokenize_us).map(|us| us as f64).collect();
    let shed = outcomes.iter().filter(|o| o.status == 429).count();
    Summary {
        requests: outcomes.len(),
        ok: ok.len(),
        errors: outcomes.len() - ok.len(),
        status_503: outcomes.iter().filter(|o| o.status == 503).count(),
        status_429: shed,
        shed_share: shed as f64 / outcomes.len().max(1) as f64,
        ttft_p50: percentile(&ttfts, 50.0),
        ttft_p90: percentile(&ttfts, 90.0),
        ttft_p99: percentile(&ttfts, 99.0),
        itl_p50: percentile(&itls, 50.0),
        itl_p90: percentile(&itls, 90.0),
        itl_p99: percentile(&itls, 99.0),
        e2e_p50: percentile(&e2es, 50.0),
        e2e_p99: percentile(&e2es, 99.0),
        output_tps: if span > 0.0 { tokens as f64 / span } else { 0.0 },
        goodput: ttfts.iter().filter(|t| **t <= slo.ttft_s).count() as f64 / outcomes.len().max(1) as f64,
        slo_attainment: ok
            .iter()
            .filter(|o| o.ttft.is_some_and(|t| t <= slo.ttft_s) && o.itl_mean.is_none_or(|itl| itl <= slo.itl_s))
            .count() as f64
            / outcomes.len().max(1) as f64,
        // Read from the sidecars by the run's driver.
        ttft_error_p50: None,
        ttft_error_p90: None,
        ttft_checks: 0,
        hit_ratio,
        hit_ceiling: None,
        hit_ratio_served: {
            let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
            (prompt > 0).then(|| ok.iter().map(|o| o.cached_tokens).sum::<u64>() as f64 / prompt as f64)
        },
        load_max_over_mean: (mean_load > 0.0).then(|| loads.iter().copied().fold(0.0, f64::max) / mean_load),
        load_floor: (mean_load > 0.0).then(|| unseen_load(&ok)).flatten().map(|unseen| (unseen / mean_load).max(1.0)),
        decision_us_p50: percentile(&decisions, 50.0),
        decision_us_p90: percentile(&decisions, 90.0),
        tokenize_us_p50: percentile(&tokenizing, 50.0),
        // Measured around the run by its driver, not from the outcomes.
        router_cpu_ms: None,
        sim_clock_lag,
        // Replayed by the run's driver, which knows the fleet.
        replayed: None,
    }
}

/// The most token load (uncached prompt + output, as the engines count it) that traffic no
/// router saw (tenant [`OUTSIDE`]) put on one engine; `None` without such traffic.
fn unseen_load(ok: &[&Outcome]) -> Option<f64> {
    let mut per_engine = std::collections::HashMap::<&str, u64>::new();
    for o in ok.iter().filter(|o| o.tags.tenant == Some(OUTSIDE)) {
        *per_engine.entry(&o.replica).or_default() += o.prompt_tokens.saturating_sub(o.cached_tokens) + o.output_tokens;
    }
    per_engine.into_values().max().map(|tokens| tokens as f64)
}

/// One priority class's or tenant's requests in a run, summarised as a run is (without the
/// engines' counters, which are not per request).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TagSummary {
    /// `priority=interactive`, `tenant=steady`, …
    pub tag: String,
    /// Its requests' numbers.
    pub summary: Summary,
}

/// The run's requests per priority class and per tenant, in name order (empty when the run
/// tagged none).
pub fn by_tag(outcomes: &[Outcome], slo: Slo) -> Vec<TagSummary> {
    let mut tags = std::collections::BTreeMap::<String, Vec<Outcome>>::new();
    for o in outcomes {
        let names = [("priority", o.tags.priority), ("tenant", o.tags.tenant)];
        for (kind, value) in names {
            if let Some(v) = value {
                tags.entry(format!("{kind}={v}")).or_default().push(o.clone());
            }
        }
    }
    tags.into_iter().map(|(tag, os)| TagSummary { tag, summary: summarize(&os, slo, &[]) }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TTFT within 1 s and a mean ITL within 50 ms.
    const SLO: Slo = Slo { ttft_s: 1.0, itl_s: 0.05 };
    use crate::bench::loadgen::Tags;

    fn outcome(replica: &str, ttft: f64, prompt: u64, cached: u64) -> Outcome {
        Outcome { prompt_tokens: prompt, cached_tokens: cached, ..Outcome::served("0", replica, ttft) }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 90.0), Some(90.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn summary_counts_errors_goodput_and_load_balance() {
        let mut failed = outcome("a", 0.0, 0, 0);
        failed.status = 503;
        failed.ttft = None;
        let outcomes = vec![outcome("a", 0.1, 100, 0), outcome("a", 3.0, 100, 50), outcome("b", 0.2, 100, 100), failed];
        let engines = [
            EngineWork { queried: 200.0, hits: 50.0, generated: 20.0, stepped_s: 3.0, lost_s: 0.3 },
            EngineWork { queried: 100.0, hits: 100.0, generated: 10.0, stepped_s: 1.0, lost_s: 0.0 },
            EngineWork::default(),
        ];
        let s = summarize(&outcomes, SLO, &engines);
        assert_eq!((s.requests, s.ok, s.errors, s.status_503), (4, 3, 1, 1));
        assert_eq!(s.goodput, 0.5, "2 of 4 within the SLO");
        assert_eq!(s.hit_ratio, Some(0.5));
        // Loads: 170, 10, 0 → mean 60, max 170.
        assert!((s.load_max_over_mean.unwrap() - 170.0 / 60.0).abs() < 1e-9);
        assert_eq!(s.output_tps, 15.0, "30 tokens over 2 s");
        assert!((s.sim_clock_lag.unwrap() - 0.3 / 4.0).abs() < 1e-9, "0.3 s lost of 4 s stepped");
        assert_eq!((s.load_floor, s.decision_us_p50), (None, None), "no outside traffic, no decisions");
    }

    /// Shed requests have no TTFT, so the percentiles cannot show them: the summary counts
    /// them, and their share, beside the percentiles, and goodput counts them as misses.
    #[test]
    fn shed_requests_are_counted_beside_the_ttft_they_lack() {
        let shed = || Outcome { status: 429, ttft: None, ..outcome("a", 0.0, 0, 0) };
        let outcomes = vec![outcome("a", 0.1, 1, 0), outcome("a", 0.2, 1, 0), outcome("b", 0.3, 1, 0), shed(), shed()];
        let s = summarize(&outcomes, SLO, &[]);
        assert_eq!((s.requests, s.ok, s.errors, s.status_429), (5, 3, 2, 2));
        assert_eq!(s.shed_share, 0.4, "2 of 5 shed");
        assert_eq!((s.ttft_p50, s.ttft_p90), (Some(0.2), Some(0.3)), "over the 3 served only");
        assert_eq!(s.goodput, 0.6, "3 of 5 sent within the SLO: the shed are misses");
        assert_eq!(summarize(&[], SLO, &[]).shed_share, 0.0, "nothing sent, nothing shed");
    }

    /// SLO attainment asks for both: a quick first token and quick tokens after it. A request of
    /// one token has no ITL to miss; a shed one misses both.
    #[test]
    fn slo_attainment_counts_requests_within_both_slos_of_all_sent() {
        let with_itl = |ttft, itl| Outcome { itl_mean: itl, ..outcome("a", ttft, 1, 0) };
        let shed = Outcome { status: 429, ttft: None, ..outcome("a", 0.0, 0, 0) };
        let outcomes = vec![
            with_itl(0.5, Some(0.01)),
            with_itl(0.5, Some(0.08)),
            with_itl(2.0, Some(0.01)),
            with_itl(0.5, None),
            shed,
        ];
        let s = summarize(&outcomes, SLO, &[]);
        assert_eq!(s.goodput, 0.6, "3 of 5 within the TTFT SLO");
        assert_eq!(s.slo_attainment, 0.4, "2 of 5 within both");
    }

    /// Traffic around the routers sets a floor under the run's balance; decisions
    /// are timed from the filter's header.
    #[test]
    fn outside_traffic_floors_the_balance_and_decisions_are_timed() {
        let outside = |replica, prompt, cached| Outcome {
            tags: Tags { priority: None, tenant: Some(OUTSIDE) },
            ..outcome(replica, 0.1, prompt, cached)
        };
        let routed = |us| Outcome { decision_us: Some(us), tokenize_us: Some(us / 10), ..outcome("b", 0.1, 100, 0) };
        let outcomes = vec![outside("a", 200, 50), outside("a", 100, 0), outside("b", 30, 0), routed(900), routed(100)];
        // Engine loads 300 and 100: mean 200. Outside traffic put 150 + 10 + 100 + 10 = 270 on "a".
        let engines = [
            EngineWork { queried: 300.0, hits: 50.0, generated: 50.0, ..EngineWork::default() },
            EngineWork { queried: 100.0, hits: 0.0, generated: 0.0, ..EngineWork::default() },
        ];
        let s = summarize(&outcomes, SLO, &engines);
        assert!((s.load_floor.unwrap() - 270.0 / 200.0).abs() < 1e-9, "{:?}", s.load_floor);
        assert_eq!((s.decision_us_p50, s.decision_us_p90), (Some(100.0), Some(900.0)));
        assert_eq!(s.tokenize_us_p50, Some(10.0), "the tokenizing part's median");
        // Outside load below the mean: the floor is perfect balance.
        let light = summarize(&[outside("a", 20, 0)], SLO, &engines);
        assert_eq!(light.load_floor, Some(1.0));
    }

    #[test]
    fn tagged_requests_are_summarised_per_class_and_tenant() {
        let tagged = |ttft, priority, tenant| Outcome { tags: Tags { priority, tenant }, ..outcome("a", ttft, 1, 0) };
        let mut shed = tagged(0.0, Some("batch"), None);
        (shed.status, shed.ttft) = (429, None);
        let outcomes = vec![
            tagged(0.1, Some("interactive"), Some("t1")),
            tagged(0.3, Some("interactive"), None),
            tagged(5.0, Some("batch"), Some("t1")),
            shed,
            outcome("a", 0.2, 1, 0),
        ];
        let t = by_tag(&outcomes, SLO);
        let names: Vec<&str> = t.iter().map(|t| t.tag.as_str()).collect();
        assert_eq!(names, ["priority=batch", "priority=interactive", "tenant=t1"]);
        let s: Vec<&Summary> = t.iter().map(|t| &t.summary).collect();
        assert_eq!((s[0].requests, s[0].ok, s[0].status_429, s[0].goodput), (2, 1, 1, 0.0));
        assert_eq!((s[1].ttft_p50, s[1].ttft_p90, s[1].goodput), (Some(0.1), Some(0.3), 1.0));
        assert_eq!((s[2].requests, s[2].goodput), (2, 0.5));
        assert!(by_tag(&[outcome("a", 0.2, 1, 0)], SLO).is_empty(), "untagged runs have no rows");
    }
}
