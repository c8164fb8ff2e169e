//! One ZMQ SUB socket per replica, on its own thread.
//!
//! Each message must be exactly `[topic, seq (u64 big-endian), payload]`. The subscriber
//! tracks `seq` per replica:
//! - a **regression** (the engine restarted, its cache is empty) clears the replica at once;
//! - a **gap** (messages lost) is counted in `kvgate_kv_seq_gaps`.
//!
//! Bad messages are counted and dropped; nothing a publisher sends can stop the thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::decode::{decode_batch, KvEvent};
use crate::index::ReplicaIdx;
use crate::metrics::{Metrics, ReasonLabels};
use crate::pool::Pool;

/// Largest message accepted from a publisher; larger ones are dropped by ZMQ itself.
const MAX_MESSAGE_BYTES: i64 = 64 << 20;
/// How often a blocked receive wakes up to check for shutdown.
const POLL: Duration = Duration::from_millis(200);

/// Starts the subscriber thread of `replica` in `pool`. It runs until `stop` is set.
pub fn spawn(
    ctx: zmq::Context,
    pool: Arc<Pool>,
    replica: ReplicaIdx,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    let name = format!("kv-sub-{}", pool.config.replicas[replica].id);
    std::thread::Builder::new().name(name).spawn(move || {
        let endpoint = pool.config.replicas[replica].kv_events.clone();
        let mut sub = Subscriber { pool, replica, metrics, last_seq: None };
        while !stop.load(Ordering::Relaxed) {
            match open(&ctx, &endpoint) {
                Ok(socket) => sub.run(&socket, &stop),
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, "cannot open KV-event socket; retrying");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    })
}

fn open(ctx: &zmq::Context, endpoint: &str) -> zmq::Result<zmq::Socket> {
    let socket = ctx.socket(zmq::SUB)?;
    socket.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    socket.set_rcvtimeo(POLL.as_millis() as i32)?;
    socket.set_linger(0)?;
    socket.set_subscribe(b"")?;
    socket.connect(endpoint)?;
    Ok(socket)
}

struct Subscriber {
    pool: Arc<Pool>,
    replica: ReplicaIdx,
    metrics: Arc<Metrics>,
    last_seq: Option<u64>,
}

impl Subscriber {
    fn run(&mut self, socket: &zmq::Socket, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            match socket.recv_multipart(0) {
                Ok(frames) => self.handle(&frames),
                Err(zmq::Error::EAGAIN) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "KV-event receive failed; reconnecting");
                    return;
                }
            }
        }
    }

    fn drop_message(&self, reason: &str) {
        let labels = self.pool.labels(self.replica);
        self.metrics
            .events_dropped
            .get_or_create(&ReasonLabels { model: labels.model, replica: labels.replica, reason: reason.to_owned() })
            .inc();
    }

    fn handle(&mut self, frames: &[Vec<u8>]) {
        let [_topic, seq, payload] = frames else { return self.drop_message("frame_count") };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
            return self.drop_message("bad_seq");
        };
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(error = %e, "undecodable KV-event payload");
                return self.drop_message("decode");
            }
        };
        match self.last_seq {
            Some(last) if seq <= last => {
                tracing::info!(replica = %self.pool.config.replicas[self.replica].id, seq, last, "engine restarted; clearing its blocks");
                self.pool.index_mut().clear_replica(self.replica);
            }
            Some(last) if seq > last + 1 => {
                self.metrics.seq_gaps.get_or_create(&self.pool.labels(self.replica)).inc();
            }
            _ => {}
        }
        self.last_seq = Some(seq);
        self.pool.stats[self.replica].next_seq.store(seq + 1, Ordering::Relaxed);
        self.apply(batch.events);
    }

    fn apply(&self, events: Vec<KvEvent>) {
        let mut applied = 0u64;
        let blocks = {
            let mut index = self.pool.index_mut();
            for event in events {
                match event {
                    KvEvent::BlockStored(s) => {
                        if !is_device(s.medium.as_deref()) {
                            self.drop_message("medium_not_device");
                            continue;
                        }
                        if s.kv_cache_spec_kind.as_deref().is_some_and(|k| k != "full_attention") {
                            self.drop_message("not_full_attention");
                            continue;
                        }
                        match index.store(
                            self.replica,
                            s.parent_block_hash,
                            &s.block_hashes,
                            &s.token_ids,
                            s.block_size as usize,
                            s.lora_name.as_deref(),
                        ) {
                            Ok(()) => applied += 1,
                            Err(e) => self.drop_message(e.label()),
                        }
                    }
                    KvEvent::BlockRemoved(r) => {
                        if is_device(r.medium.as_deref()) {
                            index.remove(self.replica, &r.block_hashes);
                            applied += 1;
                        }
                    }
                    KvEvent::AllBlocksCleared => {
                        index.clear_replica(self.replica);
                        applied += 1;
                    }
                }
            }
            index.replica_blocks(self.replica)
        };
        let labels = self.pool.labels(self.replica);
        self.metrics.events_applied.get_or_create(&labels).inc_by(applied);
        self.metrics.index_blocks.get_or_create(&labels).set(blocks as i64);
        self.pool.stats[self.replica].events_applied.fetch_add(applied, Ordering::Relaxed);
    }
}

/// `None`, `GPU` and `DEVICE` (any case) are the device tier.
fn is_device(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU") || m.eq_ignore_ascii_case("DEVICE"))
}
