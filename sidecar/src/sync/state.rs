//! The handover sockets: a running sidecar answers a starting peer's request with its view
//! ([`serve`], a ROUTER on the sync port + 1); a starting sidecar asks its peers before its
//! pools read any event ([`recover`]) and takes over the first whole answer.
//!
//! - Peers are the sync peers (`peers`, `peers_dns`), asked on their sync port + 1, one at a
//!   time. Those not accepting TCP connections are skipped at once, so a sidecar with no peer
//!   up (the first gateway, or one alone) starts without waiting; otherwise it waits at most
//!   `handover_timeout_ms` in all and, with no answer, rebuilds from the engines' replay as
//!   before. A peer of another release does not answer (the request names the version), so
//!   during an upgrade the wait runs out; a sidecar never takes its own answer.
//! - An answer is one multipart message, one [`Part`] a frame (a replica's blocks each,
//!   bookings in bounded frames), every frame at most [`MAX_FRAME_BYTES`] (a bigger one is
//!   left out, its replica rebuilt from replay). Frames are read one by one: one that cannot
//!   be read loses only itself.
//! - What a peer hands over is trusted as its sync messages are: it can skew cache credit and
//!   load, never add a target to a pool. With a key, the request and every frame of the
//!   answer are sealed ([`super::seal`]); a request not sealed with the key is not answered.
//! - Answering is bounded: at most `handover_burst` answers at once, then one per
//!   `handover_refill_ms` ([`Bucket`]); an answer holds at most [`MAX_ANSWER_BYTES`]; and
//!   at most one answer waits to be sent to any asker (ZMQ's send high-water mark), so a
//!   flood of requests cannot turn into a pile of exports in memory.

use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use super::seal::{Purpose, Sealer};
use super::SyncConfig;
use crate::health::Health;
use crate::metrics::{Metrics, RefusalLabels};
use crate::msg::handover::{Handover, HandoverError, Part, PoolHandover, REQUEST};
use crate::pool::{Pool, TakenOver};

/// The largest frame of an answer the server sends and the asker reads (a replica of a
/// million blocks is ~20 MB; bookings come in frames of a bounded number of hashes).
pub const MAX_FRAME_BYTES: i64 = 48 << 20;
/// The most bytes one answer holds; frames past it are left out (their replicas are rebuilt
/// from the engines' replay by the asker).
pub const MAX_ANSWER_BYTES: usize = 256 << 20;
/// How long a TCP probe of a peer's handover port may take.
const PROBE: Duration = Duration::from_millis(300);
/// How often the server wakes up to check for shutdown.
const POLL: Duration = Duration::from_millis(100);

/// The handover endpoint of a sync endpoint: the same address, the next port.
pub fn handover_endpoint(sync_endpoint: &str) -> Option<String> {
    let (base, port) = sync_endpoint.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    Some(format!("{base}:{}", port.checked_add(1)?))
}

/// Starts the thread that answers starting peers with `pools`' view.
pub fn serve(
    config: &SyncConfig,
    own_id: String,
    pools: HashMap<String, Arc<Pool>>,
    metrics: Arc<Metrics>,
    ctx: &zmq::Context,
    health: &Arc<Health>,
    sealer: &Sealer,
) -> anyhow::Result<JoinHandle<()>> {
    let endpoint = handover_endpoint(&config.listen)
        .ok_or_else(|| anyhow::anyhow!("sync.listen {:?} has no port to put the handover next to", config.listen))?;
    let sealer = sealer.clone();
    let mut bucket =
        Bucket::new(config.handover_burst, Duration::from_millis(config.handover_refill_ms), Instant::now());
    let socket = ctx.socket(zmq::ROUTER)?;
    socket.set_linger(0)?;
    socket.set_rcvtimeo(POLL.as_millis() as i32)?;
    socket.set_maxmsgsize(1024)?;
    // One answer at most waits for any asker; past it ROUTER drops the next.
    socket.set_sndhwm(1)?;
    socket.bind(&endpoint).map_err(|e| anyhow::anyhow!("binding the handover port {endpoint}: {e}"))?;
    tracing::info!(%endpoint, "handover to starting peers on");
    // Building and sending a whole view may take a while.
    let worker = health.worker("sync-handover", Duration::from_secs(120));
    Ok(std::thread::Builder::new().name("sync-handover".into()).spawn(move || {
        while !worker.stopping() {
            let frames = match socket.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "handover receive failed");
                    continue;
                }
            };
            let [peer, empty, request] = <[Vec<u8>; 3]>::try_from(frames).unwrap_or_default();
            let refuse = |reason: &str| {
                metrics.handovers_refused.get_or_create(&RefusalLabels { reason: reason.into() }).inc();
            };
            let request = match sealer.open(Purpose::HandoverRequest, request, SystemTime::now()) {
                Ok(request) => request,
                Err(e) => {
                    refuse(e.reason());
                    tracing::debug!(error = %e, "a handover request refused");
                    continue;
                }
            };
            if !empty.is_empty() || request != REQUEST {
                tracing::debug!("a handover request of another release, or garbage; not answered");
                continue;
            }
            if !bucket.take(Instant::now()) {
                refuse("rate_limited");
                tracing::debug!("a handover request over the rate limit; not answered");
                continue;
            }
            let started = Instant::now();
            let view = export(&own_id, &pools, |pool| pool.export_handover(&own_id));
            let mut reply = vec![peer, Vec::new()];
            let mut bytes = 0;
            for part in view.into_parts() {
                match kvgate_shared::codec::encode(&part) {
                    // Past the bound the asker would drop the connection: the frame is left
                    // out, and its replica rebuilt from the engine's replay there.
                    Ok(frame) if frame.len() as i64 > MAX_FRAME_BYTES => {
                        tracing::warn!(bytes = frame.len(), "a handover frame is too big; left out")
                    }
                    Ok(frame) if bytes + frame.len() > MAX_ANSWER_BYTES => {
                        tracing::warn!(bytes = frame.len(), "the handover answer is full; a frame left out")
                    }
                    Ok(frame) => {
                        bytes += frame.len();
                        reply.push(sealer.seal(Purpose::HandoverAnswer, frame, SystemTime::now()));
                    }
                    Err(e) => tracing::warn!(error = %e, "a handover frame is not encodable; left out"),
                }
            }
            if let Err(e) = socket.send_multipart(reply, 0) {
                tracing::warn!(error = %e, "handover answer not sent");
                continue;
            }
            metrics.handovers_served.inc();
            metrics.handover_bytes.inc_by(bytes as u64);
            tracing::info!(bytes, ms = started.elapsed().as_millis() as u64, "handed our view over to a starting peer");
        }
    })?)
}

/// Asks the peers for their view and has `pools` take the first whole answer over (before
/// their event streams start). Returns who answered and what each pool took, or `None`.
pub fn recover(
    config: &SyncConfig,
    own_id: &str,
    pools: &HashMap<String, Arc<Pool>>,
    ctx: &zmq::Context,
    sealer: &Sealer,
) -> Option<(String, Vec<(String, TakenOver)>)> {
    let deadline = Instant::now() + Duration::from_millis(config.handover_timeout_ms);
    let own = handover_endpoint(&config.listen);
    let peers: Vec<String> = config
        .peer_endpoints()
        .iter()
        .filter_map(|p| handover_endpoint(p))
        .filter(|p| Some(p) != own.as_ref() && Instant::now() < deadline && accepts_tcp(p))
        .collect();
    if peers.is_empty() {
        tracing::info!("no sync peer is up; the index is rebuilt from the engines");
        return None;
    }
    // One peer at a time (each answer is a whole export), each with its share of the time.
    let mut view = None;
    for (i, peer) in peers.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        let share = left / (peers.len() - i) as u32;
        match ask(ctx, sealer, peer, own_id, Instant::now() + share) {
            Ok(answer) => {
                view = Some(answer);
                break;
            }
            Err(e) => tracing::warn!(%peer, error = %e, "no handover from this peer"),
        }
    }
    let Some(view) = view else {
        tracing::warn!("no handover from the sync peers; the index is rebuilt from the engines");
        return None;
    };
    let origin = view.origin.clone();
    Some((origin, take_over(view, pools, own_id)))
}

/// `pools`' view as `export` gives each pool's, in model order, from sidecar `own_id`.
pub fn export(own_id: &str, pools: &HashMap<String, Arc<Pool>>, export: impl Fn(&Pool) -> PoolHandover) -> Handover {
    let mut models: Vec<&String> = pools.keys().collect();
    models.sort();
    Handover { origin: own_id.to_owned(), pools: models.into_iter().map(|m| export(&pools[m])).collect() }
}

/// Has each of `pools` take its part of `view` over (a pool of another block size hashes
/// other blocks: not taken); returns what each took.
pub fn take_over(view: Handover, pools: &HashMap<String, Arc<Pool>>, own_id: &str) -> Vec<(String, TakenOver)> {
    let mut taken = Vec::new();
    for pool_view in view.pools {
        let Some(pool) = pools.get(&pool_view.model) else { continue };
        if pool_view.block_size != pool.config().block_size {
            tracing::warn!(model = %pool_view.model, "the view's pool has another block size; not taken over");
            continue;
        }
        let model = pool_view.model.clone();
        let t = pool.take_over(pool_view, own_id);
        tracing::info!(%model, from = %view.origin, replicas = t.replicas, blocks = t.blocks, bookings = t.bookings, waiting = t.waiting, sessions = t.sessions, "took a view over");
        taken.push((model, t));
    }
    taken
}

/// Whether `endpoint` (`tcp://host:port`) accepts a TCP connection now.
fn accepts_tcp(endpoint: &str) -> bool {
    let Some(addr) = endpoint.strip_prefix("tcp://") else { return true };
    let Ok(addrs) = addr.to_socket_addrs() else { return false };
    addrs.into_iter().any(|a| TcpStream::connect_timeout(&a, PROBE).is_ok())
}

/// Why no handover was had.
#[derive(Debug, thiserror::Error)]
enum AskError {
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("no answer before the deadline")]
    Timeout,
    #[error("our own answer")]
    Ourselves,
    #[error(transparent)]
    Handover(#[from] HandoverError),
}

/// Asks `peer` and returns its answer, unless it is our own.
fn ask(ctx: &zmq::Context, sealer: &Sealer, peer: &str, own_id: &str, deadline: Instant) -> Result<Handover, AskError> {
    let socket = ctx.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    // A sealed frame is its plaintext and 51 bytes more.
    socket.set_maxmsgsize(MAX_FRAME_BYTES + 64)?;
    socket.connect(peer)?;
    let request = sealer.seal(Purpose::HandoverRequest, REQUEST.to_vec(), SystemTime::now());
    socket.send_multipart([&b""[..], &request[..]], 0)?;
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() || socket.poll(zmq::POLLIN, left.as_millis().max(1) as i64)? == 0 {
        return Err(AskError::Timeout);
    }
    let view = decode(sealer, socket.recv_multipart(0)?)?;
    if view.origin == own_id {
        return Err(AskError::Ourselves);
    }
    Ok(view)
}

/// The answer's frames, each decoded on its own: one that cannot be read loses only itself.
fn decode(sealer: &Sealer, frames: Vec<Vec<u8>>) -> Result<Handover, HandoverError> {
    let mut frames = frames.into_iter();
    if frames.next().is_none_or(|empty| !empty.is_empty()) {
        return Err(HandoverError::NoSender);
    }
    let now = SystemTime::now();
    let opened = frames.map(|f| sealer.open(Purpose::HandoverAnswer, f, now).map_err(|e| e.to_string()));
    let decoded = |f: Result<Vec<u8>, String>| {
        f.and_then(|f| kvgate_shared::codec::decode::<Part>(&f).map_err(|e| e.to_string()))
    };
    let parts = opened.enumerate().filter_map(|(i, f)| match decoded(f) {
        Ok(part) => Some(part),
        Err(e) => {
            tracing::warn!(error = %HandoverError::Frame(i, e), "a handover frame left out");
            None
        }
    });
    Handover::from_parts(parts)
}

/// A token bucket: `burst` at once, then one per `every`.
#[derive(Debug)]
pub struct Bucket {
    tokens: u32,
    burst: u32,
    every: Duration,
    since: Instant,
}

impl Bucket {
    /// A full bucket at `now`.
    pub fn new(burst: u32, every: Duration, now: Instant) -> Bucket {
        Bucket { tokens: burst, burst, every, since: now }
    }

    /// Takes a token at `now`, if there is one.
    pub fn take(&mut self, now: Instant) -> bool {
        let intervals = now.saturating_duration_since(self.since).as_nanos() / self.every.as_nanos().max(1);
        let refilled = u32::try_from(intervals).unwrap_or(u32::MAX);
        if refilled > 0 {
            self.tokens = self.tokens.saturating_add(refilled).min(self.burst);
            self.since += self.every * refilled;
        }
        if self.tokens == 0 {
            return false;
        }
        if self.tokens == self.burst {
            // A full bucket refills from now on, not from when it filled.
            self.since = now;
        }
        self.tokens -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handover_port_is_the_sync_port_plus_one() {
        assert_eq!(handover_endpoint("tcp://0.0.0.0:9913").as_deref(), Some("tcp://0.0.0.0:9914"));
        assert_eq!(handover_endpoint("tcp://[::1]:7000").as_deref(), Some("tcp://[::1]:7001"));
        assert_eq!(handover_endpoint("tcp://host:65535"), None);
        assert_eq!(handover_endpoint("ipc:///tmp/sock"), None);
    }

    #[test]
    fn the_bucket_gives_a_burst_then_one_per_interval() {
        let t0 = Instant::now();
        let every = Duration::from_secs(5);
        let mut b = Bucket::new(3, every, t0);
        assert_eq!((0..10).filter(|_| b.take(t0)).count(), 3, "the burst");
        assert!(!b.take(t0 + Duration::from_secs(4)));
        assert!(b.take(t0 + Duration::from_secs(5)), "one more after an interval");
        assert!(!b.take(t0 + Duration::from_secs(6)));
        let idle = t0 + Duration::from_secs(3600);
        assert_eq!((0..10).filter(|_| b.take(idle)).count(), 3, "an idle hour refills the burst, no more");
        assert!(!b.take(idle + Duration::from_secs(4)), "and the refill starts from when it was taken");
    }
}
