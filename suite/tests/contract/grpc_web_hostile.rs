//! Issue 19 §4 and §5, attacked over gRPC-Web: hostile and unusual answers, classified by
//! the trailer frame the way the client reads it. Crafted gRPC-Web bodies from an axum handler
//! (HTTP/1.1) behind the layer; tonic's gRPC-Web client over hyper's legacy client, raw
//! reqwest calls for text and for bodies no client library reads.

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::{Effects, grpc_frame_flagged as frame, gunzip, gzip};
use http::uri::PathAndQuery;
use hyper_util::rt::TokioExecutor;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower_idempotency::{CachePolicy, IdempotencyLayer, IdempotencyStore, MemoryStore, ScopedKey};

#[derive(Clone, PartialEq, prost::Message)]
struct Note {
    #[prost(string, tag = "1")]
    text: String,
}

fn note(text: &str) -> Vec<u8> {
    frame(
        0,
        &prost::Message::encode_to_vec(&Note {
            text: text.to_owned(),
        }),
    )
}

fn encode_base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn decode_base64(text: &[u8]) -> Vec<u8> {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    assert_eq!(text.len() % 4, 0, "whole groups");
    let mut out = Vec::new();
    for group in text.chunks(4) {
        let real: Vec<u32> = group
            .iter()
            .take_while(|&&c| c != b'=')
            .map(|c| A.iter().position(|a| a == c).expect("base64") as u32)
            .collect();
        let n = real.iter().fold(0u32, |n, v| (n << 6) | v) << (6 * (4 - real.len()));
        out.extend_from_slice(&n.to_be_bytes()[1..real.len()]);
    }
    out
}

/// What a crafted handler answers: headers, and its body as chunks with a pause before each.
#[derive(Clone, Default)]
struct Script {
    headers: Vec<(&'static str, String)>,
    chunks: Vec<(Duration, Bytes)>,
}

impl Script {
    fn binary(chunks: Vec<Vec<u8>>) -> Self {
        Self {
            headers: vec![("content-type", "application/grpc-web+proto".into())],
            chunks: chunks
                .into_iter()
                .map(|c| (Duration::ZERO, Bytes::from(c)))
                .collect(),
        }
    }
}

/// An axum app answering every POST with `script`, counting its runs; the layer around it.
async fn serve_script(
    script: Script,
    limit: Option<usize>,
    policy: CachePolicy,
    store: MemoryStore,
) -> (SocketAddr, Effects) {
    let effects = Effects::default();
    let sink = effects.clone();
    let mut layer = IdempotencyLayer::new(store)
        .single_tenant()
        .cache_policy(policy);
    if let Some(limit) = limit {
        layer = layer.response_limit(limit);
    }
    let app = axum::Router::new()
        .route(
            "/w.W/Call",
            axum::routing::post(move |_body: Bytes| {
                let script = script.clone();
                let sink = sink.clone();
                async move {
                    sink.hit();
                    let stream = futures_util::stream::unfold(
                        script.chunks.into_iter(),
                        |mut it| async move {
                            let (pause, chunk) = it.next()?;
                            if !pause.is_zero() {
                                tokio::time::sleep(pause).await;
                            }
                            Some((Ok::<_, Infallible>(chunk), it))
                        },
                    );
                    let mut res = http::Response::new(axum::body::Body::from_stream(stream));
                    for (name, value) in script.headers {
                        res.headers_mut()
                            .append(name, http::HeaderValue::from_str(&value).expect("v"));
                    }
                    res
                }
            }),
        )
        .route_layer(layer);
    (common::serve(app).await, effects)
}

/// One call from tonic's gRPC-Web client (binary, HTTP/1.1), on a connection of its own.
async fn web_call(addr: SocketAddr, key: &str) -> Result<tonic::Response<Note>, Status> {
    let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http::<tonic_web::GrpcWebCall<tonic::body::Body>>();
    let service = tower::ServiceBuilder::new()
        .layer(tonic_web::GrpcWebClientLayer::new())
        .service(http);
    let origin = format!("http://{addr}").parse().expect("origin");
    let mut grpc = tonic::client::Grpc::with_origin(service, origin);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(Note {
        text: "take a note".into(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().expect("ascii"));
    let call = grpc.unary(
        request,
        PathAndQuery::from_static("/w.W/Call"),
        ProstCodec::default(),
    );
    tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("the call hung")
}

/// A raw call: the answer's head and body as sent.
async fn raw_call(
    addr: SocketAddr,
    key: &str,
    content_type: &str,
    accept: Option<&str>,
    accept_encoding: Option<&str>,
) -> (reqwest::StatusCode, http::HeaderMap, Bytes) {
    let body = match content_type.starts_with("application/grpc-web-text") {
        true => Bytes::from(encode_base64(&note("take a note"))),
        false => Bytes::from(note("take a note")),
    };
    let mut req = common::client()
        .post(format!("http://{addr}/w.W/Call"))
        .header("content-type", content_type)
        .header("idempotency-key", key)
        .body(body);
    if let Some(accept) = accept {
        req = req.header("accept", accept);
    }
    if let Some(ae) = accept_encoding {
        req = req.header("accept-encoding", ae);
    }
    let res = req.send().await.expect("call");
    let status = res.status();
    let headers = res.headers().clone();
    let body = res.bytes().await.expect("body");
    (status, headers, body)
}

/// The status a gRPC-Web client reads in an answer: the headers' (trailers-only), else the last
/// `grpc-status` line of the trailer frame (tonic-web's client keeps the last).
fn web_status(headers: &http::HeaderMap, body: &[u8]) -> Option<String> {
    if let Some(s) = headers.get("grpc-status") {
        return Some(s.to_str().expect("ascii").to_owned());
    }
    let binary = match headers
        .get("content-type")
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc-web-text"))
    {
        true => decode_base64(body),
        false => body.to_vec(),
    };
    let mut rest = &binary[..];
    let mut status = None;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let payload = &rest[5..(5 + len).min(rest.len())];
        if rest[0] == 0x80 {
            for line in String::from_utf8_lossy(payload).split("\r\n") {
                if let Some(v) = line.strip_prefix("grpc-status:") {
                    status = Some(v.trim().to_owned());
                }
            }
        }
        rest = &rest[(5 + len).min(rest.len())..];
    }
    status
}

/// Two `grpc-status` lines in the trailer frame: tonic-web's client keeps the last (it
/// `insert`s each line), the layer reads the first. The client sees OK; is the key kept?
#[tokio::test]
async fn s19_4_duplicate_status_lines_are_read_as_the_client_reads_them() {
    let script = Script::binary(vec![
        note("done"),
        frame(0x80, b"grpc-status:14\r\ngrpc-status:0\r\n"),
    ]);
    let (addr, effects) = serve_script(
        script,
        None,
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    let first = web_call(addr, "dup-1").await;
    let saw = first.as_ref().map(|r| r.get_ref().text.clone());
    let second = web_call(addr, "dup-1").await;
    eprintln!(
        "first {saw:?}; second {:?}; effects {}",
        second.as_ref().map(|r| r.get_ref().text.clone()),
        effects.count()
    );
    assert_eq!(saw.as_deref().ok(), Some("done"), "the client saw OK");
    assert_eq!(
        effects.count(),
        1,
        "the client's call succeeded; its retry ran the handler again"
    );
}

/// A trailer frame over 64 KiB (a big `grpc-status-details-bin`, say) on an answer that fits the
/// default 1 MiB limit: the client reads OK. The layer's reader gives up past 64 KiB and calls it
/// UNKNOWN: under DefinitiveOnly the key is given back and the retry runs again.
#[tokio::test]
async fn s19_4_a_large_trailer_frame_that_fits_the_limit_is_read() {
    let mut lines = b"grpc-status:0\r\n".to_vec();
    lines.extend(format!("x-details:{}\r\n", "d".repeat(70 * 1024)).as_bytes());
    let script = Script::binary(vec![note("done"), frame(0x80, &lines)]);
    let (addr, effects) = serve_script(
        script,
        None,
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    let first = web_call(addr, "lt-1").await.expect("the client reads OK");
    assert_eq!(first.get_ref().text, "done");
    let second = web_call(addr, "lt-1").await;
    eprintln!(
        "second: replayed {:?}",
        second
            .as_ref()
            .map(|r| r.metadata().contains_key("idempotency-replayed"))
            .map_err(|s| s.code())
    );
    assert_eq!(effects.count(), 1, "an OK answer ran twice");
}

/// The same on an answer too large to keep (read as it passes): the client reads OK, the key
/// must stay consumed.
#[tokio::test]
async fn s19_4_a_large_trailer_frame_on_an_oversized_answer_is_read() {
    let mut lines = b"grpc-status:0\r\n".to_vec();
    lines.extend(format!("x-details:{}\r\n", "d".repeat(70 * 1024)).as_bytes());
    let script = Script::binary(vec![note(&"n".repeat(2048)), frame(0x80, &lines)]);
    let (addr, effects) = serve_script(
        script,
        Some(256),
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    web_call(addr, "lt-2").await.expect("the client reads OK");
    let second = web_call(addr, "lt-2").await;
    eprintln!(
        "second: {:?}",
        second.as_ref().map(|_| ()).map_err(|s| s.code())
    );
    assert_eq!(effects.count(), 1, "an OK answer ran twice");
}

/// An answer compressed all the same at the HTTP level (`Content-Encoding: gzip` over the whole
/// gRPC-Web body, as a handler or an inner layer might): a browser decodes it and reads OK. The
/// commit says such an answer "is replayed only to retries that accept its coding"; is it even
/// recorded?
#[tokio::test]
async fn s19_3_a_gzipped_grpc_web_answer_is_recorded_not_run_again() {
    let mut plain = note("done");
    plain.extend(frame(0x80, b"grpc-status:0\r\n"));
    let script = Script {
        headers: vec![
            ("content-type", "application/grpc-web+proto".into()),
            ("content-encoding", "gzip".into()),
        ],
        chunks: vec![(Duration::ZERO, Bytes::from(gzip(&plain)))],
    };
    let mut wrong = Vec::new();
    for policy in [CachePolicy::DefinitiveOnly, CachePolicy::Everything] {
        let store = MemoryStore::new();
        let (addr, effects) =
            serve_script(script.clone(), None, policy.clone(), store.clone()).await;
        let (status, headers, body) = raw_call(
            addr,
            "gz-1",
            "application/grpc-web+proto",
            None,
            Some("gzip"),
        )
        .await;
        assert_eq!(status, 200);
        let unzipped = gunzip(&body);
        assert_eq!(
            web_status(&headers, &unzipped).as_deref(),
            Some("0"),
            "OK as the client reads it"
        );
        let (_, headers2, body2) = raw_call(
            addr,
            "gz-1",
            "application/grpc-web+proto",
            None,
            Some("gzip"),
        )
        .await;
        let record = store
            .lookup(&ScopedKey::new("", "gz-1"))
            .await
            .expect("lookup")
            .and_then(|r| r.response);
        eprintln!(
            "{policy:?}: effects {}, retry headers {:?}, retry body {} bytes, record {:?}",
            effects.count(),
            headers2,
            body2.len(),
            record
                .as_ref()
                .map(|r| (r.body.as_ref().map(|b| b.len()), r.trailers.clone()))
        );
        if effects.count() != 1 {
            wrong.push(format!("{policy:?}: the OK answer ran twice"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
}

/// Hostile but well-formed: the trailer frame (and a message) cut into single bytes, in binary;
/// in text, each chunk padded on its own and the stream cut inside base64 groups. Recorded once,
/// replayed in both framings.
#[tokio::test]
async fn s19_4_frames_cut_anywhere_are_read() {
    let mut whole = note("cut");
    whole.extend(frame(
        0x80,
        b"grpc-status:0\r\nx-kept: yes\r\nset-cookie: s=1\r\n",
    ));
    // Binary, a byte per chunk.
    let script = Script::binary(whole.iter().map(|b| vec![*b]).collect());
    let (addr, effects) = serve_script(
        script,
        None,
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    for i in 0..3 {
        let r = web_call(addr, "cut-1").await.expect("ok");
        assert_eq!(r.get_ref().text, "cut");
        assert_eq!(r.metadata().contains_key("idempotency-replayed"), i > 0);
        if i > 0 {
            assert!(!r.metadata().contains_key("set-cookie"));
            assert_eq!(
                r.metadata().get("x-kept").map(|v| v.to_str().ok()),
                Some(Some("yes"))
            );
        }
    }
    assert_eq!(effects.count(), 1);

    // Text: chunks of 1, 2, 4, 5 bytes padded on their own, sent in pieces of 3 characters.
    let mut text = String::new();
    let mut rest = &whole[..];
    for n in [1usize, 2, 4, 5].iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let n = (*n).min(rest.len());
        text.push_str(&encode_base64(&rest[..n]));
        rest = &rest[n..];
    }
    let pieces: Vec<Vec<u8>> = text.as_bytes().chunks(3).map(<[u8]>::to_vec).collect();
    let script = Script {
        headers: vec![("content-type", "application/grpc-web-text+proto".into())],
        chunks: pieces
            .into_iter()
            .map(|c| (Duration::ZERO, Bytes::from(c)))
            .collect(),
    };
    let (addr, effects) = serve_script(
        script,
        None,
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    let (_, h, b) = raw_call(
        addr,
        "cut-2",
        "application/grpc-web-text",
        Some("application/grpc-web-text"),
        None,
    )
    .await;
    assert_eq!(web_status(&h, &b).as_deref(), Some("0"));
    for accept in ["application/grpc-web-text", "application/grpc-web"] {
        let (_, h, b) = raw_call(
            addr,
            "cut-2",
            "application/grpc-web-text",
            Some(accept),
            None,
        )
        .await;
        assert_eq!(h["idempotency-replayed"], "true", "{accept}");
        assert_eq!(web_status(&h, &b).as_deref(), Some("0"), "{accept}");
    }
    assert_eq!(effects.count(), 1);
}

/// Text answers too large to keep, their trailer frame straddling the limit at every offset:
/// UNAVAILABLE gives the key back, OK consumes it, the client always gets the whole answer.
#[tokio::test]
async fn s19_4_oversized_text_with_the_trailer_frame_across_the_limit() {
    for status in ["14", "0"] {
        let mut whole = note(&"s".repeat(300));
        whole.extend(frame(
            0x80,
            format!("grpc-status:{status}\r\ngrpc-message:x\r\n").as_bytes(),
        ));
        // Chunks of 7 bytes each encoded on its own: the text runs in groups of 12 chars.
        let text: Vec<Vec<u8>> = whole
            .chunks(7)
            .map(|c| encode_base64(c).into_bytes())
            .collect();
        let total: usize = text.iter().map(Vec::len).sum();
        let script = Script {
            headers: vec![("content-type", "application/grpc-web-text+proto".into())],
            chunks: text
                .into_iter()
                .map(|c| (Duration::ZERO, Bytes::from(c)))
                .collect(),
        };
        // The layer counts head bytes against the limit too; sweep a band near the end.
        for limit in (total - 60..total + 40).step_by(7) {
            let (addr, effects) = serve_script(
                script.clone(),
                Some(limit),
                CachePolicy::DefinitiveOnly,
                MemoryStore::new(),
            )
            .await;
            let (_, h, b) = raw_call(
                addr,
                "st-1",
                "application/grpc-web-text",
                Some("application/grpc-web-text"),
                None,
            )
            .await;
            assert_eq!(web_status(&h, &b).as_deref(), Some(status), "limit {limit}");
            assert_eq!(decode_base64(&b), whole, "limit {limit}: the whole answer");
            let (_, h2, b2) = raw_call(
                addr,
                "st-1",
                "application/grpc-web-text",
                Some("application/grpc-web-text"),
                None,
            )
            .await;
            match status {
                "14" => assert_eq!(effects.count(), 2, "limit {limit}: released"),
                _ => {
                    assert_eq!(effects.count(), 1, "limit {limit}: consumed");
                    let s = web_status(&h2, &b2);
                    assert!(
                        s.as_deref() == Some("0") || s.as_deref() == Some("9"),
                        "limit {limit}: {s:?}"
                    );
                }
            }
        }
    }
}

/// A client hangs up in the middle of an oversized gRPC-Web answer that ends UNAVAILABLE: the
/// stream stops, as it would without the layer, so its status is never read. The handler had
/// answered: the key is taken as done (never a second run), and the retry is told the
/// response was not stored. Nothing hangs.
#[tokio::test]
async fn s19_4_a_hang_up_mid_oversized_web_answer() {
    let mut chunks = vec![(Duration::ZERO, Bytes::from(note(&"h".repeat(4096))))];
    for _ in 0..20 {
        chunks.push((
            Duration::from_millis(30),
            Bytes::from(note(&"h".repeat(1024))),
        ));
    }
    chunks.push((
        Duration::from_millis(30),
        Bytes::from(frame(0x80, b"grpc-status:14\r\ngrpc-message:down\r\n")),
    ));
    let script = Script {
        headers: vec![("content-type", "application/grpc-web+proto".into())],
        chunks,
    };
    let store = MemoryStore::new();
    let (addr, effects) = serve_script(
        script,
        Some(256),
        CachePolicy::DefinitiveOnly,
        store.clone(),
    )
    .await;
    let mut res = common::client()
        .post(format!("http://{addr}/w.W/Call"))
        .header("content-type", "application/grpc-web+proto")
        .header("idempotency-key", "hu-1")
        .body(note("take a note"))
        .send()
        .await
        .expect("call");
    res.chunk().await.expect("chunk").expect("some");
    drop(res);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let record = store
        .lookup(&ScopedKey::new("", "hu-1"))
        .await
        .expect("lookup");
    assert_eq!(
        record.map(|r| r.status),
        Some(tower_idempotency::store::RecordStatus::Completed),
        "taken as done"
    );
    let (_, h, b) = raw_call(addr, "hu-1", "application/grpc-web+proto", None, None).await;
    assert_eq!(web_status(&h, &b).as_deref(), Some("9"), "not stored");
    assert_eq!(effects.count(), 1, "never a second run");
}

/// Many gRPC-Web clients on one key at once, a slow handler: exactly one effect; every client
/// gets the answer or an in-flight refusal, never anything else.
#[tokio::test]
async fn s19_concurrent_web_clients_on_one_key_make_one_effect() {
    let mut body = note("once");
    body.extend(frame(0x80, b"grpc-status:0\r\n"));
    let script = Script {
        headers: vec![("content-type", "application/grpc-web+proto".into())],
        chunks: vec![(Duration::from_millis(300), Bytes::from(body))],
    };
    let (addr, effects) = serve_script(
        script,
        None,
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    let calls: Vec<_> = (0..12)
        .map(|_| tokio::spawn(async move { web_call(addr, "cc-1").await }))
        .collect();
    let mut ok = 0;
    for c in calls {
        match c.await.expect("join") {
            Ok(r) => {
                assert_eq!(r.get_ref().text, "once");
                ok += 1;
            }
            Err(s) => assert_eq!(s.code(), Code::Aborted, "{s:?}"),
        }
    }
    assert!(ok >= 1);
    let after = web_call(addr, "cc-1").await.expect("replay");
    assert_eq!(after.get_ref().text, "once");
    assert_eq!(effects.count(), 1);
}

/// Status in the headers and a trailer frame that disagree: which one the layer records, and
/// which the client sees.
#[tokio::test]
async fn s19_4_head_and_trailer_frame_disagree() {
    let mut wrong = Vec::new();
    for (head, tail) in [("0", "14"), ("14", "0")] {
        let mut body = note("x");
        body.extend(frame(0x80, format!("grpc-status:{tail}\r\n").as_bytes()));
        let script = Script {
            headers: vec![
                ("content-type", "application/grpc-web+proto".into()),
                ("grpc-status", head.into()),
            ],
            chunks: vec![(Duration::ZERO, Bytes::from(body))],
        };
        let (addr, effects) = serve_script(
            script,
            None,
            CachePolicy::DefinitiveOnly,
            MemoryStore::new(),
        )
        .await;
        let first = web_call(addr, "hd-1").await;
        let second = web_call(addr, "hd-1").await;
        eprintln!(
            "head {head} frame {tail}: client saw {:?}, then {:?}; effects {}",
            first.as_ref().map(|_| "ok").map_err(|s| s.code()),
            second
                .as_ref()
                .map(|r| r.metadata().contains_key("idempotency-replayed"))
                .map_err(|s| s.code()),
            effects.count()
        );
        let client_ok = first.is_ok();
        let ran_again = effects.count() == 2;
        if client_ok && ran_again {
            wrong.push(format!(
                "head {head} frame {tail}: the client saw OK, the retry ran again"
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:?}");
}

/// Accept lists: tonic-web answers text only to an `Accept` that is exactly a text type; the
/// layer's replay framing is chosen by a prefix. Same framing live and replayed?
#[tokio::test]
async fn s19_4_replay_framing_matches_the_live_framing() {
    use tonic::transport::Server;
    use tonic::transport::server::TcpIncoming;
    #[derive(Clone, Default)]
    struct Svc(Effects);
    impl tonic::server::NamedService for Svc {
        const NAME: &'static str = "w.W";
    }
    impl<B: Send + 'static> tower::Service<http::Request<B>> for Svc {
        type Response = http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Infallible>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<B>) -> Self::Future {
            self.0.hit();
            Box::pin(async move {
                let mut t = http::HeaderMap::new();
                t.insert("grpc-status", http::HeaderValue::from_static("0"));
                let frames = vec![
                    Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(note("live")))),
                    Ok(http_body::Frame::trailers(t)),
                ];
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                let mut res = http::Response::new(tonic::body::Body::new(body));
                res.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/grpc"),
                );
                Ok(res)
            })
        }
    }
    let svc = Svc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layers = tower::ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new_for_grpc(MemoryStore::new())
                .single_tenant()
                .grpc_method("/w.W/Call", |m| m),
        )
        .layer(tonic_web::GrpcWebLayer::new())
        .into_inner();
    let server = Server::builder()
        .accept_http1(true)
        .layer(layers)
        .add_service(svc.clone())
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });
    let mut mismatched = Vec::new();
    for (i, accept) in [
        "application/grpc-web-text, application/grpc-web",
        "application/grpc-web-text+proto;q=1",
        "application/grpc-web-textual",
        "*/*",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("ac-{i}");
        let (_, live, _) = raw_call(addr, &key, "application/grpc-web", Some(accept), None).await;
        let (st, replay, b) =
            raw_call(addr, &key, "application/grpc-web", Some(accept), None).await;
        eprintln!(
            "{accept}: live {:?} / replay {st} {:?} {:?}",
            live.get("content-type"),
            replay.get("content-type"),
            replay.get("grpc-message")
        );
        assert_eq!(
            replay.get("idempotency-replayed").map(|v| v.as_bytes()),
            Some(&b"true"[..]),
            "{accept}"
        );
        assert_eq!(web_status(&replay, &b).as_deref(), Some("0"));
        if live["content-type"] != replay["content-type"] {
            mismatched.push((
                accept,
                live["content-type"].clone(),
                replay["content-type"].clone(),
            ));
        }
    }
    assert!(
        mismatched.is_empty(),
        "the replay is framed otherwise than the live answer: {mismatched:?}"
    );
}

/// §5 for gRPC-Web over HTTP/2: a request stream held open after its first message (a bidi
/// client waiting for a reply). gRPC calls are refused after a grace; gRPC-Web?
#[tokio::test]
async fn s19_5_an_open_grpc_web_stream_never_hangs() {
    use hyper_util::rt::TokioIo;
    use tonic::transport::Server;
    use tonic::transport::server::TcpIncoming;
    #[derive(Clone, Default)]
    struct Svc(Effects);
    impl tonic::server::NamedService for Svc {
        const NAME: &'static str = "w.W";
    }
    impl<B: Send + 'static> tower::Service<http::Request<B>> for Svc {
        type Response = http::Response<tonic::body::Body>;
        type Error = Infallible;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
        >;
        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Infallible>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<B>) -> Self::Future {
            self.0.hit();
            Box::pin(async move { Ok(Status::ok("").into_http()) })
        }
    }
    let svc = Svc::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let layers = tower::ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new_for_grpc(MemoryStore::new())
                .single_tenant()
                .grpc_method("/w.W/Call", |m| m),
        )
        .layer(tonic_web::GrpcWebLayer::new())
        .into_inner();
    let server = Server::builder()
        .accept_http1(true)
        .layer(layers)
        .add_service(svc.clone())
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.expect("grpc server") });

    let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("h2");
    tokio::spawn(connection);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, Infallible>>(4);
    tx.send(Ok(http_body::Frame::data(Bytes::from(note("one")))))
        .await
        .expect("send");
    let body = http_body_util::StreamBody::new(tokio_stream_from(rx));
    let request = http::Request::post(format!("http://{addr}/w.W/Call"))
        .header("content-type", "application/grpc-web+proto")
        .header("idempotency-key", "open-1")
        .body(body)
        .expect("request");
    let answer = tokio::time::timeout(Duration::from_secs(8), sender.send_request(request)).await;
    let hung = answer.is_err();
    drop(tx);
    eprintln!(
        "answered: {:?}, effects {}",
        answer
            .as_ref()
            .ok()
            .map(|r| r.as_ref().map(|r| r.headers().clone())),
        svc.0.count()
    );
    assert!(
        !hung,
        "a gRPC-Web request stream held open hung the call for 8 s"
    );
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// §5: a gRPC-Web body with two messages to a guarded method (a client stream in one body) is
/// refused for gRPC; for gRPC-Web?
#[tokio::test]
async fn s19_5_two_messages_in_a_grpc_web_body() {
    let mut body = note("done");
    body.extend(frame(0x80, b"grpc-status:0\r\n"));
    let script = Script::binary(vec![body]);
    let (addr, effects) = serve_script(
        script,
        None,
        CachePolicy::DefinitiveOnly,
        MemoryStore::new(),
    )
    .await;
    let mut two = note("one");
    two.extend(note("two"));
    let res = common::client()
        .post(format!("http://{addr}/w.W/Call"))
        .header("content-type", "application/grpc-web+proto")
        .header("idempotency-key", "two-1")
        .body(two)
        .send()
        .await
        .expect("call");
    let status = res.headers().get("grpc-status").cloned();
    eprintln!(
        "two messages: grpc-status {status:?}, effects {}",
        effects.count()
    );
    assert_eq!(
        (status.as_ref().map(|v| v.as_bytes()), effects.count()),
        (Some(&b"3"[..]), 0),
        "a gRPC call with two messages is refused INVALID_ARGUMENT; the same in gRPC-Web ran"
    );
}

/// Status values in the trailer frame that the layer reads more leniently than tonic-web's
/// client (it trims the value's start only; tonic parses one or two digits exactly): the client
/// sees UNKNOWN, the layer records a definitive OK, and the replay (re-serialised, trimmed)
/// then shows the retry an OK the first caller never saw.
#[tokio::test]
async fn s19_4_lenient_status_in_the_trailer_frame() {
    let mut wrong = Vec::new();
    for line in ["grpc-status:0 ", "grpc-status:00", "grpc-status:+0"] {
        let script = Script::binary(vec![
            note("done"),
            frame(0x80, format!("{line}\r\n").as_bytes()),
        ]);
        let (addr, effects) = serve_script(
            script,
            None,
            CachePolicy::DefinitiveOnly,
            MemoryStore::new(),
        )
        .await;
        let first = web_call(addr, "len-1").await;
        let second = web_call(addr, "len-1").await;
        eprintln!(
            "{line:?}: first {:?}, second {:?}, effects {}",
            first.as_ref().map(|_| "ok").map_err(|s| s.code()),
            second
                .as_ref()
                .map(|r| r.metadata().contains_key("idempotency-replayed"))
                .map_err(|s| s.code()),
            effects.count()
        );
        if first.is_err() && effects.count() == 1 {
            wrong.push(line);
        }
    }
    assert!(
        wrong.is_empty(),
        "{wrong:?}: the client saw UNKNOWN, the layer recorded a definitive outcome"
    );
}
