//! A sidecar that starts while a peer runs takes the peer's view over: with the engines'
//! replay buffers rolled over long ago, its overlaps and load match its peer's from the
//! start, and its event streams go on from where the peer's snapshot stood (a removal after
//! it is applied, nothing twice). A sidecar with no peer up rebuilds from the engines' replay
//! as before — and, the buffers having rolled over, knows far less.

mod common;

use std::collections::HashMap;

use std::sync::Arc;
use std::thread::JoinHandle;

use common::{conversation, pool_reading, publish_two_conversations, removed, request, store, wait_for, Engine, BS};
use kvgate_e2e::process::free_port_run;
use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_sidecar::discovery::{DiscoveryConfig, Supervisor};
use kvgate_sidecar::health::Health;
use kvgate_sidecar::index::Overlap;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Pool, TakenOver};
use kvgate_sidecar::score::ScoringConfig;
use kvgate_sidecar::sync::SyncConfig;

/// Messages each engine keeps for replay: far fewer than it has published.
const KEPT: usize = 4;
/// Blocks of each engine's conversation.
const BLOCKS: u32 = 24;

/// One gateway's sidecar: its pool reading both engines, and the sync mesh.
struct Gateway {
    pool: Arc<Pool>,
    metrics: Arc<Metrics>,
    supervisor: Supervisor,
    threads: Vec<JoinHandle<()>>,
    stop: Arc<Health>,
}

impl Gateway {
    /// Starts as `main` does: the mesh, then a peer's view, the event streams, and the
    /// handover to later peers.
    /// Returns what it took over, if a peer answered.
    fn start(
        ctx: &zmq::Context,
        id: &str,
        sync_port: u16,
        peers: &[u16],
        engines: &[(u16, u16)],
    ) -> (Gateway, Option<Vec<(String, TakenOver)>>) {
        let (pool, metrics) = pool_reading(engines);
        let pools = HashMap::from([("m".to_owned(), pool.clone())]);
        let sync = SyncConfig {
            id: Some(id.into()),
            listen: format!("tcp://127.0.0.1:{sync_port}"),
            peers: peers.iter().map(|p| format!("tcp://127.0.0.1:{p}")).collect(),
            ..SyncConfig::new("", Vec::new())
        };
        let stop = Health::new();
        let sealer = sync.sealer().unwrap();
        let mut threads = kvgate_sidecar::sync::start(&sync, &pools, metrics.clone(), ctx, &stop, &sealer).unwrap();
        let taken = kvgate_sidecar::sync::state::recover(&sync, id, &pools, ctx, &sealer).map(|(from, taken)| {
            assert_eq!(from, "a", "the peer that answered");
            taken
        });
        let supervisor =
            Supervisor::start(ctx.clone(), pool.clone(), DiscoveryConfig::default(), metrics.clone()).unwrap();
        let handover =
            kvgate_sidecar::sync::state::serve(&sync, id.into(), pools, metrics.clone(), ctx, &stop, &sealer).unwrap();
        threads.push(handover);
        (Gateway { pool, metrics, supervisor, threads, stop }, taken)
    }

    fn overlaps(&self, tokens: &[u32]) -> Vec<Overlap> {
        self.pool.find_matches(&prompt_block_hashes(tokens, BS, Salt::NONE))
    }

    fn last_seqs(&self) -> Vec<Option<u64>> {
        self.pool.state().replicas.iter().map(|r| r.last_seq).collect()
    }

    fn active(&self) -> Vec<u64> {
        self.pool.state().replicas.iter().map(|r| r.active_requests).collect()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.stop();
        self.supervisor.shutdown();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[test]
fn a_starting_sidecar_takes_its_peers_view_over_and_resumes_the_streams() {
    let ctx = zmq::Context::new();
    let ports = free_port_run(10).unwrap();
    let engine_ports = [(ports, ports + 1), (ports + 2, ports + 3)];
    let (sync_a, sync_b, sync_c) = (ports + 4, ports + 6, ports + 8);
    let engines: Vec<Engine> =
        engine_ports.iter().map(|&(events, replay)| Engine::start(&ctx, events, Some(replay)).keeping(KEPT)).collect();

    // Gateway A, alone: nothing to take over. Each engine publishes its conversation's first
    // block until A has it (ZMQ's slow joiner), then the rest, then e0 evicts block 20.
    let (a, taken) = Gateway::start(&ctx, "a", sync_a, &[sync_b], &engine_ports);
    assert!(taken.is_none(), "no peer was up");
    let through = publish_two_conversations(&engines, BLOCKS, || a.last_seqs());
    wait_for("A applied every message", || a.last_seqs() == through.map(Some));
    assert_eq!(a.overlaps(&conversation(1, BLOCKS))[0].device, 20, "block 20 was evicted");
    assert_eq!(a.overlaps(&conversation(2, BLOCKS))[1].device, BLOCKS);

    // Requests in flight through A.
    let scoring = ScoringConfig::default();
    for i in 0..3 {
        let decision = a.pool.route(&request(&format!("a{i}"), &conversation(2, 8 + i)), &scoring);
        assert_eq!(decision.replica.as_deref(), Some("e1"), "A follows conversation 2's cache");
    }

    // Gateway B starts while A runs: it takes A's view over, and from its first request its
    // overlaps and load are A's, though the engines keep only their last 4 messages.
    let (b, taken) = Gateway::start(&ctx, "b", sync_b, &[sync_a], &engine_ports);
    let taken = taken.expect("A answered");
    assert_eq!(taken.len(), 1);
    assert_eq!(
        taken[0].1,
        TakenOver { replicas: 2, blocks: 2 * BLOCKS as usize - 1, bookings: 3, waiting: 0, sessions: 0 },
        "both replicas' blocks and A's three bookings"
    );
    let prompts =
        [conversation(1, BLOCKS), conversation(2, BLOCKS), conversation(2, 5), conversation(1, 21), conversation(9, 3)];
    for prompt in &prompts {
        assert_eq!(b.overlaps(prompt), a.overlaps(prompt), "the same overlaps on the same prompt");
    }
    assert_eq!(b.last_seqs(), through.map(Some), "B stands where A's snapshot did");
    assert_eq!(b.active(), a.active(), "and books what A has in flight");
    // The operator sees both ends of it.
    assert_eq!(a.metrics.handovers_served.get(), 1);
    let restored = b.metrics.render();
    for (replica, blocks) in [("e0", BLOCKS - 1), ("e1", BLOCKS)] {
        let line = format!("kvgate_handover_restored_blocks_total{{model=\"m\",replica=\"{replica}\"}} {blocks}");
        assert!(restored.contains(&line), "{line} in {restored}");
    }
    let decision = b.pool.route(&request("b0", &conversation(1, 21)), &scoring);
    assert_eq!(
        (decision.replica.as_deref(), decision.overlap_blocks),
        (Some("e0"), 20),
        "B's first decision follows conversation 1's cache up to its evicted block"
    );
    b.pool.lifecycle(&"b0".into(), false);

    // Gateway C starts with no peer: it rebuilds from the engines' replay, which holds only
    // their last messages, whose blocks' parents it never saw.
    let (c, taken) = Gateway::start(&ctx, "c", sync_c, &[], &engine_ports);
    assert!(taken.is_none());

    // The streams go on: e1 evicts block 10 and e0 stores a new conversation. B (which may
    // have missed them while subscribing: a gap, replayed from the engines' recent messages)
    // and A agree; C knows only what came after its start.
    engines[1].send(u64::from(BLOCKS), &removed(2, 10), false);
    engines[0].send(u64::from(BLOCKS) + 1, &store(3, 0), false);
    let after = [u64::from(BLOCKS) + 1, u64::from(BLOCKS)].map(Some);
    wait_for("A and B applied them", || a.last_seqs() == after && b.last_seqs() == after);
    for prompt in prompts.iter().chain([&conversation(3, 1)]) {
        assert_eq!(b.overlaps(prompt), a.overlaps(prompt), "still the same after the snapshot");
    }
    assert_eq!(a.overlaps(&conversation(2, BLOCKS))[1].device, 10);

    // C hears nothing until its subscriptions are up (ZMQ's slow joiner): each engine
    // stores a new block until C has heard from both.
    let mut next = [u64::from(BLOCKS) + 2, u64::from(BLOCKS) + 1];
    let mut conv = 10;
    wait_for("C heard from both engines", || {
        conv += 1;
        for (e, seq) in engines.iter().zip(next.iter_mut()) {
            e.send(*seq, &store(conv, 0), false);
            *seq += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(30));
        c.last_seqs().iter().all(Option::is_some)
    });
    let last = next.map(|s| Some(s - 1));
    wait_for("A, B and C applied every message", || [&a, &b, &c].iter().all(|g| g.last_seqs() == last));
    assert_eq!(c.overlaps(&conversation(conv, 1))[0].device, 1, "C indexes what comes now");
    assert_eq!(c.overlaps(&conversation(1, BLOCKS))[0].device, 0, "but lost what came before the buffers' window");
    assert_eq!(b.overlaps(&conversation(1, BLOCKS)), a.overlaps(&conversation(1, BLOCKS)));

    // A's requests end through A: B, which took them over, releases them too.
    for i in 0..3 {
        assert!(a.pool.lifecycle(&format!("a{i}").into(), false));
    }
    wait_for("B released A's requests", || b.active().iter().sum::<u64>() == 0);
}
