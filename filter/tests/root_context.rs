//! The root context run natively against a fake host: the model list, tokenizer loading and
//! its retries (with the missing-tokenizer gauge), adapters sharing their base's tokenizer,
//! and lifecycle batches sent again until the sidecar takes them.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvgate_filter::config::FilterConfig;
use kvgate_filter::host::{HostStatus, MetricSink, RootHost, SidecarCalls};
use kvgate_filter::root::Root;
use kvgate_shared::codec;
use kvgate_shared::hash::Salt;
use kvgate_shared::wire::{
    tokenizer_path, Adapter, LifecycleBatch, LifecycleEvent, LifecycleKind, ModelBundle, ModelList,
};
use proxy_wasm::types::MetricType;

const QUEUE: u32 = 3;
const MODEL: &str = "Qwen/Qwen3-0.6B";

/// What the fake Envoy holds and what the root did to it.
struct State {
    /// (method, path, body) of each call to the sidecar, by token.
    calls: Vec<(&'static str, String, Vec<u8>)>,
    /// The answer to the call being answered: status and body.
    answer: Option<(String, Vec<u8>)>,
    queue: VecDeque<Vec<u8>>,
    now: SystemTime,
    gauges: HashMap<String, u32>,
    recorded: HashMap<u32, u64>,
    /// The tick period last set.
    tick: Option<Duration>,
}

#[derive(Clone)]
struct Fake(Rc<RefCell<State>>);

impl Fake {
    fn new() -> Fake {
        Fake(Rc::new(RefCell::new(State {
            calls: Vec::new(),
            answer: None,
            queue: VecDeque::new(),
            now: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000),
            gauges: HashMap::new(),
            recorded: HashMap::new(),
            tick: None,
        })))
    }

    fn paths(&self) -> Vec<String> {
        self.0.borrow().calls.iter().map(|(m, p, _)| format!("{m} {p}")).collect()
    }

    fn later(&self, by: Duration) {
        self.0.borrow_mut().now += by;
    }

    /// The missing-tokenizer gauge of `MODEL`, if ever defined.
    fn missing_gauge(&self) -> Option<u64> {
        let s = self.0.borrow();
        let id = s.gauges.get("model=.=Qwen/Qwen3-0.6B;.;kvgate.tokenizer_missing")?;
        s.recorded.get(id).copied()
    }
}

impl MetricSink for Fake {
    fn define(&self, _: MetricType, name: &str) -> Option<u32> {
        let mut s = self.0.borrow_mut();
        let id = 100 + s.gauges.len() as u32;
        Some(*s.gauges.entry(name.to_owned()).or_insert(id))
    }
    fn increment(&self, _: u32, _: i64) {}
    fn record(&self, id: u32, value: u64) {
        self.0.borrow_mut().recorded.insert(id, value);
    }
}

impl SidecarCalls for Fake {
    fn dispatch(
        &self,
        _: &str,
        path: &str,
        _: &str,
        _: &[(&str, &str)],
        body: &[u8],
        _: Duration,
    ) -> Result<u32, HostStatus> {
        let mut s = self.0.borrow_mut();
        s.calls.push(("POST", path.to_owned(), body.to_vec()));
        Ok(s.calls.len() as u32 - 1)
    }
    fn call_status(&self) -> Option<String> {
        self.0.borrow().answer.as_ref().map(|(status, _)| status.clone())
    }
    fn call_header(&self, _: &str) -> Option<String> {
        None
    }
    fn call_body(&self, size: usize) -> Option<Vec<u8>> {
        self.0.borrow().answer.as_ref().map(|(_, body)| body[..size.min(body.len())].to_vec())
    }
}

impl RootHost for Fake {
    fn get(&self, _: &str, path: &str, _: &str, _: Duration) -> Result<u32, HostStatus> {
        let mut s = self.0.borrow_mut();
        s.calls.push(("GET", path.to_owned(), Vec::new()));
        Ok(s.calls.len() as u32 - 1)
    }
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        assert_eq!(queue, QUEUE);
        self.0.borrow_mut().queue.pop_front()
    }
    fn now(&self) -> SystemTime {
        self.0.borrow().now
    }
    fn set_tick_period(&self, period: Duration) {
        self.0.borrow_mut().tick = Some(period);
    }
}

/// Answers call `token` with `status` and `body`.
fn answer(root: &mut Root<Fake>, fake: &Fake, token: usize, status: &str, body: Vec<u8>) {
    let size = body.len();
    fake.0.borrow_mut().answer = Some((status.to_owned(), body));
    root.answered(token as u32, size);
}

fn bundle() -> Vec<u8> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
    codec::encode(&ModelBundle::from_dir(MODEL, &dir, 16).unwrap()).unwrap()
}

fn models(names: &[&str], adapters: &[(&str, &str)]) -> Vec<u8> {
    let adapters = adapters.iter().map(|(name, base)| Adapter { name: (*name).into(), base: (*base).into() }).collect();
    codec::encode(&ModelList { models: names.iter().map(|n| (*n).to_owned()).collect(), adapters }).unwrap()
}

/// A root configured in a VM that serves requests (a worker's).
fn configured() -> (Root<Fake>, Fake) {
    let fake = Fake::new();
    let mut root = Root::with_host(fake.clone());
    root.configure(FilterConfig::default(), Some(QUEUE), None);
    root.request_arrived();
    root.tick();
    (root, fake)
}

#[test]
fn a_vm_without_requests_loads_no_tokenizer_until_its_first() {
    let fake = Fake::new();
    let mut root = Root::with_host(fake.clone());
    root.configure(FilterConfig::default(), Some(QUEUE), None);
    answer(&mut root, &fake, 0, "200", models(&[MODEL], &[]));
    root.tick();
    assert_eq!(fake.paths(), ["GET /v1/models"], "Envoy's main-thread VM never routes: no tokenizer");
    assert!(root.shared().borrow().models.is_empty());
    // The first request hurries the next tick, which fetches it and restores the period.
    assert!(root.request_arrived());
    assert_eq!(fake.0.borrow().tick, Some(Duration::from_millis(1)));
    assert!(!root.request_arrived(), "only the first");
    root.tick();
    assert_eq!(fake.paths()[1], format!("GET {}", tokenizer_path(MODEL)));
    let retry = Duration::from_millis(FilterConfig::default().retry_ms);
    assert_eq!(fake.0.borrow().tick, Some(retry));
    answer(&mut root, &fake, 1, "200", bundle());
    assert!(root.shared().borrow().models.contains_key(MODEL), "routable once it loads");
}

#[test]
fn envoy_tokenizers_names_the_models_loaded_here() {
    for (setting, fetched) in
        [(r#""none""#, [false, false]), (r#"["other"]"#, [false, true]), ("\"all\"", [true, true])]
    {
        let fake = Fake::new();
        let mut root = Root::with_host(fake.clone());
        let config = FilterConfig::parse(format!(r#"{{"envoy_tokenizers": {setting}}}"#).as_bytes()).unwrap();
        root.configure(config, Some(QUEUE), None);
        root.request_arrived();
        answer(&mut root, &fake, 0, "200", models(&[MODEL, "other"], &[]));
        root.tick();
        let wanted = [MODEL, "other"].map(|m| fake.paths().contains(&format!("GET {}", tokenizer_path(m))));
        assert_eq!(wanted, fetched, "{setting}: {:?}", fake.paths());
    }
}

#[test]
fn the_model_list_brings_tokenizers_and_adapters_share_them() {
    let (mut root, fake) = configured();
    assert_eq!(fake.paths(), ["GET /v1/models"]);
    answer(&mut root, &fake, 0, "200", models(&[MODEL], &[("tenant-lora", MODEL)]));
    assert_eq!(fake.paths()[1], format!("GET {}", tokenizer_path(MODEL)), "the listed model's tokenizer");
    assert!(root.shared().borrow().models.is_empty(), "nothing routable before it loads");
    answer(&mut root, &fake, 1, "200", bundle());
    let shared = root.shared();
    let shared = shared.borrow();
    let (base, lora) = (&shared.models[MODEL], &shared.models["tenant-lora"]);
    assert!(Rc::ptr_eq(&base.tokenizer, &lora.tokenizer), "the adapter uses its base's tokenizer");
    assert_eq!((base.salt, lora.salt), (Salt::NONE, Salt::for_lora(Some("tenant-lora"))));
    assert_eq!(base.block_size, 16);
    assert_eq!(fake.missing_gauge(), None, "never missing, never defined");
}

#[test]
fn a_missing_tokenizer_is_shown_and_fetched_again_after_a_backoff() {
    let (mut root, fake) = configured();
    answer(&mut root, &fake, 0, "200", models(&[MODEL], &[]));
    answer(&mut root, &fake, 1, "503", b"busy".to_vec());
    assert_eq!(fake.missing_gauge(), Some(1), "the gauge says it is missing");
    root.tick();
    assert_eq!(fake.paths().len(), 2, "not fetched again at once");
    fake.later(Duration::from_secs(60));
    root.tick();
    let fetches: Vec<usize> =
        fake.paths().iter().enumerate().filter(|(_, p)| p.contains("/tokenizer")).map(|(i, _)| i).collect();
    assert_eq!(fetches.len(), 2, "fetched again after its backoff: {:?}", fake.paths());
    answer(&mut root, &fake, fetches[1], "200", bundle());
    assert!(root.shared().borrow().models.contains_key(MODEL));
    assert_eq!(fake.missing_gauge(), Some(0), "the gauge clears once it loads");
}

#[test]
fn a_model_no_longer_listed_stops_being_routed() {
    let (mut root, fake) = configured();
    answer(&mut root, &fake, 0, "200", models(&[MODEL], &[]));
    answer(&mut root, &fake, 1, "200", bundle());
    fake.later(Duration::from_secs(60));
    root.tick();
    let again = fake.paths().iter().rposition(|p| p == "GET /v1/models").unwrap();
    assert!(again > 1, "the list is asked for again when due");
    answer(&mut root, &fake, again, "200", models(&[], &[]));
    assert!(root.shared().borrow().models.is_empty());
}

#[test]
fn lifecycle_reports_go_as_one_batch_and_again_until_taken() {
    let (mut root, fake) = configured();
    let event = |id: &str, kind| LifecycleEvent { model: MODEL.into(), request_id: id.into(), kind };
    let events = [
        event("a", LifecycleKind::FirstToken { ttft_us: Some(1200) }),
        event("a", LifecycleKind::Done),
        event("b", LifecycleKind::Done),
    ];
    fake.0.borrow_mut().queue.extend(events.iter().map(|e| codec::encode(e).unwrap()));
    root.flush_lifecycle();
    let posts = |fake: &Fake| -> Vec<(usize, Vec<u8>)> {
        let s = fake.0.borrow();
        s.calls.iter().enumerate().filter(|(_, c)| c.0 == "POST").map(|(i, c)| (i, c.2.clone())).collect()
    };
    let sent = posts(&fake);
    assert_eq!(sent.len(), 1, "one batch");
    let batch: LifecycleBatch = codec::decode(&sent[0].1).unwrap();
    assert_eq!(batch.events, events);
    answer(&mut root, &fake, sent[0].0, "503", Vec::new());
    root.tick();
    assert_eq!(posts(&fake).len(), 1, "not again at once");
    fake.later(Duration::from_secs(60));
    root.tick();
    let sent = posts(&fake);
    assert_eq!(sent.len(), 2, "sent again after its backoff");
    assert_eq!(sent[1].1, sent[0].1, "the same batch");
    answer(&mut root, &fake, sent[1].0, "204", Vec::new());
    fake.later(Duration::from_secs(600));
    root.tick();
    assert_eq!(posts(&fake).len(), 2, "taken: never sent again");
}
