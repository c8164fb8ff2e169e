//! A sidecar that restarts alone (no sync peer) takes the view it saved over (`state_file`):
//! with the engines' replay buffers rolled over, its overlaps are those it had before the
//! restart and its streams go on from where the saved view stood. Without the file it knows
//! only what came after its start; a file of another release, or of other engines, gives
//! nothing.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::{conversation, pool_reading, publish_two_conversations, removed, store, wait_for, Engine, BS};
use kvgate_e2e::process::free_port_run;
use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_sidecar::discovery::{DiscoveryConfig, Supervisor};
use kvgate_sidecar::health::Health;
use kvgate_sidecar::index::Overlap;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Pool, TakenOver};
use kvgate_sidecar::sync::saved::{self, SavedError};

/// Messages each engine keeps for replay: far fewer than it has published.
const KEPT: usize = 4;
/// Blocks of each engine's conversation.
const BLOCKS: u32 = 24;
/// How often the sidecars here save their view.
const EVERY: Duration = Duration::from_millis(100);

type Taken = Result<Option<Vec<(String, TakenOver)>>, SavedError>;

/// A sidecar with `state_file` and no mesh.
struct Sidecar {
    pool: Arc<Pool>,
    metrics: Arc<Metrics>,
    supervisor: Supervisor,
    saver: Option<JoinHandle<()>>,
    stop: Arc<Health>,
}

impl Sidecar {
    /// Starts as `main` does: the saved view, then the event streams, then the saving thread.
    fn start(ctx: &zmq::Context, file: &Path, engines: &[(u16, u16)]) -> (Sidecar, Taken) {
        let (pool, metrics) = pool_reading(engines);
        let pools = HashMap::from([("m".to_owned(), pool.clone())]);
        let taken = saved::restore(file, "local", &pools);
        let supervisor =
            Supervisor::start(ctx.clone(), pool.clone(), DiscoveryConfig::default(), metrics.clone()).unwrap();
        let stop = Health::new();
        let saver = saved::spawn(file.to_owned(), EVERY, "local".into(), pools, metrics.clone(), &stop).unwrap();
        (Sidecar { pool, metrics, supervisor, saver: Some(saver), stop }, taken)
    }

    fn overlaps(&self, tokens: &[u32]) -> Vec<Overlap> {
        self.pool.find_matches(&prompt_block_hashes(tokens, BS, Salt::NONE))
    }

    fn last_seqs(&self) -> Vec<Option<u64>> {
        self.pool.state().replicas.iter().map(|r| r.last_seq).collect()
    }

    /// Each engine publishes a new conversation's first block, from sequence number `next`,
    /// until this sidecar has applied every message of both (a subscription is up only a
    /// while after it is made: what it missed shows as a gap, replayed from the engine).
    fn hear_from(&self, engines: &[Engine], mut next: [u64; 2], conv: &mut u32) {
        wait_for("both engines heard", || {
            *conv += 1;
            for (e, seq) in engines.iter().zip(next.iter_mut()) {
                e.send(*seq, &store(*conv, 0), false);
                *seq += 1;
            }
            std::thread::sleep(Duration::from_millis(30));
            self.last_seqs() == next.map(|s| Some(s - 1))
        });
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(saver) = self.saver.take() {
            let _ = saver.join();
        }
        self.supervisor.shutdown();
    }
}

/// A directory of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-saved-view-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_sidecar_that_restarts_alone_takes_the_view_it_saved_over() {
    let ctx = zmq::Context::new();
    let ports = free_port_run(4).unwrap();
    let engine_ports = [(ports, ports + 1), (ports + 2, ports + 3)];
    let engines: Vec<Engine> =
        engine_ports.iter().map(|&(events, replay)| Engine::start(&ctx, events, Some(replay)).keeping(KEPT)).collect();
    let dir = scratch("restart");
    let file = dir.join("view.bin");

    // A starts with no file. Each engine publishes its conversation's first block until A
    // has it, then the rest, then e0 evicts block 20.
    let (a, taken) = Sidecar::start(&ctx, &file, &engine_ports);
    assert!(matches!(taken, Ok(None)), "no file yet: {taken:?}");
    let through = publish_two_conversations(&engines, BLOCKS, || a.last_seqs());
    wait_for("A applied every message", || a.last_seqs() == through.map(Some));
    let prompts =
        [conversation(1, BLOCKS), conversation(2, BLOCKS), conversation(2, 5), conversation(1, 21), conversation(9, 3)];
    let before: Vec<Vec<Overlap>> = prompts.iter().map(|p| a.overlaps(p)).collect();
    assert_eq!((before[0][0].device, before[1][1].device), (20, BLOCKS), "block 20 of conversation 1 was evicted");
    // A saves as it runs, and once more as it stops.
    wait_for("A saved its view", || a.metrics.saved_view_bytes.get() > 0);
    drop(a);

    // B, the restarted sidecar, takes the saved view over, though the engines keep only their
    // last 4 messages: from its first request its overlaps are A's.
    let (b, taken) = Sidecar::start(&ctx, &file, &engine_ports);
    let taken = taken.expect("the file reads").expect("there is a file");
    assert_eq!(
        taken,
        [("m".to_owned(), TakenOver { replicas: 2, blocks: 2 * BLOCKS as usize - 1, ..TakenOver::default() })],
        "both replicas' blocks, and no booking"
    );
    for (prompt, overlaps) in prompts.iter().zip(&before) {
        assert_eq!(&b.overlaps(prompt), overlaps, "the overlaps A had");
    }
    assert_eq!(b.last_seqs(), through.map(Some), "B stands where the saved view did");
    let restored = b.metrics.render();
    for (replica, blocks) in [("e0", BLOCKS - 1), ("e1", BLOCKS)] {
        let line = format!("kvgate_handover_restored_blocks_total{{model=\"m\",replica=\"{replica}\"}} {blocks}");
        assert!(restored.contains(&line), "{line} in {restored}");
    }

    // The streams go on from there: e1 evicts block 10 and e0 stores a new conversation.
    engines[1].send(u64::from(BLOCKS), &removed(2, 10), false);
    engines[0].send(u64::from(BLOCKS) + 1, &store(3, 0), false);
    let mut conv = 10;
    b.hear_from(&engines, [u64::from(BLOCKS) + 2, u64::from(BLOCKS) + 1], &mut conv);
    assert_eq!(b.overlaps(&conversation(2, BLOCKS))[1].device, 10);
    assert_eq!(b.overlaps(&conversation(3, 1))[0].device, 1);
    assert_eq!(b.overlaps(&conversation(1, BLOCKS))[0].device, 20);

    // C restarts with no file: it knows only what comes after its start.
    let seqs = b.last_seqs();
    let next = [seqs[0].unwrap() + 1, seqs[1].unwrap() + 1];
    drop(b);
    let (c, taken) = Sidecar::start(&ctx, &dir.join("none.bin"), &engine_ports);
    assert!(matches!(taken, Ok(None)));
    c.hear_from(&engines, next, &mut conv);
    assert_eq!(c.overlaps(&conversation(conv, 1))[0].device, 1, "C indexes what comes now");
    assert_eq!(c.overlaps(&conversation(1, BLOCKS))[0].device, 0, "but lost what came before the buffers' window");
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_of_another_release_or_of_other_engines_gives_nothing() {
    let ctx = zmq::Context::new();
    let ports = free_port_run(8).unwrap();
    let engine_ports = [(ports, ports + 1), (ports + 2, ports + 3)];
    let engines: Vec<Engine> =
        engine_ports.iter().map(|&(events, replay)| Engine::start(&ctx, events, Some(replay))).collect();
    let dir = scratch("foreign");
    let file = dir.join("view.bin");

    // Not a saved view: a clear error, and the sidecar starts from the engines.
    std::fs::write(&file, b"kvgate-handover/0 and then some").unwrap();
    let (a, taken) = Sidecar::start(&ctx, &file, &engine_ports);
    let error = taken.expect_err("not this release's");
    assert!(matches!(error, SavedError::Release(_)), "{error}");
    assert!(error.to_string().contains("not a view saved by this release"), "{error}");
    let mut conv = 0;
    a.hear_from(&engines, [0, 0], &mut conv);
    wait_for("A saved over the foreign file", || a.metrics.saved_view_bytes.get() > 0);
    drop(a);

    // A view of these engines, taken by a sidecar reading other engines: not restored (a
    // snapshot is restored as its replica's stream is added, within the start).
    let other_ports = [(ports + 4, ports + 5), (ports + 6, ports + 7)];
    let (b, taken) = Sidecar::start(&ctx, &file, &other_ports);
    assert_eq!(taken.unwrap().unwrap()[0].1.replicas, 2, "the file holds both replicas");
    for c in 1..=conv {
        assert_eq!(b.overlaps(&conversation(c, 1)), vec![Overlap::default(); 2], "nothing restored onto other engines");
    }
    assert!(!b.metrics.render().contains("kvgate_handover_restored_blocks_total{"), "nothing counted as restored");
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}
