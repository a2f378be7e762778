use super::statements::{CARRIED, CHUNK_SIZES, READ, chunks};

/// SQLite's busy codes, extended ones included, and no other.
#[test]
fn s1_6_busy_codes_are_told_from_read_only_ones() {
    for busy in ["5", "261", "517", "773"] {
        assert!(super::busy(busy), "{busy}");
    }
    for other in ["8", "264", "520", "1032", "1544", "6", "0", "", "busy"] {
        assert!(!super::busy(other), "{other}");
    }
}

/// §1.6: a store connects while another connection holds the file's write lock (its
/// connections are tried as the pool opens them, once the lock is free). The check leaves
/// the file as it was. A file in a missing directory is refused.
#[tokio::test]
async fn s1_6_a_store_connects_while_another_holds_the_write_lock() {
    use sqlx::{Connection, Executor};
    let dir = std::env::temp_dir().join(format!(
        "sqlite-writable-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}", dir.join("db.sqlite").display());
    let store = super::SqliteStore::connect(&url).await.expect("connect");
    store.migrate().await.expect("migrate");
    sqlx::query("PRAGMA user_version = 42")
        .execute(store.pool())
        .await
        .expect("a version");
    let mut holder = sqlx::SqliteConnection::connect(&url).await.expect("holder");
    holder.execute("BEGIN IMMEDIATE").await.expect("lock");
    let other = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        super::SqliteStore::connect(&url),
    )
    .await
    .expect("connect within a minute")
    .expect("connect while the lock is held");
    holder.execute("ROLLBACK").await.expect("unlock");
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(other.pool())
        .await
        .expect("read");
    assert_eq!(version, 42, "the check leaves the file as it was");
    let missing = format!("sqlite://{}", dir.join("no/such/dir/db.sqlite").display());
    assert!(super::SqliteStore::connect(&missing).await.is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// §1.6: a pool of one's own, given to `SqliteStore::new`, refuses the read-only
/// connections SQLite opens without an error once it runs `check_writable` on each: its
/// store answers unavailable instead of keeping a connection that fails every write. The
/// same pool without the check hands such a connection out; on a writable file the check
/// passes and leaves the file as it was.
#[tokio::test]
async fn s1_6_a_pool_of_ones_own_refuses_read_only_connections_with_the_check() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    use std::time::Duration;
    let dir = std::env::temp_dir().join(format!(
        "sqlite-own-pool-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("db.sqlite");
    let url = format!("sqlite://{}", file.display());
    let made = super::SqliteStore::connect(&url).await.expect("connect");
    made.migrate().await.expect("migrate");
    sqlx::query("PRAGMA user_version = 7")
        .execute(made.pool())
        .await
        .expect("a version");
    made.pool().close().await;
    let pool = |url: &str, checked: bool| {
        let options = SqliteConnectOptions::from_str(url).expect("options");
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_millis(500));
        if checked {
            pool.after_connect(|c, _| Box::pin(super::SqliteStore::check_writable(c)))
                .connect_lazy_with(options)
        } else {
            pool.connect_lazy_with(options)
        }
    };
    let read_only = format!("{url}?mode=ro");
    let unchecked = pool(&read_only, false);
    assert!(
        unchecked.acquire().await.is_ok(),
        "without the check SQLite hands out a read-only connection"
    );
    let checked = pool(&read_only, true);
    assert!(
        checked.acquire().await.is_err(),
        "the check refuses a read-only connection"
    );
    let store = super::SqliteStore::new(checked);
    let request = crate::store::ClaimRequest {
        key: crate::store::ScopedKey::new("", "own-pool"),
        fingerprint: crate::Fingerprint::from_bytes([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        on_lease_expiry: crate::LeaseExpiry::Reclaim,
    };
    use crate::store::IdempotencyStore;
    assert!(
        store.claim(&request).await.is_err(),
        "its store answers unavailable, never a claim"
    );
    let writable = pool(&url, true);
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(&writable)
        .await
        .expect("a checked writable connection");
    assert_eq!(version, 7, "the check leaves the file as it was");
    let store = super::SqliteStore::new(writable);
    assert!(matches!(
        store.claim(&request).await,
        Ok(crate::store::Claim::Acquired(_))
    ));
    for p in [unchecked, store.pool().clone()] {
        p.close().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The batch's one-row read carries exactly `READ`'s columns, in its order: `raw_of_json`
/// reads them back by place.
#[test]
fn s4_a_batch_read_carries_what_every_read_returns() {
    let read: Vec<&str> = READ.split(',').map(str::trim).collect();
    let carried: Vec<&str> = CARRIED.iter().map(|&(c, _)| c).collect();
    assert_eq!(carried, read);
}

/// A batch of any size is cut into chunks that add up to it, each a size whose statement
/// is made once (or a single operation), largest first.
#[test]
fn s4_a_batch_is_cut_into_chunks_of_the_cached_sizes() {
    let sizes = |n| chunks(n).map(|r| r.len()).collect::<Vec<_>>();
    assert_eq!(sizes(45), [32, 8, 4, 1]);
    assert_eq!(sizes(100), [64, 32, 4]);
    assert_eq!(chunks(0).count(), 0);
    for n in 1..=300 {
        // The ranges follow one another from 0 to n.
        let ranges: Vec<_> = chunks(n).collect();
        assert!(
            ranges.windows(2).all(|w| w[0].end == w[1].start),
            "{n}: {ranges:?}"
        );
        assert_eq!(ranges.first().map(|r| r.start), Some(0), "{n}: {ranges:?}");
        let sizes = sizes(n);
        assert_eq!(sizes.iter().sum::<usize>(), n, "{n}: {sizes:?}");
        assert!(sizes.is_sorted_by(|a, b| a >= b), "{n}: {sizes:?}");
        assert!(
            sizes.iter().all(|s| *s == 1 || CHUNK_SIZES.contains(s)),
            "{n}: {sizes:?}"
        );
        assert!(
            sizes.iter().filter(|s| **s == 1).count() <= 1,
            "{n}: {sizes:?}"
        );
    }
}

/// DESIGN §4 (the holder keeps its lease while its process lives): claims take at most the
/// pool's connections not kept for holders; a claim past that share fails as the pool does
/// (unavailable) once the pool's acquire time-out has passed, while a holder's renewal and
/// completion still go through. What is kept is a quarter of the pool by default, and at most
/// all but one connection.
#[tokio::test]
async fn s4_claims_wait_for_their_share_while_holders_write() {
    use crate::fingerprint::Fingerprint;
    use crate::store::{Claim, ClaimRequest, IdempotencyStore, LeaseExpiry, ScopedKey};
    use crate::store::{StoreError, StoredResponse};
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    use std::time::Duration;

    let dir = std::env::temp_dir().join(format!(
        "sqlite-share-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}", dir.join("db.sqlite").display());
    let made = super::SqliteStore::connect(&url).await.expect("connect");
    made.migrate().await.expect("migrate");
    made.pool().close().await;
    let options = SqliteConnectOptions::from_str(&url)
        .expect("options")
        .busy_timeout(Duration::from_secs(5));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(options);
    let store = super::SqliteStore::new(pool);
    assert_eq!(store.holder_connections(), 1, "a quarter of 4");
    assert_eq!(
        store
            .clone()
            .with_holder_connections(3)
            .holder_connections(),
        3
    );
    assert_eq!(
        store
            .clone()
            .with_holder_connections(9)
            .holder_connections(),
        3,
        "claims keep one"
    );
    let request = |key: &str| ClaimRequest {
        key: ScopedKey::new("s", key),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        on_lease_expiry: LeaseExpiry::Reclaim,
    };
    let held = match store.claim(&request("held")).await.expect("claim") {
        Claim::Acquired(lease) => lease.token,
        other => panic!("acquired, got {other:?}"),
    };
    // The claims' whole share taken, as by three claims waiting on their statements.
    let share = [
        store.reserve.claim().await.expect("a turn"),
        store.reserve.claim().await.expect("a turn"),
        store.reserve.claim().await.expect("a turn"),
    ];
    let refused = store.claim(&request("crowded")).await;
    assert!(
        matches!(refused, Err(StoreError::Unavailable(_))),
        "a claim past the share is unavailable: {refused:?}"
    );
    let key = ScopedKey::new("s", "held");
    store
        .renew(&key, held, Duration::from_secs(30))
        .await
        .expect("the holder renews");
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"done")),
        trailers: None,
    };
    store
        .complete(&key, held, &response, Duration::from_secs(60))
        .await
        .expect("the holder completes");
    drop(share);
    assert!(
        matches!(
            store.claim(&request("crowded")).await,
            Ok(Claim::Acquired(_))
        ),
        "its share given back, the claim goes"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
