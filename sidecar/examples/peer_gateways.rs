//! Peer gateways for the scale benchmark (`cargo xtask bench scale --gateways N`): what N − 1
//! other gateways' sidecars would publish on the booking mesh (`[sync]`), from one process,
//! so that the sidecar under test applies their bookings over its real sync transport.
//!
//! Each peer binds a ZMQ PUB socket on loopback (`base_port + 2 i`) and publishes, sealed with
//! the mesh's key as a sidecar does, the lifecycle of `decisions_per_s` requests a second,
//! arriving at random (exponential gaps, as independent clients' requests do):
//! `Booked` (one of the fleet's shared system prompts and `new_tokens` tokens of its own, on
//! an engine drawn at random, whose events are taken to hold the shared prompt), `FirstToken`
//! and `Done` after delays drawn uniformly from ½× to 1½× `first_token_secs` and
//! `request_secs`, so that a request's three events go out at unrelated times, as a real
//! gateway's do. They go out in batches as a sidecar's publisher sends them
//! (`kvgate_sidecar::sync::batch`: a booking within 1 ms, a first token or an end within
//! 10 ms, with the next booking), on a clock of 1 ms ticks.
//!
//! Run: `peer_gateways '<json>'` with the fields of [`Config`]. Prints one JSON line when
//! every socket is bound (`{"bound": peers}`), then every second what was sent so far
//! (`seconds` since the start by the clock, `behind`: how far the schedule has slipped,
//! `messages`, `events`, `bytes` sealed, `requests`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_sidecar::msg::sync::SyncEvent;
use kvgate_sidecar::sync::batch::Batcher;
use kvgate_sidecar::sync::seal::{Sealer, SyncKey};
use kvgate_sidecar::sync::{sealed_batch, TOPIC};
use rand::{Rng, SeedableRng};
use serde::Deserialize;

/// What to publish.
#[derive(Debug, Deserialize)]
struct Config {
    /// Peer gateways, one PUB socket each.
    peers: usize,
    /// Peer `i` binds `tcp://127.0.0.1:{base_port + 2 i}`: the port after each is left free,
    /// where a sidecar asks its peers for a handover, so that it finds none there at once.
    base_port: u16,
    /// Requests each peer decides per second.
    decisions_per_s: f64,
    /// The mesh's key file (64 hex digits).
    key_file: PathBuf,
    /// A JSON file: the shared system prompts' token ids.
    prefixes_file: PathBuf,
    /// The pool's model and engine ids (`e0` … `e{engines - 1}`).
    model: String,
    engines: usize,
    /// Tokens after the shared prompt, each request's own.
    new_tokens: usize,
    block_size: usize,
    /// Mean delays of a request's first token and end after its booking.
    first_token_secs: f64,
    request_secs: f64,
    /// How long to publish.
    seconds: f64,
    seed: u64,
}

/// One peer: its socket, its origin id, its requests' first tokens and ends not yet due, the
/// events waiting to go out.
struct Peer {
    socket: zmq::Socket,
    origin: String,
    later: BinaryHeap<Reverse<Later>>,
    decided: u64,
    /// When its next decision is due, from the start.
    next: Duration,
    batcher: Batcher,
}

/// An event due at a time from the start, ordered by it (then by the order it was made in).
struct Later {
    at: Duration,
    order: u64,
    event: SyncEvent,
}

impl PartialEq for Later {
    fn eq(&self, other: &Later) -> bool {
        (self.at, self.order) == (other.at, other.order)
    }
}

impl Eq for Later {}

impl PartialOrd for Later {
    fn partial_cmp(&self, other: &Later) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Later {
    fn cmp(&self, other: &Later) -> std::cmp::Ordering {
        (self.at, self.order).cmp(&(other.at, other.order))
    }
}

/// How often the totals so far are printed.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Totals since the start.
#[derive(Default)]
struct Sent {
    messages: u64,
    events: u64,
    bytes: u64,
}

impl Sent {
    /// One JSON line: the totals `at` since the start, on the schedule's `tick`.
    fn report(&self, at: Duration, tick: Duration, peers: &[Peer]) {
        let line = serde_json::json!({
            "seconds": at.as_secs_f64(),
            "behind": at.saturating_sub(tick).as_secs_f64(),
            "messages": self.messages,
            "events": self.events,
            "bytes": self.bytes,
            "requests": peers.iter().map(|p| p.decided).sum::<u64>(),
        });
        println!("{line}");
    }
}

fn main() -> anyhow::Result<()> {
    let json = std::env::args().nth(1).context("usage: peer_gateways '<json config>'")?;
    let config: Config = serde_json::from_str(&json).context("the config")?;
    anyhow::ensure!(
        config.decisions_per_s > 0.0 && config.first_token_secs > 0.0 && config.request_secs > 0.0,
        "decisions_per_s, first_token_secs and request_secs must be positive"
    );
    let prefixes: Vec<Vec<u32>> = serde_json::from_slice(&std::fs::read(&config.prefixes_file)?)?;
    anyhow::ensure!(!prefixes.is_empty() && config.engines > 0, "no shared prompts or no engines");
    let sealer = Sealer::new(Some(&SyncKey::read(&config.key_file)?));
    let ctx = zmq::Context::new();
    let mut peers = Vec::with_capacity(config.peers);
    for i in 0..config.peers {
        let socket = ctx.socket(zmq::PUB)?;
        socket.set_linger(0)?;
        socket.set_sndhwm(100_000)?;
        socket.bind(&format!("tcp://127.0.0.1:{}", usize::from(config.base_port) + 2 * i))?;
        let origin = format!("peer-{i}");
        let (later, batcher) = (BinaryHeap::new(), Batcher::default());
        peers.push(Peer { socket, origin, later, decided: 0, next: Duration::ZERO, batcher });
    }
    println!("{}", serde_json::json!({ "bound": config.peers }));
    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed);
    let (start, end) = (Instant::now(), Duration::from_secs_f64(config.seconds));
    // The time to a peer's next decision: exponential, with the rate asked for.
    let gap = |rng: &mut rand::rngs::StdRng| {
        Duration::from_secs_f64(-rng.random_range(f64::EPSILON..1.0).ln() / config.decisions_per_s)
    };
    for peer in &mut peers {
        peer.next = gap(&mut rng);
    }
    let mut sent = Sent::default();
    let (mut tick, mut reported) = (Duration::ZERO, Duration::ZERO);
    while tick < end {
        tick += Duration::from_millis(1);
        if tick >= reported + REPORT_EVERY {
            reported = tick;
            sent.report(start.elapsed(), tick, &peers);
        }
        if let Some(wait) = tick.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        let now = start + tick;
        for peer in &mut peers {
            while peer.next <= tick {
                let due = peer.next;
                peer.next += gap(&mut rng);
                let (booked, first, done) = request(&config, &prefixes, peer, &mut rng);
                peer.batcher.push(booked, now);
                let (first_at, end_at) = (
                    config.first_token_secs * rng.random_range(0.5..1.5),
                    config.request_secs * rng.random_range(0.5..1.5),
                );
                let order = 2 * peer.decided;
                peer.decided += 1;
                // The first token always comes before the end.
                let first_at = due + Duration::from_secs_f64(first_at.min(end_at));
                peer.later.push(Reverse(Later { at: first_at, order, event: first }));
                let end_at = due + Duration::from_secs_f64(end_at);
                peer.later.push(Reverse(Later { at: end_at, order: order + 1, event: done }));
            }
            while peer.later.peek().is_some_and(|l| l.0.at <= tick) {
                peer.batcher.push(peer.later.pop().context("checked")?.0.event, now);
            }
            let Some(events) = peer.batcher.take_due(now) else { continue };
            sent.events += events.len() as u64;
            let frame = sealed_batch(&sealer, &peer.origin, events)?;
            sent.bytes += frame.len() as u64;
            sent.messages += 1;
            peer.socket.send_multipart([TOPIC, frame.as_slice()], 0)?;
        }
    }
    sent.report(start.elapsed(), tick, &peers);
    Ok(())
}

/// A peer's next request: its booking, first token and end.
fn request(
    config: &Config,
    prefixes: &[Vec<u32>],
    peer: &Peer,
    rng: &mut rand::rngs::StdRng,
) -> (SyncEvent, SyncEvent, SyncEvent) {
    let prefix = &prefixes[rng.random_range(0..prefixes.len())];
    let mut tokens = prefix.clone();
    tokens.extend((0..config.new_tokens).map(|_| rng.random_range(50_000..150_000u32)));
    let hashes = prompt_block_hashes(&tokens, config.block_size, Salt::NONE);
    let request_id: kvgate_shared::ids::RequestId = format!("{}-{}", peer.origin, peer.decided).as_str().into();
    let model = config.model.clone();
    let booked = SyncEvent::Booked {
        model: model.clone(),
        target: format!("e{}", rng.random_range(0..config.engines)),
        request_id: request_id.clone(),
        prefill_tokens: config.new_tokens as u64,
        held_blocks: (prefix.len() / config.block_size) as u32,
        total_blocks: tokens.len().div_ceil(config.block_size) as u64,
        hashes,
        sequences: 1,
        session: None,
    };
    let first = SyncEvent::FirstToken { model: model.clone(), request_id: request_id.clone() };
    (booked, first, SyncEvent::Done { model, request_id })
}
