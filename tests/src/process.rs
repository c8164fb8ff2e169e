//! Child processes that die with their owner, and waiting on conditions.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running child, killed (and reaped) on drop. Its output goes to a log file.
pub struct Proc {
    name: String,
    child: Option<Child>,
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> anyhow::Result<Proc> {
        if let Some(dir) = log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let out = File::create(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd.spawn().map_err(|e| anyhow::anyhow!("starting {name} ({:?}): {e}", cmd.get_program()))?;
        Ok(Proc { name: name.to_owned(), child: Some(child) })
    }

    /// Kills the process now.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
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

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `n` consecutive free ports (on all interfaces); returns the first. For an engine's HTTP,
/// events and replay ports at fixed offsets, as when several engines share a host.
pub fn free_port_run(n: u16) -> anyhow::Result<u16> {
    for _ in 0..100 {
        let p = free_port()?;
        let held: Vec<_> =
            (0..n).map_while(|i| std::net::TcpListener::bind(("0.0.0.0", p.checked_add(i)?)).ok()).collect();
        if held.len() == usize::from(n) {
            return Ok(p);
        }
    }
    anyhow::bail!("no {n} consecutive free ports found")
}
