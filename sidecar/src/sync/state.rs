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
//! - What a peer hands over is trusted as its sync messages are (a NetworkPolicy should fence
//!   both ports): it can skew cache credit and load, never add a target to a pool.

use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::SyncConfig;
use crate::metrics::Metrics;
use crate::msg::handover::{Handover, HandoverError, Part, REQUEST};
use crate::pool::{Pool, TakenOver};

/// The largest frame of an answer the server sends and the asker reads (a replica of a
/// million blocks is ~20 MB; bookings come in frames of a bounded number of hashes).
pub const MAX_FRAME_BYTES: i64 = 48 << 20;
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
    stop: Arc<AtomicBool>,
) -> anyhow::Result<JoinHandle<()>> {
    let endpoint = handover_endpoint(&config.listen)
        .ok_or_else(|| anyhow::anyhow!("sync.listen {:?} has no port to put the handover next to", config.listen))?;
    let socket = ctx.socket(zmq::ROUTER)?;
    socket.set_linger(0)?;
    socket.set_rcvtimeo(POLL.as_millis() as i32)?;
    socket.set_maxmsgsize(1024)?;
    socket.bind(&endpoint).map_err(|e| anyhow::anyhow!("binding the handover port {endpoint}: {e}"))?;
    tracing::info!(%endpoint, "handover to starting peers on");
    Ok(std::thread::Builder::new().name("sync-handover".into()).spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let frames = match socket.recv_multipart(0) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "handover receive failed");
                    continue;
                }
            };
            let [peer, empty, request] = <[Vec<u8>; 3]>::try_from(frames).unwrap_or_default();
            if !empty.is_empty() || request != REQUEST {
                tracing::debug!("a handover request of another release, or garbage; not answered");
                continue;
            }
            let started = Instant::now();
            let mut models: Vec<&String> = pools.keys().collect();
            models.sort();
            let view = Handover {
                origin: own_id.clone(),
                pools: models.into_iter().map(|m| pools[m].export_handover(&own_id)).collect(),
            };
            let mut reply = vec![peer, Vec::new()];
            for part in view.into_parts() {
                match kvgate_shared::codec::encode(&part) {
                    // Past the bound the asker would drop the connection: the frame is left
                    // out, and its replica rebuilt from the engine's replay there.
                    Ok(bytes) if bytes.len() as i64 > MAX_FRAME_BYTES => {
                        tracing::warn!(bytes = bytes.len(), "a handover frame is too big; left out")
                    }
                    Ok(bytes) => reply.push(bytes),
                    Err(e) => tracing::warn!(error = %e, "a handover frame is not encodable; left out"),
                }
            }
            let bytes: usize = reply.iter().map(Vec::len).sum();
            if let Err(e) = socket.send_multipart(reply, 0) {
                tracing::warn!(error = %e, "handover answer not sent");
                continue;
            }
            metrics.handovers_served.inc();
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
        match ask(ctx, peer, own_id, Instant::now() + share) {
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
    let mut taken = Vec::new();
    for pool_view in view.pools {
        let Some(pool) = pools.get(&pool_view.model) else { continue };
        if pool_view.block_size != pool.config().block_size {
            tracing::warn!(model = %pool_view.model, "the peer's pool has another block size; not taken over");
            continue;
        }
        let model = pool_view.model.clone();
        let t = pool.take_over(pool_view, own_id);
        tracing::info!(%model, from = %view.origin, replicas = t.replicas, blocks = t.blocks, bookings = t.bookings, waiting = t.waiting, "took over a peer's view");
        taken.push((model, t));
    }
    Some((view.origin, taken))
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
fn ask(ctx: &zmq::Context, peer: &str, own_id: &str, deadline: Instant) -> Result<Handover, AskError> {
    let socket = ctx.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    socket.set_maxmsgsize(MAX_FRAME_BYTES)?;
    socket.connect(peer)?;
    socket.send_multipart([&b""[..], REQUEST], 0)?;
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() || socket.poll(zmq::POLLIN, left.as_millis().max(1) as i64)? == 0 {
        return Err(AskError::Timeout);
    }
    let view = decode(socket.recv_multipart(0)?)?;
    if view.origin == own_id {
        return Err(AskError::Ourselves);
    }
    Ok(view)
}

/// The answer's frames, each decoded on its own: one that cannot be read loses only itself.
fn decode(frames: Vec<Vec<u8>>) -> Result<Handover, HandoverError> {
    let mut frames = frames.into_iter();
    if frames.next().is_none_or(|empty| !empty.is_empty()) {
        return Err(HandoverError::NoSender);
    }
    let parts = frames.enumerate().filter_map(|(i, f)| match kvgate_shared::codec::decode::<Part>(&f) {
        Ok(part) => Some(part),
        Err(e) => {
            tracing::warn!(error = %HandoverError::Frame(i, e.to_string()), "a handover frame left out");
            None
        }
    });
    Handover::from_parts(parts)
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
}
