//! Review: leases, TTLs and what is left of a lease are judged on the store server's clock
//! (PostgreSQL's `now()`, Redis's `TIME`), never a replica's (DESIGN §1: "Leases, TTLs and
//! Retry-After are computed with the store's clock"; §5). Peers judged lease expiry on each
//! node's own clock, so a node whose clock ran ahead took over a live run, and one behind
//! waited out a dead holder.
//!
//! A replica is a child process of this binary under libfaketime (Debian: `faketime`), its
//! clock two minutes ahead of this process's or two minutes behind, on the same table or
//! Redis prefix. It claims keys this process set up and prints what each claim answered:
//!
//! - two minutes ahead, a key held under a live 20 s lease is in flight (never taken over),
//!   with most of its lease left as the store tells it (what `Retry-After` is made from), and
//!   a key completed with a 60 s TTL replays (never found expired);
//! - two minutes behind, a key whose 1 s lease ran out is taken over (attempt 2), and a key
//!   completed with a 1 s TTL that ran out counts as absent (attempt 1); the leases it takes
//!   are then live on this process's claims (written from the server's clock too).
//!
//! A store that compared a replica's clock with the record's times would answer each of the
//! four the other way. The child prints its clock first, so a libfaketime that did not take
//! fails the test rather than letting it pass unskewed.

mod common;

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use common::child::Proc;
use tower_idempotency::IdempotencyStore;
use tower_idempotency::store::{
    Claim, ClaimRequest, Fingerprint, LeaseExpiry, RecordStatus, RedisStore, ScopedKey,
    StoredResponse,
};

const CHILD: &str = "CLOCK_SKEW_REVIEW_CHILD";
const TABLE: &str = "tower_idempotency_clock_skew";
/// How far the replica's clock is off, and the least that must show in what it prints.
const SKEW: &str = "120s";
const SKEW_AT_LEAST: Duration = Duration::from_secs(100);

fn request(scope: &str, name: &str, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: ScopedKey::new(scope, name),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease,
        ttl,
        on_lease_expiry: LeaseExpiry::Reclaim,
    }
}

fn unix_ms(at: SystemTime) -> i128 {
    match at.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i128,
        Err(e) => -(e.duration().as_millis() as i128),
    }
}

/// What a claim answered, as one word the parent compares.
fn outcome(claim: Result<Claim, tower_idempotency::store::StoreError>) -> String {
    match claim {
        Ok(Claim::Acquired(lease)) => format!("acquired:{}", lease.attempt),
        // With what is left of the lease, read on the clock the store answers with.
        Ok(Claim::Existing { record, now }) => {
            let left = record.lease_until.duration_since(now).unwrap_or_default();
            format!("existing:{}:{}", record.status.as_str(), left.as_secs())
        }
        Ok(Claim::Completed { .. }) => "completed".to_owned(),
        Err(e) => format!("error:{e}"),
    }
}

/// The child's half: claim each of `SKEW_KEYS` under `SKEW_SCOPE` as the parent set them up,
/// after printing this process's clock.
async fn child_main(kind: &str) {
    let scope = std::env::var("SKEW_SCOPE").expect("SKEW_SCOPE");
    let keys = std::env::var("SKEW_KEYS").expect("SKEW_KEYS");
    println!("NOW {}", unix_ms(SystemTime::now()));
    match kind {
        "postgres" => {
            let store = common::postgres(TABLE).await.expect("PostgreSQL");
            claim_all(&store, &scope, &keys).await;
        }
        _ => {
            let prefix = std::env::var("SKEW_PREFIX").expect("SKEW_PREFIX");
            let store = RedisStore::connect(&common::redis_url())
                .await
                .expect("Redis")
                .with_prefix(&prefix)
                .expect("prefix");
            claim_all(&store, &scope, &keys).await;
        }
    }
}

async fn claim_all<St: IdempotencyStore>(store: &St, scope: &str, keys: &str) {
    for name in keys.split(',') {
        let req = request(
            scope,
            name,
            Duration::from_secs(20),
            Duration::from_secs(60),
        );
        println!("CLAIM {name} {}", outcome(store.claim(&req).await));
    }
}

/// Whether libfaketime's wrapper runs here (reported through `common::unreachable`, which
/// fails under `CI=true`, when it does not).
fn faketime_runs() -> bool {
    match std::process::Command::new("faketime")
        .args(["-f", "+0s", "true"])
        .status()
    {
        Ok(status) if status.success() => true,
        Ok(status) => {
            common::unreachable("faketime (Debian: faketime)", &status);
            false
        }
        Err(e) => {
            common::unreachable("faketime (Debian: faketime)", &e);
            false
        }
    }
}

/// Runs the child replica of `test` with its clock at `offset` (`+120s`, `-120s`) claiming
/// `keys`; what each claim answered, by key, and how far its clock was from this process's.
fn replica(
    test: &str,
    kind: &str,
    env: &[(&str, String)],
    offset: &str,
    keys: &[&str],
) -> (HashMap<String, String>, i128) {
    let mut env = env.to_vec();
    env.push(("SKEW_KEYS", keys.join(",")));
    let child = Proc::spawn(test, CHILD, kind, &env, &["faketime", "-f", offset]);
    let now = child.wait_for("NOW ").expect("the replica's clock");
    let theirs: i128 = now["NOW ".len()..].trim().parse().expect("a time");
    let skew = theirs - unix_ms(SystemTime::now());
    let mut answers = HashMap::new();
    for key in keys {
        let line = child
            .wait_for(&format!("CLAIM {key} "))
            .unwrap_or_else(|| panic!("the replica's claim of {key}"));
        // Everything after `CLAIM <key> `: an error's words too.
        let answer = line.splitn(3, ' ').nth(2).unwrap_or_default().to_owned();
        answers.insert((*key).to_owned(), answer);
    }
    (answers, skew)
}

async fn scenario<St: IdempotencyStore>(
    store: St,
    test: &str,
    kind: &str,
    env: Vec<(&str, String)>,
) {
    if !faketime_runs() {
        return;
    }
    let started = unix_ms(SystemTime::now());
    let scope = format!("skew-{kind}-{}-{started}", std::process::id());
    let mut env = env;
    env.push(("SKEW_SCOPE", scope.clone()));
    let claimed = |claim| match claim {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("a fresh key is acquired: {other:?}"),
    };
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: Some(bytes::Bytes::from_static(b"done")),
        trailers: None,
    };
    let (long, short) = (Duration::from_secs(20), Duration::from_secs(1));
    // Held by this process under a live lease; completed with a TTL that is live.
    let live = claimed(store.claim(&request(&scope, "live", long, long)).await);
    let done = claimed(store.claim(&request(&scope, "done", long, long)).await);
    store
        .complete(
            &ScopedKey::new(&*scope, "done"),
            done.token,
            &response,
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    // A lease that runs out; a completed record whose TTL runs out.
    claimed(store.claim(&request(&scope, "lapsed", short, long)).await);
    let expired = claimed(store.claim(&request(&scope, "expired", long, long)).await);
    store
        .complete(
            &ScopedKey::new(&*scope, "expired"),
            expired.token,
            &response,
            short,
        )
        .await
        .expect("complete");
    tokio::time::sleep(Duration::from_millis(1_800)).await;

    let (ahead, skew) = replica(test, kind, &env, &format!("+{SKEW}"), &["live", "done"]);
    assert!(
        skew >= SKEW_AT_LEAST.as_millis() as i128,
        "the replica's clock runs ahead ({skew} ms): libfaketime took"
    );
    let left = ahead["live"].strip_prefix("existing:in_progress:");
    let left: Option<u64> = left.and_then(|left| left.parse().ok());
    assert!(
        left.is_some_and(|left| (10..=20).contains(&left)),
        "{kind}: a replica two minutes ahead finds a live lease in flight, most of its 20 s \
         left on the store's clock: {}",
        ahead["live"]
    );
    assert_eq!(
        ahead["done"], "completed",
        "{kind}: a replica two minutes ahead replays a record within its TTL"
    );
    let (behind, skew) = replica(
        test,
        kind,
        &env,
        &format!("-{SKEW}"),
        &["lapsed", "expired"],
    );
    assert!(
        skew <= -(SKEW_AT_LEAST.as_millis() as i128),
        "the replica's clock runs behind ({skew} ms): libfaketime took"
    );
    assert_eq!(
        behind["lapsed"], "acquired:2",
        "{kind}: a replica two minutes behind takes over a lease that ran out on the server"
    );
    assert_eq!(
        behind["expired"], "acquired:1",
        "{kind}: a replica two minutes behind finds a record past its TTL absent"
    );
    // What the replica behind wrote is judged on the server's clock too: its leases (20 s,
    // written from the server's now, not two minutes early) are live here.
    for key in ["lapsed", "expired"] {
        let again = outcome(store.claim(&request(&scope, key, long, long)).await);
        let left = again.strip_prefix("existing:in_progress:");
        let left: Option<u64> = left.and_then(|left| left.parse().ok());
        assert!(
            left.is_some_and(|left| (10..=20).contains(&left)),
            "{kind}: the lease a replica two minutes behind took on {key} is live: {again}"
        );
    }
    // And this process still holds what it held.
    let record = store
        .lookup(&ScopedKey::new(&*scope, "live"))
        .await
        .expect("lookup")
        .expect("the live record");
    assert_eq!(
        (record.status, record.lease_token),
        (RecordStatus::InProgress, live.token)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_replicas_two_minutes_off_judge_leases_and_ttls_by_postgres_clock() {
    if let Ok(kind) = std::env::var(CHILD) {
        return child_main(&kind).await;
    }
    let Some(store) = common::postgres(TABLE).await else {
        return;
    };
    let test = "s1_replicas_two_minutes_off_judge_leases_and_ttls_by_postgres_clock";
    scenario(store, test, "postgres", Vec::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_replicas_two_minutes_off_judge_leases_and_ttls_by_redis_clock() {
    if let Ok(kind) = std::env::var(CHILD) {
        return child_main(&kind).await;
    }
    let prefix = common::redis_prefix("clock-skew");
    let Some(store) = common::redis("clock-skew").await else {
        return;
    };
    let store = store.with_prefix(&prefix).expect("prefix");
    let test = "s1_replicas_two_minutes_off_judge_leases_and_ttls_by_redis_clock";
    scenario(store, test, "redis", vec![("SKEW_PREFIX", prefix)]).await;
}
