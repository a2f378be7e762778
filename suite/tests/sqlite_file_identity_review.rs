//! Review of 1e63d59: `SqliteStore::connect` records its file's (device, inode) and refuses
//! every connection its pool opens later unless the path still names that file. Attacked
//! here: the path swapped back and forth while the pool opens connections (a check of the
//! path, not of the connection's own file), a second store connected in the same process on
//! a file renamed over a running one's, a restart on a file renamed over a running server's,
//! a second store on a path whose running file was moved away and another put in its place,
//! a URL asking to create (`?mode=rwc`), a file moved away and back (with the pool's
//! connections lapsed meanwhile), a file moved and a symlink left in its place, a relative
//! path, and the in-memory forms.
//!
//! Four tests failed on 1e63d59, all fixed since: a connection that opened the other file
//! while the path named it passed a check made once the path named the store's file again
//! (the check now also reads the process's descriptors under the name); a second store in the
//! process read the new file through the old one's WAL (`connect` now refuses the path while
//! the old file is open here); a restart read the new file through the old `-wal` SQLite
//! leaves beside a moved file (documented: delete it first; the test does); `?mode=rwc` made
//! the pool's connections create a deleted file again (the pool's options now never create).
//!
//! Every test runs its scenario in a child process (this binary again, `FILE_IDENTITY_CHILD`
//! set): a SIGBUS kills the child, and the parent fails naming the signal. Effects are counted
//! at a sink file, never from the answers. Sleeps here order events; nothing measures time.

mod common;

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::raw::unique;
use common::sink::{effect, effects, effects_of};
use common::sqlite_files::{Cleanup, another_database, hold_all, side, url_of};
use common::{client, problem_type, serve, sqlite_path};
use sqlx::Connection;
use tower_idempotency::store::SqliteStore;
use tower_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyStore};

const CHILD: &str = "FILE_IDENTITY_CHILD";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

// ---- the child process ------------------------------------------------------------------------

/// In the child: true (run the scenario). In the parent: runs `test` in a child and fails
/// unless it exited 0, naming the signal that killed it (7: SIGBUS) and its output's tail.
async fn in_child(test: &str) -> bool {
    if std::env::var(CHILD).is_ok() {
        return true;
    }
    let exe = std::env::current_exe().expect("this binary");
    let run = tokio::process::Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), run)
        .await
        .unwrap_or_else(|_| panic!("{test}: the child hung"))
        .expect("run the child");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    let tail = &text[text.len().saturating_sub(3000)..];
    assert!(
        out.status.signal().is_none(),
        "{test}: the process was KILLED by signal {:?} (7 is SIGBUS); its output:\n{tail}",
        out.status.signal()
    );
    assert!(
        out.status.success(),
        "{test}: the child failed ({}):\n{tail}",
        out.status
    );
    false
}

// ---- the effect sink and the server -----------------------------------------------------------

/// `POST /op`: makes the effect at the sink, answers 201 with the key.
fn app<St: IdempotencyStore>(store: St, sink: PathBuf) -> Router {
    let layer = IdempotencyLayer::new(store)
        .single_tenant()
        .lease(Duration::from_secs(30));
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, body: String| {
            let sink = sink.clone();
            async move {
                effect(&sink, ctx.key());
                (StatusCode::CREATED, format!("{}|{body}", ctx.key()))
            }
        })
        .layer(layer),
    )
}

#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    problem: Option<String>,
}

impl Answer {
    fn unavailable(&self) -> bool {
        self.status == 503
            && self.problem.as_deref() == Some(problem_type("store-unavailable").as_str())
    }
}

async fn send(addr: SocketAddr, key: &str) -> Answer {
    let res = client()
        .post(format!("http://{addr}/op"))
        .header("idempotency-key", key)
        .header("content-type", "text/plain")
        .body("b")
        .send()
        .await
        .expect("request");
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotency-replayed")
        .is_some_and(|v| v == "true");
    let body = res.text().await.expect("body");
    let problem = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned));
    Answer {
        status,
        replayed,
        problem,
    }
}

// ---- files ------------------------------------------------------------------------------------

fn file_id(path: &Path) -> (u64, u64) {
    let m = std::fs::metadata(path).expect("stat");
    (m.dev(), m.ino())
}

/// How many descriptors this process holds open on the file `id` (read through /proc).
fn open_on(id: (u64, u64)) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter_map(|e| std::fs::metadata(e.path()).ok())
                .filter(|m| (m.dev(), m.ino()) == id)
                .count()
        })
        .unwrap_or(0)
}

/// What a plain connection (no store) finds in the file at `path`: its integrity check, the
/// `marker` rows, and the number of records.
async fn inspect(path: &Path) -> (String, Result<i64, String>, Result<i64, String>) {
    let mut c = sqlx::SqliteConnection::connect(&url_of(path))
        .await
        .expect("connect to inspect");
    let integrity: String = sqlx::query_scalar("PRAGMA integrity_check")
        .fetch_one(&mut c)
        .await
        .unwrap_or_else(|e| e.to_string());
    let marker = sqlx::query_scalar("SELECT count(*) FROM marker")
        .fetch_one(&mut c)
        .await
        .map_err(|e| e.to_string());
    let records = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
        .fetch_one(&mut c)
        .await
        .map_err(|e| e.to_string());
    c.close().await.expect("close");
    (integrity, marker, records)
}

/// Takes `n` connections out of `store`'s pool (opened now, on the file the path names).
async fn hold(store: &SqliteStore, n: usize) -> Vec<sqlx::pool::PoolConnection<sqlx::Sqlite>> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(store.pool().acquire().await.expect("a connection"));
    }
    held
}

/// Readers on held connections: each reads the records in a loop until `stop`; returns the
/// errors they met.
fn readers(
    held: Vec<sqlx::pool::PoolConnection<sqlx::Sqlite>>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<String>>> {
    held.into_iter()
        .map(|mut c| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut errors = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    if let Err(e) =
                        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idempotency_records")
                            .fetch_one(&mut *c)
                            .await
                    {
                        errors.push(e.to_string());
                    }
                    tokio::task::yield_now().await;
                }
                errors
            })
        })
        .collect()
}

// ---- the tests --------------------------------------------------------------------------------

/// DESIGN §1.6 (a store that cannot serve answers 503, nothing run) and §1 (one database per
/// store): the path swapped, atomically and again and again, between the store's file and
/// another (hard link + rename, so the path always names one of the two) while the pool
/// opens connections and two open connections read. `OpenedFile::check` stats the PATH after
/// the connection opened: a connection opened while the path named the other file and checked
/// once it named the store's again is handed out, and reads the other file through the
/// store's `-wal`/`-shm` (the fault 1e63d59 set out to close). Counted through /proc: no
/// connection handed out may hold the other file open; the process must survive; the
/// completed key is never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_path_swapped_back_and_forth_never_hands_out_a_connection_on_the_other_file() {
    if !in_child(
        "s1_6_a_path_swapped_back_and_forth_never_hands_out_a_connection_on_the_other_file",
    )
    .await
    {
        return;
    }
    let path = sqlite_path("fi-toggle");
    let other = sqlite_path("fi-toggle-other");
    let keep = sqlite_path("fi-toggle-keep");
    let tmp = sqlite_path("fi-toggle-tmp");
    let _cleanup = Cleanup::dbs(&[&path, &other, &keep, &tmp]);
    let sink = path.with_extension("sink");
    let store = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    store.migrate().await.expect("migrate");
    let addr = serve(app(store.clone(), sink.clone())).await;
    let done = unique("toggle-done");
    assert_eq!(send(addr, &done).await.status, 201);
    another_database(&other).await;
    let theirs = file_id(&other);
    std::fs::hard_link(&path, &keep).expect("a second name for the store's file");
    let stop = Arc::new(AtomicBool::new(false));
    let reading = readers(hold(&store, 2).await, stop.clone());
    let toggler = std::thread::spawn({
        let (stop, path, other, keep, tmp) = (
            stop.clone(),
            path.clone(),
            other.clone(),
            keep.clone(),
            tmp.clone(),
        );
        move || {
            let put = |from: &Path| {
                let _ = std::fs::remove_file(&tmp);
                std::fs::hard_link(from, &tmp).expect("link");
                std::fs::rename(&tmp, &path).expect("rename over");
            };
            let mut swaps = 0u64;
            while !stop.load(Ordering::SeqCst) {
                put(&other);
                put(&keep);
                swaps += 1;
            }
            swaps
        }
    });
    let mut handed = 0;
    let mut wrong = 0;
    let mut read_there = Vec::new();
    for _ in 0..150 {
        if let Ok(mut c) = store.pool().acquire().await {
            handed += 1;
            // No other connection is being opened now: a descriptor on the other file is
            // this one's.
            if open_on(theirs) > 0 {
                wrong += 1;
                let marker: Result<i64, _> = sqlx::query_scalar("SELECT count(*) FROM marker")
                    .fetch_one(&mut *c)
                    .await;
                read_there.push(marker.map_err(|e| e.to_string()));
            }
            let _ = c.close().await;
        }
        if wrong > 0 && handed > 20 {
            break;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let swaps = toggler.join().expect("the toggler");
    let mut errors = Vec::new();
    for r in reading {
        errors.extend(common::guard("a reader", r).await.expect("reader"));
    }
    println!(
        "swaps {swaps}, connections handed out {handed}, on the other file {wrong} (its \
         `marker` read: {read_there:?}), reader errors {:?}",
        &errors[..errors.len().min(3)]
    );
    assert_eq!(file_id(&path), file_id(&keep), "the store's file is back");
    let again = send(addr, &done).await;
    assert!(
        again.replayed || again.unavailable(),
        "the completed key: {again:?}"
    );
    assert_eq!(effects_of(&sink, &done), 1, "the completed key ran again");
    assert!(handed > 0, "no connection was ever handed out");
    // Every connection closed: what each file now holds, read by plain connections.
    store.pool().close().await;
    let (mine_ok, _, mine) = inspect(&keep).await;
    let (theirs_ok, marker, _) = inspect(&other).await;
    println!(
        "the store's file: integrity {mine_ok:?}, records {mine:?}; the other file: integrity \
         {theirs_ok:?}, marker {marker:?}"
    );
    assert_eq!(
        (theirs_ok.as_str(), marker),
        ("ok", Ok(1)),
        "the other file was overwritten with the store's pages"
    );
    assert!(
        mine_ok == "ok" && mine.as_ref().is_ok_and(|n| *n >= 1),
        "the store's file lost its records: {mine_ok:?} {mine:?}"
    );
    assert_eq!(
        wrong, 0,
        "{wrong} of {handed} connections handed out had opened the OTHER file (opened while the \
         path named it, checked once it named the store's again)"
    );
}

/// DESIGN §1 (one database per store, never two mixed) and the README's "the process is
/// never killed": a running store's file has another renamed over it, and a second store is
/// connected in the same process on the path (a component restarted in-process, or a store
/// rebuilt after answers of 503). Its first connection would set WAL and read the new file
/// while the first store's open connections have the old file's `-wal`/`-shm` under the same
/// names (found by this review: the second store read the old file's WAL). `connect` must
/// refuse while the old file is open here; the process survives; the first store's completed
/// key is never run again; once both stopped and the old `-wal`/`-shm` are deleted, the new
/// file is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_second_store_in_the_process_on_a_file_renamed_over_a_running_ones_mixes_nothing() {
    if !in_child(
        "s1_a_second_store_in_the_process_on_a_file_renamed_over_a_running_ones_mixes_nothing",
    )
    .await
    {
        return;
    }
    let path = sqlite_path("fi-second");
    let fresh = sqlite_path("fi-second-in");
    let _cleanup = Cleanup::dbs(&[&path, &fresh]);
    let sink = path.with_extension("sink");
    let first = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    first.migrate().await.expect("migrate");
    let addr = serve(app(first.clone(), sink.clone())).await;
    let done = unique("second-done");
    assert_eq!(send(addr, &done).await.status, 201);
    another_database(&fresh).await;
    let stop = Arc::new(AtomicBool::new(false));
    let reading = readers(hold(&first, 2).await, stop.clone());
    tokio::time::sleep(ms(30)).await;
    std::fs::rename(&fresh, &path).expect("rename over");
    let second = SqliteStore::connect(&url_of(&path)).await;
    let seen: Result<i64, String> = match &second {
        Ok(s) => sqlx::query_scalar("SELECT count(*) FROM marker")
            .fetch_one(s.pool())
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(format!("connect refused: {e}")),
    };
    tokio::time::sleep(ms(100)).await;
    stop.store(true, Ordering::SeqCst);
    let mut errors = Vec::new();
    for r in reading {
        errors.extend(common::guard("a reader", r).await.expect("reader"));
    }
    let again = send(addr, &done).await;
    if let Ok(s) = &second {
        s.pool().close().await;
    }
    first.pool().close().await;
    // The README's remedy once the server stopped: the old file's `-wal`/`-shm` go.
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(side(&path, suffix));
    }
    let (integrity, marker, _) = inspect(&path).await;
    println!(
        "second store saw marker: {seen:?}; readers' errors {:?}; the file now: integrity \
         {integrity:?}, marker {marker:?}",
        &errors[..errors.len().min(3)]
    );
    assert!(
        again.replayed || again.unavailable(),
        "the completed key: {again:?}"
    );
    assert_eq!(effects_of(&sink, &done), 1, "the completed key ran again");
    assert!(
        second.is_err(),
        "a second store connected on the path while the first still had the replaced file \
         open (it saw the new file's marker: {seen:?})"
    );
    assert_eq!(
        (integrity.as_str(), marker),
        ("ok", Ok(1)),
        "the file renamed in was damaged, or overlaid with the old file's WAL"
    );
}

/// DESIGN §1 (one database per store): the running store's file MOVED AWAY (renamed to
/// another name, not deleted, not renamed over), and another file put at the path. The
/// kernel now names the running store's descriptors after the new name, so nothing open is
/// under the path, but its `-wal` and `-shm` are still the ones under the path's name, and a
/// second store connected there would read the new file through them (the wal-index is
/// shared within the process by name). `check_unshared`'s second condition (a `-wal`/`-shm`
/// in use with no descriptor on the file now at the path) must refuse it; the completed key is
/// never run again, and the new file is left whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_second_store_on_a_path_whose_running_file_was_moved_away_is_refused() {
    if !in_child("s1_a_second_store_on_a_path_whose_running_file_was_moved_away_is_refused").await {
        return;
    }
    let path = sqlite_path("fi-moved");
    let aside = sqlite_path("fi-moved-aside");
    let fresh = sqlite_path("fi-moved-in");
    let _cleanup = Cleanup::dbs(&[&path, &aside, &fresh]);
    let sink = path.with_extension("sink");
    let first = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    first.migrate().await.expect("migrate");
    let addr = serve(app(first.clone(), sink.clone())).await;
    let done = unique("moved-done");
    assert_eq!(send(addr, &done).await.status, 201);
    another_database(&fresh).await;
    let stop = Arc::new(AtomicBool::new(false));
    let reading = readers(hold(&first, 2).await, stop.clone());
    tokio::time::sleep(ms(30)).await;
    std::fs::rename(&path, &aside).expect("move away");
    std::fs::rename(&fresh, &path).expect("put another in its place");
    let held_old = open_on(file_id(&aside));
    let second = SqliteStore::connect(&url_of(&path)).await;
    let seen: Result<i64, String> = match &second {
        Ok(s) => sqlx::query_scalar("SELECT count(*) FROM marker")
            .fetch_one(s.pool())
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(format!("connect refused: {e}")),
    };
    tokio::time::sleep(ms(100)).await;
    stop.store(true, Ordering::SeqCst);
    let mut errors = Vec::new();
    for r in reading {
        errors.extend(common::guard("a reader", r).await.expect("reader"));
    }
    let again = send(addr, &done).await;
    if let Ok(s) = &second {
        s.pool().close().await;
    }
    first.pool().close().await;
    // The README's remedy once the server stopped: the old file's `-wal`/`-shm` go.
    for suffix in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(side(&path, suffix));
    }
    let (integrity, marker, _) = inspect(&path).await;
    println!(
        "descriptors on the moved file: {held_old}; second store saw marker: {seen:?}; \
         readers' errors {:?}; the file now: integrity {integrity:?}, marker {marker:?}",
        &errors[..errors.len().min(3)]
    );
    assert!(
        held_old >= 2,
        "the premise: the running store still has its moved file open ({held_old})"
    );
    assert!(
        again.replayed || again.unavailable(),
        "the completed key: {again:?}"
    );
    assert_eq!(effects_of(&sink, &done), 1, "the completed key ran again");
    assert!(
        second.is_err(),
        "a second store connected on the path while the first still used its -wal/-shm for \
         the file moved away (it saw the new file's marker: {seen:?})"
    );
    assert_eq!(
        (integrity.as_str(), marker),
        ("ok", Ok(1)),
        "the file put in place was damaged, or overlaid with the moved file's WAL"
    );
}

/// DESIGN §1 (a restart opens the new file, one database) and the README row's remedy: a
/// file renamed over a running server's, the server stopped (every connection closed). SQLite
/// neither checkpoints nor deletes the WAL of a database that has moved, so the old file's
/// `-wal` is left beside the new one under its name, and a start would read the new file
/// through it (found by this review: the new file lost its `marker`). With the old `-wal` and
/// `-shm` deleted, as `SqliteStore::connect` and the README say, the restart reads the new
/// file as it is (its `marker`, none of the old file's records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_restart_after_a_file_was_renamed_over_a_running_server_reads_the_new_file_alone() {
    if !in_child(
        "s1_a_restart_after_a_file_was_renamed_over_a_running_server_reads_the_new_file_alone",
    )
    .await
    {
        return;
    }
    let path = sqlite_path("fi-restart");
    let fresh = sqlite_path("fi-restart-in");
    let _cleanup = Cleanup::dbs(&[&path, &fresh]);
    let sink = path.with_extension("sink");
    let old = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    old.migrate().await.expect("migrate");
    let addr = serve(app(old.clone(), sink.clone())).await;
    let done = unique("restart-done");
    assert_eq!(send(addr, &done).await.status, 201);
    another_database(&fresh).await;
    std::fs::rename(&fresh, &path).expect("rename over");
    // The server stops: its pool closes every connection.
    old.pool().close().await;
    let wal_left = side(&path, "-wal").exists();
    assert!(
        wal_left,
        "SQLite removed the moved file's -wal: the README's remedy (delete it) is needless"
    );
    // The README's remedy: the old file's `-wal`/`-shm` go before the restart.
    for suffix in ["-wal", "-shm"] {
        std::fs::remove_file(side(&path, suffix)).expect("the old file's -wal/-shm");
    }
    // The restart, on the path (now the new file).
    let restarted = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    let marker: Result<i64, String> = sqlx::query_scalar("SELECT count(*) FROM marker")
        .fetch_one(restarted.pool())
        .await
        .map_err(|e| e.to_string());
    let records: Result<i64, String> =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
            .fetch_one(restarted.pool())
            .await
            .map_err(|e| e.to_string());
    restarted.pool().close().await;
    let (integrity, marker_after, _) = inspect(&path).await;
    println!(
        "old -wal left beside the new file: {wal_left}; restart saw marker {marker:?}, records \
         {records:?}; the file: integrity {integrity:?}, marker {marker_after:?}"
    );
    assert_eq!(effects_of(&sink, &done), 1);
    assert_eq!(
        (marker, records),
        (Ok(1), Ok(0)),
        "the restarted store did not read the new file as it is: the old file's WAL (left \
         beside it, -wal present: {wal_left}) was replayed into it"
    );
    assert_eq!(
        (integrity.as_str(), marker_after),
        ("ok", Ok(1)),
        "the new file was damaged"
    );
}

/// README row: "No empty database is made in a deleted one's place" (a restart on such a file
/// would run every completed key again, DESIGN §1). The URL asks `?mode=rwc` (create if
/// missing), which sqlx reads into the options the pool's connections are opened with: after
/// the file (and its `-wal`, `-shm`) is deleted under the running store, a connection the pool
/// opens creates it again before the check refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_deleted_file_is_not_made_anew_when_the_url_asks_mode_rwc() {
    if !in_child("s1_6_a_deleted_file_is_not_made_anew_when_the_url_asks_mode_rwc").await {
        return;
    }
    let path = sqlite_path("fi-rwc");
    let _cleanup = Cleanup::dbs(&[&path]);
    let sink = path.with_extension("sink");
    let url = format!("{}?mode=rwc", url_of(&path));
    let store = SqliteStore::connect(&url).await.expect("connect");
    store.migrate().await.expect("migrate");
    let addr = serve(app(store.clone(), sink.clone())).await;
    let done = unique("rwc-done");
    assert_eq!(send(addr, &done).await.status, 201);
    let held = hold_all(&store).await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(side(&path, suffix));
    }
    let opened = tokio::time::timeout(Duration::from_secs(1), store.pool().acquire()).await;
    assert!(
        !matches!(opened, Ok(Ok(_))),
        "a connection was handed out on a deleted file"
    );
    let made = path.exists();
    drop(held);
    let again = send(addr, &done).await;
    assert!(
        again.replayed || again.unavailable(),
        "the completed key: {again:?}"
    );
    assert_eq!(effects_of(&sink, &done), 1, "the completed key ran again");
    assert!(
        !made,
        "a file was made in the deleted database's place ({} bytes) by a refused connection",
        std::fs::metadata(&path).map_or(0, |m| m.len())
    );
}

/// DESIGN §1.6 and §1, the README row's "connections already open keep the old file": the
/// store's file renamed away (no file at the path), every connection of the pool lapsing
/// meanwhile (closed, as idle ones are), then the file renamed back. While away, a new key is
/// answered 503 (nothing run) or runs once; once back, the store serves again without a
/// restart: the completed key is replayed, a new key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_file_moved_away_and_back_is_served_again_without_a_restart() {
    if !in_child("s1_6_a_file_moved_away_and_back_is_served_again_without_a_restart").await {
        return;
    }
    let path = sqlite_path("fi-back");
    let aside = sqlite_path("fi-back-aside");
    let _cleanup = Cleanup::dbs(&[&path, &aside]);
    let sink = path.with_extension("sink");
    let store = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    store.migrate().await.expect("migrate");
    let addr = serve(app(store.clone(), sink.clone())).await;
    let done = unique("back-done");
    assert_eq!(send(addr, &done).await.status, 201);
    std::fs::rename(&path, &aside).expect("move away");
    let away = unique("back-away");
    let answer = send(addr, &away).await;
    assert!(
        answer.status == 201 || answer.unavailable(),
        "a new key while the file is away: {answer:?}"
    );
    // The pool's connections lapse (closed, as idle ones are) while the file is away.
    for c in hold_all(&store).await {
        let _ = c.close().await;
    }
    assert!(!path.exists(), "a file was made at the path");
    std::fs::rename(&aside, &path).expect("move back");
    let again = send(addr, &done).await;
    assert!(again.replayed, "the completed key, file back: {again:?}");
    let later = unique("back-later");
    assert_eq!(send(addr, &later).await.status, 201, "a new key, file back");
    assert!(send(addr, &later).await.replayed);
    let counts = effects(&sink);
    assert_eq!(
        counts.get(&done).copied(),
        Some(1),
        "the completed key ran again"
    );
    assert!(counts.get(&away).copied().unwrap_or(0) <= 1);
    assert_eq!(counts.get(&later).copied(), Some(1));
    let (integrity, _, _) = inspect(&path).await;
    assert_eq!(integrity, "ok");
}

/// DESIGN §1 and §1.6: the store's file moved to another directory of the same file system
/// and a symlink left at the path (an operator moving data to another disk). `stat` follows the
/// link to the same inode, so the check accepts a new connection; SQLite resolves the link and
/// names that connection's WAL after the target (`<target>-wal`), while the open connections
/// write `<path>-wal` and share one wal-index with it (one inode). The new connection must
/// read what the open ones committed; a key completed before is replayed or refused 503,
/// never run again; every key runs at most once; the file stays intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_a_file_moved_and_symlinked_back_is_read_whole_by_new_connections() {
    if !in_child("s1_a_file_moved_and_symlinked_back_is_read_whole_by_new_connections").await {
        return;
    }
    let path = sqlite_path("fi-link");
    let dir = sqlite_path("fi-link-dir");
    std::fs::create_dir(&dir).expect("dir");
    let target = dir.join("moved.db");
    let _cleanup = Cleanup::dbs(&[&path, &target, &dir]);
    let sink = path.with_extension("sink");
    let store = SqliteStore::connect(&url_of(&path)).await.expect("connect");
    store.migrate().await.expect("migrate");
    let addr = serve(app(store.clone(), sink.clone())).await;
    let keys: Vec<String> = (0..5).map(|i| unique(&format!("link-{i}"))).collect();
    for key in &keys {
        assert_eq!(send(addr, key).await.status, 201);
    }
    let mut held = hold(&store, store.pool().size().max(1) as usize).await;
    let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
        .fetch_one(&mut *held[0])
        .await
        .expect("count");
    std::fs::rename(&path, &target).expect("move");
    std::os::unix::fs::symlink(&target, &path).expect("symlink");
    let fresh = tokio::time::timeout(Duration::from_secs(2), store.pool().acquire()).await;
    let seen: Result<i64, String> = match fresh {
        Ok(Ok(mut c)) => {
            let n = sqlx::query_scalar("SELECT count(*) FROM idempotency_records")
                .fetch_one(&mut *c)
                .await
                .map_err(|e| e.to_string());
            drop(c);
            n
        }
        Ok(Err(e)) => Err(format!("refused: {e}")),
        Err(_) => Err("not handed out".to_owned()),
    };
    drop(held);
    let mut answers = Vec::new();
    for key in &keys {
        answers.push(send(addr, key).await);
    }
    let new = unique("link-new");
    let _ = send(addr, &new).await;
    let _ = send(addr, &new).await;
    store.pool().close().await;
    let (integrity, _, records) = inspect(&target).await;
    println!(
        "committed {committed}, a new connection saw {seen:?}; answers {answers:?}; the file: \
         integrity {integrity:?}, records {records:?}"
    );
    let counts = effects(&sink);
    for (key, answer) in keys.iter().zip(&answers) {
        assert_eq!(
            counts.get(key).copied(),
            Some(1),
            "{key} ran again: {answer:?}"
        );
        assert!(answer.replayed || answer.unavailable(), "{key}: {answer:?}");
    }
    assert!(counts.get(&new).copied().unwrap_or(0) <= 1);
    assert!(
        seen.is_err() || seen == Ok(committed),
        "a new connection through the symlink read {seen:?} records, the open ones {committed}"
    );
    assert_eq!(integrity, "ok", "the moved file was damaged");
}

/// DESIGN §1 (one execution per key) for the in-memory forms, which 1e63d59 must leave
/// untouched: `sqlite::memory:` and `sqlite://file:x?mode=memory&cache=shared` keep one
/// database for the store (its anchor connection), a key runs once and is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_the_in_memory_forms_run_a_key_once_and_replay_it() {
    if !in_child("s1_the_in_memory_forms_run_a_key_once_and_replay_it").await {
        return;
    }
    let sink = sqlite_path("fi-memory").with_extension("sink");
    let _cleanup = Cleanup(vec![sink.clone()]);
    let name = unique("fi-mem");
    for url in [
        "sqlite::memory:".to_owned(),
        format!("sqlite://file:{name}?mode=memory&cache=shared"),
    ] {
        let store = SqliteStore::connect(&url).await.expect("connect");
        store.migrate().await.expect("migrate");
        store.check().await.expect("check");
        let addr = serve(app(store.clone(), sink.clone())).await;
        let key = unique("mem");
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let key = key.clone();
            tasks.push(tokio::spawn(async move { send(addr, &key).await }));
        }
        for t in tasks {
            let a = common::guard("a request", t).await.expect("task");
            assert!(
                [201, 409].contains(&a.status),
                "{url}: {a:?} (the in-memory store refused)"
            );
        }
        let last = send(addr, &key).await;
        assert!(last.replayed, "{url}: {last:?}");
        assert_eq!(effects_of(&sink, &key), 1, "{url}: the key ran twice");
        assert!(
            !Path::new(&name).exists() && !Path::new(&format!("file:{name}")).exists(),
            "{url}: a file was made on disk"
        );
    }
}

/// DESIGN §1 and §1.6 with a relative path (`sqlite://records.db`, the quickstart's form), in
/// a child whose working directory is the database's: the kernel names descriptors by their
/// absolute path, so the checks must resolve the one given. Another file renamed over the
/// store's: a connection the pool opens is refused, and a second store on the same relative
/// path is refused while the first still has the old file open; the completed key never runs
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_6_a_relative_path_is_checked_as_the_file_it_names() {
    if !in_child("s1_6_a_relative_path_is_checked_as_the_file_it_names").await {
        return;
    }
    let dir = std::env::temp_dir().join(unique("fi-relative"));
    std::fs::create_dir(&dir).expect("dir");
    let _cleanup = Cleanup(vec![dir.clone()]);
    std::env::set_current_dir(&dir).expect("cd");
    let (path, fresh, sink) = (
        Path::new("records.db"),
        Path::new("fresh.db"),
        dir.join("effects.sink"),
    );
    let first = SqliteStore::connect("sqlite://records.db")
        .await
        .expect("connect");
    first.migrate().await.expect("migrate");
    let addr = serve(app(first.clone(), sink.clone())).await;
    let done = unique("relative-done");
    assert_eq!(send(addr, &done).await.status, 201);
    another_database(fresh).await;
    let held = hold_all(&first).await;
    std::fs::rename(fresh, path).expect("rename over");
    let opened = tokio::time::timeout(Duration::from_secs(1), first.pool().acquire()).await;
    assert!(
        !matches!(opened, Ok(Ok(_))),
        "a connection on the file renamed over a relative path was handed out"
    );
    let second = SqliteStore::connect("sqlite://records.db").await;
    assert!(
        second.is_err(),
        "a second store opened the relative path while the first had the old file open"
    );
    drop(held);
    let again = send(addr, &done).await;
    assert!(
        again.replayed || again.unavailable(),
        "the completed key: {again:?}"
    );
    assert_eq!(effects_of(&sink, &done), 1, "the completed key ran again");
}
