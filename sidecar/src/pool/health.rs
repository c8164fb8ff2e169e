//! Each replica's ingestion health (events applied, last sequence number, degraded, stalled,
//! disconnected) and whether its engine reports cached tokens: written by the applier and the transport, read by routing (`trusted`) and
//! `/debug/state`. The flags live in each member's `ReplicaHealth` (atomics); this file keeps
//! them and their gauges in step.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::members::{CACHE_REPORT_NO, CACHE_REPORT_YES, NONE};
use super::{Member, Pool};
use crate::index::ReplicaIdx;
use crate::metrics::{ReasonLabels, DEGRADED_REASONS};
use crate::msg::ingest::{Outcome, Progress};

impl Pool {
    /// Records what one ingested message did to a replica's health.
    pub fn after_ingest(&self, replica: ReplicaIdx, progress: Progress, outcome: &Outcome) {
        let h = self.members()[replica.get()].health.clone();
        h.events_applied.fetch_add(outcome.applied, Ordering::Relaxed);
        h.last_seq.store(progress.last_seq.unwrap_or(NONE), Ordering::Relaxed);
        h.degraded.store(progress.degraded, Ordering::Relaxed);
        h.awaiting_events_since.store(NONE, Ordering::Relaxed);
        h.stalled.store(false, Ordering::Relaxed);
        h.disconnected.store(false, Ordering::Relaxed);
        let blocks = self.index.read().replica_blocks(replica);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.set_gauges(replica, |labels| {
            self.metrics.index_blocks.get_or_create(labels).set(blocks as i64);
            self.metrics.last_event.get_or_create(labels).set(now as i64);
        });
        self.publish_health(replica);
    }

    /// Flags replicas whose publisher has been silent for `timeout` while they were expected
    /// to store blocks.
    pub fn check_stalls(&self, timeout: Duration) {
        let now = self.now_ms();
        let stalled: Vec<ReplicaIdx> = {
            let members = self.members();
            let newly_stalled = |m: &Member| {
                let since = m.health.awaiting_events_since.load(Ordering::Relaxed);
                m.active
                    && since != NONE
                    && now.saturating_sub(since) > timeout.as_millis() as u64
                    && !m.health.stalled.swap(true, Ordering::Relaxed)
            };
            members.iter().enumerate().filter(|(_, m)| newly_stalled(m)).map(|(i, _)| ReplicaIdx::new(i)).collect()
        };
        for i in stalled {
            tracing::warn!(replica = %self.labels(i).replica, "KV-event publisher stalled; routing on load only");
            self.publish_health(i);
        }
    }

    /// Records that the connection to a replica's publisher dropped: it earns no cache
    /// credit until its next message shows whether its engine restarted.
    pub fn publisher_disconnected(&self, replica: ReplicaIdx) {
        let h = self.members()[replica.get()].health.clone();
        if !h.disconnected.swap(true, Ordering::Relaxed) {
            tracing::warn!(replica = %self.labels(replica).replica, "KV-event publisher disconnected; no cache credit until it is back");
            self.publish_health(replica);
        }
    }

    /// Records whether a replica's engine reported cached prompt tokens in a usage report;
    /// says once, when it first reports none, how to turn them on.
    pub(super) fn cache_report(&self, replica: ReplicaIdx, reported: bool) {
        let h = self.members()[replica.get()].health.clone();
        let now = if reported { CACHE_REPORT_YES } else { CACHE_REPORT_NO };
        if h.cache_report.swap(now, Ordering::Relaxed) == now {
            return;
        }
        let labels = self.labels(replica);
        if !reported {
            tracing::warn!(
                model = %labels.model,
                replica = %labels.replica,
                "the engine reports no cached prompt tokens, so kvgate cannot check its cache predictions for it \
                 (counted in kvgate_predictions_unchecked_total, no alarm): start vLLM with \
                 --enable-prompt-tokens-details (SGLang: --enable-cache-report)"
            );
        }
        self.set_gauges(replica, |labels| {
            self.metrics.engine_reports_cached_tokens.get_or_create(labels).set(i64::from(reported));
        });
    }

    fn publish_health(&self, replica: ReplicaIdx) {
        let h = self.members()[replica.get()].health.clone();
        self.set_gauges(replica, |l| {
            for (reason, flag) in DEGRADED_REASONS.into_iter().zip([&h.degraded, &h.stalled, &h.disconnected]) {
                let labels = ReasonLabels { model: l.model.clone(), replica: l.replica.clone(), reason: reason.into() };
                self.metrics.degraded.get_or_create(&labels).set(i64::from(flag.load(Ordering::Relaxed)));
            }
        });
    }
}
