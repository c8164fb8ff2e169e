//! Child processes that die with their owner, and waiting on conditions.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A running child, killed (and reaped) on drop. Its output goes to a log file. It can be
/// restarted with the same command line (a crashed engine or sidecar coming back).
pub struct Proc {
    name: String,
    child: Option<Child>,
    program: OsString,
    args: Vec<OsString>,
    envs: Vec<(OsString, Option<OsString>)>,
    log: PathBuf,
    /// Runs in a process group of its own, killed as a whole.
    group: bool,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr written to `log`.
    pub fn spawn(name: &str, cmd: Command, log: &Path) -> anyhow::Result<Proc> {
        Proc::spawn_with(name, cmd, log, false)
    }

    /// Like [`Proc::spawn`], in a process group of its own that [`Proc::kill`] kills whole:
    /// for programs that fork workers holding ports (vLLM's engine core), which would
    /// otherwise outlive a killed parent.
    pub fn spawn_group(name: &str, cmd: Command, log: &Path) -> anyhow::Result<Proc> {
        Proc::spawn_with(name, cmd, log, true)
    }

    fn spawn_with(name: &str, cmd: Command, log: &Path, group: bool) -> anyhow::Result<Proc> {
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut proc = Proc {
            name: name.to_owned(),
            child: None,
            program: cmd.get_program().to_owned(),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
            envs: cmd.get_envs().map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned))).collect(),
            log: log.to_owned(),
            group,
        };
        proc.start(File::create(log)?)?;
        Ok(proc)
    }

    fn start(&mut self, out: File) -> anyhow::Result<()> {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        for (key, value) in &self.envs {
            match value {
                Some(v) => cmd.env(key, v),
                None => cmd.env_remove(key),
            };
        }
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        if self.group {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        let child = cmd.spawn().map_err(|e| anyhow::anyhow!("starting {} ({:?}): {e}", self.name, self.program))?;
        self.child = Some(child);
        Ok(())
    }

    /// Kills the process if it runs, and starts it again with the same command line; its
    /// output is appended to the same log.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let out = OpenOptions::new().append(true).open(&self.log)?;
        self.start(out)
    }

    /// Kills the process now.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if self.group {
                if let Ok(pgid) = i32::try_from(child.id()) {
                    // SAFETY: killpg only sends a signal to the group this process leads.
                    unsafe { libc::killpg(pgid, libc::SIGKILL) };
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!("{} exited early: {status}", self.name);
            }
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `check` every 50 ms until it returns `Some`, or fails after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free TCP port (bound on all interfaces, then released), below the kernel's ephemeral
/// range: between its choice and its use no outgoing connection can take it — a ZMQ socket
/// redialling a peer that is not up yet picks a fresh ephemeral port every 100 ms, and once
/// took a sidecar's handover port that way.
pub fn free_port() -> anyhow::Result<u16> {
    free_port_run(1)
}

/// `n` consecutive free ports (on all interfaces, below the ephemeral range, as
/// [`free_port`]); returns the first. For an engine's HTTP, events and replay ports at fixed
/// offsets, as when several engines share a host.
pub fn free_port_run(n: u16) -> anyhow::Result<u16> {
    anyhow::ensure!(n > 0, "no ports asked for");
    let (low, high) = below_ephemeral();
    let span = u32::from(high - low);
    // Each process starts at its own offset and every claim moves past the ports it tried,
    // so no two claims of a process (nor, mostly, of processes side by side) overlap.
    let start = std::process::id().wrapping_mul(7919);
    for _ in 0..span / u32::from(n) {
        let first = low as u32 + start.wrapping_add(NEXT_PORT.fetch_add(u32::from(n), Ordering::Relaxed)) % span;
        let Some(last) = first.checked_add(u32::from(n)).filter(|end| *end <= u32::from(high)) else { continue };
        let held: Vec<_> =
            (first..last).map_while(|p| std::net::TcpListener::bind(("0.0.0.0", p as u16)).ok()).collect();
        if held.len() == usize::from(n) {
            return Ok(first as u16);
        }
    }
    anyhow::bail!("no {n} consecutive free ports found below {high}")
}

/// How far [`free_port_run`] has gone.
static NEXT_PORT: AtomicU32 = AtomicU32::new(0);

/// Ports [`free_port_run`] chooses from: 10000 (or half the range's start, if lower) up to
/// the start of the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`;
/// Linux's default starts at 32768). A host whose ephemeral range starts too low to leave
/// room gets 32768–60999 (Linux's default range) instead.
fn below_ephemeral() -> (u16, u16) {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    match (10_000.min(start / 2), start) {
        (low, high) if low >= 1024 => (low, high),
        _ => (32_768, 61_000),
    }
}

/// Pins every thread of `pid` to `core` (Linux `taskset`); threads and children it starts
/// later inherit the pinning.
pub fn pin(pid: u32, core: usize) -> anyhow::Result<()> {
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", &core.to_string(), &pid.to_string()])
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "taskset {pid} failed");
    Ok(())
}

/// Sets every thread of `pid` to nice value `nice` (raising a priority needs privilege);
/// threads it starts later inherit the value from the thread that starts them.
#[allow(unsafe_code)]
pub fn renice(pid: u32, nice: i32) -> anyhow::Result<()> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Some(tid) = task?.file_name().to_str().and_then(|t| t.parse::<libc::id_t>().ok()) else { continue };
        // SAFETY: setpriority takes and returns plain integers; no memory is shared.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
            let error = std::io::Error::last_os_error();
            // A thread that ended since the listing is no failure.
            if std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
                anyhow::bail!("renice thread {tid} of {pid}: {error}");
            }
        }
    }
    Ok(())
}

/// A process's resident set size in bytes (`VmRSS` of `/proc/<pid>/status`), if readable.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// CPU time a process has used so far, user and system, in seconds (from `/proc/<pid>/stat`,
/// whose times are in USER_HZ = 100 ticks per second on Linux).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// CPU time, as [`cpu_seconds`], of the threads of `pid` named one of `names` (their `comm`).
pub fn threads_cpu_seconds(pid: u32, names: &[&str]) -> Option<f64> {
    let mut total = 0.0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if names.contains(&comm.trim_end()) {
            total += stat_cpu_seconds(&dir.join("stat").to_string_lossy())?;
        }
    }
    Some(total)
}

/// User and system time in a `/proc/…/stat` file, in seconds.
fn stat_cpu_seconds(path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name may hold spaces: the fields after it start past its closing ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the pid and the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread's nice value (field 19 of `/proc/<pid>/task/<tid>/stat`), if readable.
    fn nice_of(pid: u32, tid: u32) -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
        // The fields after the command name's closing ')': the state is the first, nice the 17th.
        stat.rsplit_once(')')?.1.split_whitespace().nth(16)?.parse().ok()
    }

    #[test]
    fn renice_lowers_every_thread_of_a_running_process() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep runs");
        let pid = child.id();
        let before = nice_of(pid, pid).expect("its nice value is readable");
        let lower = (before + 7).min(19);
        let result = renice(pid, lower);
        let after = nice_of(pid, pid);
        let _ = child.kill();
        let _ = child.wait();
        result.expect("lowering a child's priority needs no privilege");
        assert_eq!(after, Some(lower));
    }

    #[test]
    fn thread_cpu_is_counted_for_the_named_threads_only() {
        let pid = std::process::id();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinner = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("cpu-probe-spin".into())
                .spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
                .expect("a thread")
        };
        let spun = wait_for("the spinning thread's CPU time", Duration::from_secs(20), || {
            threads_cpu_seconds(pid, &["cpu-probe-spin"]).filter(|s| *s >= 0.05)
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spinner.join().expect("the spinner ends");
        assert!(spun.is_ok(), "{spun:?}");
        assert_eq!(threads_cpu_seconds(pid, &["no-such-thread"]), Some(0.0));
    }
}
