use super::*;
use crate::MemoryStore;

/// An inner service boxed as axum boxes a route, behind the layer: the futures' sizes as
/// a router's requests meet them.
type Sized = Idempotency<
    tower::util::BoxCloneSyncService<
        Request<RequestBody<axum::body::Body>>,
        Response<axum::body::Body>,
        std::convert::Infallible,
    >,
    MemoryStore,
    crate::scope::SingleTenant,
>;

fn sized_service() -> Sized {
    let inner = tower::util::BoxCloneSyncService::new(tower::service_fn(|_req| async {
        Ok(Response::new(axum::body::Body::empty()))
    }));
    let layer = crate::IdempotencyLayer::new(MemoryStore::new()).single_tenant();
    tower_layer::Layer::layer(&layer, inner)
}

/// The future every guarded request allocates stays small, as `run`'s doc says: an `async
/// fn` kept the request's head twice (1 008 bytes in this build, 1 160 in release, above
/// glibc's 1 032-byte per-thread cache); the `async` block keeps it once (704).
#[test]
fn the_pipeline_future_keeps_the_head_once() {
    let service = sized_service();
    let pipeline = Pipeline {
        span: tracing::Span::none(),
        route: service.config.default.clone(),
        keeper: service.keeper.clone(),
        make_scope: service.make_scope,
        config: service.config.clone(),
    };
    let (parts, body) = Request::new(axum::body::Body::empty()).into_parts();
    let future = pipeline.run(service.inner.clone(), parts, body);
    let size = std::mem::size_of_val(&future);
    assert!(
        size <= 800,
        "the pipeline's future is {size} bytes: something waiting across an await (the \
         head, a claim) is kept twice or inline"
    );
}

/// The future every guarded request that runs its handler allocates fits glibc's per-thread
/// cache (requests of up to 1 032 bytes): above it, every unique-key request allocates and
/// frees it through the allocator's slow bins (about 270 instructions more under callgrind
/// for the 2 016-byte future this replaced).
#[test]
fn the_execution_future_fits_the_allocators_cache() {
    let service = sized_service();
    let execution = Execution {
        keeper: service.keeper.clone(),
        key: ScopedKey::new("", "size"),
        lease: crate::store::Lease {
            token: crate::store::FencingToken::new(1),
            attempt: 1,
            until: std::time::SystemTime::now(),
        },
        asked: None,
        route: service.config.default.clone(),
        config: service.config.clone(),
        dialect: Dialect::Http,
        head: false,
    };
    let req = Request::new(RequestBody::buffered(bytes::Bytes::new(), None));
    let future = execution.run(service.inner.clone(), req, None);
    let size = std::mem::size_of_val(&future);
    assert!(
        size <= 1032,
        "the execution future is {size} bytes: above glibc's per-thread cache"
    );
}
