//! The pool as a whole: decisions, membership, policies, lifecycle, under concurrency.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::hash::{prompt_block_hashes, EngineHash, Salt};
use kvgate_shared::wire::{RouteRequest, RouteResponse};

use super::ReplicaConfig;
use super::*;
use crate::index::{Store, Tier};
use crate::latency::Inputs;
use crate::load::EngineReport;
use crate::load::NewBooking;
use crate::msg::ingest::{Outcome, Progress};
use crate::msg::sync::SyncEvent;
use crate::score::ScoringConfig;

fn pool(replicas: usize) -> Pool {
    pool_with(replicas, Policy::KvAware)
}

fn pool_with(replicas: usize, policy: Policy) -> Pool {
    let replicas = (0..replicas)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 8000 + i).parse().unwrap();
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig { policy, ..PoolConfig::new("m", "unused", 4, replicas) };
    Pool::new(config, Vec::new(), Arc::new(Metrics::default()))
}

fn request(id: &str, tokens: &[u32]) -> RouteRequest {
    RouteRequest {
        prefill_legs: true,
        ..RouteRequest::exact(id, "m", tokens.len() as u32, 4, prompt_block_hashes(tokens, 4, Salt::NONE))
    }
}

#[test]
fn cache_hits_win_and_concurrent_misses_spread() {
    let p = pool(3);
    let cached: Vec<u32> = (0..64).collect();
    p.store_blocks(ReplicaIdx::new(2), prompt_store(&(0..16).map(EngineHash).collect::<Vec<_>>(), &cached)).unwrap();
    let cfg = ScoringConfig::default();
    let hit = p.route(&request("hit", &cached), &cfg);
    assert_eq!((hit.replica.as_deref(), hit.overlap_blocks), (Some("r2"), 16));
    // Six distinct uncached prompts in a row, none finished: bookings spread them.
    let mut per_replica = [0; 3];
    for i in 0..6u32 {
        let tokens: Vec<u32> = (0..64).map(|t| 10_000 + i * 100 + t).collect();
        let r = p.route(&request(&format!("miss{i}"), &tokens), &cfg);
        per_replica[r.replica.unwrap()[1..].parse::<usize>().unwrap()] += 1;
    }
    assert!(per_replica.iter().all(|n| *n >= 1), "no herding onto one replica: {per_replica:?}");
}

/// A prompt's blocks stored on the device tier from its start, as the engine reports them.
fn prompt_store<'a>(engine_hashes: &'a [EngineHash], token_ids: &'a [u32]) -> Store<'a> {
    Store { parent: None, engine_hashes, token_ids, block_size: 4, salt: Salt::NONE, extra: &[], tier: Tier::Device }
}

fn cache_on(p: &Pool, replica: usize, tokens: &[u32]) {
    let engine: Vec<EngineHash> =
        (0..(tokens.len() / 4) as u64).map(|i| EngineHash(i + 1000 * replica as u64)).collect();
    let store = prompt_store(&engine, tokens);
    p.store_blocks(ReplicaIdx::new(replica), store).unwrap();
}

fn chosen(r: &RouteResponse) -> usize {
    r.replica.as_deref().unwrap()[1..].parse().unwrap()
}

#[test]
fn learned_adapters_route_only_where_they_are_loaded() {
    let p = pool(3);
    let sql = BTreeSet::from(["sql".to_owned()]);
    assert!(!p.serves_adapter("sql"));
    let endpoint = p.members()[1].replica.endpoint.to_string();
    assert!(p.set_adapters(&endpoint, &sql));
    assert!(!p.set_adapters(&endpoint, &sql), "the same list changes nothing");
    assert!(p.serves_adapter("sql"));
    assert_eq!(p.adapters(), sql);
    let scoring = ScoringConfig::default();
    for i in 0..6 {
        let req = RouteRequest { model: "sql".into(), ..request(&format!("a{i}"), &[i, 2, 3, 4, 5]) };
        assert_eq!(chosen(&p.route(&req, &scoring)), 1, "only replica 1 has the adapter");
    }
    let spread: BTreeSet<usize> =
        (0..6).map(|i| chosen(&p.route(&request(&format!("b{i}"), &[i, 9, 9, 9, 9]), &scoring))).collect();
    assert_eq!(spread.len(), 2, "the base model spreads over the other replicas, which are idle");
    assert!(p.set_adapters(&endpoint, &BTreeSet::new()));
    assert!(!p.serves_adapter("sql"), "unloaded everywhere: no longer routed");
    let req = RouteRequest { model: "sql".into(), ..request("c", &[1, 2, 3, 4]) };
    assert_eq!(p.route(&req, &scoring).endpoint, None);
}

#[test]
fn least_load_ignores_the_cache_and_kv_aware_weighs_it() {
    let cached: Vec<u32> = (0..256).collect();
    for (policy, expected) in [(Policy::KvAware, 0), (Policy::LeastLoad, 1)] {
        let p = pool_with(2, policy);
        cache_on(&p, 0, &cached);
        // r0 is a little busy; its cache saves far more than that.
        p.load_table().book(
            ReplicaIdx::new(0),
            NewBooking {
                id: &crate::load::BookingId::new(&"busy".into()),
                prefill_tokens: 40,
                hashes: &[],
                total_blocks: 10,
                max_tokens: None,
                prediction: None,
                sequences: 1,
                streamed: true,
                flow: None,
                from_peer: false,
                timed: false,
                computed: None,
            },
            Instant::now(),
        );
        let r = p.route(&request("q", &cached), &ScoringConfig::default());
        assert_eq!(chosen(&r), expected, "{policy:?}");
    }
}

#[test]
fn round_robin_cycles_and_still_books_load() {
    let p = pool_with(3, Policy::RoundRobin);
    let picks: Vec<usize> = (0..6)
        .map(|i| chosen(&p.route(&request(&format!("r{i}"), &[1, 2, 3, 4]), &ScoringConfig::default())))
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    assert_eq!(p.state().replicas.iter().map(|r| r.active_requests).sum::<u64>(), 6);
}

#[test]
fn consistent_hash_keeps_sessions_and_falls_back_without_one() {
    let p = pool_with(4, Policy::ConsistentHash);
    let cfg = ScoringConfig::default();
    let with_session = |id: &str, s: &str| RouteRequest { session: Some(s.into()), ..request(id, &[1, 2, 3, 4]) };
    let first = chosen(&p.route(&with_session("a0", "alice"), &cfg));
    for i in 1..10 {
        assert_eq!(chosen(&p.route(&with_session(&format!("a{i}"), "alice"), &cfg)), first, "sticky");
    }
    let spread: std::collections::HashSet<usize> =
        (0..40).map(|i| chosen(&p.route(&with_session(&format!("u{i}"), &format!("user-{i}")), &cfg))).collect();
    assert!(spread.len() >= 3, "sessions spread over replicas: {spread:?}");
    let cached: Vec<u32> = (0..64).collect();
    cache_on(&p, 2, &cached);
    let r = p.route(&request("no-session", &cached), &cfg);
    assert_eq!(chosen(&r), 2, "no session: kv_aware");
    assert_eq!(p.explain(Some("no-session"), 1)[0].policy, Policy::KvAware);
}

#[test]
fn decisions_are_explained() {
    let p = pool(2);
    let cached: Vec<u32> = (0..64).collect();
    cache_on(&p, 1, &cached);
    p.route(&request("why", &cached), &ScoringConfig::default());
    let e = &p.explain(Some("why"), 10)[0];
    assert_eq!(e.chosen.as_deref(), Some("r1"));
    assert_eq!(e.candidates[1].overlap.device, 16);
    assert!(e.candidates[1].logit < e.candidates[0].logit);
    assert!(p.explain(Some("unknown"), 10).is_empty());
}

#[test]
fn a_silent_publisher_is_flagged_stalled_and_earns_no_credit() {
    let p = pool(1);
    let tokens: Vec<u32> = (0..64).collect();
    p.route(&request("a", &tokens), &ScoringConfig::default());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !p.state().replicas[0].stalled {
        assert!(Instant::now() < deadline, "never flagged");
        p.check_stalls(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!p.members()[0].health.trusted());
    // Any event brings it back.
    p.after_ingest(ReplicaIdx::new(0), Progress::default(), &Outcome::default());
    assert!(!p.state().replicas[0].stalled);
}

#[test]
fn membership_changes_keep_what_is_unchanged_and_empty_what_left() {
    let p = with_grace(pool(3), 0);
    let replicas = p.config.replicas.clone();
    let prompt: Vec<u32> = (0..64).collect();
    for r in 0..3 {
        cache_on(&p, r, &prompt);
    }
    let only_r1: Vec<u32> = (500..564).collect();
    let engine: Vec<EngineHash> = (5000..5016).map(EngineHash).collect();
    let store = prompt_store(&engine, &only_r1);
    p.store_blocks(ReplicaIdx::new(1), store).unwrap();
    let cfg = ScoringConfig::default();
    assert_eq!(chosen(&p.route(&request("held", &only_r1), &cfg)), 1);
    assert!(p.set_members(&replicas).is_empty(), "the same membership changes nothing");

    // r1 leaves, r0's events endpoint changes, r3 joins.
    let mut moved = replicas[0].clone();
    moved.kv_events = "tcp://10.9.9.9:5557".into();
    let newcomer = ReplicaConfig { id: "r3".into(), endpoint: "127.0.0.1:8003".parse().unwrap(), ..moved.clone() };
    let stop_r1 = p.members()[1].stop.clone();
    let start = p.set_members(&[moved.clone(), replicas[2].clone(), newcomer.clone()]);
    let started: Vec<(usize, &str)> = start.iter().map(|(i, r, _)| (i.get(), r.id.as_str())).collect();
    assert_eq!(
        started,
        [(0, "r0"), (1, "r3")],
        "a changed replica restarts in its slot; a newcomer takes the slot r1 emptied"
    );
    assert!(stop_r1.load(Ordering::Relaxed), "the leaver's events are no longer read");
    let matches = p.find_matches(&prompt_block_hashes(&prompt, 4, Salt::NONE));
    let device: Vec<u32> = matches.iter().map(|o| o.device).collect();
    assert_eq!(device, [0, 0, 16], "r2 keeps its blocks; r0 (new engine) and r3 (in r1's emptied slot) hold none");
    let state: Vec<String> = p.state().replicas.into_iter().map(|r| r.id).collect();
    assert_eq!(state, ["r0", "r3", "r2"]);
    assert!(!p.lifecycle(&"held".into(), false), "r1's booking left with it");
    for i in 0..30 {
        let r = p.route(&request(&format!("q{i}"), &[i; 8]), &cfg);
        assert_ne!(r.replica.as_deref(), Some("r1"), "a replica that left is never chosen");
    }

    // r1 comes back: no slot is free, so a new one, empty.
    let start = p.set_members(&[moved, replicas[1].clone(), replicas[2].clone(), newcomer]);
    assert_eq!(start.iter().map(|(i, _, _)| i.get()).collect::<Vec<_>>(), [3]);
    assert_eq!(p.members().len(), 4);
    assert_eq!(p.state().replicas.len(), 4);
}

/// The same pool with another `leave_grace_secs`.
fn with_grace(p: Pool, secs: u64) -> Pool {
    let config = PoolConfig { leave_grace_secs: secs, ..p.config.clone() };
    Pool::new(config, Vec::new(), Arc::new(Metrics::default()))
}

#[test]
fn a_replica_that_flaps_comes_back_warm_and_one_that_stays_away_is_emptied() {
    let p = pool(3);
    let replicas = p.config.replicas.clone();
    let prompt: Vec<u32> = (0..64).collect();
    cache_on(&p, 1, &prompt);
    let cfg = ScoringConfig::default();
    // r1 fails its health checks: it leaves.
    assert!(p.set_members(&[replicas[0].clone(), replicas[2].clone()]).is_empty());
    for i in 0..10 {
        let r = p.route(&request(&format!("away{i}"), &prompt), &cfg);
        assert_ne!(chosen(&r), 1, "not routed to while it is away");
    }
    assert!(!p.members()[1].stop.load(Ordering::Relaxed), "its events are still read");
    // It passes them again within the grace period: back, warm.
    assert!(p.set_members(&replicas).is_empty(), "nothing to restart");
    let r = p.route(&request("back", &prompt), &cfg);
    assert_eq!((chosen(&r), r.overlap_blocks), (1, 16), "its cache counts at once");

    // With no grace, leaving empties it.
    let p = with_grace(pool(3), 0);
    cache_on(&p, 1, &prompt);
    p.set_members(&[replicas[0].clone(), replicas[2].clone()]);
    assert!(p.members()[1].stop.load(Ordering::Relaxed));
    let start = p.set_members(&replicas);
    assert_eq!(start.iter().map(|(i, _, _)| i.get()).collect::<Vec<_>>(), [1], "back in its emptied slot, cold");
    assert_eq!(p.route(&request("cold", &prompt), &cfg).overlap_blocks, 0);
}

#[test]
fn pod_rollouts_reuse_slots_and_keep_the_index_exact() {
    let p = with_grace(pool(3), 0);
    let prompt: Vec<u32> = (0..64).collect();
    for rollout in 0..200u32 {
        // Every rollout replaces each pod by a new one at a new address.
        let pods: Vec<ReplicaConfig> = (0..3u32)
            .map(|i| {
                let n = rollout * 3 + i;
                let endpoint = format!("10.1.{}.{}:8000", n / 250, n % 250 + 1).parse().unwrap();
                ReplicaConfig::new(&format!("pod-{n}"), endpoint, &format!("tcp://10.1.0.1:{}", 5000 + n))
            })
            .collect();
        let started = p.set_members(&pods);
        assert_eq!(started.len(), 3, "rollout {rollout}: three new pods");
        // The new pods cache the prompt; the index holds what they hold, nothing of the old.
        let holder = (rollout % 3) as usize;
        cache_on(&p, started[holder].0.get(), &prompt);
        let matches = p.find_matches(&prompt_block_hashes(&prompt, 4, Salt::NONE));
        let holding: Vec<usize> = (0..matches.len()).filter(|i| matches[*i].device > 0).collect();
        assert_eq!(holding, [started[holder].0.get()], "rollout {rollout}: only the pod that cached it");
    }
    assert!(p.members().len() <= 6, "slots stay bounded: {}", p.members().len());
}

#[test]
fn an_empty_pool_routes_nowhere() {
    let p = pool(2);
    p.set_members(&[]);
    let r = p.route(&request("x", &[1, 2, 3, 4]), &ScoringConfig::default());
    assert_eq!((r.endpoint, r.replica), (None, None));
    assert!(p.state().replicas.is_empty());
}

#[test]
fn prefix_affinity_follows_its_own_routing_not_events() {
    let p = pool_with(3, Policy::PrefixAffinity);
    let cfg = ScoringConfig::default();
    let prompt: Vec<u32> = (0..64).collect();
    let first = p.route(&request("first", &prompt), &cfg);
    let home = chosen(&first);
    assert!(p.lifecycle(&"first".into(), false));
    // Events say another replica holds the prompt: this policy does not read them.
    cache_on(&p, (home + 1) % 3, &prompt);
    let mut longer = prompt.clone();
    longer.extend(1000..1016);
    let again = p.route(&request("again", &longer), &cfg);
    assert_eq!((chosen(&again), again.overlap_blocks), (home, 16), "where the gateway sent the prefix");
    // Distinct prompts still spread by load.
    let mut per_replica = [0; 3];
    for i in 0..6u32 {
        let tokens: Vec<u32> = (0..64).map(|t| 20_000 + i * 100 + t).collect();
        per_replica[chosen(&p.route(&request(&format!("d{i}"), &tokens), &cfg))] += 1;
    }
    assert!(per_replica.iter().all(|n| *n >= 1), "{per_replica:?}");
    let explained = &p.explain(Some("again"), 1)[0];
    assert_eq!(explained.policy, Policy::PrefixAffinity);
    assert!(p.state().replicas.iter().all(|r| !r.stalled), "no events expected, none missed");
}

#[test]
fn data_parallel_ranks_are_targets_of_their_own() {
    let mut config = pool(1).config;
    config.replicas[0].data_parallel_size = 2;
    config.replicas[0].kv_events = "tcp://10.0.0.7:5557".into();
    config.replicas[0].kv_replay = Some("tcp://10.0.0.7:5600".into());
    let t = targets(&config.replicas);
    let ids: Vec<(&str, &str, Option<&str>, Option<u32>)> =
        t.iter().map(|(r, rank)| (r.id.as_str(), r.kv_events.as_str(), r.kv_replay.as_deref(), *rank)).collect();
    assert_eq!(
        ids,
        [
            ("r0#0", "tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:5600"), Some(0)),
            ("r0#1", "tcp://10.0.0.7:5558", Some("tcp://10.0.0.7:5601"), Some(1))
        ]
    );
    assert!(t.iter().all(|(r, _)| r.endpoint == config.replicas[0].endpoint), "one HTTP endpoint");
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    let prompt: Vec<u32> = (0..64).collect();
    cache_on(&p, 1, &prompt);
    let r = p.route(&request("dp", &prompt), &ScoringConfig::default());
    assert_eq!((r.replica.as_deref(), r.dp_rank), (Some("r0#1"), Some(1)), "the rank that holds the prefix");
    assert_eq!(pool(1).route(&request("x", &prompt), &ScoringConfig::default()).dp_rank, None);
}

/// A 64-block prompt, and the same with one more block: a conversation's next turn.
fn prompt_and_next_turn() -> (Vec<u32>, Vec<u32>) {
    let prompt: Vec<u32> = (0..256).collect();
    let longer = prompt.iter().copied().chain(5000..5016).collect();
    (prompt, longer)
}

#[test]
fn kv_aware_credits_prefixes_routed_moments_ago() {
    let cfg = ScoringConfig::default();
    let (prompt, longer) = prompt_and_next_turn();
    // The first request's prefill is done (it streams its answer) but the engine's events
    // have not arrived yet.
    let p = pool(3);
    let home = chosen(&p.route(&request("first", &prompt), &cfg));
    assert!(p.lifecycle(&"first".into(), true));
    let second = p.route(&request("second", &longer), &cfg);
    assert_eq!((chosen(&second), second.overlap_blocks), (home, 64), "follows the first before any event");
    let mut config = pool(3).config;
    config.inflight_credit_secs = 0;
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    p.route(&request("first", &prompt), &cfg);
    assert!(p.lifecycle(&"first".into(), true));
    assert_eq!(p.route(&request("second", &longer), &cfg).overlap_blocks, 0, "no credit without events");
}

#[test]
fn routes_past_a_prefix_the_events_hold_are_credited_and_only_they_are_remembered() {
    let cfg = ScoringConfig::default();
    let (prompt, longer) = prompt_and_next_turn();
    // r1's events hold the prompt's first 32 blocks; this gateway sends it the whole prompt.
    let p = pool(3);
    cache_on(&p, 1, &prompt[..128]);
    let first = p.route(&request("first", &prompt), &cfg);
    assert_eq!((chosen(&first), first.overlap_blocks), (1, 32));
    assert!(p.lifecycle(&"first".into(), true));
    assert_eq!(p.affinity_index().len(), 32, "the 32 blocks past the events' are remembered, not all 64");
    let second = p.route(&request("second", &longer), &cfg);
    assert_eq!((chosen(&second), second.overlap_blocks), (1, 64), "the events' 32 blocks, then the routed 32");
    // A peer's booking says how much its target's events held; this gateway's events agree.
    let p = pool(3);
    cache_on(&p, 1, &prompt[..128]);
    let mut booked = peer_booking("r1", "first", &prompt);
    if let SyncEvent::Booked { held_blocks, .. } = &mut booked {
        *held_blocks = 32;
    }
    p.apply_remote("peer", &booked);
    assert_eq!(p.affinity_index().len(), 32);
    let second = p.route(&request("second", &longer), &cfg);
    assert_eq!((chosen(&second), second.overlap_blocks), (1, 64), "the peer's route past the events counts");
}

/// Another gateway's booking of `tokens` on `target`, as the sync mesh delivers it.
fn peer_booking(target: &str, request_id: &str, tokens: &[u32]) -> SyncEvent {
    SyncEvent::Booked {
        model: "m".into(),
        target: target.into(),
        request_id: request_id.into(),
        prefill_tokens: tokens.len() as u64,
        hashes: prompt_block_hashes(tokens, 4, Salt::NONE),
        held_blocks: 0,
        total_blocks: tokens.len().div_ceil(4) as u64,
        sequences: 1,
        session: None,
    }
}

#[test]
fn a_peers_booking_lands_on_the_replica_its_target_names_now() {
    let p = pool(3);
    let replicas = p.config.replicas.clone();
    // Requests on each replica by id, from `/debug/state`.
    let active = |p: &Pool| -> Vec<(String, u64)> {
        p.state().replicas.into_iter().map(|r| (r.id, r.active_requests)).collect()
    };
    p.apply_remote("peer", &peer_booking("r2", "a", &[1; 8]));
    assert_eq!(active(&p), [("r0".into(), 0), ("r1".into(), 0), ("r2".into(), 1)]);
    // r1 leaves and is in its grace period: not a target a peer can book on.
    p.set_members(&[replicas[0].clone(), replicas[2].clone()]);
    p.apply_remote("peer", &peer_booking("r1", "b", &[1; 8]));
    assert_eq!(p.state().bookings, 1, "a booking on a replica that left is ignored");
    // Back, it is one again.
    p.set_members(&replicas);
    p.apply_remote("peer", &peer_booking("r1", "c", &[1; 8]));
    assert_eq!(active(&p), [("r0".into(), 0), ("r1".into(), 1), ("r2".into(), 1)]);

    // Without a grace period r1's slot is emptied, and a newcomer takes it.
    let p = with_grace(pool(3), 0);
    let newcomer = ReplicaConfig { id: "r3".into(), ..replicas[1].clone() };
    p.set_members(&[replicas[0].clone(), newcomer, replicas[2].clone()]);
    p.apply_remote("peer", &peer_booking("r1", "d", &[1; 8]));
    p.apply_remote("peer", &peer_booking("r3", "e", &[1; 8]));
    assert_eq!(active(&p), [("r0".into(), 0), ("r3".into(), 1), ("r2".into(), 0)], "r3 in r1's slot, r1 nowhere");
}

#[test]
fn kv_aware_credits_prefixes_a_peer_routed_moments_ago() {
    let cfg = ScoringConfig::default();
    let (prompt, longer) = prompt_and_next_turn();
    // Another gateway sent the prompt to r2 a moment ago; the engine's events have not arrived.
    let peer_booked = |p: &Pool| p.apply_remote("peer", &peer_booking("r2", "first", &prompt));
    let p = pool(3);
    peer_booked(&p);
    let second = p.route(&request("second", &longer), &cfg);
    assert_eq!((chosen(&second), second.overlap_blocks), (2, 64), "follows the peer's route before any event");
    // A booking on a replica this gateway does not know gives no credit anywhere.
    let p = pool(2);
    peer_booked(&p);
    assert_eq!(p.route(&request("second", &longer), &cfg).overlap_blocks, 0, "r2 is not in this pool");
    // `prefix_affinity` keeps to where this gateway sent prompts.
    let p = pool_with(3, Policy::PrefixAffinity);
    peer_booked(&p);
    assert_eq!(p.route(&request("second", &longer), &cfg).overlap_blocks, 0, "a peer's route is not affinity");
    // Without in-flight credit the peer's booking is only load, which r2 is the one to avoid.
    let mut config = pool(3).config;
    config.inflight_credit_secs = 0;
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    peer_booked(&p);
    let second = p.route(&request("second", &longer), &cfg);
    assert!(chosen(&second) != 2 && second.overlap_blocks == 0, "{second:?}");
}

#[test]
fn membership_changes_under_traffic_do_not_deadlock() {
    let p = Arc::new(pool(4));
    let all = p.config.replicas.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    for w in 0..3u32 {
        let (p, tx) = (p.clone(), tx.clone());
        std::thread::spawn(move || {
            for i in 0..1500u32 {
                let id = format!("w{w}-{i}");
                p.route(&request(&id, &[i % 50; 8]), &ScoringConfig::default());
                let booked = id.as_str().into();
                p.first_token(&booked, Some(Duration::from_millis(5)));
                p.engine_usage(&booked, 8, Some(0));
                p.lifecycle(&booked, false);
                let peer_id = format!("p{w}-{i}");
                p.apply_remote("peer", &peer_booking(&format!("r{}", i % 4), &peer_id, &[i % 50; 8]));
                p.apply_remote("peer", &SyncEvent::Done { model: "m".into(), request_id: peer_id.into() });
                if i % 100 == 0 {
                    p.expire(Duration::from_secs(300));
                    p.state();
                    p.observe_engine(ReplicaIdx::new(0), EngineReport { requests: 3, ..Default::default() });
                }
            }
            tx.send(()).unwrap();
        });
    }
    let changer = p.clone();
    std::thread::spawn(move || {
        for k in 0..600 {
            changer.set_members(&all[..2 + k % 3]);
        }
        tx.send(()).unwrap();
    });
    for _ in 0..4 {
        rx.recv_timeout(Duration::from_secs(60)).expect("routing and membership changes deadlocked");
    }
}

#[test]
fn every_prompt_and_every_sample_is_booked() {
    let p = pool(1);
    let tokens: Vec<u32> = (0..64).collect();
    // A list of 3 prompts (the first one's tokens known), each decoded twice (`n` 2).
    let req = RouteRequest { prompts: 3, samples: 2, ..request("multi", &tokens) };
    p.route(&req, &ScoringConfig::default());
    let booked = &p.state().replicas[0];
    assert_eq!((booked.active_requests, booked.prefill_tokens), (6, 3 * 64), "six sequences, three prefills");
    assert!(p.lifecycle(&"multi".into(), false));
    let released = &p.state().replicas[0];
    assert_eq!((released.active_requests, released.prefill_tokens, released.active_blocks), (0, 0, 0));
}

#[test]
fn a_request_without_max_tokens_gets_the_engines_default_limit() {
    let tokens: Vec<u32> = (0..64).collect();
    // Block size 4: 16 prompt blocks. After 64 output tokens (16 more blocks), a request whose
    // limit is 64 weighs nothing; one without a known limit keeps its whole footprint.
    let footprint_after = |max_model_len: Option<u64>| {
        let base = pool(1);
        let config = PoolConfig { max_model_len, ..base.config().clone() };
        let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
        p.route(&request("r", &tokens), &ScoringConfig::default());
        assert!(p.progress(&"r".into(), 64));
        p.state().replicas[0].active_blocks
    };
    assert_eq!(footprint_after(None), 32, "no limit known: prompt and output blocks count");
    assert_eq!(footprint_after(Some(128)), 0, "vLLM's default: the 64 tokens of context left");
    assert_eq!(footprint_after(Some(1024)), 30, "960 tokens left: 64 of them done");
}

#[test]
fn decisions_do_not_wait_for_a_batch_of_events_being_applied() {
    let p = pool(2);
    let held: Vec<u32> = (0..32).collect();
    let arriving: Vec<u32> = (100..132).collect();
    cache_on(&p, 1, &held);
    // The applier is midway through a batch: replica 0 stores `arriving`, not yet visible.
    let mut batch = p.index_mut();
    let engine: Vec<EngineHash> = (0..8).map(|i| EngineHash(500 + i)).collect();
    let store = prompt_store(&engine, &arriving);
    batch.apply(Write::Change(ReplicaIdx::new(0), Change::Store(StoredBlocks::from_store(store)))).unwrap();
    let cfg = ScoringConfig::default();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (p, cfg, held, arriving) = (&p, &cfg, &held, &arriving);
        s.spawn(move || {
            let decided = p.route(&request("during", held), cfg);
            tx.send((chosen(&decided), p.find_matches(&prompt_block_hashes(arriving, 4, Salt::NONE))[0].device))
                .unwrap();
        });
        let (replica, arriving_seen) =
            rx.recv_timeout(Duration::from_secs(10)).expect("a decision finishes while the batch is held");
        assert_eq!(replica, 1, "decided on the index as it was before the batch");
        assert_eq!(arriving_seen, 0, "half-applied batches are invisible");
    });
    drop(batch);
    assert_eq!(p.find_matches(&prompt_block_hashes(&arriving, 4, Salt::NONE))[0].device, 8, "visible once it ends");
    assert_eq!(chosen(&p.route(&request("after", &arriving), &cfg)), 0);
}

/// A disaggregated pool: `r0`, `r1` prefill, `r2`, `r3` decode; block size 4, remote
/// prefill from 64 uncached tokens.
fn pd_pool(mode: super::TransferProtocol, backlog: Option<u64>) -> Pool {
    use super::DisaggregationConfig;
    pd_pool_with(DisaggregationConfig {
        mode,
        min_remote_prefill_tokens: 64,
        max_prefill_backlog_tokens: backlog,
        prefill_policy: super::PrefillPolicy::KvAware,
    })
}

fn pd_pool_with(disaggregation: super::DisaggregationConfig) -> Pool {
    use super::Role;
    let replicas = (0..4)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 8000 + i).parse().unwrap();
            let role = if i < 2 { Role::Prefill } else { Role::Decode };
            ReplicaConfig {
                role,
                bootstrap_port: (i < 2).then_some(9000 + i as u16),
                ..ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
            }
        })
        .collect();
    let config = PoolConfig { disaggregation: Some(disaggregation), ..PoolConfig::new("m", "unused", 4, replicas) };
    Pool::new(config, Vec::new(), Arc::new(Metrics::default()))
}

fn replica_load(p: &Pool, id: &str) -> (u64, u64) {
    let state = p.state();
    let r = state.replicas.iter().find(|r| r.id == id).unwrap();
    (r.prefill_tokens, r.active_requests)
}

#[test]
fn a_long_prompt_is_prefilled_where_it_is_cached_and_decoded_elsewhere() {
    let p = pd_pool(super::TransferProtocol::Vllm, None);
    let prompt: Vec<u32> = (0..200).collect();
    cache_on(&p, 1, &prompt[..160]);
    let r = p.route(&request("long", &prompt), &ScoringConfig::default());
    let leg = r.prefill.clone().expect("a prefill leg");
    assert_eq!((leg.replica.as_str(), leg.endpoint.as_str(), leg.overlap_blocks), ("r1", "127.0.0.1:8001", 40));
    assert_eq!(leg.booking_id, "long/prefill");
    assert_eq!(leg.transfer, kvgate_shared::wire::Transfer::Vllm);
    let decoder = r.replica.clone().unwrap();
    assert!(decoder == "r2" || decoder == "r3", "decoded on a decode worker, not {decoder}");
    // The leg's prefill is booked on r1 (what it has not cached), the decode worker computes
    // no prompt.
    assert_eq!(replica_load(&p, "r1"), (40, 1));
    assert_eq!(replica_load(&p, &decoder), (0, 1));
    let explained = p.explain(Some("long/prefill"), 1);
    assert_eq!(explained[0].disaggregation, Some("prefill_leg"));
    assert_eq!(explained[0].candidates.len(), 2, "both prefill workers scored");
    assert_eq!(p.explain(Some("long"), 1)[0].disaggregation, Some("disaggregated"));
    // Both predictions are checked against what the engines report: the leg's cache on r1,
    // and the same on the decode worker, which reports the prefill worker's cache hits (vLLM
    // 0.32 passes them on as `remote_prefill_cached_tokens`), not what it loaded.
    assert!(p.engine_usage(&"long/prefill".into(), 200, Some(160)));
    assert!(p.engine_usage(&"long".into(), 200, Some(160)));
    for id in ["long/prefill", "long"] {
        let checked = p.explain(Some(id), 1)[0].checked.expect("checked");
        assert_eq!((checked.check.cached_error, checked.check.prompt_mismatch), (0, false), "{id}");
    }
    // The leg's end frees the prefill worker; the request's end the decode worker.
    assert!(p.lifecycle(&"long/prefill".into(), false));
    assert_eq!(replica_load(&p, "r1"), (0, 0));
    assert!(p.lifecycle(&"long".into(), false));
    assert_eq!(replica_load(&p, &decoder), (0, 0));
}

#[test]
fn short_or_cached_prompts_are_served_whole_on_the_decode_worker() {
    let p = pd_pool(super::TransferProtocol::Vllm, None);
    let short: Vec<u32> = (0..40).collect();
    let r = p.route(&request("short", &short), &ScoringConfig::default());
    assert!(r.prefill.is_none(), "40 tokens are prefilled in place");
    assert!(matches!(r.replica.as_deref(), Some("r2" | "r3")));
    assert_eq!(p.explain(Some("short"), 1)[0].disaggregation, Some("short_prompt"));
    // A long prompt the decode worker r3 mostly holds: 24 tokens left to compute there.
    let long: Vec<u32> = (1000..1200).collect();
    cache_on(&p, 3, &long[..176]);
    let r = p.route(&request("cached", &long), &ScoringConfig::default());
    assert_eq!((r.replica.as_deref(), r.prefill.as_ref()), (Some("r3"), None));
    let (prefill, _) = replica_load(&p, "r3");
    assert!(prefill >= 24, "its rest is prefilled on r3: {prefill}");
}

#[test]
fn busy_prefill_workers_leave_prompts_to_the_decode_workers() {
    let p = pd_pool(super::TransferProtocol::Vllm, Some(150));
    let cfg = ScoringConfig::default();
    for i in 0..2u32 {
        let prompt: Vec<u32> = (0..200).map(|t| 10_000 * (i + 1) + t).collect();
        assert!(p.route(&request(&format!("p{i}"), &prompt), &cfg).prefill.is_some());
    }
    // Both prefill workers have 200 tokens booked, above the 150 allowed.
    let prompt: Vec<u32> = (50_000..50_200).collect();
    let r = p.route(&request("third", &prompt), &cfg);
    assert!(r.prefill.is_none());
    assert_eq!(p.explain(Some("third"), 1)[0].disaggregation, Some("prefill_busy"));
    let text = p.metrics.render();
    assert!(text.contains(r#"kvgate_disaggregation_decisions_total{model="m",mode="prefill_busy"} 1"#), "{text}");
    assert!(text.contains(r#"kvgate_disaggregation_decisions_total{model="m",mode="disaggregated"} 2"#), "{text}");
}

#[test]
fn sglang_legs_carry_the_prefill_workers_bootstrap_address_and_a_room() {
    let p = pd_pool(super::TransferProtocol::Sglang, None);
    let prompt: Vec<u32> = (0..200).collect();
    cache_on(&p, 0, &prompt[..120]);
    let leg = p.route(&request("sg", &prompt), &ScoringConfig::default()).prefill.expect("a leg");
    let kvgate_shared::wire::Transfer::Sglang { host, port, room } = leg.transfer else { panic!("{leg:?}") };
    assert_eq!((leg.replica.as_str(), host.as_str(), port), ("r0", "127.0.0.1", 9000));
    assert!(room < 1 << 63, "a room SGLang takes: {room}");
    let again: Vec<u32> = (5000..5200).collect();
    let other = p.route(&request("sg2", &again), &ScoringConfig::default()).prefill.expect("a leg");
    assert_ne!(other.transfer, kvgate_shared::wire::Transfer::Sglang { host, port, room }, "a room per request");
}

#[test]
fn round_robin_prefill_takes_turns_blind_to_the_cache() {
    use super::{DisaggregationConfig, PrefillPolicy, TransferProtocol};
    let p = pd_pool_with(DisaggregationConfig {
        mode: TransferProtocol::Vllm,
        min_remote_prefill_tokens: 64,
        max_prefill_backlog_tokens: None,
        prefill_policy: PrefillPolicy::RoundRobin,
    });
    let cfg = ScoringConfig::default();
    let legs: Vec<String> = (0..4u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..200).map(|t| 10_000 * (i + 1) + t).collect();
            cache_on(&p, 1, &prompt[..160]);
            p.route(&request(&format!("rr{i}"), &prompt), &cfg).prefill.expect("a leg").replica
        })
        .collect();
    assert_eq!(legs, ["r0", "r1", "r0", "r1"], "every prompt cached on r1, and still in turn");
}

#[test]
fn requests_no_leg_can_serve_are_served_whole_and_ended_requests_book_no_leg() {
    let p = pd_pool(super::TransferProtocol::Vllm, None);
    let cfg = ScoringConfig::default();
    let prompt: Vec<u32> = (0..200).collect();
    let no_leg = RouteRequest { prefill_legs: false, ..request("no-leg", &prompt) };
    assert!(p.route(&no_leg, &cfg).prefill.is_none());
    assert_eq!(p.explain(Some("no-leg"), 1)[0].disaggregation, Some("no_leg"));
    let sampled = RouteRequest { samples: 2, ..request("n2", &(300..500).collect::<Vec<u32>>()) };
    assert!(p.route(&sampled, &cfg).prefill.is_none(), "two sequences would pull one leg's KV");
    // A request whose end was reported before its decision (its filter gave up waiting).
    assert!(!p.lifecycle(&"gone".into(), false));
    let gone = p.route(&request("gone", &(600..800).collect::<Vec<u32>>()), &cfg);
    assert!(gone.prefill.is_none(), "no leg nobody would end");
    assert_eq!((replica_load(&p, "r0"), replica_load(&p, "r1")), ((0, 0), (0, 0)));
}

#[test]
fn a_leg_that_did_not_deliver_moves_the_prefill_to_the_decode_worker() {
    let p = pd_pool(super::TransferProtocol::Vllm, None);
    let prompt: Vec<u32> = (0..200).collect();
    let r = p.route(&request("failed", &prompt), &ScoringConfig::default());
    let decoder = r.replica.unwrap();
    assert_eq!(replica_load(&p, &decoder).0, 0);
    assert!(p.lifecycle(&"failed/prefill".into(), false));
    assert!(p.served_whole(&"failed".into()));
    assert_eq!(replica_load(&p, &decoder).0, 200, "the whole prompt, none of it cached there");
    p.engine_usage(&"failed".into(), 200, Some(0));
    assert!(p.explain(Some("failed"), 1)[0].checked.is_none(), "the transfer's prediction no longer holds");
    assert_eq!(p.state().prediction.unchecked.moved, 1, "and is counted unchecked");
}

#[test]
fn sglang_decode_servers_always_get_a_leg_and_aggregated_servers_take_none() {
    use super::{DisaggregationConfig, PrefillPolicy, Role, TransferProtocol};
    // r0 prefill, r1 both, r2 and r3 decode.
    let replicas = (0..4)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 8000 + i).parse().unwrap();
            let role = [Role::Prefill, Role::Both, Role::Decode, Role::Decode][i];
            ReplicaConfig {
                role,
                bootstrap_port: (i == 0).then_some(9000),
                ..ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
            }
        })
        .collect();
    let disaggregation = DisaggregationConfig {
        mode: TransferProtocol::Sglang,
        min_remote_prefill_tokens: 64,
        max_prefill_backlog_tokens: Some(0),
        prefill_policy: PrefillPolicy::KvAware,
    };
    let config = PoolConfig { disaggregation: Some(disaggregation), ..PoolConfig::new("m", "unused", 4, replicas) };
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    let cfg = ScoringConfig::default();
    for i in 0..6u32 {
        let short: Vec<u32> = (0..8).map(|t| 1000 * i + t).collect();
        let r = p.route(&request(&format!("s{i}"), &short), &cfg);
        match r.replica.as_deref() {
            Some("r2" | "r3") => {
                assert_eq!(r.prefill.map(|l| l.replica).as_deref(), Some("r0"), "{i}: a room, short or busy")
            }
            Some("r1") => assert!(r.prefill.is_none(), "{i}: served whole where that works"),
            other => panic!("{i}: decoded on {other:?}"),
        }
    }
}

#[test]
fn a_same_prefix_burst_is_checked_against_what_was_cached_then() {
    let p = pool(2);
    let prompt: Vec<u32> = (0..64).collect();
    let cfg = ScoringConfig::default();
    let first = p.route(&request("first", &prompt), &cfg);
    // Routed moments after the first, before any event: credited with the first's prefix.
    let second = p.route(&request("second", &prompt), &cfg);
    assert_eq!(second.replica, first.replica, "the in-flight credit draws it there");
    assert_eq!(second.overlap_blocks, 16);
    // The engine scheduled both in one step: neither found anything cached.
    assert!(p.engine_usage(&"first".into(), 64, Some(0)));
    assert!(p.engine_usage(&"second".into(), 64, Some(0)));
    let t = p.state().prediction;
    assert_eq!((t.checked, t.exact, t.in_flight, t.over), (2, 1, 1, 0), "{t:?}");
    assert!(!p.engine_usage(&"second".into(), 64, Some(0)), "a prediction is checked once");
}

/// Concurrent decisions for one new prefix see each other's routes: at most one per replica
/// is made before the prefix went anywhere, so every other is credited with it.
#[test]
fn concurrent_decisions_for_one_new_prefix_each_see_the_others_routes() {
    const THREADS: usize = 8;
    let p = Arc::new(pool(2));
    for round in 0..50u32 {
        let prompt: Vec<u32> = (0..64).map(|t| round * 1000 + t).collect();
        let barrier = Arc::new(std::sync::Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|i| {
                let (p, prompt, barrier) = (p.clone(), prompt.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    p.route(&request(&format!("{round}-{i}"), &prompt), &ScoringConfig::default())
                })
            })
            .collect();
        let uncredited = threads.into_iter().map(|t| t.join().unwrap()).filter(|r| r.overlap_blocks == 0).count();
        assert!(uncredited <= 2, "round {round}: {uncredited} of {THREADS} decisions missed the others' routes");
    }
}

#[test]
fn evictions_between_decision_and_report_explain_a_shortfall() {
    let p = pool(2);
    let prompt: Vec<u32> = (0..64).collect();
    cache_on(&p, 1, &prompt);
    let r = p.route(&request("r", &prompt), &ScoringConfig::default());
    assert_eq!((chosen(&r), r.overlap_blocks), (1, 16));
    let hashes: Vec<EngineHash> = (0..16).map(|i| EngineHash(i + 1000)).collect();
    let removal = Change::Remove { tier: Tier::Device, engine_hashes: hashes };
    p.index_mut().apply(Write::Change(ReplicaIdx::new(1), removal)).unwrap();
    assert!(p.engine_usage(&"r".into(), 64, Some(0)));
    let t = p.state().prediction;
    assert_eq!((t.evicted, t.over, t.alarm), (1, 0, false), "{t:?}");
}

#[test]
fn requests_that_cannot_be_checked_are_counted_with_their_reason() {
    let p = pool(1);
    let cfg = ScoringConfig::default();
    p.route(&request("silent", &(0..64).collect::<Vec<u32>>()), &cfg);
    assert!(p.lifecycle(&"silent".into(), false), "it ends without a usage report");
    p.route(&request("no-details", &(100..164).collect::<Vec<u32>>()), &cfg);
    assert!(p.engine_usage(&"no-details".into(), 65, None), "an engine without cached-token details");
    let mut estimated = request("estimated", &[]);
    (estimated.prompt_tokens, estimated.prompt_count) = (500, kvgate_shared::wire::PromptCount::Estimated);
    p.route(&estimated, &cfg);
    let several = RouteRequest { samples: 3, ..request("several", &(300..364).collect::<Vec<u32>>()) };
    p.route(&several, &cfg);
    assert!(!p.engine_usage(&"several".into(), 64, Some(60)), "one sequence's report names no prediction");
    let state = p.state();
    let u = state.prediction.unchecked;
    let counts = (u.no_usage, u.no_cached_tokens, u.estimated, u.several_sequences, state.prediction.checked);
    assert_eq!(counts, (1, 1, 1, 1, 0), "{u:?}");
    assert_eq!(state.prediction.prompt_mismatches, 1, "the prompt count is still compared");
    assert_eq!(state.replicas[0].reports_cached_tokens, Some(false));
    p.route(&request("detailed", &(200..264).collect::<Vec<u32>>()), &cfg);
    assert!(p.engine_usage(&"detailed".into(), 64, Some(0)));
    assert_eq!(p.state().replicas[0].reports_cached_tokens, Some(true));
}

#[test]
fn the_pools_autoscaling_gauges_sum_its_replicas_load() {
    let metrics = Arc::new(Metrics::default());
    let replicas = (0..2)
        .map(|i| ReplicaConfig::new(&format!("r{i}"), format!("127.0.0.1:{}", 8000 + i).parse().unwrap(), "tcp://x:1"))
        .collect();
    let p = Pool::new(PoolConfig::new("m", "unused", 4, replicas), Vec::new(), metrics.clone());
    let cfg = ScoringConfig::default();
    for i in 0..3u32 {
        let tokens: Vec<u32> = (0..40).map(|t| i * 1000 + t).collect();
        p.route(&request(&format!("q{i}"), &tokens), &cfg);
    }
    p.expire(Duration::from_secs(300));
    let text = metrics.render();
    let value = |name: &str| {
        let prefix = format!("{name}{{model=\"m\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.parse::<f64>().unwrap())
    };
    assert_eq!(value("kvgate_pool_prefill_backlog_tokens"), Some(120.0), "three 40-token prompts booked");
    assert_eq!(value("kvgate_pool_active_requests"), Some(3.0));
    assert_eq!(value("kvgate_pool_saturation"), None, "set only with admission control");
    // Ended requests leave the backlog.
    for i in 0..3 {
        assert!(p.lifecycle(&format!("q{i}").as_str().into(), false));
    }
    p.expire(Duration::from_secs(300));
    let text = metrics.render();
    assert!(text.contains("kvgate_pool_prefill_backlog_tokens{model=\"m\"} 0\n"), "{text}");
}

#[test]
fn ttft_is_predicted_for_each_decision_checked_when_the_first_token_comes_and_alarms_when_a_replica_slows() {
    let p = pool(1);
    let scoring = ScoringConfig::default();
    // The replica's TTFT: 3 ms plus 20 ms per thousand prefill tokens (of 4-token blocks, none
    // cached); `slowdown` times that once it is slowed behind kvgate's back.
    let send = |i: u32, slowdown: u32| {
        let tokens: Vec<u32> = (0..4 * (20 + i % 7 * 30)).map(|t| 100_000 * (i + 1) + t).collect();
        let req = RouteRequest { stream: true, ..request(&format!("t{i}"), &tokens) };
        assert_eq!(chosen(&p.route(&req, &scoring)), 0);
        let measured = Duration::from_micros(u64::from(slowdown) * (3_000 + 20 * tokens.len() as u64));
        assert!(p.first_token(&req.request_id, Some(measured)));
        assert!(p.lifecycle(&req.request_id, false));
        let explained = p.explain(Some(req.request_id.as_ref()), 1).pop().unwrap();
        (explained, measured)
    };
    let replica = || p.state().replicas[0].ttft;
    for i in 0..crate::latency::MIN_SAMPLES as u32 {
        let (explained, _) = send(i, 1);
        assert_eq!((explained.predicted_ttft_secs, explained.ttft_checked), (None, None), "not learned yet");
    }
    let (explained, measured) = send(100, 1);
    let predicted = explained.predicted_ttft_secs.expect("learned");
    assert!((predicted - measured.as_secs_f64()).abs() < 1e-4, "{predicted} vs {measured:?}");
    let checked = explained.ttft_checked.expect("checked against the measurement");
    assert!(checked.close() && (checked.measured_secs - measured.as_secs_f64()).abs() < 1e-6);
    for i in 0..40 {
        assert!(send(101 + i, 1).0.ttft_checked.is_some_and(|c| c.close()));
    }
    assert_eq!((replica().samples, replica().alarm), (crate::latency::MIN_SAMPLES as u64 + 41, false));
    assert_eq!(p.state().prediction.ttft, crate::accuracy::LatencyTotals { checked: 41, close: 41 });
    // Slowed 4×: the predictions miss, and the replica's alarm fires, until its model has
    // relearned it.
    let raised = (0..32).find(|i| {
        send(200 + i, 4);
        replica().alarm
    });
    assert!(raised.is_some(), "the alarm fires: {:?}", replica());
    let text = p.metrics.render();
    assert!(text.contains("kvgate_ttft_prediction_alarm{model=\"m\",replica=\"r0\"} 1"), "{text}");
    assert!(text.contains("kvgate_ttft_prediction_error_ratio_count{model=\"m\",replica=\"r0\"}"));
    let cleared = (0..100).find(|i| {
        send(400 + i, 4);
        !replica().alarm
    });
    assert!(cleared.is_some(), "relearned: {:?}", replica());
    assert!(p.metrics.render().contains("kvgate_ttft_prediction_alarm{model=\"m\",replica=\"r0\"} 0"));
}

#[test]
fn predicted_latency_sends_requests_where_they_start_soonest() {
    let p = pool_with(2, Policy::PredictedLatency);
    let scoring = ScoringConfig::default();
    // Replica 1 runs 3× slower than replica 0: 3 ms plus 20 ms per thousand prefill tokens.
    let ttft = |replica: usize, tokens: u64| Duration::from_micros((1 + 2 * replica as u64) * (3_000 + 20 * tokens));
    let prompt = |i: u32| -> Vec<u32> { (0..4 * (20 + i % 7 * 30)).map(|t| 100_000 * (i + 1) + t).collect() };
    let send = |i: u32| {
        let tokens = prompt(i);
        let req = RouteRequest { stream: true, ..request(&format!("l{i}"), &tokens) };
        let at = chosen(&p.route(&req, &scoring));
        assert!(p.first_token(&req.request_id, Some(ttft(at, tokens.len() as u64))));
        assert!(p.lifecycle(&req.request_id, false));
        at
    };
    // Until both replicas' models predict, it decides as kv_aware: idle replicas, either.
    let learned = |r: usize| p.state().replicas[r].ttft.samples >= crate::latency::MIN_SAMPLES as u64;
    let warmed = (0..200).find(|i| {
        send(*i);
        learned(0) && learned(1)
    });
    assert!(
        warmed.is_some(),
        "both replicas learned: {:?}",
        p.state().replicas.iter().map(|r| r.ttft).collect::<Vec<_>>()
    );
    let to_fast = (300..340).filter(|i| send(*i) == 0).count();
    assert_eq!(to_fast, 40, "an idle fleet: the fast replica starts every request soonest");
    // A long prompt in prefill on the fast replica: the slow one, idle, now starts sooner.
    let long: Vec<u32> = (0..4 * 2_000).map(|t| 9_000_000 + t).collect();
    let backlog = RouteRequest { stream: true, ..request("backlog", &long) };
    assert_eq!(chosen(&p.route(&backlog, &scoring)), 0);
    assert_eq!(chosen(&p.route(&RouteRequest { stream: true, ..request("next", &prompt(500)) }, &scoring)), 1);
    let explained = p.explain(Some("next"), 1).pop().unwrap();
    assert_eq!(explained.policy, Policy::PredictedLatency);
    // Each candidate's prediction is shown; the chosen one's is the lowest.
    let predicted: Vec<f64> = explained.candidates.iter().map(|c| c.predicted_ttft_secs.unwrap()).collect();
    assert!(predicted[1] < predicted[0], "{predicted:?}");
    assert_eq!(explained.predicted_ttft_secs.map(|s| s as f32), Some(predicted[1] as f32));
    // And what each model was given there: on the idle replica, its own prompt and nothing
    // decoding for its TTFT; nothing booked before it and its own sequence for its ITL.
    let own = prompt(500).len() as u64;
    assert_eq!(explained.ttft_inputs, Some(Inputs { prefill_ahead: own, decoding: 0, prefill_not_stored: 0 }));
    assert_eq!(explained.itl_inputs, Some(Inputs { prefill_ahead: 0, decoding: 1, prefill_not_stored: 0 }));
    // A request that is not streamed is not timed: no inputs.
    let quiet = RouteRequest { stream: false, ..request("quiet", &prompt(501)) };
    assert!(p.route(&quiet, &scoring).replica.is_some());
    let quiet = p.explain(Some("quiet"), 1).pop().unwrap();
    assert_eq!((quiet.ttft_inputs, quiet.itl_inputs), (None, None));
}

/// Two replicas that both cache a shared system prompt, in a pool that binds sessions (with
/// `stickiness` as the credit), or not; no in-flight credit, so only the engines' events say
/// what is cached.
fn session_pool(stickiness: Option<f64>, grace_secs: u64) -> Pool {
    let mut config = pool(2).config;
    config.inflight_credit_secs = 0;
    config.leave_grace_secs = grace_secs;
    config.sessions = stickiness.map(|s| SessionConfig { stickiness_blocks: s, ..SessionConfig::default() });
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    cache_on(&p, 0, &conversation(0));
    cache_on(&p, 1, &conversation(0));
    p
}

/// A conversation's prompt after `turns` turns of 16 tokens each, on a shared system prompt of
/// 64 tokens (16 blocks).
fn conversation(turns: u32) -> Vec<u32> {
    (0..64).chain((0..turns * 16).map(|t| 50_000 + t)).collect()
}

fn in_session(id: &str, session: &str, tokens: &[u32]) -> RouteRequest {
    RouteRequest { session: Some(session.into()), ..request(id, tokens) }
}

/// Session `s` bound to r0 by its first turn, r0 then holding the turn's prefix (as its engine
/// says), and `busy` prefill tokens of another gateway's booked on r0; where its second turn goes.
fn second_turn(p: &Pool, busy: u32) -> RouteResponse {
    let cfg = ScoringConfig::default();
    cache_on(p, 0, &conversation(1));
    let first = p.route(&in_session("turn-1", "s", &conversation(1)), &cfg);
    assert_eq!(chosen(&first), 0, "the first turn goes where its prefix is");
    assert!(p.lifecycle(&"turn-1".into(), false));
    let other: Vec<u32> = (90_000..90_000 + busy).collect();
    p.apply_remote("peer", &peer_booking("r0", "busy", &other));
    p.route(&in_session("turn-2", "s", &conversation(2)), &cfg)
}

#[test]
fn a_session_stays_on_its_replica_unless_another_is_cheaper_by_more_than_the_credit() {
    // Without sessions: the least load on r0 that sends the second turn to r1.
    let moves_at = (1..200).map(|b| b * 4).find(|&busy| chosen(&second_turn(&session_pool(None, 30), busy)) == 1);
    let moves_at = moves_at.expect("enough load on r0 moves the conversation");
    // With a credit of 32, that load keeps it on r0: the decision says why.
    let p = session_pool(Some(32.0), 30);
    assert_eq!(chosen(&second_turn(&p, moves_at)), 0, "bound to r0, which holds its prefix");
    let e = &p.explain(Some("turn-2"), 1)[0];
    assert_eq!((e.session, e.candidates[0].session_credit, e.candidates[1].session_credit), (Some("kept"), 32.0, 0.0));
    assert_eq!(p.explain(Some("turn-1"), 1)[0].session, Some("new"));
    // 36 more prefill tokens there (36 of cost at block size 4 and prefill weight 4, and
    // 9 blocks) outweigh the credit: the session moves, and is bound where it went.
    let p = session_pool(Some(32.0), 30);
    assert_eq!(chosen(&second_turn(&p, moves_at + 36)), 1, "r1 is cheaper by more than the credit");
    assert_eq!(p.explain(Some("turn-2"), 1)[0].session, Some("outweighed"));
    // r1 holds less of the conversation than r0 (its engine has not said it stored turn 2):
    // no credit there.
    p.route(&in_session("turn-3", "s", &conversation(3)), &ScoringConfig::default());
    assert_eq!(p.explain(Some("turn-3"), 1)[0].session, Some("prefix_gone"));
    let text = p.metrics.render();
    for outcome in ["new", "outweighed", "prefix_gone"] {
        let line = format!(r#"kvgate_session_decisions_total{{model="m",outcome="{outcome}"}} 1"#);
        assert!(text.contains(&line), "{line} in\n{text}");
    }
    assert!(text.contains(r#"kvgate_sessions_bound{model="m"} 1"#), "{text}");
}

#[test]
fn requests_without_a_session_or_pools_without_binding_bind_nothing() {
    let p = session_pool(Some(32.0), 30);
    let r = p.route(&request("no-session", &conversation(1)), &ScoringConfig::default());
    assert!(r.replica.is_some());
    assert_eq!(p.explain(Some("no-session"), 1)[0].session, None);
    assert_eq!(p.state().sessions_bound, Some(0));
    let p = session_pool(None, 30);
    p.route(&in_session("s1", "s", &conversation(1)), &ScoringConfig::default());
    assert_eq!((p.explain(Some("s1"), 1)[0].session, p.state().sessions_bound), (None, None));
}

#[test]
fn a_peers_booking_binds_the_session_here_too() {
    // Another gateway routed session `s` to r1: a small booking, but load r0 does not have.
    let mut booking = peer_booking("r1", "elsewhere", &[1, 2, 3, 4]);
    if let SyncEvent::Booked { session, .. } = &mut booking {
        *session = Some(crate::msg::sync::SessionKey::of("s"));
    }
    let next = |stickiness| {
        let p = session_pool(stickiness, 30);
        p.apply_remote("peer", &booking);
        let r = p.route(&in_session("next", "s", &conversation(1)), &ScoringConfig::default());
        (chosen(&r), p.explain(Some("next"), 1)[0].session, p.state().sessions_bound)
    };
    assert_eq!(next(Some(32.0)), (1, Some("kept"), Some(1)), "the peer's binding keeps the session on r1");
    assert_eq!(next(None), (0, None, None), "without binding, r1's load sends it to r0");
}

#[test]
fn a_starting_sidecar_is_handed_its_peers_session_bindings() {
    // Gateway A has session `s` bound to r1 (a peer's booking said so, with load r0 has not).
    let mut booking = peer_booking("r1", "elsewhere", &[1, 2, 3, 4]);
    if let SyncEvent::Booked { session, .. } = &mut booking {
        *session = Some(crate::msg::sync::SessionKey::of("s"));
    }
    let a = session_pool(Some(32.0), 30);
    a.apply_remote("peer", &booking);
    let view = a.export_handover("a");
    assert_eq!(view.sessions.iter().map(|s| s.target.as_str()).collect::<Vec<_>>(), ["r1"]);
    // Gateway B starts and takes A's view over: the booking and the binding.
    let next = |b: &Pool, id: &str| {
        let r = b.route(&in_session(id, "s", &conversation(1)), &ScoringConfig::default());
        (chosen(&r), b.explain(Some(id), 1)[0].session)
    };
    let b = session_pool(Some(32.0), 30);
    let taken = b.take_over(view.clone(), "b");
    assert_eq!((taken.bookings, taken.sessions), (1, 1));
    assert_eq!(next(&b, "next"), (1, Some("kept")), "B keeps the session where A bound it");
    assert_eq!(b.state().sessions_bound, Some(1));
    // A target B does not have yet: the binding waits for it to join.
    let c = session_pool(Some(32.0), 0);
    let replicas = c.config.replicas.clone();
    c.set_members(&replicas[..1]);
    assert_eq!(c.take_over(view, "c").sessions, 0, "r1 is not a member yet");
    c.set_members(&replicas);
    cache_on(&c, 1, &conversation(0));
    assert_eq!(c.state().sessions_bound, Some(1), "bound once r1 joined");
}

#[test]
fn a_session_whose_replica_left_is_bound_afresh() {
    let p = session_pool(Some(32.0), 0);
    let cfg = ScoringConfig::default();
    cache_on(&p, 1, &conversation(1));
    assert_eq!(chosen(&p.route(&in_session("t1", "s", &conversation(1)), &cfg)), 1);
    assert_eq!(chosen(&p.route(&in_session("u1", "u", &conversation(1)), &cfg)), 1);
    let replicas = p.config.replicas.clone();
    p.set_members(&replicas[..1]);
    assert_eq!(chosen(&p.route(&in_session("t2", "s", &conversation(2)), &cfg)), 0);
    assert_eq!(p.explain(Some("t2"), 1)[0].session, Some("replica_gone"));
    // r1's slot goes to a newcomer holding more of the conversation: session `s` (bound to
    // r0) is not credited there; `u`'s binding to the slot went with r1.
    let newcomer = ReplicaConfig { id: "r9".into(), ..replicas[1].clone() };
    p.set_members(&[replicas[0].clone(), newcomer]);
    cache_on(&p, 1, &conversation(2));
    p.route(&in_session("t3", "s", &conversation(2)), &cfg);
    assert_eq!(p.explain(Some("t3"), 1)[0].session, Some("prefix_gone"), "r0 holds less than r9");
    p.route(&in_session("u2", "u", &conversation(2)), &cfg);
    assert_eq!(p.explain(Some("u2"), 1)[0].session, Some("new"));
}
