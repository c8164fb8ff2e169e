//! ZMQ transport: per pool one reader thread waiting on every replica's SUB socket at once
//! and moving each message into its replica's inbox, bounded in bytes; per pool a few ingest
//! workers (one per core) that run each replica's [`super::ingest::Ingest`] — decoding,
//! replaying gaps — with no lock held, and hand the changes to the pool's [`Applier`].
//!
//! - The reader waits on the sockets' signalling descriptors with epoll (`mio`) and reads
//!   only the sockets that signalled: a round costs what is ready, not how many engines are
//!   subscribed. (`zmq::poll` over every socket cost the reader O(engines) system calls a
//!   wake-up: half the sidecar's CPU at 64 engines; `docs/scale.md`.) Each
//!   [`REPLICAS_PER_CONTEXT`] replicas share a ZMQ context, libzmq's limit being 1 023 sockets.
//! - A replica's ingestion is a [`Stream`]: its inbox and its `Ingest` state. When a message
//!   arrives the reader schedules the stream on the pool's run queue (once: a scheduled
//!   stream is not queued again); a worker takes it, ingests up to [`TURN`] messages, and
//!   queues it again if more are waiting. So one replica's messages are ingested in order, by
//!   one worker at a time, and a busy replica cannot hold a worker while others wait.
//! - Few threads, not one per replica: under an event storm the threads that want the CPU are
//!   the reader, the workers and the applier, however many replicas there are, so the API's
//!   threads (routing decisions) still get their share. One reader per replica was measured
//!   against this (`docs/benchmarks/contention.md`): 64 reader threads waking for every
//!   message preempted decisions more often. The reader takes up to [`TURN`] messages from a
//!   socket per round, so one busy engine cannot starve the others' sockets.
//! - Replicas join with [`Readers::add`]; one whose stop flag is set (it left the pool, or
//!   shutdown) is dropped, and its sockets closed, at the reader's next round.
//! - The reader and the workers run at a lower CPU priority than the API ([`crate::niceness`]).
//! - A replay that hangs holds one worker for at most its timeout; the other workers go on.
//! - The reader never blocks on a replica: when the inbox is full (in bytes or in messages)
//!   the message is dropped and counted (`reason="inbox_full"`), and ingestion sees a
//!   sequence gap, which it replays like any other.
//! - Messages must be exactly `[topic, seq (8 bytes, big-endian), payload]`.
//! - A ZMQ socket monitor watches the connection: when it drops (the engine died or
//!   restarted, or the network failed) the replica earns no cache credit until its next
//!   message, which either continues the sequence (gaps replayed as usual) or starts it again
//!   (a restart: the replica is cleared).
//! - Replay uses a DEALER: send `["", start_seq_be8]`, read until the end marker (seq
//!   `ff…ff`, empty payload). Both reply layouts are accepted: `["", seq, payload]` (vLLM ≤
//!   0.25) and `["", topic, seq, payload]` (0.26+). A replay is bounded in time, messages and
//!   bytes; past a bound it counts as lost (the replica is degraded, not stalled).

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, RecvTimeoutError, SendError, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;

use super::apply::{Applier, Job};
use super::ingest::{Ingest, NoReplay, Replay};
use crate::index::ReplicaIdx;
use crate::metrics::Metrics;
use crate::niceness::give_way_to_routing;
use crate::pool::Pool;
use crate::pool::{EventsMode, ReplicaConfig};

/// Largest message accepted from a publisher; ZMQ drops larger ones itself.
const MAX_MESSAGE_BYTES: i64 = 64 << 20;
/// Messages ZMQ itself buffers on the SUB socket (the reader drains it into the inbox as
/// they come, so this only fills if the reader is starved of CPU).
const SOCKET_MESSAGES: i32 = 10_000;
/// Bytes buffered between a reader and its ingester, per replica.
const INBOX_BYTES: usize = 64 << 20;
/// Bytes buffered in all of a pool's inboxes together. Per replica alone, a sidecar that falls
/// behind 1 000 engines could hold 64 GiB of backlog (`docs/scale.md`); this holds about 30 s
/// of an H100 fleet's messages at that size.
const POOL_INBOX_BYTES: usize = 1 << 30;
/// Messages buffered between a reader and its ingester.
const INBOX_MESSAGES: usize = 10_000;
/// The longest a blocked call waits before checking for shutdown; also how late the reader
/// notices a replica that left without waking it, and how often it retries a failed socket.
const POLL: Duration = Duration::from_millis(200);
/// Messages a worker ingests from one replica before it takes the next scheduled one.
pub const TURN: usize = 32;
/// How long a replay may take in all.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// The most messages one replay returns (vLLM buffers 10 000 by default).
const REPLAY_MAX_MESSAGES: usize = 100_000;
/// The most payload bytes one replay returns.
const REPLAY_MAX_BYTES: usize = 256 << 20;

/// One replica's event source: its slot, its endpoints, and the flag that stops reading and
/// ingesting its events (set when it leaves the pool, or at shutdown).
#[derive(Debug, Clone)]
pub struct Source {
    /// The replica's slot in the pool.
    pub replica: ReplicaIdx,
    /// Its endpoints.
    pub config: ReplicaConfig,
    /// Stops its subscription and its ingestion.
    pub stop: Arc<AtomicBool>,
}

/// One replica's ingestion: its inbox and its ingest state, run by one worker at a time.
struct Stream {
    replica: ReplicaIdx,
    /// The replica's stop flag.
    stop: Arc<AtomicBool>,
    replay: Option<String>,
    /// Messages in the inbox.
    queued: AtomicUsize,
    /// Payload bytes in the inbox.
    bytes: AtomicUsize,
    /// What the pool's inboxes hold together.
    budget: Arc<Budget>,
    /// On the run queue or being run: the reader does not queue it again.
    scheduled: AtomicBool,
    /// The inbox's receiving end and the ingest state; only the worker running the stream
    /// takes this lock.
    state: Mutex<StreamState>,
}

/// A message as the reader received it: its sequence number and payload.
type Message = (u64, Vec<u8>);

/// What only the worker running a stream touches.
struct StreamState {
    inbox: Receiver<Message>,
    ingest: Ingest,
}

/// Bytes held in a pool's inboxes, and the most they may hold.
#[derive(Debug)]
struct Budget {
    held: AtomicUsize,
    limit: usize,
}

impl Budget {
    fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget { held: AtomicUsize::new(0), limit })
    }
}

impl Stream {
    /// Counts `len` bytes into the inbox if they fit in the replica's share and the pool's;
    /// false (nothing counted) if not. Only the reader adds, so the check and the add do not
    /// race with another add.
    fn hold(&self, len: usize) -> bool {
        let fits = self.bytes.load(Ordering::Relaxed) + len <= INBOX_BYTES
            && self.budget.held.load(Ordering::Relaxed) + len <= self.budget.limit;
        if fits {
            self.bytes.fetch_add(len, Ordering::Relaxed);
            self.budget.held.fetch_add(len, Ordering::Relaxed);
        }
        fits
    }

    /// `len` bytes left the inbox.
    fn release(&self, len: usize) {
        self.bytes.fetch_sub(len, Ordering::Relaxed);
        self.budget.held.fetch_sub(len, Ordering::Relaxed);
    }

    /// Puts the stream on the run queue unless it is there already.
    fn schedule(self: &Arc<Self>, runs: &Sender<Arc<Stream>>) {
        if !self.scheduled.swap(true, Ordering::SeqCst) {
            // A closed run queue means the pool is shutting down: nothing left to do.
            let _ = runs.send(self.clone());
        }
    }
}

impl Drop for Stream {
    /// What its inbox still held goes back to the pool (the replica left).
    fn drop(&mut self) {
        self.budget.held.fetch_sub(*self.bytes.get_mut(), Ordering::Relaxed);
    }
}

/// The reader's side of a replica's inbox.
struct Inbox {
    tx: SyncSender<Message>,
    stream: Arc<Stream>,
    runs: Sender<Arc<Stream>>,
}

/// A pool's ingest workers: where readers schedule their replicas' streams.
#[derive(Debug, Clone)]
pub struct Ingesters {
    runs: Sender<Arc<Stream>>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("replica", &self.replica).finish_non_exhaustive()
    }
}

impl Ingesters {
    /// Starts `workers` ingest workers for `pool`; they run until `stop` is set.
    pub fn spawn(
        ctx: &zmq::Context,
        pool: &Pool,
        applier: &Applier,
        workers: usize,
        stop: &Arc<AtomicBool>,
    ) -> std::io::Result<(Ingesters, Vec<JoinHandle<()>>)> {
        let (runs, queue) = channel::<Arc<Stream>>();
        let queue = Arc::new(Mutex::new(queue));
        let threads = (0..workers.max(1))
            .map(|w| {
                let (ctx, queue, runs, applier, stop) =
                    (ctx.clone(), queue.clone(), runs.clone(), applier.clone(), stop.clone());
                std::thread::Builder::new().name(format!("kv-ingest-{}-{w}", pool.config().model)).spawn(move || {
                    give_way_to_routing();
                    work(&ctx, &queue, &runs, &applier, &stop);
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok((Ingesters { runs }, threads))
    }
}

/// A pool's reader: one thread that waits on every replica's SUB socket at once and moves
/// each message into its replica's inbox. Replicas are added with [`Readers::add`] and leave
/// when their stop flag is set.
pub struct Readers {
    added: Sender<(Source, Inbox)>,
    /// Wakes the reader to take up a new replica or drop one that left (a PAIR socket).
    wake: Mutex<zmq::Socket>,
    runs: Sender<Arc<Stream>>,
    /// What the pool's inboxes hold together.
    budget: Arc<Budget>,
}

impl Readers {
    /// Starts the reader thread of `pool`; it runs until `stop` is set. Its replicas' ingestion
    /// runs on `ingesters`.
    pub fn spawn(
        ctx: &zmq::Context,
        pool: Arc<Pool>,
        metrics: Arc<Metrics>,
        ingesters: &Ingesters,
        stop: &Arc<AtomicBool>,
    ) -> std::io::Result<(Readers, JoinHandle<()>)> {
        static READERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let endpoint = format!("inproc://kv-readers-{}", READERS.fetch_add(1, Ordering::Relaxed));
        let pair = |bind: bool| -> zmq::Result<zmq::Socket> {
            let socket = ctx.socket(zmq::PAIR)?;
            socket.set_linger(0)?;
            if bind {
                socket.bind(&endpoint)?;
            } else {
                socket.connect(&endpoint)?;
            }
            Ok(socket)
        };
        let (woken, wake) = (pair(true)?, pair(false)?);
        let (added, sources) = channel();
        let stop = stop.clone();
        let name = format!("kv-read-{}", pool.config().model);
        let poll = mio::Poll::new()?;
        poll.registry().register(&mut SourceFd(&woken.as_raw_fd()), WOKEN, mio::Interest::READABLE)?;
        let reader = Reader {
            contexts: Contexts::default(),
            pool,
            metrics,
            woken,
            sources,
            subscriptions: HashMap::new(),
            next_key: 0,
            poll,
            pending: HashSet::new(),
            swept: Instant::now(),
        };
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            give_way_to_routing();
            reader.run(&stop);
        })?;
        let readers = Readers {
            added,
            wake: Mutex::new(wake),
            runs: ingesters.runs.clone(),
            budget: Budget::new(POOL_INBOX_BYTES),
        };
        Ok((readers, thread))
    }

    /// Starts reading `source`'s events into `pool`.
    pub fn add(&self, pool: &Pool, source: Source) {
        let (tx, rx) = sync_channel::<Message>(INBOX_MESSAGES);
        // A snapshot a peer handed over is restored before the stream's first message; its
        // ingestion resumes after it.
        let block_size = pool.config().block_size as usize;
        let ingest = match pool.restore(source.replica) {
            Some(seq) => Ingest::resume(block_size, seq),
            None => Ingest::new(block_size),
        };
        let stream = Arc::new(Stream {
            replica: source.replica,
            stop: source.stop.clone(),
            replay: source.config.kv_replay.clone(),
            queued: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            budget: self.budget.clone(),
            scheduled: AtomicBool::new(false),
            state: Mutex::new(StreamState { inbox: rx, ingest }),
        });
        if let Err(SendError((source, _))) = self.added.send((source, Inbox { tx, stream, runs: self.runs.clone() })) {
            // The reader stops at shutdown; any other time it would have died, and its
            // replicas' health (stalled, no credit) shows it too.
            tracing::error!(replica = %source.config.id, "the pool's KV-event reader has stopped; this replica's events will not be read");
        }
        self.wake();
    }

    /// Has the reader look at its replicas again now (one may have left the pool).
    pub fn wake(&self) {
        // A full pipe already holds a wake-up the reader has yet to see.
        let _ = self.wake.lock().unwrap_or_else(|e| e.into_inner()).send(&b""[..], zmq::DONTWAIT);
    }
}

/// Replicas whose sockets share one ZMQ context. libzmq allows 1 023 sockets a context
/// (`ZMQ_MAX_SOCKETS`, which this binding cannot raise) and a replica takes three: its SUB,
/// the monitor's PAIR and the PAIR libzmq monitors through. Each context also runs its own
/// I/O thread, so a large fleet's connections are served by several.
const REPLICAS_PER_CONTEXT: usize = 256;

/// The ZMQ contexts a reader opens its replicas' sockets in, and how many replicas each holds.
#[derive(Default)]
struct Contexts {
    all: Vec<(zmq::Context, usize)>,
}

impl Contexts {
    /// A context with room for one more replica, and its number.
    fn take(&mut self) -> (usize, zmq::Context) {
        let i = match self.all.iter().position(|(_, n)| *n < REPLICAS_PER_CONTEXT) {
            Some(i) => i,
            None => {
                self.all.push((zmq::Context::new(), 0));
                self.all.len() - 1
            }
        };
        self.all[i].1 += 1;
        (i, self.all[i].0.clone())
    }

    /// A replica's sockets in context `i` are closed.
    fn give_back(&mut self, i: usize) {
        self.all[i].1 -= 1;
    }
}

/// The reader thread's state.
struct Reader {
    contexts: Contexts,
    pool: Arc<Pool>,
    metrics: Arc<Metrics>,
    woken: zmq::Socket,
    sources: Receiver<(Source, Inbox)>,
    /// Every replica read, by its key (its tokens in `poll` are `2 key` and `2 key + 1`).
    subscriptions: HashMap<usize, Subscription>,
    next_key: usize,
    /// The sockets' signalling descriptors, registered edge-triggered.
    poll: mio::Poll,
    /// Subscriptions to read in the next round whether or not their sockets signal: more was
    /// waiting than a turn takes, or they were just opened.
    pending: HashSet<usize>,
    /// When every subscription was last looked at.
    swept: Instant,
}

/// The token of the wake-up socket.
const WOKEN: mio::Token = mio::Token(usize::MAX);

/// One replica the reader reads.
struct Subscription {
    source: Source,
    inbox: Inbox,
    /// Its sockets, or when to try opening them again.
    sockets: Result<Sockets, Instant>,
}

/// A replica's SUB socket and the monitor of its connection, and the context they are in.
struct Sockets {
    sub: zmq::Socket,
    monitor: zmq::Socket,
    context: usize,
}

/// What to look at on one subscription.
#[derive(Clone, Copy, Default)]
struct Ready {
    message: bool,
    monitor: bool,
}

/// What reading a subscription left.
enum Read {
    /// Nothing waiting.
    Drained,
    /// More messages than a turn takes: read again in the next round.
    More,
    /// The replica left (or its ingestion has gone): drop it.
    Gone,
    /// A receive failed: close the sockets, to be opened again at the next sweep.
    Failed,
}

impl Reader {
    /// Waits on the signalling descriptors of every replica's sockets and reads only those
    /// that signal (or still hold messages from the last round): a round costs what is ready,
    /// not what is subscribed. ZMQ's descriptors signal on an edge, so a socket is read until
    /// it says nothing is waiting, or put in `pending`; and every [`POLL`] each socket is
    /// asked once more, so a missed edge delays a message by at most that.
    fn run(mut self, stop: &AtomicBool) {
        let mut events = mio::Events::with_capacity(1024);
        self.sweep();
        while !stop.load(Ordering::Relaxed) {
            let timeout = if self.pending.is_empty() { POLL } else { Duration::ZERO };
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                // A signal (SIGHUP reloads the config) interrupts the wait: nothing failed.
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::warn!(error = %e, "KV-event poll failed; polling again");
                    std::thread::sleep(POLL);
                }
                continue;
            }
            let mut ready: HashMap<usize, Ready> =
                self.pending.drain().map(|k| (k, Ready { message: true, monitor: false })).collect();
            let mut woken = false;
            for event in &events {
                if event.token() == WOKEN {
                    woken = true;
                    continue;
                }
                let r = ready.entry(event.token().0 / 2).or_default();
                if event.token().0 % 2 == 0 {
                    r.message = true;
                } else {
                    r.monitor = true;
                }
            }
            if woken || self.swept.elapsed() >= POLL {
                while self.woken.recv_bytes(zmq::DONTWAIT).is_ok() {}
                self.sweep();
                ready.extend(self.pending.drain().map(|k| (k, Ready { message: true, monitor: true })));
            }
            for (key, r) in ready {
                let Some(s) = self.subscriptions.get_mut(&key) else { continue };
                match s.read(&self.pool, &self.metrics, r) {
                    Read::Drained => {}
                    Read::More => {
                        self.pending.insert(key);
                    }
                    Read::Gone => self.drop_subscription(key),
                    Read::Failed => s.close(&self.poll, &mut self.contexts),
                }
            }
        }
    }

    /// Takes up new replicas, drops those that left, opens closed sockets that are due, and
    /// marks every open subscription to be read this round.
    fn sweep(&mut self) {
        self.swept = Instant::now();
        while let Ok((source, inbox)) = self.sources.try_recv() {
            let key = self.next_key;
            self.next_key += 1;
            self.subscriptions.insert(key, Subscription { source, inbox, sockets: Err(Instant::now()) });
        }
        let left: Vec<usize> =
            self.subscriptions.iter().filter(|(_, s)| s.source.stop.load(Ordering::Relaxed)).map(|(k, _)| *k).collect();
        for key in left {
            self.drop_subscription(key);
        }
        for (&key, s) in &mut self.subscriptions {
            if s.sockets.is_err() && s.open_when_due(&mut self.contexts) {
                s.register(&self.poll, key);
            }
            if s.sockets.is_ok() {
                self.pending.insert(key);
            }
        }
    }

    fn drop_subscription(&mut self, key: usize) {
        if let Some(mut s) = self.subscriptions.remove(&key) {
            s.close(&self.poll, &mut self.contexts);
        }
        self.pending.remove(&key);
    }
}

impl Subscription {
    /// Opens the replica's sockets if they are closed and it is time to try; true if they
    /// were opened.
    fn open_when_due(&mut self, contexts: &mut Contexts) -> bool {
        let Err(due) = self.sockets else { return false };
        if Instant::now() < due {
            return false;
        }
        let config = &self.source.config;
        let (context, ctx) = contexts.take();
        let opened = open_sub(&ctx, config)
            .and_then(|sub| Ok(Sockets { monitor: monitor(&ctx, &sub, &config.id)?, sub, context }));
        if opened.is_err() {
            contexts.give_back(context);
        }
        self.sockets = opened.map_err(|e| {
            tracing::warn!(endpoint = %config.kv_events, error = %e, "cannot open the KV-event socket; retrying");
            Instant::now() + Duration::from_secs(1)
        });
        self.sockets.is_ok()
    }

    /// Has `poll` wake the reader when either socket signals.
    fn register(&self, poll: &mio::Poll, key: usize) {
        let Ok(sockets) = &self.sockets else { return };
        for (socket, token) in [(&sockets.sub, 2 * key), (&sockets.monitor, 2 * key + 1)] {
            let fd = socket.as_raw_fd();
            if let Err(e) = poll.registry().register(&mut SourceFd(&fd), mio::Token(token), mio::Interest::READABLE) {
                // Still read at every sweep, at most [`POLL`] late.
                tracing::warn!(replica = %self.source.config.id, error = %e, "cannot wait on the KV-event socket");
            }
        }
    }

    /// Closes the sockets, once `poll` no longer waits on them; the next sweep opens them
    /// again if the replica is still read.
    fn close(&mut self, poll: &mio::Poll, contexts: &mut Contexts) {
        let Ok(sockets) = std::mem::replace(&mut self.sockets, Err(Instant::now())) else { return };
        for socket in [&sockets.sub, &sockets.monitor] {
            // Not registered (it failed) is the only error, and then there is nothing to undo.
            let _ = poll.registry().deregister(&mut SourceFd(&socket.as_raw_fd()));
        }
        contexts.give_back(sockets.context);
    }

    /// Handles what `ready` says may be waiting: a disconnection, and up to [`TURN`]
    /// messages moved into the inbox. [`Read::Gone`] once the replica has left (its slot may
    /// already hold a newcomer, which must not see this engine's events) or its ingestion
    /// has gone.
    fn read(&mut self, pool: &Pool, metrics: &Metrics, ready: Ready) -> Read {
        let replica = self.source.replica;
        if self.source.stop.load(Ordering::Relaxed) {
            return Read::Gone;
        }
        let Ok(sockets) = &self.sockets else { return Read::Drained };
        if ready.monitor && disconnected(&sockets.monitor) {
            pool.publisher_disconnected(replica);
        }
        if !ready.message {
            return Read::Drained;
        }
        for _ in 0..TURN {
            let frames = match sockets.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => return Read::Drained,
                Err(e) => {
                    tracing::warn!(error = %e, "KV-event receive failed; reopening");
                    return Read::Failed;
                }
            };
            let [_topic, seq, payload] = <[Vec<u8>; 3]>::try_from(frames).unwrap_or_default();
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
                metrics.dropped(&pool.labels(replica), "bad_frames");
                continue;
            };
            let (len, stream) = (payload.len(), &self.inbox.stream);
            // Counted before it is sent, so a worker never sees a message it was not told of.
            if !stream.hold(len) {
                metrics.dropped(&pool.labels(replica), "inbox_full");
                continue;
            }
            stream.queued.fetch_add(1, Ordering::SeqCst);
            match self.inbox.tx.try_send((seq, payload)) {
                Ok(()) => stream.schedule(&self.inbox.runs),
                Err(TrySendError::Full(_)) => {
                    stream.release(len);
                    stream.queued.fetch_sub(1, Ordering::SeqCst);
                    metrics.dropped(&pool.labels(replica), "inbox_full");
                }
                Err(TrySendError::Disconnected(_)) => return Read::Gone,
            }
        }
        Read::More
    }
}

fn open_sub(ctx: &zmq::Context, r: &ReplicaConfig) -> zmq::Result<zmq::Socket> {
    let socket = ctx.socket(zmq::SUB)?;
    socket.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    socket.set_rcvhwm(SOCKET_MESSAGES)?;
    socket.set_linger(0)?;
    socket.set_subscribe(r.kv_events_topic.as_bytes())?;
    match r.kv_events_mode {
        EventsMode::Connect => socket.connect(&r.kv_events)?,
        EventsMode::Bind => socket.bind(&r.kv_events)?,
    }
    Ok(socket)
}

/// A monitor of `socket`'s disconnections, on a PAIR socket.
fn monitor(ctx: &zmq::Context, socket: &zmq::Socket, name: &str) -> zmq::Result<zmq::Socket> {
    static MONITORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let endpoint = format!("inproc://kv-monitor-{name}-{}", MONITORS.fetch_add(1, Ordering::Relaxed));
    socket.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED.to_raw().into())?;
    let events = ctx.socket(zmq::PAIR)?;
    events.set_linger(0)?;
    events.connect(&endpoint)?;
    Ok(events)
}

/// Whether the monitor reported a disconnection (reads every pending monitor event).
fn disconnected(monitor: &zmq::Socket) -> bool {
    let mut dropped = false;
    while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
        let event = frames.first().and_then(|f| f.get(..2)).map(|b| u16::from_le_bytes([b[0], b[1]]));
        dropped |= event == Some(zmq::SocketEvent::DISCONNECTED.to_raw());
    }
    dropped
}

/// An ingest worker: runs scheduled streams, a turn at a time, until `stop`.
fn work(
    ctx: &zmq::Context,
    queue: &Mutex<Receiver<Arc<Stream>>>,
    runs: &Sender<Arc<Stream>>,
    applier: &Applier,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Relaxed) {
        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).recv_timeout(POLL);
        let stream = match next {
            Ok(stream) => stream,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if !turn(ctx, &stream, applier) {
            return;
        }
        // Unscheduled first, then checked: a message the reader counted after the last
        // receive is seen here, or the reader saw the flag clear and scheduled it itself.
        stream.scheduled.store(false, Ordering::SeqCst);
        if stream.queued.load(Ordering::SeqCst) > 0 && !stream.stop.load(Ordering::Relaxed) {
            stream.schedule(runs);
        }
    }
}

/// Ingests up to [`TURN`] of a stream's messages. False once the applier has stopped.
fn turn(ctx: &zmq::Context, stream: &Stream, applier: &Applier) -> bool {
    let mut state = stream.state.lock().unwrap_or_else(|e| e.into_inner());
    let StreamState { inbox, ingest } = &mut *state;
    for _ in 0..TURN {
        if stream.stop.load(Ordering::Relaxed) {
            break;
        }
        let Ok((seq, payload)) = inbox.try_recv() else { break };
        stream.queued.fetch_sub(1, Ordering::SeqCst);
        stream.release(payload.len());
        // Decoding and replay take as long as they take: no lock is held here.
        let planned = match &stream.replay {
            Some(endpoint) => ingest.on_message(seq, &payload, &mut Dealer { ctx, endpoint }),
            None => ingest.on_message(seq, &payload, &mut NoReplay),
        };
        let job = Job { replica: stream.replica, stop: stream.stop.clone(), planned, progress: ingest.progress() };
        if !applier.send(job) {
            return false;
        }
    }
    true
}

/// Replay over a DEALER socket.
struct Dealer<'a> {
    ctx: &'a zmq::Context,
    endpoint: &'a str,
}

impl Replay for Dealer<'_> {
    fn replay(&mut self, start: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        replay(self.ctx, self.endpoint, start).map_err(|e| e.to_string())
    }
}

/// Fetches the messages an engine still buffers from `start` on.
pub fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> anyhow::Result<Vec<(u64, Vec<u8>)>> {
    let socket = ctx.socket(zmq::DEALER)?;
    socket.set_linger(0)?;
    socket.set_rcvtimeo(REPLAY_TIMEOUT.as_millis() as i32)?;
    socket.set_maxmsgsize(MAX_MESSAGE_BYTES)?;
    socket.connect(endpoint)?;
    socket.send_multipart([&b""[..], &start.to_be_bytes()], 0)?;
    let deadline = std::time::Instant::now() + REPLAY_TIMEOUT;
    let (mut out, mut bytes) = (Vec::new(), 0usize);
    loop {
        if std::time::Instant::now() > deadline || out.len() > REPLAY_MAX_MESSAGES || bytes > REPLAY_MAX_BYTES {
            anyhow::bail!("replay from {endpoint} did not finish within its bounds");
        }
        let frames = socket.recv_multipart(0)?;
        let frames: Vec<&Vec<u8>> = frames.iter().skip_while(|f| f.is_empty()).collect();
        let (seq, payload) = match frames.as_slice() {
            // Leading empty frames (delimiter, empty topic) are stripped above.
            [seq, payload] | [_, seq, payload] => (seq, payload),
            _ => anyhow::bail!("replay reply with {} frames", frames.len()),
        };
        let seq = <[u8; 8]>::try_from(seq.as_slice())
            .map(u64::from_be_bytes)
            .map_err(|_| anyhow::anyhow!("bad replay seq"))?;
        if seq == u64::MAX && payload.is_empty() {
            return Ok(out);
        }
        bytes += payload.len();
        out.push((seq, payload.to_vec()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(budget: &Arc<Budget>) -> Stream {
        let (_, inbox) = sync_channel(1);
        Stream {
            replica: ReplicaIdx::new(0),
            stop: Arc::default(),
            replay: None,
            queued: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            budget: budget.clone(),
            scheduled: AtomicBool::new(false),
            state: Mutex::new(StreamState { inbox, ingest: Ingest::new(16) }),
        }
    }

    #[test]
    fn the_pools_inboxes_share_one_bound_and_a_replica_that_leaves_frees_its_share() {
        let budget = Budget::new(100);
        let (a, b) = (stream(&budget), stream(&budget));
        assert!(a.hold(60));
        assert!(!b.hold(50), "the pool holds 60 of 100");
        assert!(b.hold(40));
        a.release(60);
        assert!(b.hold(50), "what a worker took is room again");
        drop(b);
        assert_eq!(budget.held.load(Ordering::Relaxed), 0, "a stream dropped with a full inbox gives it back");
        let roomy = Budget::new(usize::MAX);
        let c = stream(&roomy);
        assert!(c.hold(INBOX_BYTES));
        assert!(!c.hold(1), "a replica's own share bounds it too");
    }
}
