//! Tests of `scheduler`.

use super::*;
use crate::kv_events::Medium;
use crate::time_model::Preset;
use crate::vllm_hash::{HashAlgo, VllmHasher};

const BS: usize = 16;

fn scheduler(blocks: usize, limits: Limits) -> Scheduler {
    let cache = KvCache::new(BS, blocks, 0, VllmHasher::new(HashAlgo::Sha256, None));
    Scheduler::new(limits, Preset::Llama8bH100.cost(), cache)
}

fn roomy() -> Limits {
    Limits { max_num_seqs: 256, max_num_batched_tokens: 8192 }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(31).wrapping_add(salt)).collect()
}

fn output(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 5000 + i).collect()
}

/// Steps until every request finished; returns the elapsed simulated time (µs), the
/// first-token time of each sequence, and all outcomes.
fn run(s: &mut Scheduler) -> (f64, Vec<(SeqId, f64)>, Vec<StepOutcome>) {
    let mut now = 0.0;
    let mut firsts = Vec::new();
    let mut outcomes = Vec::new();
    for _ in 0..100_000 {
        if s.is_idle() {
            return (now, firsts, outcomes);
        }
        let out = s.step();
        assert!(out.duration_us > 0.0, "a busy scheduler always makes progress");
        now += out.duration_us;
        firsts.extend(out.emitted.iter().filter(|e| e.index == 1).map(|e| (e.id, now)));
        outcomes.push(out);
    }
    panic!("did not finish");
}

fn stored(events: &[Event]) -> usize {
    events
        .iter()
        .map(|e| match e {
            Event::BlockStored { block_hashes, medium: Medium::Gpu, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum()
}

#[test]
fn a_request_prefills_then_decodes_one_token_per_step() {
    let mut s = scheduler(1024, roomy());
    let id = s.add(prompt(100, 1), output(5), ExtraKeys::default(), Remote::None).unwrap();
    let first = s.step();
    assert_eq!(first.work.prefill_tokens, 100);
    assert_eq!(first.emitted, vec![Emitted { id, token: 5000, index: 1, cached_tokens: 0, finished: false }]);
    let (_, _, rest) = run(&mut s);
    assert_eq!(rest.len(), 4, "4 more decode steps");
    assert!(rest.iter().all(|o| o.work.decode_seqs == 1 && o.work.prefill_tokens == 0));
    assert!(rest.last().unwrap().emitted[0].finished);
}

#[test]
fn chunked_prefill_splits_a_long_prompt_across_steps() {
    let mut s = scheduler(1024, Limits { max_num_seqs: 256, max_num_batched_tokens: 512 });
    s.add(prompt(1300, 1), output(2), ExtraKeys::default(), Remote::None).unwrap();
    let chunks: Vec<u64> = (0..3).map(|_| s.step().work.prefill_tokens).collect();
    assert_eq!(chunks, vec![512, 512, 276]);
}

#[test]
fn a_decode_shares_the_step_with_a_prefill_chunk() {
    let mut s = scheduler(1024, Limits { max_num_seqs: 256, max_num_batched_tokens: 256 });
    s.add(prompt(32, 1), output(10), ExtraKeys::default(), Remote::None).unwrap();
    s.step();
    s.add(prompt(1000, 2), output(2), ExtraKeys::default(), Remote::None).unwrap();
    let mixed = s.step();
    assert_eq!((mixed.work.decode_seqs, mixed.work.prefill_tokens), (1, 255), "decode first, then a chunk");
}

#[test]
fn prefix_hits_shorten_ttft_and_are_counted() {
    let mut s = scheduler(1024, roomy());
    let p = prompt(4000, 1);
    s.add(p.clone(), output(1), ExtraKeys::default(), Remote::None).unwrap();
    let (cold, _, _) = run(&mut s);
    let mut warm_prompt = p.clone();
    warm_prompt.extend(prompt(50, 9));
    s.add(warm_prompt, output(1), ExtraKeys::default(), Remote::None).unwrap();
    let (warm, _, outcomes) = run(&mut s);
    assert_eq!(outcomes[0].emitted[0].cached_tokens, 4000 / BS * BS);
    assert!(warm * 5.0 < cold, "warm TTFT {warm} µs vs cold {cold} µs");
    let c = s.counters();
    assert_eq!((c.prefix_queries, c.prefix_hits), (8050, 4000));
    assert_eq!((c.prompt_tokens, c.generation_tokens), (8050, 2));
}

#[test]
fn children_of_one_prompt_compute_it_once_and_find_its_blocks() {
    // vLLM's parallel sampling (n = 3): three requests with one prompt, queued together.
    // The first caches the prompt's full blocks as it is scheduled; the others, scheduled
    // after it in the same step, find them (up to len − 1 tokens) and compute the rest.
    let mut s = scheduler(64, roomy());
    let p = prompt(100, 1);
    let ids: Vec<SeqId> = (0..3)
        .map(|c| {
            let output = (0..2).map(|i| 5000 + 10 * c + i).collect();
            s.add(p.clone(), output, ExtraKeys::default(), Remote::None).unwrap()
        })
        .collect();
    let first = s.step();
    assert_eq!(first.work.prefill_tokens, 100 + 4 + 4, "the prompt once, then each child's last 4 tokens");
    let emitted: Vec<(SeqId, usize)> = first.emitted.iter().map(|e| (e.id, e.cached_tokens)).collect();
    assert_eq!(emitted, vec![(ids[0], 0), (ids[1], 96), (ids[2], 96)], "in the order they were queued");
    assert_eq!(stored(&first.events), 6, "the prompt's 6 full blocks, stored once");
    assert_eq!(s.cache_usage(), 9.0 / 64.0, "6 shared blocks, and a tail block each");
    let c = s.counters();
    assert_eq!((c.prompt_tokens, c.prompt_computed, c.prompt_local_hits), (300, 108, 192));
    assert_eq!((c.prefix_queries, c.prefix_hits), (300, 192));
    let (_, _, rest) = run(&mut s);
    assert_eq!(rest.len(), 1, "the second tokens, decoded together");
    assert_eq!(rest[0].work.decode_seqs, 3);
    assert_eq!(s.cache_usage(), 0.0);
}

#[test]
fn max_num_seqs_caps_the_batch_and_throughput_saturates() {
    // Throughput (output tokens per simulated second) grows with offered concurrency up
    // to max_num_seqs, then stays flat: the extra requests only wait.
    let throughput = |concurrency: usize| {
        let mut s = scheduler(100_000, Limits { max_num_seqs: 8, max_num_batched_tokens: 8192 });
        for i in 0..concurrency {
            s.add(prompt(64, i as u32), output(64), ExtraKeys::default(), Remote::None).unwrap();
        }
        let (t, _, outcomes) = run(&mut s);
        assert!(outcomes.iter().all(|o| o.work.decode_seqs <= 8));
        (concurrency * 64) as f64 / t
    };
    let (t1, t4, t8, t16, t32) = (throughput(1), throughput(4), throughput(8), throughput(16), throughput(32));
    assert!(t4 > 3.0 * t1 && t8 > 1.5 * t4, "scales below the cap: {t1} {t4} {t8}");
    assert!((t16 - t8).abs() / t8 < 0.1 && (t32 - t8).abs() / t8 < 0.1, "flat above the cap: {t8} {t16} {t32}");
}

#[test]
fn the_token_budget_caps_prefill_throughput() {
    let mut s = scheduler(100_000, Limits { max_num_seqs: 256, max_num_batched_tokens: 1024 });
    for i in 0..10 {
        s.add(prompt(1000, i), output(1), ExtraKeys::default(), Remote::None).unwrap();
    }
    let (_, _, outcomes) = run(&mut s);
    assert!(outcomes.iter().all(|o| o.work.prefill_tokens <= 1024));
    assert_eq!(outcomes.iter().map(|o| o.work.prefill_tokens).sum::<u64>(), 10_000);
}

#[test]
fn out_of_blocks_preempts_the_newest_and_recomputes_it() {
    // 20 blocks of 16: two requests of 120 prompt + 100 output tokens cannot both finish.
    let mut s = scheduler(20, roomy());
    let a = s.add(prompt(120, 1), output(100), ExtraKeys::default(), Remote::None).unwrap();
    let b = s.add(prompt(120, 2), output(100), ExtraKeys::default(), Remote::None).unwrap();
    let (_, _, outcomes) = run(&mut s);
    assert!(s.counters().preemptions > 0);
    let tokens = |id| outcomes.iter().flat_map(|o| &o.emitted).filter(|e| e.id == id).count();
    assert_eq!((tokens(a), tokens(b)), (100, 100), "both complete, every token once");
    assert_eq!(s.cache_usage(), 0.0, "all blocks returned");
}

#[test]
fn a_prompt_larger_than_the_cache_is_refused() {
    let mut s = scheduler(4, roomy());
    assert!(s.add(prompt(100, 1), output(1), ExtraKeys::default(), Remote::None).is_err());
}

#[test]
fn decode_completed_blocks_are_stored_and_all_blocks_freed_at_the_end() {
    let mut s = scheduler(64, roomy());
    s.add(prompt(40, 1), output(30), ExtraKeys::default(), Remote::None).unwrap();
    let (_, _, outcomes) = run(&mut s);
    let events: Vec<Event> = outcomes.into_iter().flat_map(|o| o.events).collect();
    // 40 + 29 computed tokens = 4 full blocks of 16.
    assert_eq!(stored(&events), 4);
    assert_eq!(s.cache_usage(), 0.0);
}

#[test]
fn abort_frees_the_blocks() {
    let mut s = scheduler(64, roomy());
    let id = s.add(prompt(100, 1), output(50), ExtraKeys::default(), Remote::None).unwrap();
    s.step();
    assert!(s.cache_usage() > 0.0);
    s.abort(id);
    assert!(s.is_idle());
    assert_eq!(s.cache_usage(), 0.0);
}

fn key(name: &str) -> HoldKey {
    HoldKey::Request(name.into())
}

fn remote_decode(s: &mut Scheduler, p: Vec<u32>, name: &str) -> (SeqId, Held) {
    let id = s.add(p, output(1), ExtraKeys::default(), Remote::Decode(key(name))).unwrap();
    let (_, _, outcomes) = run(s);
    let held: Vec<Held> = outcomes.into_iter().flat_map(|o| o.held).collect();
    assert_eq!(held.len(), 1);
    (id, held[0].clone())
}

#[test]
fn a_remote_decode_holds_its_blocks_until_its_decoder_reads_them() {
    let mut s = scheduler(64, roomy());
    let (id, held) = remote_decode(&mut s, prompt(100, 1), "r1");
    assert_eq!((held.id, held.key.clone(), held.block_ids.len()), (id, key("r1"), 7), "100 tokens fill 7 blocks");
    assert!(s.is_idle(), "nothing left to run");
    assert_eq!((s.held_blocks(), s.cache_usage()), (7, 7.0 / 64.0), "held blocks stay in use");
    let cached = s.cached_blocks();
    let mut events = Vec::new();
    assert_eq!(s.release(&key("r1"), &mut events), Some(held.block_ids));
    assert_eq!((s.held_blocks(), s.cache_usage(), s.cached_blocks()), (0, 0.0, cached), "freed, still cached");
    assert_eq!(s.release(&key("r1"), &mut events), None, "read once");
}

#[test]
fn a_hold_expires_unless_read_and_only_its_own() {
    let mut s = scheduler(64, roomy());
    let (first, _) = remote_decode(&mut s, prompt(40, 1), "r");
    let (second, _) = remote_decode(&mut s, prompt(40, 2), "r");
    assert_eq!(s.held_blocks(), 3, "the reused key dropped the first hold");
    let mut events = Vec::new();
    assert!(!s.expire(&key("r"), first, &mut events), "the first one's timer finds the second's blocks");
    assert!(s.expire(&key("r"), second, &mut events));
    assert_eq!((s.held_blocks(), s.cache_usage()), (0, 0.0));
    assert!(!s.expire(&key("r"), second, &mut events), "gone");
}

#[test]
fn a_vllm_remote_prefill_is_loaded_then_computes_only_its_last_token() {
    let mut s = scheduler(64, roomy());
    // 64 tokens of the prompt are cached locally.
    let p = prompt(100, 1);
    s.add(p[..70].to_vec(), output(1), ExtraKeys::default(), Remote::None).unwrap();
    run(&mut s);
    let before = s.counters();
    let id = s.add(p.clone(), output(3), ExtraKeys::default(), Remote::Prefill(LoadMode::RecomputeLast)).unwrap();
    let admitted = s.step();
    assert_eq!(admitted.loads, vec![Load { id, local_tokens: 64, tokens: 36, blocks: 3 }]);
    assert!(admitted.work.is_empty() && admitted.duration_us == 0.0, "a load takes no compute");
    assert_eq!((s.num_waiting(), s.num_running(), s.is_idle()), (1, 0, false));
    assert!(s.step().work.is_empty(), "nothing to do while it loads");
    let (events, first) = s.finish_load(id, true).unwrap();
    assert_eq!(first, None);
    // 99 tokens count as computed: blocks 5 and 6 (of 16 tokens) are stored now.
    assert_eq!(stored(&events), 2);
    let (_, _, outcomes) = run(&mut s);
    assert_eq!(outcomes[0].work.prefill_tokens, 1, "the last prompt token");
    assert!(outcomes[1..].iter().all(|o| o.work.prefill_tokens == 0 && o.work.decode_seqs == 1));
    let emitted: Vec<&Emitted> = outcomes.iter().flat_map(|o| &o.emitted).collect();
    assert_eq!(emitted.len(), 3);
    assert_eq!(emitted[0].cached_tokens, 99, "vLLM reports the loaded prompt as cached");
    let c = s.counters();
    let d = |f: fn(&Counters) -> u64| f(&c) - f(&before);
    let by_source = (d(|c| c.prompt_computed), d(|c| c.prompt_local_hits), d(|c| c.prompt_external));
    assert_eq!(by_source, (1, 64, 36));
    assert_eq!((d(|c| c.prompt_cached), d(|c| c.prompt_recomputed), d(|c| c.prompt_tokens)), (99, 1, 100));
    assert_eq!(s.cache_usage(), 0.0);
}

#[test]
fn an_sglang_remote_prefill_arrives_with_its_first_token() {
    let mut s = scheduler(64, roomy());
    let id = s.add(prompt(100, 1), output(3), ExtraKeys::default(), Remote::Prefill(LoadMode::WithFirstToken)).unwrap();
    let load = s.step().loads[0];
    assert_eq!((load.local_tokens, load.tokens, load.blocks), (0, 100, 7));
    let (events, first) = s.finish_load(id, true).unwrap();
    assert_eq!(stored(&events), 6);
    assert_eq!(first, Some(Emitted { id, token: 5000, index: 1, cached_tokens: 100, finished: false }));
    let (_, _, outcomes) = run(&mut s);
    assert_eq!(outcomes.len(), 2, "two more tokens, decoded");
    assert!(outcomes.iter().all(|o| o.work.prefill_tokens == 0 && o.work.decode_seqs == 1));
    let c = s.counters();
    assert_eq!((c.prompt_computed, c.prompt_external, c.prompt_cached, c.generation_tokens), (0, 100, 100, 3));
    // A one-token request finishes with its load.
    let id = s.add(prompt(20, 2), output(1), ExtraKeys::default(), Remote::Prefill(LoadMode::WithFirstToken)).unwrap();
    s.step();
    let (_, first) = s.finish_load(id, true).unwrap();
    assert!(first.unwrap().finished);
    assert!(s.is_idle());
    assert_eq!(s.cache_usage(), 0.0);
}

#[test]
fn a_failed_load_computes_the_prompt_here() {
    let mut s = scheduler(64, Limits { max_num_seqs: 256, max_num_batched_tokens: 64 });
    let id = s.add(prompt(100, 1), output(2), ExtraKeys::default(), Remote::Prefill(LoadMode::RecomputeLast)).unwrap();
    s.step();
    let (_, first) = s.finish_load(id, false).unwrap();
    assert_eq!(first, None);
    let (_, _, outcomes) = run(&mut s);
    let chunks: Vec<u64> = outcomes.iter().map(|o| o.work.prefill_tokens).filter(|n| *n > 0).collect();
    assert_eq!(chunks, vec![64, 36], "chunked prefill of the whole prompt");
    assert_eq!(outcomes.iter().flat_map(|o| &o.emitted).next().unwrap().cached_tokens, 0);
    let c = s.counters();
    assert_eq!((c.prompt_computed, c.prompt_external, c.prompt_cached), (100, 0, 0));
    assert_eq!(s.finish_load(id, true), None, "unknown once it left the loading set");
}

#[test]
fn aborting_a_loading_request_frees_its_blocks() {
    let mut s = scheduler(64, roomy());
    let id = s.add(prompt(100, 1), output(2), ExtraKeys::default(), Remote::Prefill(LoadMode::RecomputeLast)).unwrap();
    s.step();
    assert!(s.cache_usage() > 0.0, "blocks are taken for the load");
    s.abort(id);
    assert!(s.is_idle());
    assert_eq!(s.cache_usage(), 0.0);
    assert_eq!(s.finish_load(id, true), None);
}
