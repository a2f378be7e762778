//! A TCP proxy in front of a real server that tests can cut and restore, and that counts the
//! statements PostgreSQL clients execute through it (Execute and simple Query messages).
//!
//! Statements, not network flights: sqlx pings every connection when it returns to the pool, a
//! round trip of its own that carries no statement and that no request waits for.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The bytes whose sending loses its reply, and how many more times.
type Armed = (&'static [u8], usize);

#[derive(Clone)]
pub struct Proxy {
    pub addr: SocketAddr,
    down: Arc<AtomicBool>,
    statements: Arc<AtomicU64>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Armed by [`Proxy::lose_replies_to`]: the bytes whose next sendings lose their reply,
    /// and how many more times.
    lose: Arc<Mutex<Option<Armed>>>,
    lost: Arc<AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let proxy = Self {
            addr: listener.local_addr().expect("addr"),
            down: Arc::default(),
            statements: Arc::default(),
            links: Arc::default(),
            lose: Arc::default(),
            lost: Arc::default(),
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if p.down.load(Ordering::SeqCst) {
                    drop(client); // refused while down
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let link = tokio::spawn(relay(client, server, p.clone()));
                p.links.lock().expect("lock").push(link);
            }
        });
        proxy
    }

    /// Cuts every open connection and refuses new ones.
    pub fn cut(&self) {
        self.down.store(true, Ordering::SeqCst);
        for link in self.links.lock().expect("lock").drain(..) {
            link.abort();
        }
    }

    pub fn restore(&self) {
        self.down.store(false, Ordering::SeqCst);
    }

    pub fn statements(&self) -> u64 {
        self.statements.load(Ordering::SeqCst)
    }

    /// The next time a client sends bytes holding `needle` (a statement's text, as a Parse
    /// message carries it), the statement runs, and the reply to its Execute is lost: the
    /// client's connection closes instead. A write that landed, unheard.
    pub fn lose_reply_to(&self, needle: &'static [u8]) {
        self.lose_replies_to(needle, 1);
    }

    /// As [`lose_reply_to`](Self::lose_reply_to), for the next `times` sendings (each on a
    /// connection of its own: the one that sent the last is closed).
    pub fn lose_replies_to(&self, needle: &'static [u8], times: usize) {
        *self.lose.lock().expect("lock") = (times > 0).then_some((needle, times));
    }

    /// How many replies [`lose_reply_to`](Self::lose_reply_to) lost.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::SeqCst)
    }
}

async fn relay(client: TcpStream, server: TcpStream, proxy: Proxy) {
    let (mut client_r, mut client_w) = client.into_split();
    let (mut server_r, mut server_w) = server.into_split();
    let cut = Arc::new(AtomicBool::new(false));
    let (statements, lose, cut_up) = (proxy.statements.clone(), proxy.lose.clone(), cut.clone());
    let upstream = async move {
        let mut parser = FrontendParser::default();
        let mut buf = vec![0u8; 16 * 1024];
        let mut seen = false;
        loop {
            let n = match client_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let executed = parser.feed(&buf[..n]);
            statements.fetch_add(executed, Ordering::SeqCst);
            {
                let mut armed = lose.lock().expect("lock");
                if let Some((needle, times)) = &mut *armed
                    && buf[..n].windows(needle.len()).any(|w| w == *needle)
                {
                    *times -= 1;
                    if *times == 0 {
                        *armed = None;
                    }
                    seen = true;
                }
            }
            // The statement's text goes in its Parse, which sqlx sends before the Execute
            // that runs it: the reply lost is the Execute's, so the statement has run.
            if seen && executed > 0 {
                seen = false;
                cut_up.store(true, Ordering::SeqCst);
            }
            if server_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    let downstream = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match server_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if cut.load(Ordering::SeqCst) {
                // The reply never arrives: the client's side closes.
                proxy.lost.fetch_add(1, Ordering::SeqCst);
                let _ = client_w.shutdown().await;
                return;
            }
            if client_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(upstream, downstream);
}

/// Splits the client's byte stream into PostgreSQL frontend messages and counts those that run a
/// statement: `E` (Execute, extended protocol) and `Q` (simple query).
#[derive(Default)]
struct FrontendParser {
    pending: Vec<u8>,
    started: bool,
}

impl FrontendParser {
    fn feed(&mut self, bytes: &[u8]) -> u64 {
        self.pending.extend_from_slice(bytes);
        let mut count = 0;
        loop {
            if !self.started {
                // Untyped startup packets: length, then a protocol code.
                if self.pending.len() < 8 {
                    return count;
                }
                let len = u32::from_be_bytes(self.pending[..4].try_into().expect("4")) as usize;
                if self.pending.len() < len {
                    return count;
                }
                let code = u32::from_be_bytes(self.pending[4..8].try_into().expect("4"));
                // SSLRequest and GSSENCRequest are followed by another untyped packet.
                self.started = code != 80877103 && code != 80877104;
                self.pending.drain(..len);
                continue;
            }
            if self.pending.len() < 5 {
                return count;
            }
            let len = u32::from_be_bytes(self.pending[1..5].try_into().expect("4")) as usize;
            if self.pending.len() < 1 + len {
                return count;
            }
            if matches!(self.pending[0], b'E' | b'Q') {
                count += 1;
            }
            self.pending.drain(..1 + len);
        }
    }
}
