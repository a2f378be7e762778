//! Reading the Redis protocol (RESP) a client sends, for proxies that act on one command, and
//! one such proxy.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One RESP command (an array of bulk strings, as redis-rs sends them) at the head of `buf`:
/// its length and its arguments; `None` while incomplete.
pub fn parse_command(buf: &[u8]) -> Option<(usize, Vec<Vec<u8>>)> {
    fn line(buf: &[u8], from: usize) -> Option<(i64, usize)> {
        let end = buf[from..].windows(2).position(|w| w == b"\r\n")? + from;
        let n = std::str::from_utf8(&buf[from..end]).ok()?.parse().ok()?;
        Some((n, end + 2))
    }
    if buf.is_empty() {
        return None;
    }
    if buf[0] != b'*' {
        let end = buf.windows(2).position(|w| w == b"\r\n")?;
        return Some((end + 2, vec![buf[..end].to_vec()]));
    }
    let (n, mut pos) = line(buf, 1)?;
    let mut args = Vec::new();
    for _ in 0..n.max(0) {
        if pos >= buf.len() {
            return None;
        }
        let (len, p) = line(buf, pos + 1)?;
        let len = len.max(0) as usize;
        if buf.len() < p + len + 2 {
            return None;
        }
        args.push(buf[p..p + len].to_vec());
        pos = p + len + 2;
    }
    Some((pos, args))
}

/// A RESP-aware TCP proxy in front of the test Redis that loses the reply to one script's
/// call: the call is forwarded, Redis runs it, and the link is dropped before the reply
/// reaches the store. A write that landed, unheard.
#[derive(Clone)]
pub struct RespProxy {
    pub addr: SocketAddr,
    ctl: Arc<Ctl>,
}

#[derive(Default)]
struct Ctl {
    /// The script SHA whose call is cut, how many matching calls to let through first, and
    /// how many more to cut after it.
    armed: Mutex<Option<(String, usize, usize)>>,
    /// How many calls were cut that way.
    fired: AtomicUsize,
    /// Refuses new connections while set.
    down: AtomicBool,
    links: Mutex<Vec<JoinHandle<()>>>,
}

impl RespProxy {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let proxy = Self {
            addr: listener.local_addr().expect("addr"),
            ctl: Arc::default(),
        };
        let ctl = proxy.ctl.clone();
        let up = upstream();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if ctl.down.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(up).await else {
                    continue;
                };
                let link = tokio::spawn(relay(client, server, ctl.clone()));
                ctl.links.lock().expect("lock").push(link);
            }
        });
        proxy
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// The `skip + 1`-th next call of the script with source `source` is forwarded to Redis,
    /// and its connection is dropped before the reply reaches the store.
    pub fn arm(&self, source: &str, skip: usize) {
        self.arm_times(source, skip, 1);
    }

    /// As [`arm`](Self::arm), for `times` calls in a row (each on the connection the store
    /// makes after the last was dropped).
    pub fn arm_times(&self, source: &str, skip: usize, times: usize) {
        let sha = redis::Script::new(source).get_hash().to_owned();
        *self.ctl.armed.lock().expect("lock") = Some((sha, skip, times.saturating_sub(1)));
    }

    /// How many replies were lost.
    pub fn fired(&self) -> usize {
        self.ctl.fired.load(Ordering::SeqCst)
    }

    /// Cuts every link and refuses new ones.
    pub fn cut(&self) {
        self.ctl.down.store(true, Ordering::SeqCst);
        for link in self.ctl.links.lock().expect("lock").drain(..) {
            link.abort();
        }
    }

    /// Takes new links again.
    pub fn restore(&self) {
        self.ctl.down.store(false, Ordering::SeqCst);
    }
}

/// The test Redis's address, from [`super::redis_url`].
fn upstream() -> SocketAddr {
    use std::net::ToSocketAddrs;
    let url = super::redis_url();
    let host = url
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .unwrap_or("127.0.0.1:6379")
        .to_owned();
    host.to_socket_addrs()
        .expect("resolve")
        .next()
        .expect("an address")
}

async fn relay(client: TcpStream, server: TcpStream, ctl: Arc<Ctl>) {
    let (mut client_r, mut client_w) = client.into_split();
    let (mut server_r, mut server_w) = server.into_split();
    let swallow = Arc::new(AtomicBool::new(false));
    let swallowing = swallow.clone();
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if swallowing.load(Ordering::SeqCst) {
                continue;
            }
            if client_w.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let upstream = async move {
        let mut pending = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = match client_r.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&chunk[..n]);
            while let Some((len, args)) = parse_command(&pending) {
                let command: Vec<u8> = pending.drain(..len).collect();
                let target = {
                    let mut armed = ctl.armed.lock().expect("lock");
                    let hit = match (&mut *armed, args.first(), args.get(1)) {
                        (Some((sha, skip, _)), Some(name), Some(arg))
                            if name.eq_ignore_ascii_case(b"EVALSHA")
                                && arg.eq_ignore_ascii_case(sha.as_bytes()) =>
                        {
                            if *skip == 0 {
                                true
                            } else {
                                *skip -= 1;
                                false
                            }
                        }
                        _ => false,
                    };
                    if hit {
                        match &mut *armed {
                            Some((_, _, more)) if *more > 0 => *more -= 1,
                            _ => *armed = None,
                        }
                    }
                    hit
                };
                if target {
                    swallow.store(true, Ordering::SeqCst);
                    let _ = server_w.write_all(&command).await;
                    // Let Redis run it; then drop the link without relaying its reply.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    ctl.fired.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                if server_w.write_all(&command).await.is_err() {
                    return;
                }
            }
        }
    };
    tokio::select! {
        () = downstream => {}
        () = upstream => {}
    }
}
