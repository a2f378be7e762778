//! SQLite files as an operator handles them under a running store: another database put in
//! its place, and a pool's open connections held so the next acquire opens one; and the
//! paths the SQLite reviews share (a database's URL, its side files, their removal).

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::Connection;
use tower_idempotency::store::SqliteStore;

/// The URL `SqliteStore::connect` takes for the file at `path`.
pub fn url_of(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

/// The file beside a database named by its suffix (`-wal`, `-shm`, `-journal`).
pub fn side(path: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}{suffix}", path.display()))
}

/// Removes databases (with their `-wal`, `-shm`, `-journal` and `.sink`), and whatever else
/// was added, when dropped.
pub struct Cleanup(pub Vec<PathBuf>);

impl Cleanup {
    /// One database and its side files.
    pub fn db(path: &Path) -> Self {
        Self::dbs(&[path])
    }

    /// Several databases and their side files.
    pub fn dbs(paths: &[&Path]) -> Self {
        let mut all = Vec::new();
        for path in paths {
            all.push(path.to_path_buf());
            for suffix in ["-wal", "-shm", "-journal"] {
                all.push(side(path, suffix));
            }
            all.push(path.with_extension("sink"));
        }
        Self(all)
    }

    /// A file or directory more.
    pub fn and(mut self, path: PathBuf) -> Self {
        self.0.push(path);
        self
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            if p.is_dir() {
                let _ = std::fs::remove_dir_all(p);
            } else {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Makes a migrated database at `path` with a table of its own (`marker`, one row), all in
/// the file itself (rollback journal: no `-wal`/`-shm`): the file an operator puts in a
/// running store's place.
pub async fn another_database(path: &Path) {
    let other = SqliteStore::connect(&url_of(path)).await.expect("connect");
    other.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE marker (x)")
        .execute(other.pool())
        .await
        .expect("marker");
    sqlx::query("INSERT INTO marker VALUES ('the other database')")
        .execute(other.pool())
        .await
        .expect("marker row");
    other.pool().close().await;
    let mut last = sqlx::SqliteConnection::connect(&url_of(path))
        .await
        .expect("connect");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode = DELETE")
        .fetch_one(&mut last)
        .await
        .expect("journal mode");
    assert_eq!(mode, "delete", "another connection is still open");
    last.close().await.expect("close");
    for suffix in ["-wal", "-shm"] {
        let side = side(path, suffix);
        assert!(!side.exists(), "{} is left", side.display());
    }
}

/// Takes every connection `store`'s pool has open out of it, none opened for it: those
/// idle, and those still on their way back from a request.
pub async fn hold_all(store: &SqliteStore) -> Vec<sqlx::pool::PoolConnection<sqlx::Sqlite>> {
    let mut held = Vec::new();
    for _ in 0..500 {
        while let Some(c) = store.pool().try_acquire() {
            held.push(c);
        }
        if !held.is_empty() && held.len() >= store.pool().size() as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!held.is_empty(), "no open connection to hold");
    held
}
