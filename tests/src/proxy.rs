//! A TCP proxy between a client and a service (Redis, PostgreSQL) that a test can cut off and
//! restore: a store outage on demand, with the service itself left running.
//!
//! [`Proxy::cut`] closes every open connection and refuses new ones (accepted, then closed at once);
//! [`Proxy::restore`] lets new connections through again. [`Proxy::go_down`] also stops listening,
//! so that connecting is refused as by a server that is down, until [`Proxy::come_back`]. A proxy made by [`Proxy::redis`] also
//! records the name of every command clients send, for tests that count round trips.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A cut-able TCP proxy on 127.0.0.1; stops (closing its connections) when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    up: Arc<AtomicBool>,
    cuts: watch::Sender<u64>,
    commands: Option<Arc<Mutex<Vec<String>>>>,
    /// The task accepting connections, which owns the listener.
    task: Mutex<tokio::task::JoinHandle<()>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.lock().expect("lock").abort();
        self.cuts.send_modify(|n| *n += 1);
    }
}

impl Proxy {
    /// A proxy to `upstream` that forwards bytes as they are.
    pub async fn start(upstream: SocketAddr) -> Self {
        Self::spawn(upstream, None).await
    }

    /// A proxy to the Redis server of `redis_url` (a TCP URL) that also records command names
    /// ([`commands`](Self::commands)).
    pub async fn redis(redis_url: &str) -> Self {
        let client = idem_runtime::redis::Client::open(redis_url).expect("redis url");
        let target = match &client.get_connection_info().addr {
            idem_runtime::redis::ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
            other => panic!("the proxy needs a TCP redis url, got {other:?}"),
        };
        Self::spawn(resolve(&target).await, Some(Arc::default())).await
    }

    async fn spawn(upstream: SocketAddr, commands: Option<Arc<Mutex<Vec<String>>>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let up = Arc::new(AtomicBool::new(true));
        let (cuts, _) = watch::channel(0u64);
        let task = Self::accept(listener, upstream, &up, &cuts, &commands);
        Self {
            addr,
            upstream,
            up,
            cuts,
            commands,
            task: Mutex::new(task),
        }
    }

    /// The task that accepts connections on `listener` and forwards each to `upstream`.
    fn accept(
        listener: TcpListener,
        upstream: SocketAddr,
        up: &Arc<AtomicBool>,
        cuts: &watch::Sender<u64>,
        commands: &Option<Arc<Mutex<Vec<String>>>>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn({
            let (up, cuts, commands) = (up.clone(), cuts.clone(), commands.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    // Subscribe before reading `up`: `cut` clears `up` before it signals, so a
                    // connection either sees `up` cleared here or receives the signal.
                    let mut cut = cuts.subscribe();
                    if !up.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let commands = commands.clone();
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(upstream).await else {
                            return;
                        };
                        // Biased, the cut first: after a cut, no later poll forwards another byte.
                        tokio::select! {
                            biased;
                            _ = cut.changed() => {}
                            _ = pump(client, server, commands) => {}
                        }
                    });
                }
            }
        })
    }

    /// Closes every open connection and stops listening: connecting is refused, as by a server
    /// that is down, until [`come_back`](Self::come_back).
    pub fn go_down(&self) {
        self.task.lock().expect("lock").abort();
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Listens again on the same address.
    pub async fn come_back(&self) {
        let listener = TcpListener::bind(self.addr).await.expect("bind again");
        let task = Self::accept(
            listener,
            self.upstream,
            &self.up,
            &self.cuts,
            &self.commands,
        );
        *self.task.lock().expect("lock") = task;
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://<addr>`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Closes every open connection and refuses new ones until [`restore`](Self::restore). Each open
    /// connection stops at its next step, before forwarding anything more; none is accepted after.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Lets new connections through again.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    /// The names of the commands sent so far, upper case (Redis proxies only; empty otherwise).
    pub fn commands(&self) -> Vec<String> {
        self.commands
            .as_ref()
            .map(|c| c.lock().expect("lock").clone())
            .unwrap_or_default()
    }
}

/// The first address `target` (`host:port`) resolves to.
pub async fn resolve(target: &str) -> SocketAddr {
    tokio::net::lookup_host(target)
        .await
        .expect("resolve")
        .next()
        .expect("an address")
}

async fn pump(client: TcpStream, server: TcpStream, commands: Option<Arc<Mutex<Vec<String>>>>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = async {
        let mut pending = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Some(commands) = &commands {
                pending.extend_from_slice(&buf[..n]);
                let names = take_commands(&mut pending);
                commands.lock().expect("lock").extend(names);
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let replies = async {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
    };
    tokio::select! {
        _ = requests => {}
        _ = replies => {}
    }
}

/// Removes the complete RESP commands (arrays of bulk strings, as clients send them) from the
/// front of `buf` and returns their names in upper case.
fn take_commands(buf: &mut Vec<u8>) -> Vec<String> {
    fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        Some((&buf[at..at + end], at + end + 2))
    }
    fn number(bytes: &[u8]) -> usize {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse().ok())
            .expect("a RESP length")
    }
    let mut names = Vec::new();
    let mut consumed = 0;
    'commands: while let Some((header, mut at)) = line(buf, consumed) {
        assert_eq!(header.first(), Some(&b'*'), "clients send arrays");
        let mut name = None;
        for _ in 0..number(&header[1..]) {
            let Some((len, start)) = line(buf, at) else {
                break 'commands;
            };
            let end = start + number(&len[1..]);
            if buf.len() < end + 2 {
                break 'commands;
            }
            name.get_or_insert_with(|| String::from_utf8_lossy(&buf[start..end]).to_uppercase());
            at = end + 2;
        }
        names.push(name.unwrap_or_default());
        consumed = at;
    }
    buf.drain(..consumed);
    names
}

#[cfg(test)]
mod tests {
    use super::take_commands;

    #[test]
    fn the_proxy_counts_commands_split_across_reads() {
        let wire =
            b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n*3\r\n$7\r\nevalsha\r\n$2\r\nab";
        let mut buf = wire.to_vec();
        assert_eq!(take_commands(&mut buf), ["GET", "PING"]);
        buf.extend_from_slice(b"\r\n$0\r\n\r\n");
        assert_eq!(take_commands(&mut buf), ["EVALSHA"]);
        assert!(buf.is_empty());
    }
}
