//! A sidecar that hangs: a listener on loopback that accepts every connection, reads what is
//! sent and never answers — a sidecar stuck (a deadlock, a stalled process) as the filter in
//! Envoy sees it, without any fault-injection knob in the product. It notes the path of each
//! request, so a test can tell which calls were still made.

use std::sync::{Arc, Mutex};

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

/// A running hung sidecar; it stops (closing every connection) when dropped.
pub struct HungSidecar {
    paths: Arc<Mutex<Vec<String>>>,
    _runtime: tokio::runtime::Runtime,
}

impl HungSidecar {
    /// Listens on `127.0.0.1:port`.
    pub fn listen(port: u16) -> anyhow::Result<HungSidecar> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(TcpListener::bind(("127.0.0.1", port)))?;
        let paths = Arc::new(Mutex::new(Vec::new()));
        let seen = paths.clone();
        runtime.spawn(async move {
            while let Ok((connection, _)) = listener.accept().await {
                tokio::spawn(hold(connection, seen.clone()));
            }
        });
        Ok(HungSidecar { paths, _runtime: runtime })
    }

    /// The path of every request received so far, in order.
    pub fn paths(&self) -> Vec<String> {
        self.paths.lock().map(|p| p.clone()).unwrap_or_default()
    }
}

/// Reads a connection until its client closes it, noting its request's path, answering
/// nothing. A client waits for the answer before it sends another request on the connection
/// (Envoy does not pipeline), so each connection carries at most one request.
async fn hold(mut connection: TcpStream, paths: Arc<Mutex<Vec<String>>>) {
    let mut head = Vec::new();
    let mut noted = false;
    let mut buf = vec![0u8; 16 << 10];
    while let Ok(n @ 1..) = connection.read(&mut buf).await {
        if noted {
            continue;
        }
        head.extend_from_slice(&buf[..n]);
        let Some(end) = head.windows(2).position(|w| w == b"\r\n") else { continue };
        let line = String::from_utf8_lossy(&head[..end]);
        if let (Some(path), Ok(mut paths)) = (line.split_whitespace().nth(1), paths.lock()) {
            paths.push(path.to_owned());
        }
        noted = true;
    }
}
