//! Tests of `admission`.

use super::*;
use crate::load::EngineReport;
use tokio::sync::mpsc;

/// A gate that lives for the whole test (so that places can move into tasks).
fn gate(max_queued: usize, classes: Vec<ClassConfig>) -> &'static Gate {
    Box::leak(Box::new(Gate::new(&AdmissionConfig {
        enabled: true,
        kv_blocks: 100,
        max_prefill_tokens: 1000,
        max_queued,
        classes,
        ..AdmissionConfig::default()
    })))
}

fn class(name: &str, priority: i32) -> ClassConfig {
    ClassConfig { name: name.into(), priority, ..ClassConfig::default() }
}

/// A request holding a place, driven by the test: wait (until a deadline), or leave.
struct Waiter {
    waits: mpsc::UnboundedSender<Option<Duration>>,
    results: mpsc::UnboundedReceiver<Result<bool, ShedReason>>,
    task: tokio::task::JoinHandle<()>,
}

impl Waiter {
    fn new(g: &'static Gate, class: usize, tenant: Option<&'static str>) -> Waiter {
        Waiter::asking(g, class, "m", tenant)
    }

    fn asking(g: &'static Gate, class: usize, asks: &'static str, tenant: Option<&'static str>) -> Waiter {
        let (waits, mut commands) = mpsc::unbounded_channel::<Option<Duration>>();
        let (report, results) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut place = g.place(class, asks, tenant);
            while let Some(Some(within)) = commands.recv().await {
                let _ = report.send(place.wait(g.releases(), Instant::now() + within).await);
            }
        });
        Waiter { waits, results, task }
    }

    /// Starts waiting and returns once it is in the queue.
    async fn wait(&mut self, g: &Gate, within: Duration) {
        let before = g.waiting();
        self.waits.send(Some(within)).unwrap();
        while g.waiting() == before {
            tokio::task::yield_now().await;
        }
    }

    /// Its last wait's outcome, once there is one.
    async fn result(&mut self) -> Result<(), ShedReason> {
        self.results.recv().await.unwrap().map(|woken| assert!(woken, "woken, not released"))
    }

    /// Waits again after a wake-up that found no room (its place is kept).
    async fn wait_again(&mut self, within: Duration) {
        self.waits.send(Some(within)).unwrap();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    /// Whether its wait is over, after the other tasks have run.
    async fn is_woken(&mut self) -> bool {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        !self.results.is_empty()
    }

    /// Lets its place go (admitted, or gone) and waits until it has.
    async fn leave(self) {
        let _ = self.waits.send(None);
        self.task.await.unwrap();
    }
}

const FAR: Duration = Duration::from_secs(10);

/// `n` requests from `tenant`, queued one after the other.
async fn queued(g: &'static Gate, n: usize, tenant: &'static str) -> Vec<Waiter> {
    let mut waiters = Vec::new();
    for _ in 0..n {
        let mut w = Waiter::new(g, 0, Some(tenant));
        w.wait(g, FAR).await;
        waiters.push(w);
    }
    waiters
}

#[test]
fn saturation_is_either_threshold() {
    let g = gate(1, Vec::new());
    let load = |active_blocks, prefill_tokens| ReplicaLoad { active_blocks, prefill_tokens, ..Default::default() };
    assert!(!g.saturated(&load(89, 999)));
    assert!(g.saturated(&load(90, 0)), "90 % of 100 blocks");
    assert!(g.saturated(&load(0, 1000)), "the prefill backlog");
}

#[test]
fn capacity_and_signals_can_come_from_the_engine() {
    let learned = Gate::new(&AdmissionConfig { enabled: true, ..AdmissionConfig::default() });
    let report = |kv_blocks, kv_usage, waiting| EngineReport { kv_blocks, kv_usage, waiting, requests: waiting };
    let load = |active_blocks, engine| ReplicaLoad { active_blocks, engine, ..Default::default() };
    assert!(!learned.saturated(&load(1000, None)), "no capacity known: never saturated");
    assert!(!learned.saturated(&load(89, Some(report(Some(100), None, 0)))));
    assert!(learned.saturated(&load(90, Some(report(Some(100), None, 0)))), "90 % of what the engine has");
    assert!(!learned.saturated(&load(0, Some(report(None, Some(0.99), 50)))), "signals are off by default");
    let signals = Gate::new(&AdmissionConfig {
        enabled: true,
        engine_signals: true,
        max_engine_waiting: 4,
        ..AdmissionConfig::default()
    });
    assert!(!signals.saturated(&load(0, Some(report(None, Some(0.5), 3)))));
    assert!(signals.saturated(&load(0, Some(report(None, Some(0.95), 0)))), "the engine's cache is full");
    assert!(signals.saturated(&load(0, Some(report(None, Some(0.5), 4)))), "the engine queues");
}

#[tokio::test]
async fn a_waiting_higher_class_is_seen_by_lower_ones() {
    let g = gate(8, vec![class("batch", 0), class("interactive", 10)]);
    let (batch, chat) = (g.class_of(Some("batch")), g.class_of(Some("interactive")));
    // Short waits: a waiter that is never woken leaves when its wait ends.
    const SHORT: Duration = Duration::from_millis(300);
    let mut low = Waiter::new(g, batch, Some("t"));
    low.wait(g, SHORT).await;
    assert!(!g.higher_waiting(batch) && !g.higher_waiting(chat), "only batch waits");
    let mut high = Waiter::new(g, chat, None);
    high.wait(g, SHORT).await;
    assert!(g.higher_waiting(batch) && !g.higher_waiting(chat));
    high.leave().await;
    assert!(!g.higher_waiting(batch));
    low.leave().await;
}

#[tokio::test]
async fn a_wake_up_without_room_goes_on_to_another_tenant_only_with_headroom() {
    for headroom in [0.5, 0.0] {
        let g: &'static Gate = Box::leak(Box::new(Gate::new(&AdmissionConfig {
            enabled: true,
            kv_blocks: 100,
            fair_headroom: headroom,
            ..AdmissionConfig::default()
        })));
        let mut burst = Waiter::new(g, 0, Some("burst"));
        burst.wait(g, FAR).await;
        // Short waits: a waiter that is never woken leaves when its wait ends.
        let short = Duration::from_millis(300);
        let mut more = Waiter::new(g, 0, Some("burst"));
        more.wait(g, short).await;
        let mut quiet = Waiter::new(g, 0, Some("quiet"));
        quiet.wait(g, short).await;
        g.freed();
        burst.result().await.unwrap();
        // It finds no room and waits again, passing the wake-up on.
        burst.wait_again(short).await;
        assert!(!more.is_woken().await, "not to the burst's own next request");
        assert_eq!(quiet.is_woken().await, headroom > 0.0, "to the other tenant's, with headroom {headroom}");
        for w in [burst, more, quiet] {
            w.leave().await;
        }
    }
}

#[test]
fn a_lower_class_leaves_headroom_for_a_higher_one() {
    let batch = ClassConfig { kv_fraction: Some(0.5), ..class("batch", 0) };
    let g = gate(8, vec![batch, class("interactive", 10)]);
    let load = ReplicaLoad { active_blocks: 60, ..Default::default() };
    assert!(g.saturated_for(&load, g.class_of(Some("batch")), false), "batch stops at 50 of 100 blocks");
    assert!(!g.saturated_for(&load, g.class_of(Some("interactive")), false), "interactive goes on to 90");
}

#[test]
fn a_tenant_under_its_share_has_headroom_past_its_class() {
    // Defaults: 90 % of 100 blocks, 1000 prefill tokens; headroom 0.5 → 95 blocks, 1500.
    let g = gate(8, vec![]);
    let default = g.class_of(None);
    let load = |blocks, prefill| ReplicaLoad { active_blocks: blocks, prefill_tokens: prefill, ..Default::default() };
    for (blocks, prefill, over, under) in [(92, 0, true, false), (95, 0, true, true), (0, 1200, true, false)] {
        assert_eq!(g.saturated_for(&load(blocks, prefill), default, false), over, "{blocks} blocks, {prefill}");
        assert_eq!(g.saturated_for(&load(blocks, prefill), default, true), under, "{blocks} blocks, {prefill}");
    }
    assert!(g.saturated_for(&load(0, 1500), default, true), "the raised backlog is a limit too");
    assert!(g.has_fair_headroom() && g.flow_of(default, None).is_none(), "no tenant, no flow");
    assert_ne!(g.flow_of(default, Some("a")), g.flow_of(default, Some("b")));

    // A lower class's raised limits stop at a higher class's: its headroom stays its own.
    let batch = ClassConfig { kv_fraction: Some(0.7), max_prefill_tokens: Some(800), ..class("batch", 0) };
    let chat = ClassConfig { kv_fraction: Some(0.8), ..class("chat", 10) };
    let g = gate(8, vec![batch, chat]);
    let (batch, chat) = (g.class_of(Some("batch")), g.class_of(Some("chat")));
    assert!(
        !g.saturated_for(&load(79, 0), batch, true) && g.saturated_for(&load(80, 0), batch, true),
        "0.85 capped at 0.8"
    );
    assert!(
        !g.saturated_for(&load(0, 999), batch, true) && g.saturated_for(&load(0, 1000), batch, true),
        "1200 capped at 1000"
    );
    assert!(
        !g.saturated_for(&load(89, 0), chat, true) && g.saturated_for(&load(90, 0), chat, true),
        "the top class: 0.9"
    );
}

#[tokio::test]
async fn waiters_wake_in_order_and_nobody_overtakes_a_woken_one() {
    let g = gate(8, Vec::new());
    let (mut a, mut b) = (Waiter::new(g, 0, None), Waiter::new(g, 0, None));
    a.wait(g, FAR).await;
    b.wait(g, FAR).await;
    assert!(!g.place(0, "m", None).is_first(), "a newcomer does not overtake");
    g.freed();
    assert_eq!(a.result().await, Ok(()));
    assert!(!b.is_woken().await, "one release wakes one waiter");
    assert!(!g.place(0, "m", None).is_first(), "a woken request keeps its place while it decides");
    a.leave().await;
    assert_eq!(b.result().await, Ok(()), "admitted: the next one is woken, there may be room for it too");
}

#[tokio::test]
async fn a_woken_request_that_still_does_not_fit_passes_the_wake_on() {
    let g = gate(8, Vec::new());
    let mut a = Waiter::new(g, 0, None);
    let mut alike = Waiter::new(g, 0, None);
    let mut adapter = Waiter::asking(g, 0, "m-lora", None);
    a.wait(g, FAR).await;
    alike.wait(g, FAR).await;
    adapter.wait(g, FAR).await;
    g.freed();
    assert_eq!(a.result().await, Ok(()));
    // a finds the pool still full and waits again: the next request for the same model
    // would not fit either, so the wake-up goes to one for an adapter (other replicas).
    a.wait_again(FAR).await;
    assert!(!alike.is_woken().await, "a request like a is not woken");
    assert_eq!(adapter.result().await, Ok(()), "one that may fit where a does not is");
    assert_eq!(g.waiting(), 2, "a waits again");
    g.freed();
    assert_eq!(a.result().await, Ok(()), "a kept its place ahead of the others");
    a.leave().await;
    assert_eq!(alike.result().await, Ok(()), "admitted, a passes its wake-up on");
    alike.leave().await;
    adapter.leave().await;
}

#[tokio::test]
async fn a_higher_class_goes_first_and_tenants_take_turns() {
    let g = gate(16, vec![class("batch", 0), class("interactive", 10)]);
    let (batch, interactive) = (g.class_of(Some("batch")), g.class_of(Some("interactive")));
    assert_eq!(g.class_of(None), batch, "the lowest class is the default");
    assert_eq!(g.class_of(Some("unknown")), batch);
    // A tenant that was admitted at once many times is not charged for it.
    for _ in 0..100 {
        drop(g.place(batch, "m", Some("noisy")));
    }
    // A bursting tenant queues three batch requests, then a quiet one queues one; then an
    // interactive request arrives last of all.
    let mut order = Vec::new();
    for (who, class, tenant) in [
        ("noisy-1", batch, "noisy"),
        ("noisy-2", batch, "noisy"),
        ("noisy-3", batch, "noisy"),
        ("quiet-1", batch, "quiet"),
        ("chat", interactive, "noisy"),
    ] {
        let mut w = Waiter::new(g, class, Some(tenant));
        w.wait(g, FAR).await;
        order.push((who, w));
    }
    let mut woken = Vec::new();
    for _ in 0..order.len() {
        g.freed();
        for (who, w) in &mut order {
            if !woken.contains(who) && w.is_woken().await {
                woken.push(*who);
            }
        }
    }
    assert_eq!(woken, ["chat", "noisy-1", "quiet-1", "noisy-2", "noisy-3"]);
}

#[tokio::test]
async fn a_wake_up_that_finds_no_room_does_not_send_a_quiet_tenant_back() {
    let g = gate(16, vec![]);
    let mut noisy = queued(g, 3, "noisy").await;
    // A release that makes no room: the first waiter is woken, finds the pool still
    // full, and waits again. Its turn has not come: nobody was admitted.
    g.freed();
    noisy[0].result().await.unwrap();
    noisy[0].wait_again(FAR).await;
    // A quiet tenant's first request still goes right after the noisy tenant's first.
    let mut quiet = Waiter::new(g, 0, Some("quiet"));
    quiet.wait(g, FAR).await;
    g.freed();
    let first = noisy.remove(0);
    assert!(!quiet.is_woken().await, "the noisy tenant's first request is ahead");
    first.leave().await;
    assert!(quiet.is_woken().await, "then the quiet tenant's, before the noisy tenant's second");
    for w in &mut noisy {
        assert!(!w.is_woken().await);
    }
    quiet.leave().await;
    for w in noisy {
        w.leave().await;
    }
}

#[tokio::test]
async fn a_request_admitted_out_of_turn_does_not_move_the_turn_past_the_waiters() {
    let g = gate(16, vec![]);
    let mut noisy = queued(g, 3, "noisy").await;
    let mut adapter = Waiter::asking(g, 0, "m-lora", Some("noisy"));
    adapter.wait(g, FAR).await;
    // The first waiter does not fit; the adapter's request, last in the queue, does.
    g.freed();
    noisy[0].result().await.unwrap();
    noisy[0].wait_again(FAR).await;
    adapter.result().await.unwrap();
    adapter.leave().await;
    // A quiet tenant's request still goes before the noisy tenant's second.
    let mut quiet = Waiter::new(g, 0, Some("quiet"));
    quiet.wait(g, FAR).await;
    let first = noisy.remove(0);
    first.leave().await;
    assert!(quiet.is_woken().await, "the quiet tenant is next");
    quiet.leave().await;
    for w in noisy {
        w.leave().await;
    }
}

#[tokio::test]
async fn a_full_class_and_a_long_wait_are_shed() {
    let g = gate(1, Vec::new());
    let mut a = Waiter::new(g, 0, None);
    a.wait(g, Duration::from_millis(50)).await;
    assert_eq!(g.place(0, "m", None).wait(g.releases(), Instant::now() + FAR).await, Err(ShedReason::QueueFull));
    assert_eq!(a.result().await, Err(ShedReason::QueueTime));
    a.leave().await;
    let mut next = Waiter::new(g, 0, None);
    next.wait(g, FAR).await;
    g.freed();
    assert_eq!(next.result().await, Ok(()), "its place in the class is free again");
}

#[tokio::test]
async fn a_request_dropped_while_it_waits_gives_its_place_back() {
    let g = gate(1, Vec::new());
    let mut a = Waiter::new(g, 0, None);
    a.wait(g, FAR).await;
    // The filter stopped waiting: the sidecar drops the request's handler mid-wait.
    a.task.abort();
    let _ = a.task.await;
    assert_eq!(g.waiting(), 0);
    let mut b = Waiter::new(g, 0, None);
    tokio::time::timeout(Duration::from_secs(5), b.wait(g, FAR)).await.expect("the class has room again");
    g.freed();
    assert_eq!(b.result().await, Ok(()));
}

#[tokio::test]
async fn a_request_woken_then_dropped_passes_its_wake_up_on() {
    let g = gate(8, Vec::new());
    let (mut x, mut y) = (Waiter::new(g, 0, None), Waiter::new(g, 0, None));
    x.wait(g, FAR).await;
    y.wait(g, FAR).await;
    g.freed();
    assert_eq!(x.result().await, Ok(()));
    x.task.abort();
    let _ = x.task.await;
    assert_eq!(y.result().await, Ok(()), "the release x did not use goes to y");
}

#[tokio::test]
async fn a_release_before_the_wait_is_not_missed() {
    let g = gate(1, Vec::new());
    let seen = g.releases();
    g.freed();
    assert_eq!(
        g.place(0, "m", None).wait(seen, Instant::now() + FAR).await,
        Ok(false),
        "returns at once to decide again"
    );
    assert_eq!(g.waiting(), 0);
}
