//! kvgate's index vs Dynamo's, on one vLLM-like event stream, in one run.
//!
//! Stream: R replicas; requests of 64 blocks = a 16-block prefix shared by one of 32 groups
//! plus 48 unique blocks. On each replica the first request of a group stores all 64 blocks
//! (parent nil); later ones store their 48 new blocks after the cached prefix. Once a replica
//! holds its block budget, every new request first evicts the oldest request's unique
//! blocks, one single-hash `BlockRemoved` per block, children first — vLLM's pattern.
//!
//! Indexes: kvgate's `KvIndex`, Dynamo's single-thread `RadixTree`, and Dynamo's
//! `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with 2 threads.
//!
//! Reported: apply throughput (blocks/s, including the local-hash computation each side
//! needs), the longest single event's apply (what a routing decision waiting on the index's
//! lock would wait; from a second pass that times every event, so that the clock reads do not
//! slow the throughput pass), `find_matches` p50/p99 for a full
//! hit, a shared prefix and a miss, and heap bytes per indexed block (a counting allocator).
//! Usage:
//! `cargo run --release -- [replicas] [blocks_per_replica] [repeats] [churn_percent]` (default
//! 64 × 100000, 3 repeats: each index applies the stream that many times, alternating with the
//! others, and its fastest apply and lowest lookup percentiles are compared; every repeat's
//! apply ratios are printed too. After filling its budget a replica serves `churn_percent` %
//! more of it, default 10, evicting as it goes).
//! The full routing decision is compared by `src/bin/decision.rs` (`--bin decision`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use kvgate_shared::hash::{local_block_hash, next_sequence_hash, EngineHash, Salt, SequenceHash};
use kvgate_sidecar::index::{KvIndex, ReplicaIdx, Store, Tier};

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const BS: usize = 16;
const GROUPS: u32 = 32;
const PREFIX: usize = 16;
const UNIQUE: usize = 48;

/// One event, in a neutral form both indexes are fed from.
enum Ev {
    Stored { replica: usize, parent: Option<EngineHash>, hashes: Vec<EngineHash>, tokens: Vec<u32> },
    Removed { replica: usize, hash: EngineHash },
}

fn tokens_of(seed: u64, blocks: usize) -> Vec<u32> {
    (0..blocks * BS)
        .map(|i| (xxhash_rust::xxh3::xxh3_64_with_seed(&(i as u64).to_le_bytes(), seed) % 150_000) as u32)
        .collect()
}

/// Content-derived engine hashes (identical on every replica, as with a fixed PYTHONHASHSEED).
fn engine_hashes(tokens: &[u32]) -> Vec<EngineHash> {
    let mut parent = None;
    tokens
        .chunks(BS)
        .map(|b| {
            let seq = next_sequence_hash(parent, local_block_hash(b, Salt::NONE));
            parent = Some(seq);
            EngineHash(seq.0.rotate_left(29) ^ 0xa5a5_a5a5)
        })
        .collect()
}

struct Stream {
    events: Vec<Ev>,
    blocks_stored: u64,
    /// Queries: (full hit, shared prefix, miss), as token lists.
    hits: Vec<Vec<u32>>,
    shared: Vec<Vec<u32>>,
    misses: Vec<Vec<u32>>,
}

fn stream(replicas: usize, budget: usize, churn_percent: usize) -> Stream {
    let groups: Vec<Vec<u32>> = (0..GROUPS).map(|g| tokens_of(1_000 + u64::from(g), PREFIX)).collect();
    // Fill the budget, then go on for `churn_percent` % of it.
    let requests_per_replica = budget / UNIQUE + budget / UNIQUE * churn_percent / 100;
    let mut events = Vec::new();
    let mut blocks_stored = 0;
    let mut hits = Vec::new();
    for r in 0..replicas {
        let mut cached_groups = vec![false; GROUPS as usize];
        let mut live: VecDeque<Vec<EngineHash>> = VecDeque::new();
        let mut held = 0usize;
        for q in 0..requests_per_replica {
            let g = (q * 7 + r) % GROUPS as usize;
            let mut tokens = groups[g].clone();
            tokens.extend(tokens_of(((r as u64) << 32) | q as u64, UNIQUE));
            let hashes = engine_hashes(&tokens);
            while held + UNIQUE > budget {
                let Some(old) = live.pop_front() else { break };
                for h in old.iter().rev() {
                    events.push(Ev::Removed { replica: r, hash: *h });
                }
                held -= old.len();
            }
            if cached_groups[g] {
                events.push(Ev::Stored {
                    replica: r,
                    parent: Some(hashes[PREFIX - 1]),
                    hashes: hashes[PREFIX..].to_vec(),
                    tokens: tokens[PREFIX * BS..].to_vec(),
                });
                blocks_stored += UNIQUE as u64;
            } else {
                cached_groups[g] = true;
                events.push(Ev::Stored { replica: r, parent: None, hashes: hashes.clone(), tokens: tokens.clone() });
                blocks_stored += (PREFIX + UNIQUE) as u64;
                held += PREFIX;
            }
            held += UNIQUE;
            live.push_back(hashes[PREFIX..].to_vec());
            if q + 1 == requests_per_replica && hits.len() < 1000 {
                hits.push(tokens);
            }
        }
    }
    while hits.len() < 1000 {
        hits.push(hits[hits.len() % replicas].clone());
    }
    let shared = (0..1000u64)
        .map(|i| {
            let mut t = groups[(i % u64::from(GROUPS)) as usize].clone();
            t.extend(tokens_of(9_000_000 + i, UNIQUE));
            t
        })
        .collect();
    let misses = (0..1000u64).map(|i| tokens_of(8_000_000 + i, PREFIX + UNIQUE)).collect();
    Stream { events, blocks_stored, hits, shared, misses }
}

fn percentile(mut samples: Vec<Duration>, p: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() - 1) as f64 * p) as usize]
}

#[derive(Clone)]
struct Report {
    name: &'static str,
    apply_blocks_per_s: f64,
    /// The longest single event's apply: what a reader of the index waits behind.
    longest_event: Option<Duration>,
    find: Vec<(&'static str, Duration, Duration)>,
    bytes_per_block: f64,
}

/// Each sample is the mean of 16 back-to-back runs of one query, so the clock's own cost
/// (~20-40 ns) does not swamp sub-100 ns lookups.
fn time_queries<H>(queries: &[Vec<H>], mut f: impl FnMut(&[H]) -> u32) -> (Duration, Duration) {
    const REPEAT: u32 = 16;
    let mut samples = Vec::with_capacity(queries.len());
    let mut sink = 0u64;
    for q in queries {
        let t = Instant::now();
        for _ in 0..REPEAT {
            sink += u64::from(f(std::hint::black_box(q)));
        }
        samples.push(t.elapsed() / REPEAT);
    }
    std::hint::black_box(sink);
    (percentile(samples.clone(), 0.5), percentile(samples, 0.99))
}

/// How an apply pass is timed.
#[derive(Clone, Copy, PartialEq)]
enum Clock {
    /// The whole pass only: throughput.
    Pass,
    /// Every event too: the longest event (the clock reads cost the pass a few percent).
    EachEvent,
}

/// Times `apply` for the longest event, if the clock says so.
fn timed(clock: Clock, longest: &mut Duration, apply: impl FnOnce()) {
    if clock == Clock::EachEvent {
        let started = Instant::now();
        apply();
        *longest = (*longest).max(started.elapsed());
    } else {
        apply();
    }
}

fn kvgate(s: &Stream, replicas: usize, queries: &[(&'static str, Vec<Vec<SequenceHash>>)], clock: Clock) -> Report {
    let before = LIVE.load(Ordering::Relaxed);
    let mut index = KvIndex::new(BS, replicas);
    let mut longest = Duration::ZERO;
    let mut removed = Vec::new();
    let t = Instant::now();
    for (i, ev) in s.events.iter().enumerate() {
        timed(clock, &mut longest, || {
            match ev {
                Ev::Stored { replica, parent, hashes, tokens } => {
                    let store = Store {
                        parent: *parent,
                        engine_hashes: hashes,
                        token_ids: tokens,
                        block_size: BS,
                        salt: Salt::NONE,
                        extra: &[],
                        tier: Tier::Device,
                    };
                    index.store(ReplicaIdx::new(*replica), store).expect("consistent stream");
                }
                // The sidecar applies a batch's consecutive removals of one tier in one call.
                Ev::Removed { replica, hash } => {
                    removed.push(*hash);
                    if !matches!(s.events.get(i + 1), Some(Ev::Removed { replica: next, .. }) if next == replica) {
                        index.remove(ReplicaIdx::new(*replica), Tier::Device, &removed);
                        removed.clear();
                    }
                }
            }
        });
    }
    let elapsed = t.elapsed();
    let held: usize = (0..replicas).map(|r| index.replica_blocks(ReplicaIdx::new(r))).sum();
    let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
    let find = queries
        .iter()
        .map(|(name, qs)| {
            let (p50, p99) =
                time_queries(qs, |q| index.find_overlaps(q).iter().map(|(_, o)| o.device).max().unwrap_or(0));
            (*name, p50, p99)
        })
        .collect();
    Report {
        name: "kvgate KvIndex",
        apply_blocks_per_s: s.blocks_stored as f64 / elapsed.as_secs_f64(),
        longest_event: (clock == Clock::EachEvent).then_some(longest),
        find,
        bytes_per_block: bytes / held as f64,
    }
}

fn dynamo_events(s: &Stream) -> Vec<RouterEvent> {
    s.events
        .iter()
        .enumerate()
        .map(|(i, ev)| match ev {
            Ev::Stored { replica, parent, hashes, tokens } => {
                // The work Dynamo's ZMQ converter does per block: the local hash of its tokens.
                let blocks = hashes
                    .iter()
                    .zip(tokens.chunks(BS))
                    .map(|(h, b)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h.0),
                        tokens_hash: LocalBlockHash(local_block_hash(b, Salt::NONE).0),
                        mm_extra_info: None,
                    })
                    .collect();
                let data = KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.0)),
                    start_position: None,
                    blocks,
                });
                RouterEvent::new(*replica as u64, KvCacheEvent { event_id: i as u64, data, dp_rank: 0 })
            }
            Ev::Removed { replica, hash } => {
                let data = KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: vec![ExternalSequenceBlockHash(hash.0)],
                });
                RouterEvent::new(*replica as u64, KvCacheEvent { event_id: i as u64, data, dp_rank: 0 })
            }
        })
        .collect()
}

/// A Dynamo index's report: `elapsed` and `bytes` for applying the stream, lookups through
/// `find` (returning its overlap scores).
fn dynamo_report(
    name: &'static str,
    s: &Stream,
    elapsed: Duration,
    longest_event: Option<Duration>,
    bytes: f64,
    local_queries: &[(&'static str, Vec<Vec<u64>>)],
    find: impl Fn(Vec<LocalBlockHash>) -> OverlapScores,
) -> Report {
    let find = local_queries
        .iter()
        .map(|(query, qs)| {
            let (p50, p99) = time_queries(qs, |q| {
                let seq: Vec<LocalBlockHash> = q.iter().map(|h| LocalBlockHash(*h)).collect();
                find(seq).scores.values().copied().max().unwrap_or(0)
            });
            (*query, p50, p99)
        })
        .collect();
    Report {
        name,
        apply_blocks_per_s: s.blocks_stored as f64 / elapsed.as_secs_f64(),
        longest_event,
        find,
        bytes_per_block: bytes / held_blocks(s) as f64,
    }
}

fn dynamo_radix(s: &Stream, local_queries: &[(&'static str, Vec<Vec<u64>>)], clock: Clock) -> Report {
    let before = LIVE.load(Ordering::Relaxed);
    let mut tree = RadixTree::new();
    let t = Instant::now();
    // Converting (hashing tokens) is timed with the apply, as kvgate's store hashes too.
    let mut longest = Duration::ZERO;
    for ev in dynamo_events(s) {
        timed(clock, &mut longest, || tree.apply_event(ev).expect("consistent stream"));
    }
    let elapsed = t.elapsed();
    let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
    let longest = (clock == Clock::EachEvent).then_some(longest);
    dynamo_report("Dynamo RadixTree", s, elapsed, longest, bytes, local_queries, |seq| tree.find_matches(seq, false))
}

/// Dynamo's concurrent indexer: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with 2
/// threads. Events are enqueued (converted as for the `RadixTree`) and the clock stops when
/// every thread has applied its share; lookups run inline on the caller's thread, as its
/// `find_matches` does.
fn dynamo_thread_pool(s: &Stream, local_queries: &[(&'static str, Vec<Vec<u64>>)]) -> Report {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let before = LIVE.load(Ordering::Relaxed);
    let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 2, BS as u32);
    let t = Instant::now();
    for ev in dynamo_events(s) {
        pool.enqueue_event(ev).expect("consistent stream");
    }
    runtime.block_on(pool.flush_and_wait()).expect("the threads apply everything");
    let elapsed = t.elapsed();
    let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
    // Its events are applied on its own threads: no single event's time to take.
    dynamo_report("Dynamo ThreadPool", s, elapsed, None, bytes, local_queries, |seq| {
        pool.backend().find_matches(&seq, false)
    })
}

/// The report with the fastest apply, with the median of the reports' longest events and,
/// per query kind, the lowest p50 and p99 of any repeat (like the apply, the repeat least
/// disturbed by the machine's neighbours).
fn best<'a>(reports: impl Iterator<Item = &'a Report>) -> Report {
    let reports: Vec<&Report> = reports.collect();
    let mut longest: Vec<Duration> = reports.iter().filter_map(|r| r.longest_event).collect();
    longest.sort_unstable();
    let fastest =
        reports.iter().max_by(|a, b| a.apply_blocks_per_s.total_cmp(&b.apply_blocks_per_s)).expect("a repeat");
    let find = (0..fastest.find.len())
        .map(|i| {
            let lowest = |pick: fn(&(&'static str, Duration, Duration)) -> Duration| {
                reports.iter().map(|r| pick(&r.find[i])).min().expect("a repeat")
            };
            (fastest.find[i].0, lowest(|f| f.1), lowest(|f| f.2))
        })
        .collect();
    Report { longest_event: longest.get(longest.len() / 2).copied(), find, ..(*fastest).clone() }
}

/// Blocks held at the end of the stream (the same for both indexes).
fn held_blocks(s: &Stream) -> usize {
    let mut held = std::collections::HashSet::new();
    for ev in &s.events {
        match ev {
            Ev::Stored { replica, hashes, .. } => held.extend(hashes.iter().map(|h| (*replica, *h))),
            Ev::Removed { replica, hash } => {
                held.remove(&(*replica, *hash));
            }
        }
    }
    held.len()
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let replicas = args.first().copied().unwrap_or(64);
    let budget = args.get(1).copied().unwrap_or(100_000);
    let repeats = args.get(2).copied().unwrap_or(3).max(1);
    let churn_percent = args.get(3).copied().unwrap_or(10);
    eprintln!("building the stream: {replicas} replicas x {budget} blocks ...");
    let s = stream(replicas, budget, churn_percent);
    eprintln!("{} events, {} blocks stored", s.events.len(), s.blocks_stored);
    let seq = |ts: &[Vec<u32>]| {
        ts.iter().map(|t| kvgate_shared::hash::prompt_block_hashes(t, BS, Salt::NONE)).collect::<Vec<_>>()
    };
    let local = |ts: &[Vec<u32>]| {
        ts.iter()
            .map(|t| kvgate_shared::hash::local_block_hashes(t, BS, Salt::NONE).iter().map(|h| h.0).collect())
            .collect::<Vec<Vec<u64>>>()
    };
    let ours = [("full hit", seq(&s.hits)), ("shared prefix", seq(&s.shared)), ("miss", seq(&s.misses))];
    let theirs = [("full hit", local(&s.hits)), ("shared prefix", local(&s.shared)), ("miss", local(&s.misses))];

    // The machine is shared: each index applies the stream `repeats` times, alternating, and
    // its fastest apply and lowest lookup times are compared (least disturbed by neighbours).
    let mut runs = Vec::new();
    for r in 0..repeats {
        eprintln!("repeat {} of {repeats} ...", r + 1);
        let k = kvgate(&s, replicas, &ours, Clock::Pass);
        let d = dynamo_radix(&s, &theirs, Clock::Pass);
        let p = dynamo_thread_pool(&s, &theirs);
        let k = Report { longest_event: kvgate(&s, replicas, &[], Clock::EachEvent).longest_event, ..k };
        let d = Report { longest_event: dynamo_radix(&s, &[], Clock::EachEvent).longest_event, ..d };
        runs.push([k, d, p]);
    }
    for [k, d, p] in &runs {
        println!(
            "repeat: apply {:>10.0} / {:>10.0} / {:>10.0} blocks/s (kvgate / RadixTree / ThreadPool): {:.2}x / {:.2}x",
            k.apply_blocks_per_s,
            d.apply_blocks_per_s,
            p.apply_blocks_per_s,
            k.apply_blocks_per_s / d.apply_blocks_per_s,
            k.apply_blocks_per_s / p.apply_blocks_per_s
        );
    }
    let [k, d, p] = [0, 1, 2].map(|i| best(runs.iter().map(|run| &run[i])));
    println!("\nbest of {repeats} (apply, lookups), median longest event, memory:");
    for r in [&k, &d, &p] {
        println!(
            "{:<18} apply {:>10.0} blocks/s   memory {:>6.1} B/block",
            r.name, r.apply_blocks_per_s, r.bytes_per_block
        );
        if let Some(longest) = r.longest_event {
            println!("{:<18}   longest single event {:>9.2?}", "", longest);
        }
        for (q, p50, p99) in &r.find {
            println!("{:<18}   find_matches {:<13} p50 {:>9.2?}  p99 {:>9.2?}", "", q, p50, p99);
        }
    }
    println!("\nratios (kvgate vs Dynamo RadixTree, same run):");
    println!("  apply throughput  {:.2}x  (target >= 2x)", k.apply_blocks_per_s / d.apply_blocks_per_s);
    for ((q, kp50, _), (_, dp50, _)) in k.find.iter().zip(&d.find) {
        println!(
            "  find_matches p50 {:<13} {:.2}x of Dynamo's time  (target <= 0.5)",
            q,
            kp50.as_secs_f64() / dp50.as_secs_f64()
        );
    }
    println!("  memory per block  {:.2}x of Dynamo's  (target <= 0.5)", k.bytes_per_block / d.bytes_per_block);
    if let (Some(kl), Some(dl)) = (k.longest_event, d.longest_event) {
        println!("  longest event     {:.2}x of Dynamo's", kl.as_secs_f64() / dl.as_secs_f64());
    }
    println!("\nratios (kvgate, one thread, vs Dynamo ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, 2 threads):");
    println!("  apply throughput  {:.2}x", k.apply_blocks_per_s / p.apply_blocks_per_s);
    for ((q, kp50, _), (_, pp50, _)) in k.find.iter().zip(&p.find) {
        println!("  find_matches p50 {:<13} {:.2}x of its time", q, kp50.as_secs_f64() / pp50.as_secs_f64());
    }
    println!("  memory per block  {:.2}x of its", k.bytes_per_block / p.bytes_per_block);
}
