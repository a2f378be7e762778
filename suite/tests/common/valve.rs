//! [`Valve`]: a TCP proxy in front of a server whose links can be stalled (and thawed), refused
//! or slowed: a replica cut off from its primary, a cluster node that stops answering, a
//! subscription that dies silently.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy in front of a server. Links whose id is in `[frozen_from, frozen_below)` are
/// stalled: what either side sends is held, in order, and delivered once they are thawed (a
/// link stuck behind a congested or flapping path, TCP retransmitting with backoff; a frozen
/// VM that resumes). What a client sends is always read (and held), so a client that closes
/// its socket is seen at once: [`Valve::open`] counts the client sockets still open. New links
/// can be refused (accepted and closed at once), and every reply slowed.
#[derive(Clone)]
pub struct Valve {
    pub addr: SocketAddr,
    pub next: Arc<AtomicU64>,
    pub frozen_from: Arc<AtomicU64>,
    pub frozen_below: Arc<AtomicU64>,
    pub refuse: Arc<AtomicBool>,
    pub delay_ms: Arc<AtomicU64>,
    pub open: Arc<AtomicUsize>,
}

impl Valve {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let valve = Self {
            addr: listener.local_addr().expect("addr"),
            next: Arc::default(),
            frozen_from: Arc::default(),
            frozen_below: Arc::default(),
            refuse: Arc::default(),
            delay_ms: Arc::default(),
            open: Arc::default(),
        };
        let v = valve.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let id = v.next.fetch_add(1, Ordering::SeqCst);
                if v.refuse.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(relay(v.clone(), client, server, id));
            }
        });
        valve
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Links accepted so far, refused ones included (the next one's id).
    pub fn links(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }

    /// Stalls every link made so far.
    pub fn freeze(&self) {
        self.freeze_from(0);
    }

    /// Stalls the links made since `mark` (a [`links`](Self::links) reading).
    pub fn freeze_from(&self, mark: u64) {
        self.frozen_from.store(mark, Ordering::SeqCst);
        self.frozen_below.store(self.links(), Ordering::SeqCst);
    }

    /// Delivers what the stalled links hold, and lets them carry again.
    pub fn thaw(&self) {
        self.frozen_below.store(0, Ordering::SeqCst);
    }

    pub fn frozen(&self, id: u64) -> bool {
        id >= self.frozen_from.load(Ordering::SeqCst)
            && id < self.frozen_below.load(Ordering::SeqCst)
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Refuses new links (accepted and closed at once) while `on`.
    pub fn refusing(&self, on: bool) {
        self.refuse.store(on, Ordering::SeqCst);
    }

    /// Holds every reply `delay` ms.
    pub fn slow(&self, delay: u64) {
        self.delay_ms.store(delay, Ordering::SeqCst);
    }
}

async fn relay(v: Valve, client: TcpStream, server: TcpStream, id: u64) {
    v.open.fetch_add(1, Ordering::SeqCst);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let v1 = v.clone();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
        v1.open.fetch_sub(1, Ordering::SeqCst);
    };
    let v2 = v.clone();
    let up = async move {
        while let Some(chunk) = rx.recv().await {
            while v2.frozen(id) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if sw.write_all(&chunk).await.is_err() {
                return;
            }
        }
        // The client closed: the server sees it after what was held.
        while v2.frozen(id) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = sw.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while v.frozen(id) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let delay = v.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if cw.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(reader, up, down);
}
