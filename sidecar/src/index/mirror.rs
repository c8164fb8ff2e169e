//! Two copies of a structure, so that readers never wait for the writer.
//!
//! Readers use the *live* copy; the writer changes the *standby* copy and then swaps the two.
//! Every write is logged and, at the start of the next write, replayed on the copy that was
//! live while it was made, so both copies go through the same writes in the same order (the
//! structure must be deterministic: the same writes give the same contents). This is the
//! left-right scheme; here each copy sits behind its own `RwLock`, which keeps it std-only
//! and safe:
//!
//! - A reader loads which copy is live and `try_read`s it. The writer only ever locks the
//!   standby copy, so the lock is free unless the copies were swapped between the load and
//!   the lock — then the reader loads again and finds the other copy free. A reader never
//!   sleeps on the writer (after a few such races in a row, it takes the blocking read).
//! - The writer waits for readers that began on a copy before it became the standby: one
//!   decision at most, tens of microseconds.
//! - Writers are serialised by the log's mutex. A write's cost is twice a single copy's (each
//!   change is applied to both), and the memory is twice a single copy's.
//! - A write that panics leaves the standby copy half-written: it is not made live, and the
//!   next batch rebuilds it from the live copy before writing.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A structure whose writes can be replayed: applying the same ops in the same order to two
/// equal values leaves them equal.
pub trait Absorb {
    /// One write.
    type Op;
    /// What applying it returns.
    type Out;
    /// Applies one write.
    fn absorb(&mut self, op: &Self::Op) -> Self::Out;
}

/// How many times a reader retries after losing a race with a swap before it blocks.
const READ_RETRIES: usize = 8;

/// Two copies of `T`: reads never wait for writes.
pub struct Mirrored<T: Absorb + Clone> {
    copies: [RwLock<T>; 2],
    /// Which copy readers use.
    live: AtomicUsize,
    /// Writes applied to the live copy and not yet to the standby one.
    log: Mutex<Vec<T::Op>>,
    /// A write panicked: the standby copy is half-written and must be rebuilt.
    torn: AtomicBool,
}

impl<T: Absorb + Clone> Mirrored<T> {
    /// Two copies of `value`.
    pub fn new(value: T) -> Self {
        Mirrored {
            copies: [RwLock::new(value.clone()), RwLock::new(value)],
            live: AtomicUsize::new(0),
            log: Mutex::default(),
            torn: AtomicBool::new(false),
        }
    }

    /// The live copy, without waiting for a writer.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        for _ in 0..READ_RETRIES {
            let live = self.live.load(Ordering::Acquire);
            if let Ok(guard) = self.copies[live].try_read() {
                return guard;
            }
        }
        let live = self.live.load(Ordering::Acquire);
        self.copies[live].read().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a batch of writes on the standby copy; they become visible to readers, all at
    /// once, when the batch is dropped.
    pub fn write(&self) -> Batch<'_, T> {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let standby = 1 - self.live.load(Ordering::Acquire);
        let mut copy = self.copies[standby].write().unwrap_or_else(|e| e.into_inner());
        let mut replay = std::mem::take(&mut *log);
        if self.torn.swap(false, Ordering::AcqRel) {
            // The log's writes are in the live copy (if they were made live at all).
            replay.clear();
            copy.clone_from(&self.copies[1 - standby].read().unwrap_or_else(|e| e.into_inner()));
        }
        let mut batch = Batch { copy: Some(copy), log, standby, live: &self.live, torn: &self.torn };
        // Replayed within the batch, so that a replay that panics tears the copy like a write.
        let copy = batch.copy.as_mut().expect("held until drop");
        for op in &replay {
            copy.absorb(op);
        }
        batch
    }
}

/// Writes in progress on the standby copy ([`Mirrored::write`]).
pub struct Batch<'a, T: Absorb + Clone> {
    copy: Option<RwLockWriteGuard<'a, T>>,
    log: MutexGuard<'a, Vec<T::Op>>,
    standby: usize,
    live: &'a AtomicUsize,
    torn: &'a AtomicBool,
}

impl<T: Absorb + Clone> Batch<'_, T> {
    /// Applies one write (readers see it when the batch ends).
    pub fn apply(&mut self, op: T::Op) -> T::Out {
        let out = self.copy.as_mut().expect("held until drop").absorb(&op);
        self.log.push(op);
        out
    }

    /// The standby copy, with this batch's writes.
    pub fn get(&self) -> &T {
        self.copy.as_ref().expect("held until drop")
    }
}

impl<T: Absorb + Clone> Drop for Batch<'_, T> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A write panicked midway: readers keep the live copy, the next batch rebuilds
            // this one from it.
            self.torn.store(true, Ordering::Release);
            self.copy = None;
            return;
        }
        // Unlock the copy before it goes live, so readers that load it find it free; the log
        // (and with it the next writer) is released after the swap.
        self.copy = None;
        self.live.store(self.standby, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[derive(Default, Clone)]
    struct Sum(Vec<u64>);

    /// A structure whose second write ever panics: the first one's replay on the other copy.
    #[derive(Default, Clone)]
    struct PanicsOnReplay(Vec<u64>);

    static ABSORBED: AtomicUsize = AtomicUsize::new(0);

    impl Absorb for PanicsOnReplay {
        type Op = u64;
        type Out = ();
        fn absorb(&mut self, op: &u64) {
            assert_ne!(ABSORBED.fetch_add(1, Ordering::Relaxed), 1, "a replay that panics");
            self.0.push(*op);
        }
    }

    impl Absorb for Sum {
        type Op = u64;
        type Out = usize;
        fn absorb(&mut self, op: &u64) -> usize {
            assert_ne!(*op, u64::MAX, "an op that panics");
            self.0.push(*op);
            self.0.len()
        }
    }

    #[test]
    fn a_batch_that_panics_is_not_shown_and_the_copies_heal() {
        let m = Mirrored::new(Sum::default());
        m.write().apply(1);
        let torn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut batch = m.write();
            batch.apply(2);
            batch.apply(u64::MAX);
        }));
        assert!(torn.is_err());
        assert_eq!(m.read().0, [1], "nothing of the torn batch is visible");
        m.write().apply(3);
        assert_eq!(m.read().0, [1, 3]);
        drop(m.write());
        assert_eq!(m.read().0, [1, 3], "the other copy agrees");
    }

    #[test]
    fn a_replay_that_panics_tears_the_copy_too() {
        let m = Mirrored::new(PanicsOnReplay::default());
        m.write().apply(7);
        let torn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.write().apply(8)));
        assert!(torn.is_err(), "replaying 7 on the other copy panicked");
        assert_eq!(m.read().0, [7], "the torn copy is not shown");
        m.write().apply(9);
        assert_eq!(m.read().0, [7, 9], "rebuilt from the live copy, 7 not applied twice");
        drop(m.write());
        assert_eq!(m.read().0, [7, 9], "the other copy agrees");
    }

    #[test]
    fn readers_see_a_batch_only_once_it_ends_and_both_copies_agree() {
        let m = Mirrored::new(Sum::default());
        let mut batch = m.write();
        assert_eq!(batch.apply(1), 1);
        assert_eq!(batch.apply(2), 2);
        assert!(m.read().0.is_empty(), "a batch in progress is invisible");
        drop(batch);
        assert_eq!(m.read().0, [1, 2]);
        // The next batch starts from the other copy, which first replays 1 and 2.
        let mut batch = m.write();
        assert_eq!(batch.get().0, [1, 2]);
        assert_eq!(batch.apply(3), 3);
        drop(batch);
        assert_eq!(m.read().0, [1, 2, 3]);
        drop(m.write());
        let [a, b] = &m.copies;
        assert_eq!(a.read().unwrap().0, b.read().unwrap().0);
    }

    #[test]
    fn a_reader_holding_a_copy_does_not_stop_other_reads_and_writes() {
        let m = Arc::new(Mirrored::new(Sum::default()));
        m.write().apply(1);
        // A long read of the live copy; the writer takes the other one meanwhile.
        let held = m.read();
        let writer = {
            let m = m.clone();
            std::thread::spawn(move || m.write().apply(2))
        };
        assert_eq!(writer.join().unwrap(), 2);
        assert_eq!(held.0, [1], "the held copy is untouched");
        assert_eq!(m.read().0, [1, 2], "new reads see the write");
        drop(held);
        assert_eq!(m.write().apply(3), 3);
        assert_eq!(m.read().0, [1, 2, 3]);
    }

    #[test]
    fn reads_under_a_stream_of_writes_see_whole_batches() {
        let m = Arc::new(Mirrored::new(Sum::default()));
        let writer = {
            let m = m.clone();
            std::thread::spawn(move || {
                for i in 0..2000u64 {
                    let mut batch = m.write();
                    batch.apply(2 * i);
                    batch.apply(2 * i + 1);
                }
            })
        };
        while !writer.is_finished() {
            let seen = m.read();
            assert_eq!(seen.0.len() % 2, 0, "never half a batch");
            assert!(seen.0.iter().enumerate().all(|(i, v)| *v == i as u64), "in order, none lost");
        }
        writer.join().unwrap();
        assert_eq!(m.read().0.len(), 4000);
    }
}
