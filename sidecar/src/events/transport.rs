//! ZMQ transport: per replica, a reader thread on a SUB socket feeding a bounded queue, and an
//! applier thread that runs [`super::ingest::Ingest`] against the pool's index.
//!
//! - The reader never waits for the index: when the queue is full the message is dropped and
//!   counted, and the applier sees a sequence gap, which it replays like any other.
//! - Messages must be exactly `[topic, seq (8 bytes, big-endian), payload]`.
//! - A ZMQ socket monitor watches the connection: when it drops (the engine died or
//!   restarted, or the network failed) the replica earns no cache credit until its next
//!   message, which either continues the sequence (gaps replayed as usual) or starts it again
//!   (a restart: the replica is cleared).
//! - Replay uses a DEALER: send `["", start_seq_be8]`, read until the end marker (seq
//!   `ff…ff`, empty payload). Both reply layouts are accepted: `["", seq, payload]` (vLLM ≤
//!   0.25) and `["", topic, seq, payload]` (0.26+).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::ingest::{Ingest, NoReplay, Outcome, Replay};
use crate::config::{EventsMode, ReplicaConfig};
use crate::index::ReplicaIdx;
use crate::metrics::Metrics;
use crate::pool::Pool;

/// Largest message accepted from a publisher; ZMQ drops larger ones itself.
const MAX_MESSAGE_BYTES: i64 = 64 << 20;
/// Messages buffered between a reader and its applier.
const QUEUE_MESSAGES: usize = 10_000;
/// How often blocked calls wake up to check for shutdown.
const POLL: Duration = Duration::from_millis(200);
/// How long a replay may take in all.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// The most messages one replay returns (vLLM buffers 10 000 by default).
const REPLAY_MAX_MESSAGES: usize = 100_000;

/// One replica's event source: its slot, its endpoints, and the flag that stops its threads
/// (set when it leaves the pool, or at shutdown).
#[derive(Debug, Clone)]
pub struct Source {
    /// The replica's slot in the pool.
    pub replica: ReplicaIdx,
    /// Its endpoints.
    pub config: ReplicaConfig,
    /// Stops both threads.
    pub stop: Arc<AtomicBool>,
}

/// Starts the reader and applier threads of one replica. They run until its stop flag is set.
pub fn spawn(
    ctx: zmq::Context,
    pool: Arc<Pool>,
    source: Source,
    metrics: Arc<Metrics>,
) -> std::io::Result<Vec<JoinHandle<()>>> {
    let (tx, rx) = sync_channel::<(u64, Vec<u8>)>(QUEUE_MESSAGES);
    let id = source.config.id.clone();
    let reader = {
        let (ctx, pool, metrics, source) = (ctx.clone(), pool.clone(), metrics.clone(), source.clone());
        std::thread::Builder::new()
            .name(format!("kv-read-{id}"))
            .spawn(move || read_loop(&ctx, &pool, &source, &metrics, tx))?
    };
    let applier = std::thread::Builder::new()
        .name(format!("kv-apply-{id}"))
        .spawn(move || apply_loop(&ctx, &pool, &source, &metrics, rx))?;
    Ok(vec![reader, applier])
}

fn open_sub(ctx: &zmq::Context, r: &ReplicaConfig) -> zmq::Result<zmq::Socket> {
    let socket = ctx.socket(zmq::SUB)?;
    socket.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    socket.set_rcvtimeo(POLL.as_millis() as i32)?;
    socket.set_rcvhwm(100_000)?;
    socket.set_linger(0)?;
    socket.set_subscribe(r.kv_events_topic.as_bytes())?;
    match r.kv_events_mode {
        EventsMode::Connect => socket.connect(&r.kv_events)?,
        EventsMode::Bind => socket.bind(&r.kv_events)?,
    }
    Ok(socket)
}

/// A monitor of `socket`'s disconnections, on a PAIR socket.
fn monitor(ctx: &zmq::Context, socket: &zmq::Socket, name: &str) -> zmq::Result<zmq::Socket> {
    static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let endpoint = format!("inproc://kv-monitor-{name}-{}", MONITORS.fetch_add(1, Ordering::Relaxed));
    socket.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED.to_raw().into())?;
    let events = ctx.socket(zmq::PAIR)?;
    events.set_linger(0)?;
    events.connect(&endpoint)?;
    Ok(events)
}

/// Whether the monitor reported a disconnection (reads every pending monitor event).
fn disconnected(monitor: &zmq::Socket) -> bool {
    let mut dropped = false;
    while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
        let event = frames.first().and_then(|f| f.get(..2)).map(|b| u16::from_le_bytes([b[0], b[1]]));
        dropped |= event == Some(zmq::SocketEvent::DISCONNECTED.to_raw());
    }
    dropped
}

fn read_loop(ctx: &zmq::Context, pool: &Pool, source: &Source, metrics: &Metrics, tx: SyncSender<(u64, Vec<u8>)>) {
    let (replica, stop) = (source.replica, &source.stop);
    while !stop.load(Ordering::Relaxed) {
        let opened = open_sub(ctx, &source.config).and_then(|s| Ok((monitor(ctx, &s, &source.config.id)?, s)));
        let (events, socket) = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(endpoint = %source.config.kv_events, error = %e, "cannot open the KV-event socket; retrying");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        while !stop.load(Ordering::Relaxed) {
            let mut items = [socket.as_poll_item(zmq::POLLIN), events.as_poll_item(zmq::POLLIN)];
            if let Err(e) = zmq::poll(&mut items, POLL.as_millis() as i64) {
                tracing::warn!(error = %e, "KV-event poll failed; reopening");
                break;
            }
            if items[1].is_readable() && disconnected(&events) {
                pool.publisher_disconnected(replica);
            }
            if !items[0].is_readable() {
                continue;
            }
            let frames = match socket.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "KV-event receive failed; reopening");
                    break;
                }
            };
            let [_topic, seq, payload] = <[Vec<u8>; 3]>::try_from(frames).unwrap_or_default();
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
                metrics.dropped(pool, replica, "bad_frames");
                continue;
            };
            match tx.try_send((seq, payload)) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => metrics.dropped(pool, replica, "queue_full"),
                Err(TrySendError::Disconnected(_)) => return,
            }
        }
    }
}

fn apply_loop(ctx: &zmq::Context, pool: &Pool, source: &Source, metrics: &Metrics, rx: Receiver<(u64, Vec<u8>)>) {
    let (replica, stop) = (source.replica, &source.stop);
    let mut ingest = Ingest::new(replica, pool.config.block_size as usize);
    let replay_endpoint = source.config.kv_replay.clone();
    while !stop.load(Ordering::Relaxed) {
        let (seq, payload) = match rx.recv_timeout(POLL) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let outcome = {
            let mut index = pool.index_mut();
            // The replica may have left while this message waited: its slot was cleared
            // under this lock after the flag was set, so nothing may be written now.
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match &replay_endpoint {
                Some(endpoint) => ingest.on_message(seq, &payload, &mut index, &mut Dealer { ctx, endpoint }),
                None => ingest.on_message(seq, &payload, &mut index, &mut NoReplay),
            }
        };
        pool.after_ingest(replica, &ingest, &outcome);
        record(metrics, pool, replica, &outcome);
    }
}

fn record(metrics: &Metrics, pool: &Pool, replica: ReplicaIdx, outcome: &Outcome) {
    let labels = pool.labels(replica);
    metrics.events_applied.get_or_create(&labels).inc_by(outcome.applied);
    metrics.gaps_replayed.get_or_create(&labels).inc_by(outcome.gaps_replayed);
    metrics.gaps_lost.get_or_create(&labels).inc_by(outcome.gaps_lost);
    for reason in &outcome.dropped {
        metrics.dropped(pool, replica, reason);
    }
}

/// Replay over a DEALER socket.
struct Dealer<'a> {
    ctx: &'a zmq::Context,
    endpoint: &'a str,
}

impl Replay for Dealer<'_> {
    fn replay(&mut self, start: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        replay(self.ctx, self.endpoint, start).map_err(|e| e.to_string())
    }
}

/// Fetches the messages an engine still buffers from `start` on.
pub fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> anyhow::Result<Vec<(u64, Vec<u8>)>> {
    let socket = ctx.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    socket.set_rcvtimeo(REPLAY_TIMEOUT.as_millis() as i32)?;
    socket.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    socket.connect(endpoint)?;
    socket.send_multipart([&b""[..], &start.to_be_bytes()], 0)?;
    let deadline = std::time::Instant::now() + REPLAY_TIMEOUT;
    let mut out = Vec::new();
    loop {
        if std::time::Instant::now() > deadline || out.len() > REPLAY_MAX_MESSAGES {
            anyhow::bail!("replay from {endpoint} did not finish");
        }
        let frames = socket.recv_multipart(0)?;
        let frames: Vec<&Vec<u8>> = frames.iter().skip_while(|f| f.is_empty()).collect();
        let (seq, payload) = match frames.as_slice() {
            // Leading empty frames (delimiter, empty topic) are stripped above.
            [seq, payload] | [_, seq, payload] => (seq, payload),
            _ => anyhow::bail!("replay reply with {} frames", frames.len()),
        };
        let seq = <[u8; 8]>::try_from(seq.as_slice())
            .map(u64::from_be_bytes)
            .map_err(|_| anyhow::anyhow!("bad replay seq"))?;
        if seq == u64::MAX && payload.is_empty() {
            return Ok(out);
        }
        out.push((seq, payload.to_vec()));
    }
}
