//! The CPU priority of background threads.
//!
//! A routing decision is on a request's path; applying KV events is not. When the CPU is
//! short (an event storm from many engines on a small gateway pod) the scheduler shares it
//! between every runnable thread alike, and event threads can outnumber the API's: decisions
//! wait to be scheduled, and their tail grows by milliseconds
//! (`docs/benchmarks/contention.md`). Event readers and ingest workers therefore run
//! at a lower priority: they still take every idle cycle, but give way to the API. So does the
//! pool's applier: it writes the standby copy of the index, which no decision waits for
//! (`crate::index::mirror`).
//!
//! On Linux a nice value belongs to one thread (`setpriority(2)` on its thread id); elsewhere
//! this does nothing.

/// How much lower event threads run: nice 10 gives a thread about a tenth of the CPU share of
/// a nice-0 thread competing with it, and all of it when nothing else wants the CPU.
pub const EVENT_THREAD_NICE: i32 = 10;

/// Lowers the calling background thread's priority by [`EVENT_THREAD_NICE`], below the
/// API's; a failure is logged, and the thread runs on at its priority.
pub fn give_way_to_routing() {
    if let Err(e) = lower_this_thread(EVENT_THREAD_NICE) {
        tracing::warn!(error = %e, "cannot lower a background thread's priority; decisions may wait for the CPU under an event storm");
    }
}

/// Lowers the calling thread's priority by `nice` (only ever lower: raising needs privilege).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn lower_this_thread(nice: i32) -> std::io::Result<()> {
    // SAFETY: gettid and setpriority take and return plain integers; no memory is shared.
    let status = unsafe {
        let tid = libc::gettid();
        let current = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, current.saturating_add(nice).min(19))
    };
    if status == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Lowers the calling thread's priority by `nice`: nothing to do on this platform.
#[cfg(not(target_os = "linux"))]
pub fn lower_this_thread(_nice: i32) -> std::io::Result<()> {
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// This thread's nice value, as the kernel reports it.
    fn nice_of_this_thread() -> i32 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        // Field 19 is the nice value; fields after the `(comm)` one are space-separated.
        let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
        after_comm.split(' ').nth(16).unwrap().parse().unwrap()
    }

    #[test]
    fn only_the_calling_thread_is_lowered() {
        let before = nice_of_this_thread();
        let lowered = std::thread::spawn(move || {
            lower_this_thread(EVENT_THREAD_NICE).unwrap();
            nice_of_this_thread()
        })
        .join()
        .unwrap();
        assert_eq!(lowered, (before + EVENT_THREAD_NICE).min(19));
        assert_eq!(nice_of_this_thread(), before, "the spawning thread keeps its priority");
    }
}
