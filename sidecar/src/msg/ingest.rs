//! What ingesting one message of a replica's events did: the applier's report to the pool
//! (its health, gauges and metrics). Pure types; the ingestion is in `crate::events`.

/// What happened to one message, for metrics.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Outcome {
    /// Events applied to the index.
    pub applied: u64,
    /// Events (or whole messages) dropped, by reason.
    pub dropped: Vec<&'static str>,
    /// Gaps closed by replay.
    pub gaps_replayed: u64,
    /// Gaps that could not be closed (the replica is now degraded).
    pub gaps_lost: u64,
    /// The replica's blocks were cleared (restart or `AllBlocksCleared`).
    pub cleared: bool,
    /// The engine's timestamp (Unix seconds) of the newest batch in the message, if one was
    /// decoded: how late its changes became visible is measured from it.
    pub published: Option<f64>,
}

impl Outcome {
    /// Counts the stores the index refused when the changes were applied (`crate::events::ingest::apply`): they
    /// were counted as applied when planned.
    pub fn refused(&mut self, reasons: Vec<&'static str>) {
        self.applied -= reasons.len() as u64;
        self.dropped.extend(reasons);
    }
}

/// A replica's ingestion state after a message, as its health reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Whether a lost range may have left stale blocks in the index.
    pub degraded: bool,
}
