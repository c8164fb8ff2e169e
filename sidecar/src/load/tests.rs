//! Tests of `load`.

use super::*;

fn id(key: &str) -> BookingId {
    BookingId::new(&key.into())
}

fn h(hashes: impl IntoIterator<Item = u64>) -> Vec<SequenceHash> {
    hashes.into_iter().map(SequenceHash).collect()
}

/// A booking of `hashes` (they live as long as the test).
fn booking(key: &str, prefill: u64, hashes: &[u64], total: u64) -> NewBooking<'static> {
    NewBooking {
        id: Box::leak(Box::new(id(key))),
        prefill_tokens: prefill,
        hashes: h(hashes.iter().copied()).leak(),
        total_blocks: total,
        max_tokens: None,
        prediction: None,
        sequences: 1,
        streamed: true,
        flow: None,
        from_peer: false,
        timed: false,
        computed: None,
    }
}

#[test]
fn a_non_streamed_prefill_ends_at_its_estimate_learned_from_streamed_ones() {
    let mut t = LoadTable::new(2, 1_000.0);
    let t0 = Instant::now();
    let prompt: Vec<u64> = (0..4).collect();
    let quiet = |id, tokens| NewBooking { streamed: false, ..booking(id, tokens, &prompt, 4) };
    // Before any streamed request: the pool's default rate, 1 000 tokens/s.
    assert!(t.book(ReplicaIdx::new(0), quiet("q1", 500), t0));
    assert_eq!(t.load(ReplicaIdx::new(0)).prefill_tokens, 500);
    assert!(t.end_prefills(t0 + Duration::from_millis(499)).is_empty());
    assert_eq!(t.end_prefills(t0 + Duration::from_millis(500)), [id("q1")]);
    assert_eq!(t.load(ReplicaIdx::new(0)).prefill_tokens, 0, "prefill over, the request still decodes");
    assert_eq!(t.load(ReplicaIdx::new(0)).requests, 1);
    assert!(t.prefill_done(&id("q1"), t0 + Duration::from_secs(9)), "its first byte, at the end: no double release");
    assert_eq!(t.prefill_rate(ReplicaIdx::new(0)), 1_000.0, "a non-streamed first byte teaches nothing");
    // A streamed request: 2 000 prefill tokens, first token 100 ms later → 20 000 tokens/s.
    assert!(t.book(ReplicaIdx::new(0), booking("s", 2_000, &prompt, 4), t0));
    assert!(t.prefill_done(&id("s"), t0 + Duration::from_millis(100)));
    assert!((t.prefill_rate(ReplicaIdx::new(0)) - 20_000.0).abs() < 1.0);
    assert_eq!(t.prefill_rate(ReplicaIdx::new(1)), 1_000.0, "per replica");
    assert!(t.book(ReplicaIdx::new(0), quiet("q2", 4_000), t0));
    assert!(t.end_prefills(t0 + Duration::from_millis(199)).is_empty());
    assert_eq!(t.end_prefills(t0 + Duration::from_millis(200)), [id("q2")]);
    // Released or re-booked before its estimate: nothing is ended twice.
    assert!(t.book(ReplicaIdx::new(1), quiet("q3", 100), t0));
    assert!(t.finish(&id("q3")));
    assert!(t.end_prefills(t0 + Duration::from_secs(60)).is_empty());
    assert_eq!(t.load(ReplicaIdx::new(1)), ReplicaLoad::default());
}

#[test]
fn a_booking_moves_with_its_request() {
    let mut t = LoadTable::new(2, 8_000.0);
    let now = Instant::now();
    let prompt: Vec<u64> = (0..8).collect();
    let hashes = h(prompt.iter().copied());
    assert!(t.book(ReplicaIdx::new(0), booking("r", 100, &prompt, 10), now));
    assert!(t.prefill_done(&id("r"), Instant::now()));
    let before = t.load(ReplicaIdx::new(0));
    assert_eq!(
        t.move_booking(&id("r"), ReplicaIdx::new(1), Instant::now()),
        Some((ReplicaIdx::new(0), hashes.clone(), false))
    );
    assert_eq!(t.load(ReplicaIdx::new(0)), ReplicaLoad::default(), "nothing stays on the replica it left");
    assert_eq!(t.load(ReplicaIdx::new(1)), before, "it carries its load as it stands (prefill done)");
    assert_eq!(t.move_booking(&id("r"), ReplicaIdx::new(1), Instant::now()), None, "already there");
    assert_eq!(t.move_booking(&id("unknown"), ReplicaIdx::new(0), Instant::now()), None);
    assert!(t.finish(&id("r")));
    assert_eq!(
        (t.load(ReplicaIdx::new(0)), t.load(ReplicaIdx::new(1))),
        (ReplicaLoad::default(), ReplicaLoad::default())
    );
}

#[test]
fn decode_progress_grows_output_and_decays_the_unique_footprint() {
    let mut t = LoadTable::new(1, 8_000.0);
    let now = Instant::now();
    let prompt: Vec<u64> = (0..128).collect();
    let mut long = booking("long", 0, &prompt, 128);
    long.max_tokens = Some(64);
    assert!(t.book(ReplicaIdx::new(0), long, now));
    // Another request shares the first 28 blocks: those are never discounted.
    assert!(t.book(ReplicaIdx::new(0), booking("other", 0, &prompt[..28], 28), now));
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 128);
    assert!(t.progress(&id("long"), 16, 16));
    // 1 output block; unique = 100 prompt + 1 output; weight 0.75: round(75.75) = 76 kept.
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 28 + 76);
    assert!(t.progress(&id("long"), 32, 16));
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 28 + 51, "weight 0.5 of 102: round(51) kept");
    assert!(t.progress(&id("long"), 64, 16));
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 28, "at max_tokens its own footprint weighs nothing");
    assert!(t.finish(&id("long")));
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 28, "finishing releases exactly what was counted");
    assert!(!t.progress(&id("long"), 80, 16), "unknown once finished");
    // Without max_tokens the footprint only grows.
    assert!(t.progress(&id("other"), 40, 16));
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 28 + 3);
}

#[test]
fn every_way_a_booking_ends_ends_its_flow() {
    let mut t = LoadTable::new(2, 1000.0);
    let flow = |tenant| Some(Flow { class: 0, tenant });
    let now = Instant::now();
    let book = |t: &mut LoadTable, id: &'static str, replica: usize, tenant: u64| {
        t.book(ReplicaIdx::new(replica), NewBooking { flow: flow(tenant), ..booking(id, 10, &[1], 1) }, now)
    };
    book(&mut t, "done", 0, 1);
    book(&mut t, "moved", 0, 2);
    book(&mut t, "rebooked", 0, 3);
    book(&mut t, "rebooked", 1, 3);
    book(&mut t, "cleared", 1, 4);
    book(&mut t, "old", 0, 5);
    assert_eq!(t.flows_in_flight(), 5, "booking an id again counts it once");
    assert!(!t.under_share(Flow { class: 0, tenant: 1 }), "one each of five: at its share");
    t.finish(&id("done"));
    t.move_booking(&id("moved"), ReplicaIdx::new(1), Instant::now());
    assert_eq!(t.flows_in_flight(), 4, "a moved booking keeps its flow");
    t.clear_replica(ReplicaIdx::new(1));
    assert_eq!(t.flows_in_flight(), 1, "gone with their replica: moved, rebooked, cleared");
    assert_eq!(t.expire(now + Duration::from_secs(10), Duration::from_secs(1)).0, 1);
    assert_eq!(t.flows_in_flight(), 0);
    assert!(!t.finish(&id("late")) && !book(&mut t, "late", 0, 6), "an early end books nothing");
    assert_eq!(t.flows_in_flight(), 0);
}

#[test]
fn engine_reported_requests_beyond_bookings_are_external_load() {
    let mut t = LoadTable::new(2, 8_000.0);
    let now = Instant::now();
    assert!(t.book(ReplicaIdx::new(0), booking("a", 0, &[1, 2, 3], 4), now));
    assert!(t.book(ReplicaIdx::new(0), booking("b", 0, &[1, 2], 2), now));
    t.observe(ReplicaIdx::new(0), EngineReport { requests: 1, ..Default::default() });
    assert_eq!(t.load(ReplicaIdx::new(0)).external, 0, "the engine has not seen all bookings yet: nothing external");
    t.observe(ReplicaIdx::new(1), EngineReport { requests: 3, ..Default::default() });
    let l = t.load(ReplicaIdx::new(1));
    assert_eq!((l.external, l.requests), (3, 3));
    assert_eq!(l.active_blocks, 3 * 3, "each charged the mean booked request: (4 + 2) / 2 = 3 blocks");
    t.observe(ReplicaIdx::new(1), EngineReport { requests: 0, ..Default::default() });
    let idle = ReplicaLoad { engine: Some(EngineReport::default()), ..ReplicaLoad::default() };
    assert_eq!(t.load(ReplicaIdx::new(1)), idle, "what the engine said is kept beside the load");
    assert!(t.finish(&id("a")) && t.finish(&id("b")));
    t.observe(ReplicaIdx::new(1), EngineReport { requests: 2, ..Default::default() });
    assert_eq!(t.load(ReplicaIdx::new(1)).active_blocks, 2, "1 block each when nothing is booked");
}

#[test]
fn external_requests_the_engine_reports_waiting_are_charged_a_prefill() {
    let mut t = LoadTable::new(2, 8_000.0);
    let now = Instant::now();
    // Two bookings on replica 0, prefills of 300 and 100 tokens: a mean of 200.
    assert!(t.book(ReplicaIdx::new(0), booking("a", 300, &[1, 2], 2), now));
    assert!(t.book(ReplicaIdx::new(0), booking("b", 100, &[3], 1), now));
    // Replica 1 runs 1 request and queues 3 that kvgate did not send.
    t.observe(ReplicaIdx::new(1), EngineReport { requests: 4, waiting: 3, ..Default::default() });
    assert_eq!(t.load(ReplicaIdx::new(1)).prefill_tokens, 3 * 200);
    // Replica 0 reports its 2 bookings waiting and 1 request of its own, running: the
    // waiting ones are kvgate's, already booked with their prefill.
    t.observe(ReplicaIdx::new(0), EngineReport { requests: 3, waiting: 2, ..Default::default() });
    assert_eq!((t.load(ReplicaIdx::new(0)).prefill_tokens, t.load(ReplicaIdx::new(0)).external), (400, 1));
    // Once their prefill is over, a request waiting there is an outsider's.
    assert!(t.prefill_done(&id("a"), now) && t.prefill_done(&id("b"), now));
    t.observe(ReplicaIdx::new(0), EngineReport { requests: 3, waiting: 1, ..Default::default() });
    assert_eq!(t.load(ReplicaIdx::new(0)).prefill_tokens, 200);
    assert!(t.finish(&id("a")) && t.finish(&id("b")));
    t.observe(ReplicaIdx::new(1), EngineReport { requests: 4, waiting: 3, ..Default::default() });
    assert_eq!(t.load(ReplicaIdx::new(1)).prefill_tokens, 0, "nothing booked: no mean to charge");
    // A booking of three sequences is three requests waiting at the engine, all kvgate's.
    assert!(t.book(ReplicaIdx::new(1), NewBooking { sequences: 3, ..booking("n3", 90, &[4], 1) }, now));
    t.observe(ReplicaIdx::new(1), EngineReport { requests: 4, waiting: 3, ..Default::default() });
    assert_eq!((t.load(ReplicaIdx::new(1)).prefill_tokens, t.load(ReplicaIdx::new(1)).external), (90, 1));
}

#[test]
fn a_replica_that_leaves_takes_its_bookings_with_it() {
    let mut t = LoadTable::new(1, 8_000.0);
    let added = t.add_replica();
    assert_eq!(added, ReplicaIdx::new(1));
    let now = Instant::now();
    assert!(t.book(ReplicaIdx::new(0), booking("a", 10, &[1, 2], 3), now));
    assert!(t.book(ReplicaIdx::new(1), booking("b", 20, &[1, 2], 3), now));
    assert!(t.book(ReplicaIdx::new(1), booking("c", 5, &[7], 1), now));
    assert_eq!(t.clear_replica(ReplicaIdx::new(1)), 2);
    assert_eq!(t.load(ReplicaIdx::new(1)), ReplicaLoad::default());
    assert_eq!(t.load(ReplicaIdx::new(0)).requests, 1, "other replicas keep theirs");
    assert!(!t.prefill_done(&id("b"), Instant::now()), "a late report for a dropped booking is unknown");
}

#[test]
fn lifecycle_releases_load() {
    let mut t = LoadTable::new(2, 8_000.0);
    let now = Instant::now();
    t.book(ReplicaIdx::new(1), booking("a", 100, &[1, 2], 3), now);
    assert_eq!(
        t.load(ReplicaIdx::new(1)),
        ReplicaLoad { prefill_tokens: 100, active_blocks: 3, requests: 1, external: 0, engine: None }
    );
    assert!(t.prefill_done(&id("a"), Instant::now()));
    assert_eq!(t.load(ReplicaIdx::new(1)).prefill_tokens, 0);
    assert!(t.finish(&id("a")));
    assert_eq!(t.load(ReplicaIdx::new(1)), ReplicaLoad::default());
    assert!(!t.finish(&id("a")), "a second end is ignored");
    assert!(!t.prefill_done(&id("unknown"), Instant::now()));
}

#[test]
fn the_booked_part_of_a_prompt_is_its_longest_booked_prefix() {
    let mut t = LoadTable::new(1, 8_000.0);
    let now = Instant::now();
    // Prompts of one conversation: each block's hash names its prefix.
    t.book(ReplicaIdx::new(0), booking("short", 10, &[1, 2, 3], 3), now);
    t.book(ReplicaIdx::new(0), booking("long", 10, &[1, 2, 3, 4, 5], 5), now);
    let new_blocks =
        |prompt: &[u64]| t.additional_blocks(ReplicaIdx::new(0), &h(prompt.iter().copied()), prompt.len() as u64);
    assert_eq!(new_blocks(&[1, 2, 3, 4, 5, 6, 7]), 2);
    assert_eq!(new_blocks(&[1, 2, 3, 4]), 0);
    assert_eq!(new_blocks(&[9, 10]), 2);
    t.finish(&id("long"));
    let new_blocks =
        |prompt: &[u64]| t.additional_blocks(ReplicaIdx::new(0), &h(prompt.iter().copied()), prompt.len() as u64);
    assert_eq!(new_blocks(&[1, 2, 3, 4, 5, 6, 7]), 4, "what the short booking still holds");
}

#[test]
fn shared_prefixes_count_once() {
    let mut t = LoadTable::new(1, 8_000.0);
    let now = Instant::now();
    t.book(ReplicaIdx::new(0), booking("a", 10, &[1, 2], 2), now);
    assert_eq!(t.additional_blocks(ReplicaIdx::new(0), &h([1, 2, 3]), 4), 2);
    t.book(ReplicaIdx::new(0), booking("b", 10, &[1, 2, 3], 4), now);
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 4, "blocks 1,2 shared, 3 and b's tail new");
    t.finish(&id("a"));
    assert_eq!(t.load(ReplicaIdx::new(0)).active_blocks, 4);
}

#[test]
fn an_end_that_overtakes_its_booking_leaks_nothing() {
    let mut t = LoadTable::new(1, 8_000.0);
    assert!(!t.finish(&id("late")));
    assert!(!t.book(ReplicaIdx::new(0), booking("late", 100, &[1], 1), Instant::now()));
    assert_eq!(t.load(ReplicaIdx::new(0)), ReplicaLoad::default());
    assert!(t.book(ReplicaIdx::new(0), booking("late", 100, &[1], 1), Instant::now()), "only once");
}

#[test]
fn rebooking_and_expiry() {
    let mut t = LoadTable::new(2, 8_000.0);
    let now = Instant::now();
    t.book(ReplicaIdx::new(0), booking("a", 10, &[], 1), now);
    t.book(ReplicaIdx::new(1), booking("a", 20, &[], 1), now);
    assert_eq!((t.load(ReplicaIdx::new(0)).requests, t.load(ReplicaIdx::new(1)).requests), (0, 1));
    assert_eq!(t.expire(now + Duration::from_secs(10), Duration::from_secs(60)).0, 0);
    assert_eq!(t.expire(now + Duration::from_secs(61), Duration::from_secs(60)).0, 1);
    assert_eq!(t.load(ReplicaIdx::new(1)), ReplicaLoad::default());
}

#[test]
fn a_peers_booking_id_gives_back_its_origin_and_id() {
    assert_eq!(BookingId::peer("gw-1", &"req/with/slashes".into()).peer_parts(), Some(("gw-1", "req/with/slashes")));
    assert_eq!(BookingId::leg(&"r".into()).as_str(), "r/prefill");
    assert_eq!(id("plain").peer_parts(), None);
}

/// A replica whose TTFT is 4 ms plus 10 ms per thousand prefill tokens ahead, and 0.5 ms per
/// decoding sequence.
fn measured_ttft(prefill_ahead: u64, decoding: u64) -> Duration {
    Duration::from_micros(4_000 + 10 * prefill_ahead + 500 * decoding)
}

#[test]
fn each_streamed_request_teaches_its_replica_the_ttft_it_faced_and_is_checked_against_it() {
    let mut t = LoadTable::new(2, 1_000.0);
    let now = Instant::now();
    let timed = |key: &str, prefill| NewBooking { timed: true, ..booking(key, prefill, &[], 1) };
    let r0 = ReplicaIdx::new(0);
    // Two decoding requests hold the replica; each new one has another's prefill ahead of it.
    for key in ["d1", "d2"] {
        assert!(t.book(r0, booking(key, 0, &[], 1), now));
        assert!(t.prefill_done(&id(key), now));
    }
    let mut learned = 0;
    for i in 0..crate::latency::MIN_SAMPLES as u64 + 4 {
        let (ahead, own) = (200 * (i % 5), 300 + 100 * (i % 3));
        assert!(t.book(r0, NewBooking { timed: false, ..booking("ahead", ahead, &[], 1) }, now));
        let key = format!("s{i}");
        assert!(t.book(r0, timed(&key, own), now));
        let predicted = t.predicted(&id(&key), Latency::Ttft);
        assert_eq!(predicted.is_some(), learned >= crate::latency::MIN_SAMPLES as u64, "predicts once it has learned");
        let measured = measured_ttft(ahead + own, 2);
        let checked = t.measured(&id(&key), Latency::Ttft, measured, now);
        assert_eq!(checked.map(|(r, w)| (r, w.check.predicted_secs)), predicted.map(|p| (r0, p.as_secs_f64())));
        assert!(checked.is_none_or(|(_, w)| w.check.close() && !w.alarm));
        if let Some(p) = predicted {
            let error = (p.as_secs_f64() - measured.as_secs_f64()).abs();
            assert!(error < 1e-4, "{p:?} vs {measured:?}");
        }
        assert!(t.measured(&id(&key), Latency::Ttft, measured, now).is_none(), "learned from once");
        learned += 1;
        assert_eq!(t.predictor(r0, Latency::Ttft).samples(), learned);
        for key in ["ahead", key.as_str()] {
            assert!(t.finish(&id(key)));
        }
    }
    assert_eq!(t.predictor(ReplicaIdx::new(1), Latency::Ttft).samples(), 0, "per replica");
    // A request that did not time its replica (a peer's, a non-streamed one) teaches nothing,
    // nor does one that ran elsewhere.
    assert!(t.book(r0, booking("quiet", 500, &[], 1), now));
    assert_eq!(t.predicted(&id("quiet"), Latency::Ttft), None);
    assert!(t.measured(&id("quiet"), Latency::Ttft, measured_ttft(500, 2), now).is_none());
    assert!(t.book(r0, timed("moved", 500), now));
    assert!(t.predicted(&id("moved"), Latency::Ttft).is_some());
    assert!(t.move_booking(&id("moved"), ReplicaIdx::new(1), Instant::now()).is_some());
    assert!(t.measured(&id("moved"), Latency::Ttft, measured_ttft(500, 2), now).is_none());
    assert_eq!(t.predictor(r0, Latency::Ttft).samples(), learned);
    // A replica that leaves takes its model along: a newcomer in its slot is learned afresh.
    t.clear_replica(r0);
    assert_eq!(t.predictor(r0, Latency::Ttft).samples(), 0);
}

/// A timed request is also given what will share its decode's steps — every sequence on its
/// replica, its own included — and teaches the replica's ITL model what it measured; one of
/// several sequences (their tokens interleave in one stream) is not timed.
#[test]
fn each_streamed_request_of_one_sequence_teaches_its_replica_its_itl() {
    let mut t = LoadTable::new(1, 1_000.0);
    let now = Instant::now();
    let r0 = ReplicaIdx::new(0);
    let timed = |key: &str| NewBooking { timed: true, ..booking(key, 100, &[], 1) };
    // 2 ms a step, and 0.25 ms more per sequence in the batch.
    let itl = |sequences: u64| Duration::from_micros(2_000 + 250 * sequences);
    let mut held = Vec::new();
    for i in 0..crate::latency::MIN_SAMPLES as u64 + 4 {
        let key = format!("s{i}");
        assert!(t.book(r0, timed(&key), now));
        let (inputs, _) = t.bookings[&id(&key)].timed[Latency::Itl].unwrap();
        assert_eq!(inputs.decoding, held.len() as u64 + 1, "the sequences held, and its own");
        let predicted = t.predicted(&id(&key), Latency::Itl);
        assert_eq!(predicted.is_some(), i >= crate::latency::MIN_SAMPLES as u64);
        let checked = t.measured(&id(&key), Latency::Itl, itl(inputs.decoding), now);
        if let Some(p) = predicted {
            assert!((p.as_secs_f64() - itl(inputs.decoding).as_secs_f64()).abs() < 1e-5, "{p:?}");
            assert!(checked.is_some_and(|(r, w)| r == r0 && w.check.close()));
        }
        assert!(t.measured(&id(&key), Latency::Itl, itl(1), now).is_none(), "learned from once");
        // Every other request stays, so the batch grows.
        if i % 2 == 0 {
            held.push(key);
        } else {
            assert!(t.finish(&id(&key)));
        }
    }
    assert_eq!(t.predictor(r0, Latency::Itl).samples(), crate::latency::MIN_SAMPLES as u64 + 4);
    assert!(t.book(r0, NewBooking { sequences: 3, ..timed("n3") }, now));
    assert!(
        t.bookings[&id("n3")].timed[Latency::Ttft].is_some() && t.bookings[&id("n3")].timed[Latency::Itl].is_none()
    );
}

/// The prefill booked ahead of a request drains at the speed its replica's model learned: a
/// request booked halfway through another's prefill faces half of it, one booked after it
/// none, and none once the other's first token came, however early.
#[test]
fn the_prefill_ahead_drains_at_the_speed_learned() {
    let mut t = LoadTable::new(1, 1_000.0);
    let (r0, t0) = (ReplicaIdx::new(0), Instant::now());
    let timed = |key: &str, prefill| NewBooking { timed: true, ..booking(key, prefill, &[], 1) };
    let ahead = |t: &LoadTable, key: &str| t.bookings[&id(key)].timed[Latency::Ttft].unwrap().0.prefill_ahead;
    // Taught on requests with nothing ahead: 4 ms plus 10 µs a prefill token.
    for i in 0..crate::latency::MIN_SAMPLES as u64 {
        let key = format!("learn{i}");
        let own = 100 * (1 + i % 5);
        assert!(t.book(r0, timed(&key, own), t0));
        assert_eq!(ahead(&t, &key), own, "nothing ahead");
        t.measured(&id(&key), Latency::Ttft, measured_ttft(own, 0), t0);
        assert!(t.finish(&id(&key)));
    }
    // 1 000 tokens take 10 ms: booked 5 ms in, a request faces 500 of them; 20 ms in, none.
    assert!(t.book(r0, booking("long", 1_000, &[], 1), t0));
    assert!(t.book(r0, timed("half", 100), t0 + Duration::from_millis(5)));
    assert!(ahead(&t, "half").abs_diff(100 + 500) <= 5, "{}: the ridge keeps the speed within 1 %", ahead(&t, "half"));
    assert!(t.finish(&id("half")));
    assert!(t.book(r0, timed("later", 100), t0 + Duration::from_millis(20)));
    assert_eq!(ahead(&t, "later"), 100, "the long prefill is computed by now");
    assert_eq!(t.load(r0).prefill_tokens, 1_100, "though its first token was not reported yet");
    // Its first token reported at once: nothing of it is ahead, whatever the speed learned.
    let t1 = t0 + Duration::from_secs(1);
    assert!(t.book(r0, booking("quick", 1_000, &[], 1), t1));
    for key in ["long", "later", "quick"] {
        assert!(t.prefill_done(&id(key), t1));
    }
    assert!(t.book(r0, timed("after", 100), t1));
    assert_eq!(ahead(&t, "after"), 100);
}

/// With the replica's events, a request also faces the prefill booked there that the engine
/// has not stored — its bookings' own blocks not yet in its cache — beyond the backlog the
/// speed learned has left: a chunk in progress, or a request the engine keeps waiting, however
/// long ago it was booked.
#[test]
fn prefill_the_engine_has_not_stored_is_faced_beyond_what_was_drained() {
    let mut t = LoadTable::new(2, 1_000.0);
    let (r0, r1, t0) = (ReplicaIdx::new(0), ReplicaIdx::new(1), Instant::now());
    // The engine's cache: the blocks it has stored, in prompt order.
    let stored = std::cell::RefCell::new(HashSet::new());
    let held = |hashes: &[SequenceHash]| hashes.iter().take_while(|h| stored.borrow().contains(&h.0)).count();
    let computed = Some(Computed { block_size: 16, held: &held });
    // What a probe of 100 tokens booked at `at` faces: (the backlog the speed has left, the
    // prefill not stored beyond it).
    let faces = |t: &mut LoadTable, key: &str, at: Instant| {
        let probe = NewBooking { timed: true, computed, ..booking(key, 100, &[900], 7) };
        assert!(t.book(r0, probe, at));
        let inputs = t.bookings[&id(key)].timed[Latency::Ttft].unwrap().0;
        assert!(t.finish(&id(key)));
        (inputs.prefill_ahead - 100, inputs.prefill_not_stored)
    };
    // A 64-block prompt, nothing cached; then one that shares it and adds 8 blocks, credited
    // with the first's blocks in flight: its own prefill is its last 8 blocks.
    let long: Vec<u64> = (0..64).collect();
    let longer: Vec<u64> = (0..72).collect();
    // (Not streamed: its first byte teaches no prefill rate, so the speed stays the default.)
    assert!(t.book(r0, NewBooking { streamed: false, ..booking("long", 1_024, &long, 64) }, t0));
    assert!(t.book(r0, booking("longer", 128, &longer, 72), t0));
    // At once, all of both is ahead, drained or not.
    assert_eq!(faces(&mut t, "p0", t0), (1_152, 0));
    // A minute later the speed learned (the default, 1 000 tokens a second) has drained it
    // all; nothing is stored, so all of it is still not computed.
    let later = |secs: u64| t0 + Duration::from_secs(60 + secs);
    assert_eq!(faces(&mut t, "p1", later(0)), (0, 1_152));
    // Half of the first prompt stored: half of it left.
    stored.borrow_mut().extend(0..32);
    assert_eq!(faces(&mut t, "p2", later(1)), (0, 512 + 128));
    // All of it: the second's own blocks are still to compute; the first's are not its own.
    stored.borrow_mut().extend(32..64);
    assert_eq!(faces(&mut t, "p3", later(2)), (0, 128));
    stored.borrow_mut().extend(64..68);
    assert_eq!(faces(&mut t, "p4", later(3)), (0, 64));
    // Its first token: nothing of the first is ahead whatever was stored; the second moved
    // elsewhere takes its prefill along.
    stored.borrow_mut().clear();
    assert!(t.prefill_done(&id("long"), later(4)));
    assert_eq!(faces(&mut t, "p5", later(5)), (0, 128));
    assert!(t.move_booking(&id("longer"), r1, later(6)).is_some());
    assert_eq!(faces(&mut t, "p6", later(7)), (0, 0));
    // A prompt without hashes (hashed with another block size, or not tokenized): its events
    // cannot tell, so none of it counts.
    assert!(t.book(r0, booking("blind", 500, &[], 32), later(9)));
    assert_eq!(faces(&mut t, "p8", later(10)), (0, 0));
    // Without the events, nothing is known beyond the speed learned.
    let probe = NewBooking { timed: true, ..booking("p7", 100, &[900], 7) };
    assert!(t.book(r1, probe, later(8)));
    assert_eq!(t.bookings[&id("p7")].timed[Latency::Ttft].unwrap().0.prefill_not_stored, 0);
}
