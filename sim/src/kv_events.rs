//! vLLM's KV-event wire format, as published by vLLM 0.32: `[topic, seq_be8, msgpack]` on a
//! ZMQ PUB socket, the payload `[ts, [event…], dp_rank]` with events as tagged maps.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::{Rng, SeedableRng};
use rmp::encode as mp;

use crate::extra_keys::ExtraKeys;
use crate::lora::Lora;

/// A KV-cache event, in vLLM's terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New full blocks committed to the prefix cache.
    BlockStored {
        /// Engine hashes of the new blocks.
        block_hashes: Vec<u64>,
        /// Engine hash of the block before them.
        parent_block_hash: Option<u64>,
        /// The new blocks' tokens, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The tier that now holds them.
        medium: Medium,
        /// The request's extra keys (its LoRA adapter; its `cache_salt`, which vLLM puts in
        /// the prompt's first block's `extra_keys`).
        keys: ExtraKeys,
    },
    /// Blocks evicted.
    BlockRemoved {
        /// Their engine hashes.
        block_hashes: Vec<u64>,
        /// The tier they left.
        medium: Medium,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
}

/// A cache tier, as vLLM names it in `medium`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// GPU memory (`"GPU"`), where the engine computes.
    Gpu,
    /// The CPU offload tier (`"CPU"`).
    Cpu,
}

impl Medium {
    /// vLLM's constant.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

fn write_str(buf: &mut Vec<u8>, s: &str) {
    // Writing to a Vec cannot fail.
    let _ = mp::write_str(buf, s);
}

fn write_u64s(buf: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    let _ = mp::write_array_len(buf, values.len() as u32);
    for v in values {
        let _ = mp::write_uint(buf, v);
    }
}

fn write_lora_id(buf: &mut Vec<u8>, lora: Option<&Lora>) {
    match lora {
        Some(l) => drop(mp::write_uint(buf, u64::from(l.id))),
        None => drop(mp::write_nil(buf)),
    }
}

fn write_lora_name(buf: &mut Vec<u8>, lora: Option<&Lora>) {
    match lora {
        Some(l) => write_str(buf, &l.name),
        None => drop(mp::write_nil(buf)),
    }
}

/// vLLM's per-block `extra_keys`, untagged: `nil`, or `[lora_name]` under an adapter, with
/// the `cache_salt` after it on the prompt's first block (`starts_prompt`: the stored run
/// begins there).
fn write_extra_keys(buf: &mut Vec<u8>, blocks: usize, keys: &ExtraKeys, starts_prompt: bool) {
    let _ = mp::write_array_len(buf, blocks as u32);
    for i in 0..blocks {
        let items: Vec<&str> =
            keys.lora.iter().map(|l| l.name.as_str()).chain(keys.salt_of(starts_prompt && i == 0)).collect();
        if items.is_empty() {
            let _ = mp::write_nil(buf);
            continue;
        }
        let _ = mp::write_array_len(buf, items.len() as u32);
        for item in items {
            write_str(buf, item);
        }
    }
}

/// The event layout on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Encoding {
    /// Tagged maps, vLLM 0.24+ (what 0.32/0.33 publish).
    #[default]
    Map,
    /// Positional arrays, vLLM 0.22/0.23's 12-element layout, for consumers pinned to it.
    LegacyArray,
}

/// Encodes one batch exactly as vLLM's msgspec does: for [`Encoding::Map`] as 0.32/0.33
/// (map16 header for `BlockStored`, `group_idx: 0`, `kv_cache_spec_kind:
/// "full_attention"`), for [`Encoding::LegacyArray`] as 0.22 (every field, trailing nils kept).
pub fn encode_batch(ts: f64, events: &[Event], dp_rank: u32, encoding: Encoding) -> Vec<u8> {
    let mut buf = Vec::new();
    let _ = mp::write_array_len(&mut buf, 3);
    let _ = mp::write_f64(&mut buf, ts);
    let _ = mp::write_array_len(&mut buf, events.len() as u32);
    for event in events {
        if encoding == Encoding::LegacyArray {
            encode_positional(&mut buf, event);
            continue;
        }
        match event {
            Event::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, keys } => {
                let lora = &keys.lora;
                // msgspec sizes the header by the struct's field count: map16.
                buf.extend_from_slice(&[0xde, 0x00, 11]);
                write_str(&mut buf, "type");
                write_str(&mut buf, "BlockStored");
                write_str(&mut buf, "block_hashes");
                write_u64s(&mut buf, block_hashes.iter().copied());
                write_str(&mut buf, "parent_block_hash");
                match parent_block_hash {
                    Some(h) => drop(mp::write_uint(&mut buf, *h)),
                    None => drop(mp::write_nil(&mut buf)),
                }
                write_str(&mut buf, "token_ids");
                write_u64s(&mut buf, token_ids.iter().map(|t| u64::from(*t)));
                write_str(&mut buf, "block_size");
                let _ = mp::write_uint(&mut buf, u64::from(*block_size));
                write_str(&mut buf, "lora_id");
                write_lora_id(&mut buf, lora.as_deref());
                write_str(&mut buf, "medium");
                write_str(&mut buf, medium.as_str());
                write_str(&mut buf, "lora_name");
                write_lora_name(&mut buf, lora.as_deref());
                write_str(&mut buf, "extra_keys");
                write_extra_keys(&mut buf, block_hashes.len(), keys, parent_block_hash.is_none());
                write_str(&mut buf, "group_idx");
                let _ = mp::write_uint(&mut buf, 0);
                write_str(&mut buf, "kv_cache_spec_kind");
                write_str(&mut buf, "full_attention");
            }
            Event::BlockRemoved { block_hashes, medium } => {
                let _ = mp::write_map_len(&mut buf, 4);
                write_str(&mut buf, "type");
                write_str(&mut buf, "BlockRemoved");
                write_str(&mut buf, "block_hashes");
                write_u64s(&mut buf, block_hashes.iter().copied());
                write_str(&mut buf, "medium");
                write_str(&mut buf, medium.as_str());
                write_str(&mut buf, "group_idx");
                let _ = mp::write_uint(&mut buf, 0);
            }
            Event::AllBlocksCleared => {
                let _ = mp::write_map_len(&mut buf, 1);
                write_str(&mut buf, "type");
                write_str(&mut buf, "AllBlocksCleared");
            }
        }
    }
    let _ = mp::write_uint(&mut buf, u64::from(dp_rank));
    buf
}

/// vLLM 0.22's positional events: `BlockStored` has 12 elements, `BlockRemoved` 4.
fn encode_positional(buf: &mut Vec<u8>, event: &Event) {
    match event {
        Event::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, keys } => {
            let lora = &keys.lora;
            let _ = mp::write_array_len(buf, 12);
            write_str(buf, "BlockStored");
            write_u64s(buf, block_hashes.iter().copied());
            match parent_block_hash {
                Some(h) => drop(mp::write_uint(buf, *h)),
                None => drop(mp::write_nil(buf)),
            }
            write_u64s(buf, token_ids.iter().map(|t| u64::from(*t)));
            let _ = mp::write_uint(buf, u64::from(*block_size));
            write_lora_id(buf, lora.as_deref());
            write_str(buf, medium.as_str());
            write_lora_name(buf, lora.as_deref());
            write_extra_keys(buf, block_hashes.len(), keys, parent_block_hash.is_none());
            let _ = mp::write_uint(buf, 0); // group_idx
            write_str(buf, "full_attention");
            let _ = mp::write_nil(buf); // kv_cache_spec_sliding_window
        }
        Event::BlockRemoved { block_hashes, medium } => {
            let _ = mp::write_array_len(buf, 4);
            write_str(buf, "BlockRemoved");
            write_u64s(buf, block_hashes.iter().copied());
            write_str(buf, medium.as_str());
            let _ = mp::write_uint(buf, 0);
        }
        Event::AllBlocksCleared => {
            let _ = mp::write_array_len(buf, 1);
            write_str(buf, "AllBlocksCleared");
        }
    }
}

/// vLLM's `--kv-events-config` (the keys the simulator honours; others are ignored).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default)]
pub struct KvEventsConfig {
    /// PUB endpoint. Bound if it contains `*` or `::` or is `ipc://`/`inproc://`; otherwise
    /// connected (vLLM's rule: `tcp://0.0.0.0:5557` connects!).
    pub endpoint: String,
    /// Replay ROUTER endpoint (always bound); none disables replay.
    pub replay_endpoint: Option<String>,
    /// Topic frame.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// PUB high-water mark.
    pub hwm: i32,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            hwm: 100_000,
        }
    }
}

/// vLLM's bind-or-connect heuristic for the PUB socket.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Faults to inject into the event stream, for reliability tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct Chaos {
    /// Fraction of batches not sent on the PUB socket (still numbered and kept for replay).
    pub drop_fraction: f64,
    /// Publish nothing (batches are numbered and buffered, not sent) while true.
    pub stall: bool,
    /// Delay before each batch is sent, in milliseconds.
    pub delay_ms: u64,
}

enum Command {
    Publish(Vec<Event>),
    Chaos(Chaos),
    /// Start again at seq 0 with an empty replay buffer (a publisher restart).
    Restart,
}

/// A handle to the publisher thread. Each `publish` is one batch with the next seq.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::Sender<Command>,
}

/// How often the publisher thread checks its replay socket when idle.
const REPLAY_POLL: std::time::Duration = std::time::Duration::from_millis(5);

impl Publisher {
    /// Opens the sockets and starts the publishing thread.
    /// `dp_rank` goes into every batch; the endpoints must already be offset for it.
    pub fn start(
        config: KvEventsConfig,
        encoding: Encoding,
        chaos: Chaos,
        seed: u64,
        dp_rank: u32,
    ) -> anyhow::Result<Publisher> {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB)?;
        publisher.set_sndhwm(config.hwm)?;
        if binds(&config.endpoint) {
            publisher.bind(&config.endpoint)?;
        } else {
            publisher.connect(&config.endpoint)?;
        }
        let replay = match &config.replay_endpoint {
            Some(endpoint) => {
                let router = ctx.socket(zmq::ROUTER)?;
                // vLLM 0.33: room for a whole replay.
                router.set_sndhwm(i32::try_from(2 * (config.buffer_steps + 1)).unwrap_or(i32::MAX))?;
                router.bind(endpoint)?;
                Some(router)
            }
            None => None,
        };
        let (tx, rx) = mpsc::channel::<Command>();
        std::thread::Builder::new().name("kv-pub".into()).spawn(move || {
            let _ctx = ctx;
            let mut state = PublisherState {
                config,
                encoding,
                chaos,
                dp_rank,
                seq: 0,
                buffer: VecDeque::new(),
                rng: rand::rngs::StdRng::seed_from_u64(seed),
            };
            loop {
                match rx.recv_timeout(REPLAY_POLL) {
                    Ok(Command::Publish(events)) => state.publish(&publisher, &events),
                    Ok(Command::Chaos(c)) => state.chaos = c,
                    Ok(Command::Restart) => {
                        state.seq = 0;
                        state.buffer.clear();
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                if let Some(router) = &replay {
                    state.serve_replays(router);
                }
            }
        })?;
        Ok(Publisher { tx })
    }

    /// Queues a batch (dropped if empty, as vLLM publishes only steps with events).
    pub fn publish(&self, events: Vec<Event>) {
        if !events.is_empty() {
            let _ = self.tx.send(Command::Publish(events));
        }
    }

    /// Changes the injected faults.
    pub fn set_chaos(&self, chaos: Chaos) {
        let _ = self.tx.send(Command::Chaos(chaos));
    }

    /// Restarts the sequence at 0 with an empty replay buffer.
    pub fn restart(&self) {
        let _ = self.tx.send(Command::Restart);
    }
}

struct PublisherState {
    config: KvEventsConfig,
    encoding: Encoding,
    chaos: Chaos,
    dp_rank: u32,
    seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    rng: rand::rngs::StdRng,
}

impl PublisherState {
    fn publish(&mut self, socket: &zmq::Socket, events: &[Event]) {
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let payload = encode_batch(ts, events, self.dp_rank, self.encoding);
        let seq = self.seq;
        self.seq += 1;
        let dropped = self.chaos.stall
            || (self.chaos.drop_fraction > 0.0 && self.rng.random_bool(self.chaos.drop_fraction.min(1.0)));
        if !dropped {
            if self.chaos.delay_ms > 0 {
                std::thread::sleep(std::time::Duration::from_millis(self.chaos.delay_ms));
            }
            let frames: [&[u8]; 3] = [self.config.topic.as_bytes(), &seq.to_be_bytes(), &payload];
            if let Err(e) = socket.send_multipart(frames, 0) {
                tracing::warn!(error = %e, "KV-event publish failed");
            }
        }
        if self.config.buffer_steps > 0 {
            if self.buffer.len() == self.config.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back((seq, payload));
        }
    }

    /// Answers pending replay requests: `[identity, "", start_seq]` gets every buffered batch
    /// with `seq >= start` as `[identity, "", topic, seq, payload]`, then the end marker
    /// `[identity, "", "", ff×8, ""]` (vLLM 0.26+). Malformed requests are ignored, as vLLM does.
    fn serve_replays(&self, router: &zmq::Socket) {
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            let [identity, empty, start] = match <[Vec<u8>; 3]>::try_from(frames) {
                Ok(f) => f,
                Err(_) => continue,
            };
            if !empty.is_empty() || start.is_empty() || start.len() > 8 {
                continue;
            }
            let start = start.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let frames: [&[u8]; 5] = [&identity, b"", self.config.topic.as_bytes(), &seq.to_be_bytes(), payload];
                if router.send_multipart(frames, 0).is_err() {
                    return;
                }
            }
            let _ = router.send_multipart([&identity[..], b"", b"", &[0xff; 8], b""], 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn hex(s: &str) -> Vec<u8> {
        let s = s.trim();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// Byte-for-byte a payload captured from vLLM 0.33.
    #[test]
    fn matches_vllms_bytes() {
        let events = vec![
            Event::BlockStored {
                block_hashes: vec![9561501211280363793, 15292913576410714033],
                parent_block_hash: None,
                token_ids: (1..=8).collect(),
                block_size: 4,
                medium: Medium::Gpu,
                keys: ExtraKeys::default(),
            },
            Event::BlockRemoved { block_hashes: vec![9561501211280363793], medium: Medium::Gpu },
            Event::AllBlocksCleared,
        ];
        let expected = hex(include_str!("../../testdata/kv-events/vllm-0.33-map.hex"));
        assert_eq!(encode_batch(1700000000.5, &events, 0, Encoding::Map), expected);
        let legacy = hex(include_str!("../../testdata/kv-events/vllm-0.22-positional.hex"));
        assert_eq!(encode_batch(1700000000.5, &events, 0, Encoding::LegacyArray), legacy, "vLLM 0.22's bytes");
        assert!(rmpv::decode::read_value(&mut expected.as_slice()).is_ok());
    }

    /// Under an adapter, as vLLM: `lora_id`, `lora_name`, and the name as each block's extra key.
    #[test]
    fn lora_events_carry_the_adapter() {
        let lora = Arc::new(Lora { id: 3, name: "sql".into(), path: "/a/sql".into() });
        let stored = Event::BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: None,
            token_ids: (1..=8).collect(),
            block_size: 4,
            medium: Medium::Gpu,
            keys: ExtraKeys { lora: Some(lora), cache_salt: None },
        };
        for encoding in [Encoding::Map, Encoding::LegacyArray] {
            let bytes = encode_batch(1.0, std::slice::from_ref(&stored), 0, encoding);
            let value = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
            let event = &value[1][0];
            let (id, name, extra) = match encoding {
                Encoding::Map => {
                    let field = |k: &str| {
                        event.as_map().unwrap().iter().find(|(key, _)| key.as_str() == Some(k)).unwrap().1.clone()
                    };
                    (field("lora_id"), field("lora_name"), field("extra_keys"))
                }
                Encoding::LegacyArray => (event[5].clone(), event[7].clone(), event[8].clone()),
            };
            assert_eq!(id.as_u64(), Some(3));
            assert_eq!(name.as_str(), Some("sql"));
            let per_block = extra.as_array().unwrap();
            assert_eq!(per_block.len(), 2);
            assert!(per_block.iter().all(|keys| keys[0].as_str() == Some("sql")));
        }
    }

    #[test]
    fn vllm_bind_or_connect_rule() {
        assert!(binds("tcp://*:5557"));
        assert!(binds("tcp://[::]:5557"));
        assert!(binds("ipc:///tmp/kv"));
        assert!(!binds("tcp://0.0.0.0:5557"), "vLLM connects here");
        assert!(!binds("tcp://127.0.0.1:5557"));
    }

    #[test]
    fn config_takes_vllm_json() {
        let c: KvEventsConfig = serde_json::from_str(r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:6000","replay_endpoint":"tcp://*:6001","topic":"kv"}"#).unwrap();
        assert_eq!(
            (c.endpoint.as_str(), c.replay_endpoint.as_deref(), c.topic.as_str(), c.buffer_steps),
            ("tcp://*:6000", Some("tcp://*:6001"), "kv", 10_000)
        );
    }

    /// Drops happen, are numbered, and are replayable with vLLM 0.26+'s layout.
    #[test]
    fn replay_serves_dropped_batches() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let replay_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let config = KvEventsConfig {
            endpoint: format!("tcp://127.0.0.1:{port}").replace("127.0.0.1", "*"),
            replay_endpoint: Some(format!("tcp://*:{replay_port}")),
            topic: "t".into(),
            buffer_steps: 3,
            hwm: 1000,
        };
        let p = Publisher::start(config, Encoding::Map, Chaos { stall: true, ..Chaos::default() }, 0, 0).unwrap();
        for _ in 0..5 {
            p.publish(vec![Event::AllBlocksCleared]);
        }
        let ctx = zmq::Context::new();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_rcvtimeo(500).unwrap();
        dealer.connect(&format!("tcp://127.0.0.1:{replay_port}")).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // A request unanswered within its timeout (the connection still being made, a busy
        // host) is sent again until the deadline.
        let replies = loop {
            dealer.send_multipart([&b""[..], &0u64.to_be_bytes()], 0).unwrap();
            let mut replies = Vec::new();
            // As a DEALER sees them: ["", topic, seq, payload], up to the end marker.
            while let Ok(frames) = dealer.recv_multipart(0) {
                let end = frames[2] == [0xff; 8];
                replies.push(frames);
                if end {
                    break;
                }
            }
            if replies.len() == 4 || std::time::Instant::now() > deadline {
                break replies;
            }
        };
        // buffer_steps = 3: seqs 2, 3, 4, then the end marker.
        let seqs: Vec<u64> =
            replies[..3].iter().map(|f| u64::from_be_bytes(f[2].clone().try_into().unwrap())).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(replies[0][1], b"t");
        assert_eq!(replies[3], vec![vec![], vec![], vec![0xff; 8], vec![]]);
    }
}
