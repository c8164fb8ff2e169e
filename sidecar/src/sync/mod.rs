//! Several gateways, one view of the load: each sidecar tells its peers what it booked.
//!
//! A sidecar sees only its own gateway pod's traffic. With N gateway pods, each would think
//! the engines carry 1/N of their real load and they would herd onto the same replicas. So
//! every sidecar publishes its bookings and their lifecycle (first token, done) on a ZMQ PUB
//! socket, subscribes to its peers', and books theirs in its own load table — under
//! `origin/request_id`, so ids never collide, and skipping its own messages.
//!
//! - Peers come from the config (`peers`) or from a DNS name (`peers_dns`, re-resolved; every
//!   address is dialled on the `listen` port, the sidecar's own address included and skipped
//!   by origin).
//! - Traffic is batched ([`batch`]): a booking goes out within 1 ms, a first token or an end
//!   within 10 ms, riding with the next booking; a batch of 256 events at once. A stopping
//!   sidecar sends what waits (its last requests' ends) before it closes the socket.
//! - The view is eventually consistent: a lost message leaves a booking to the TTL sweep
//!   (`request_expiry_secs`); a peer's restart loses nothing of ours.
//! - Messages carry the sync version in their topic (`kvgate-sync/<version>`): a peer of
//!   another release is heard, counted (`kvgate_sync_mismatches_total`) and logged once, and
//!   its messages are dropped rather than misread.
//! - A sidecar that starts while its peers run takes their index and bookings over before it
//!   reads any event ([`state`], on the sync port + 1), so it routes on the fleet's whole
//!   cache from its first request even after the engines' replay buffers rolled over.
//!   A sidecar with no peer up takes the view it saved itself before it restarted
//!   ([`saved`], `state_file`), if it has one: that needs no mesh.
//! - As it happens, only bookings and their lifecycle are shared; KV events come from the
//!   engines to every sidecar directly. Under `kv_aware`'s in-flight credit a peer's booking
//!   also counts as cached where it went, for `inflight_credit_secs`, until the engine's
//!   events say so (a `ran_on` correction of our own is not sent: a peer's credit stays on
//!   the replica first named until it expires). A peer can only book work and give credit on
//!   replicas this sidecar already knows — through a booking, or a handover — so a peer can
//!   skew load and credit, never steer a request to a host outside the pool.
//! - Beyond one host the mesh is sealed ([`seal`]): with `key_file`, every message and every
//!   handover frame is encrypted and authenticated with the key the gateways share, and
//!   anything else is refused and counted (`kvgate_sync_rejected_total`). Without a key the
//!   sidecar refuses to listen beyond loopback unless told `allow_unauthenticated`.

use std::collections::{BTreeSet, HashMap};
use std::net::ToSocketAddrs;

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

pub mod batch;
mod config;
pub mod saved;
pub mod seal;
pub mod state;

use batch::Batcher;
pub use config::SyncConfig;
use seal::{Purpose, Sealer};

use crate::health::{Health, Worker};
use crate::metrics::{Metrics, RefusalLabels};
use crate::msg::sync::{Outbox, SyncBatch, SyncEvent};
use crate::pool::Pool;

/// What every sync topic starts with; the subscription, so peers of other versions are heard.
const TOPIC_PREFIX: &[u8] = b"kvgate-sync";
/// The topic of this release's sync messages. The version moves whenever [`SyncBatch`]'s
/// encoding does (2: bookings carry their sequence count; 3: and their session; 4: and the
/// blocks their target held by its events).
pub const TOPIC: &[u8] = b"kvgate-sync/4";
/// Foreign topics remembered, each logged once; a peer cannot grow the set past this.
const FOREIGN_TOPICS: usize = 16;
/// The bytes of a foreign topic that are remembered and logged.
const FOREIGN_TOPIC_BYTES: usize = 64;
/// Events waiting to be published; more are dropped (the TTL sweep covers them).
const OUTBOX: usize = 65_536;
/// How long the publisher's last messages may take to leave when it stops.
const LINGER_ON_STOP: Duration = Duration::from_millis(200);
/// How often blocked calls wake up to check for shutdown, and `peers_dns` is re-resolved.
const POLL: Duration = Duration::from_millis(100);
const RESOLVE_EVERY: Duration = Duration::from_secs(5);
/// A sync thread silent this long is stalled: each wakes every [`POLL`], and a DNS lookup of
/// the peers may block a while.
const STALLED_AFTER: Duration = Duration::from_secs(60);

/// Starts the publisher and the subscriber, and hands every pool its outbox. (The handover
/// to starting peers is [`state::serve`], started once this sidecar's own streams run.)
pub fn start(
    config: &SyncConfig,
    pools: &HashMap<String, Arc<Pool>>,
    metrics: Arc<Metrics>,
    ctx: &zmq::Context,
    health: &Arc<Health>,
    sealer: &Sealer,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let (tx, rx) = sync_channel(OUTBOX);
    for pool in pools.values() {
        pool.set_outbox(Outbox::new(tx.clone()));
    }
    let publisher = ctx.socket(zmq::PUB)?;
    publisher.set_linger(0)?;
    publisher.bind(&config.listen)?;
    let subscriber = ctx.socket(zmq::SUB)?;
    subscriber.set_subscribe(TOPIC_PREFIX)?;
    subscriber.set_rcvtimeo(POLL.as_millis() as i32)?;
    subscriber.set_linger(0)?;
    let id = config.id();
    let sealer = sealer.clone();
    tracing::info!(id = %id, listen = %config.listen, sealed = sealer.keyed(), "gateway sync on");
    let publish = {
        let (id, sealer, worker) = (id.clone(), sealer.clone(), health.worker("sync-pub", STALLED_AFTER));
        std::thread::Builder::new()
            .name("sync-pub".into())
            .spawn(move || publish_loop(&publisher, &id, &sealer, &rx, &worker))?
    };
    let (config, pools, worker) = (config.clone(), pools.clone(), health.worker("sync-sub", STALLED_AFTER));
    let receive = std::thread::Builder::new().name("sync-sub".into()).spawn(move || {
        let mesh = Mesh { own_id: &id, sealer: &sealer, pools: &pools, metrics: &metrics };
        receive_loop(&subscriber, &config, &mesh, &worker)
    })?;
    Ok(vec![publish, receive])
}

fn publish_loop(socket: &zmq::Socket, origin: &str, sealer: &Sealer, rx: &Receiver<SyncEvent>, worker: &Worker) {
    let mut batcher = Batcher::default();
    while !worker.stopping() {
        let wait = batcher.deadline().map_or(POLL, |d| d.saturating_duration_since(Instant::now()));
        match rx.recv_timeout(wait) {
            Ok(event) => batcher.push(event, Instant::now()),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if let Some(events) = batcher.take_due(Instant::now()) {
            publish(socket, origin, sealer, events);
        }
    }
    // Stopping: what waits goes out now. The last requests' ends have no booking after them
    // to ride with, and a peer would count them until its expiry sweep.
    while let Ok(event) = rx.try_recv() {
        batcher.push(event, Instant::now());
        if let Some(events) = batcher.take_due(Instant::now()) {
            publish(socket, origin, sealer, events);
        }
    }
    let events = batcher.take_all();
    if !events.is_empty() {
        publish(socket, origin, sealer, events);
    }
    // Closing the socket waits this long for them to leave.
    if let Err(e) = socket.set_linger(LINGER_ON_STOP.as_millis() as i32) {
        tracing::debug!(error = %e, "sync linger not set");
    }
}

/// Seals `events` as one message and publishes it.
fn publish(socket: &zmq::Socket, origin: &str, sealer: &Sealer, events: Vec<SyncEvent>) {
    match sealed_batch(sealer, origin, events) {
        Ok(frame) => {
            if let Err(e) = socket.send_multipart([TOPIC, frame.as_slice()], 0) {
                tracing::warn!(error = %e, "sync publish failed");
            }
        }
        Err(e) => tracing::warn!(error = %e, "sync batch not encodable"),
    }
}

/// `origin`'s `events` as the payload of one sync message (after its [`TOPIC`] frame):
/// encoded as a [`SyncBatch`] and sealed.
pub fn sealed_batch(
    sealer: &Sealer,
    origin: &str,
    events: Vec<SyncEvent>,
) -> Result<Vec<u8>, kvgate_shared::codec::CodecError> {
    let bytes = kvgate_shared::codec::encode(&SyncBatch { origin: origin.to_owned(), events })?;
    Ok(sealer.seal(Purpose::Sync, bytes, SystemTime::now()))
}

/// What the subscriber applies peers' messages with.
struct Mesh<'a> {
    own_id: &'a str,
    sealer: &'a Sealer,
    pools: &'a HashMap<String, Arc<Pool>>,
    metrics: &'a Metrics,
}

fn receive_loop(socket: &zmq::Socket, config: &SyncConfig, mesh: &Mesh<'_>, worker: &Worker) {
    let Mesh { own_id, sealer, pools, metrics } = *mesh;
    let mut refused: BTreeSet<&'static str> = BTreeSet::new();
    let mut dialled: BTreeSet<String> = BTreeSet::new();
    let mut foreign: BTreeSet<Vec<u8>> = BTreeSet::new();
    let mut resolved_at: Option<Instant> = None;
    while !worker.stopping() {
        if resolved_at.is_none_or(|t| t.elapsed() >= RESOLVE_EVERY) {
            resolved_at = Some(Instant::now());
            for peer in config.peer_endpoints() {
                if !dialled.contains(&peer) {
                    match socket.connect(&peer) {
                        Ok(()) => {
                            tracing::info!(%peer, "sync peer dialled");
                            dialled.insert(peer);
                        }
                        Err(e) => tracing::warn!(%peer, error = %e, "cannot dial sync peer"),
                    }
                }
            }
        }
        let frames = match socket.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "sync receive failed");
                continue;
            }
        };
        let [topic, payload] = <[Vec<u8>; 2]>::try_from(frames).unwrap_or_default();
        if topic != TOPIC {
            metrics.sync_mismatches.inc();
            // Remembered (and logged) by their first bytes: a topic is as long as its sender likes.
            let topic = &topic[..topic.len().min(FOREIGN_TOPIC_BYTES)];
            if foreign.len() < FOREIGN_TOPICS && foreign.insert(topic.to_vec()) {
                tracing::warn!(
                    topic = %String::from_utf8_lossy(topic),
                    ours = %String::from_utf8_lossy(TOPIC),
                    "a sync peer runs another release; its bookings are ignored until both run one"
                );
            }
            continue;
        }
        let payload = match sealer.open(Purpose::Sync, payload, SystemTime::now()) {
            Ok(payload) => payload,
            Err(e) => {
                metrics.sync_rejected.get_or_create(&RefusalLabels { reason: e.reason().into() }).inc();
                // Logged once per reason: whoever sends them decides how many there are.
                if refused.insert(e.reason()) {
                    tracing::warn!(error = %e, "a sync message refused (not from this mesh); further ones are only counted");
                }
                continue;
            }
        };
        let Ok(batch) = kvgate_shared::codec::decode::<SyncBatch>(&payload) else {
            tracing::debug!("undecodable sync message dropped");
            continue;
        };
        if batch.origin == own_id {
            continue;
        }
        for event in &batch.events {
            let model = match event {
                SyncEvent::Booked { model, .. }
                | SyncEvent::FirstToken { model, .. }
                | SyncEvent::Done { model, .. } => model,
            };
            if let Some(pool) = pools.get(model) {
                pool.apply_remote(&batch.origin, event);
            }
        }
    }
}

impl SyncConfig {
    /// This sidecar's id: the configured one, else the pod's `HOSTNAME`, else a random one.
    pub fn id(&self) -> String {
        self.id
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| format!("kvgate-{}-{:08x}", std::process::id(), rand::random::<u32>()))
    }

    /// Every peer endpoint to dial now: the configured ones, and `peers_dns`'s addresses on the
    /// `listen` port (an unresolvable name gives none this time).
    pub fn peer_endpoints(&self) -> Vec<String> {
        let mut out = self.peers.clone();
        if let Some(name) = &self.peers_dns {
            let port = self.listen.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).unwrap_or(0);
            match (name.as_str(), port).to_socket_addrs() {
                Ok(addrs) => out.extend(addrs.map(|a| format!("tcp://{a}"))),
                Err(e) => tracing::debug!(%name, error = %e, "sync peers not resolvable yet"),
            }
        }
        out
    }
}
