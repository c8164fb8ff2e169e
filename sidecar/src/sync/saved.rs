//! The sidecar's view saved to a local file (`state_file`), taken over at its next start when
//! no peer hands one over: a handover to itself, for a sidecar that restarts alone.
//!
//! Without it, a lone sidecar that restarts rebuilds from the engines' replay buffers, which
//! hold only their last messages: every block stored before them is unknown, and so is every
//! later block stored under one of them (a hot system prompt's continuations above all).
//!
//! - **What is saved**: each pool's index, replica by replica, at a known point of its event
//!   stream, and its session bindings: the [`Handover`] a peer would get, without the
//!   bookings (the requests in flight when it is saved end, or not, before the next start).
//!   Saved every `state_save_secs` and once more on shutdown, to a file beside it first and
//!   then renamed over it, so a crash mid-write leaves the previous view whole.
//! - **At start** ([`restore`]): a peer's view is taken first, as it is fresher; otherwise the
//!   saved one. Each replica's stream resumes after its snapshot's message, the gap replayed
//!   from the engine; where the engine no longer buffers it, that replica starts over as it
//!   would without the file (`crate::events::ingest`), so an old file never gives stale
//!   credit. A snapshot is restored only onto the engine it was taken from.
//! - **The format**: [`REQUEST`] (which moves whenever [`Part`]'s encoding does: a file of
//!   another release is not read), when it was saved (ms since the epoch), then each part as
//!   a length and its encoding. A part that cannot be decoded loses only itself; a file cut
//!   short loses the parts past the cut.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::health::Health;
use crate::metrics::Metrics;
use crate::msg::handover::{Handover, HandoverError, Part, REQUEST};
use crate::pool::{Pool, TakenOver};

/// How often the saving thread checks for shutdown.
const POLL: Duration = Duration::from_millis(200);

/// Why a saved view was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file does not start as this release writes it.
    #[error("{0} is not a view saved by this release of kvgate")]
    Release(PathBuf),
    /// Its parts do not make a view.
    #[error("{path}: {source}")]
    Parts {
        /// The file.
        path: PathBuf,
        /// Why.
        source: HandoverError,
    },
}

/// `view`'s bytes as saved at `saved_at`.
pub fn encode(view: Handover, saved_at: SystemTime) -> Vec<u8> {
    let mut bytes = REQUEST.to_vec();
    let ms = saved_at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64;
    bytes.extend_from_slice(&ms.to_le_bytes());
    for part in view.into_parts() {
        match kvgate_shared::codec::encode(&part) {
            Ok(frame) => {
                bytes.extend_from_slice(&(frame.len() as u64).to_le_bytes());
                bytes.extend_from_slice(&frame);
            }
            Err(e) => tracing::warn!(error = %e, "a part of the view is not encodable; not saved"),
        }
    }
    bytes
}

/// The view in `bytes` (as [`encode`] wrote them) and when it was saved, or `None` if they
/// are not of this release. Parts that cannot be decoded are left out.
pub fn decode(bytes: &[u8]) -> Option<(SystemTime, Result<Handover, HandoverError>)> {
    let rest = bytes.strip_prefix(REQUEST)?;
    let (ms, mut rest) = rest.split_first_chunk::<8>()?;
    let saved_at = UNIX_EPOCH + Duration::from_millis(u64::from_le_bytes(*ms));
    let mut parts = Vec::new();
    while let Some((len, after)) = rest.split_first_chunk::<8>() {
        let Some((frame, after)) =
            usize::try_from(u64::from_le_bytes(*len)).ok().and_then(|n| after.split_at_checked(n))
        else {
            tracing::warn!(parts = parts.len(), "the saved view is cut short; the parts before the cut are taken");
            break;
        };
        match kvgate_shared::codec::decode::<Part>(frame) {
            Ok(part) => parts.push(part),
            Err(e) => tracing::warn!(error = %e, "a part of the saved view cannot be read; left out"),
        }
        rest = after;
    }
    Some((saved_at, Handover::from_parts(parts)))
}

/// Saves `pools`' view to `path`, through a file beside it; returns its size.
pub fn save(path: &Path, own_id: &str, pools: &HashMap<String, Arc<Pool>>) -> std::io::Result<usize> {
    let bytes = encode(super::state::export(own_id, pools, Pool::export_view), SystemTime::now());
    let mut beside = path.as_os_str().to_owned();
    beside.push(".new");
    let beside = PathBuf::from(beside);
    let mut file = std::fs::File::create(&beside)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    std::fs::rename(&beside, path)?;
    Ok(bytes.len())
}

/// Has `pools` take the view saved at `path` over (before their event streams start), as
/// they would a peer's. `Ok(None)` when there is no file.
pub fn restore(
    path: &Path,
    own_id: &str,
    pools: &HashMap<String, Arc<Pool>>,
) -> Result<Option<Vec<(String, TakenOver)>>, SavedError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(SavedError::Read { path: path.to_owned(), source }),
    };
    let (saved_at, view) = decode(&bytes).ok_or_else(|| SavedError::Release(path.to_owned()))?;
    let mut view = view.map_err(|source| SavedError::Parts { path: path.to_owned(), source })?;
    // Session bindings age while the sidecar is down, as they would have had it run.
    let down = SystemTime::now().duration_since(saved_at).unwrap_or_default().as_millis() as u64;
    for pool in &mut view.pools {
        for session in &mut pool.sessions {
            session.idle_ms = session.idle_ms.saturating_add(down);
        }
    }
    let taken = super::state::take_over(view, pools, own_id);
    tracing::info!(path = %path.display(), age_s = down / 1000, "took over the view saved before the restart");
    Ok(Some(taken))
}

/// Starts the thread that saves `pools`' view to `path` every `every`, and once more when
/// the sidecar stops.
pub fn spawn(
    path: PathBuf,
    every: Duration,
    own_id: String,
    pools: HashMap<String, Arc<Pool>>,
    metrics: Arc<Metrics>,
    health: &Arc<Health>,
) -> anyhow::Result<JoinHandle<()>> {
    // A save of a large view may take a few seconds on a busy host.
    let worker = health.worker("saved-view", every + Duration::from_secs(60));
    let save_now = move || match save(&path, &own_id, &pools) {
        Ok(bytes) => {
            metrics.saved_view_bytes.set(bytes as i64);
        }
        Err(e) => {
            metrics.saved_view_failures.inc();
            tracing::warn!(path = %path.display(), error = %e, "the view was not saved");
        }
    };
    Ok(std::thread::Builder::new().name("saved-view".into()).spawn(move || {
        let mut last = std::time::Instant::now();
        while !worker.stopping() {
            std::thread::sleep(POLL);
            worker.beat();
            if last.elapsed() >= every {
                save_now();
                last = std::time::Instant::now();
            }
        }
        save_now();
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::handover::{PoolHandover, SessionHandover};
    use crate::msg::sync::SessionKey;

    fn view() -> Handover {
        Handover {
            origin: "a".into(),
            pools: vec![PoolHandover {
                model: "m".into(),
                block_size: 16,
                replicas: Vec::new(),
                bookings: Vec::new(),
                sessions: vec![SessionHandover { key: SessionKey::of("s1"), target: "e0".into(), idle_ms: 5 }],
            }],
        }
    }

    #[test]
    fn a_saved_view_reads_back_with_when_it_was_saved() {
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let (saved_at, read) = decode(&encode(view(), at)).expect("this release's");
        assert_eq!(saved_at, at);
        assert_eq!(read.unwrap(), view());
    }

    #[test]
    fn another_release_or_a_cut_file_loses_what_it_must_and_no_more() {
        let bytes = encode(view(), SystemTime::now());
        let mut other = bytes.clone();
        other[..REQUEST.len()].copy_from_slice(&b"kvgate-handover/0"[..REQUEST.len()]);
        assert!(decode(&other).is_none(), "another release's file is not read");
        assert!(decode(&bytes[..REQUEST.len() + 3]).is_none(), "nor one cut before its time");
        // Cut inside the last part (the pool's sessions): the parts before it are taken.
        let (_, read) = decode(&bytes[..bytes.len() - 2]).unwrap();
        let read = read.unwrap();
        assert_eq!((read.origin.as_str(), read.pools.len()), ("a", 1));
        assert!(read.pools[0].sessions.is_empty(), "{read:?}");
    }

    #[test]
    fn a_part_that_cannot_be_read_loses_only_itself() {
        let frame = |bytes: &[u8]| [&(bytes.len() as u64).to_le_bytes()[..], bytes].concat();
        let part = |p: &Part| frame(&kvgate_shared::codec::encode(p).unwrap());
        let file = [
            REQUEST,
            &0u64.to_le_bytes()[..],
            &part(&Part::From { origin: "a".into() }),
            &frame(&[0xfe; 6]),
            &part(&Part::Pool { model: "m".into(), block_size: 16 }),
        ]
        .concat();
        let (_, read) = decode(&file).unwrap();
        let read = read.unwrap();
        assert_eq!(read.pools.iter().map(|p| (p.model.as_str(), p.block_size)).collect::<Vec<_>>(), [("m", 16)]);
    }
}
