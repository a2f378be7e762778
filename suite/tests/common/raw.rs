//! A raw HTTP/1.1 client: the exact head, body and trailers the server wrote (a connection the
//! server drops without an answer reads as status 0), for tests that compare answers byte for
//! byte.

use std::net::SocketAddr;
use std::time::SystemTime;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::guard;

/// A key no other run of the tests uses.
pub fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{name}-{}-{nanos}", std::process::id())
}

#[derive(Clone, PartialEq)]
pub struct Raw {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, Vec<u8>)>,
}

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
        f.debug_struct("Raw")
            .field("status", &self.status)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(n, v)| (n, text(v)))
                    .collect::<Vec<_>>(),
            )
            .field("body", &text(&self.body))
            .field(
                "trailers",
                &self
                    .trailers
                    .iter()
                    .map(|(n, v)| (n, text(v)))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Raw {
    /// Every value of a header, in order.
    pub fn all(&self, name: &str) -> Vec<&[u8]> {
        self.headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    /// A header's first value.
    pub fn one(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    pub fn replayed(&self) -> bool {
        self.one("idempotency-replayed") == Some(b"true")
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            panic!("a JSON body, got {:?}", String::from_utf8_lossy(&self.body))
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

pub fn header_lines(block: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for line in block.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        let colon = line.iter().position(|&b| b == b':').expect("a header line");
        let name = String::from_utf8_lossy(&line[..colon]).to_ascii_lowercase();
        let value = line[colon + 1..].trim_ascii().to_vec();
        out.push((name, value));
    }
    out
}

pub fn parse_raw(buf: &[u8]) -> Raw {
    let end = find(buf, b"\r\n\r\n").expect("a complete head");
    let head = &buf[..end];
    let mut rest = &buf[end + 4..];
    let first_line_end = find(head, b"\r\n").unwrap_or(head.len());
    let status_line = String::from_utf8_lossy(&head[..first_line_end]).into_owned();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status line {status_line:?}"));
    let headers = header_lines(&head[first_line_end.min(head.len())..]);
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && find(v, b"chunked").is_some());
    let mut body = Vec::new();
    let mut trailers = Vec::new();
    if chunked {
        while let Some(line_end) = find(rest, b"\r\n") {
            let size_text = String::from_utf8_lossy(&rest[..line_end]).into_owned();
            let size_text = size_text.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size_text, 16).expect("a hex chunk size");
            rest = &rest[line_end + 2..];
            if size == 0 {
                let block_end = find(rest, b"\r\n\r\n").map_or(rest.len(), |i| i + 2);
                if !rest.starts_with(b"\r\n") {
                    trailers = header_lines(&rest[..block_end]);
                }
                break;
            }
            body.extend_from_slice(&rest[..size.min(rest.len())]);
            rest = &rest[(size + 2).min(rest.len())..];
        }
    } else if let Some((_, len)) = headers.iter().find(|(n, _)| n == "content-length") {
        let len: usize = String::from_utf8_lossy(len).parse().expect("length");
        body.extend_from_slice(&rest[..len.min(rest.len())]);
    } else {
        body.extend_from_slice(rest);
    }
    Raw {
        status,
        headers,
        body,
        trailers,
    }
}

/// One POST on a connection of its own, read to the connection's close.
pub async fn raw_post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Raw {
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
    raw_post_bytes(addr, path, &headers, body).await
}

/// [`raw_post`] with header values as raw bytes (obs-text, which `&str` cannot carry).
pub async fn raw_post_bytes(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Raw {
    guard("a raw request", async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: {addr}\r\nte: trailers\r\nconnection: close\r\n\
             content-length: {}\r\n",
            body.len()
        )
        .into_bytes();
        for (name, value) in headers {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        stream.write_all(&head).await.expect("write");
        stream.write_all(body).await.expect("write");
        let mut buf = Vec::new();
        // A connection the server drops without an answer reads as empty.
        let _ = stream.read_to_end(&mut buf).await;
        if buf.is_empty() {
            return Raw {
                status: 0,
                headers: Vec::new(),
                body: Vec::new(),
                trailers: Vec::new(),
            };
        }
        parse_raw(&buf)
    })
    .await
}
