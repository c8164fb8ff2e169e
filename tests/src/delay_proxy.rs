//! A TCP proxy on loopback that holds everything a client sends for a fixed delay before
//! passing it on: a slow sidecar, as the filter in Envoy sees it, without any fault-injection
//! knob in the product.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy; it stops when dropped.
pub struct DelayProxy {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    _runtime: tokio::runtime::Runtime,
}

impl DelayProxy {
    /// Listens on a free loopback port and forwards each connection to `127.0.0.1:upstream`,
    /// delaying every chunk the client sends by `delay` (answers flow back at once).
    pub fn start(upstream: u16, delay: Duration) -> anyhow::Result<DelayProxy> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let port = listener.local_addr()?.port();
        runtime.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        let _ = proxy(client, server, delay).await;
                    }
                });
            }
        });
        Ok(DelayProxy { port, _runtime: runtime })
    }
}

async fn proxy(client: TcpStream, server: TcpStream, delay: Duration) -> std::io::Result<()> {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = client_read.read(&mut buf).await?;
            if n == 0 {
                return server_write.shutdown().await;
            }
            tokio::time::sleep(delay).await;
            server_write.write_all(&buf[..n]).await?;
        }
    };
    let downstream = async move { tokio::io::copy(&mut server_read, &mut client_write).await.map(drop) };
    tokio::try_join!(upstream, downstream).map(drop)
}
