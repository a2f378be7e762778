//! The database file a [`SqliteStore`](super::SqliteStore) opened, and connections that must
//! not open another under its name.
//!
//! An operator who deletes the file, or renames another over it, under a running server leaves
//! the path naming another file while the pool's open connections keep the old one. A
//! connection then opened on the new file shares the `-wal` and `-shm` names with them, and
//! SQLite shares a WAL index within a process by the database's inode while POSIX locks never
//! conflict within a process: the new connection takes itself for the index's only user, so
//! its first read truncates the `-shm` the old connections have mapped (their next read kills
//! the process with SIGBUS) and reads the old file's WAL into the new file. So a connection is
//! refused before it reads a page unless it can only have opened the file first opened, and a
//! store does not open a file under a name whose `-wal`/`-shm` this process uses for another.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// A file told apart from every other, even one given its inode number once it is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Id {
    dev: u64,
    ino: u64,
    born: Option<SystemTime>,
}

impl Id {
    #[cfg(unix)]
    fn of(metadata: &std::fs::Metadata) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        Some(Self {
            dev: metadata.dev(),
            ino: metadata.ino(),
            born: metadata.created().ok(),
        })
    }

    #[cfg(not(unix))]
    fn of(_: &std::fs::Metadata) -> Option<Self> {
        None
    }

    /// The file at `path` now (following links); `None` if there is none or it cannot be told.
    fn at(path: &Path) -> Option<Self> {
        std::fs::metadata(path).ok().and_then(|m| Self::of(&m))
    }
}

/// The database file [`SqliteStore::connect`](super::SqliteStore::connect) opened, which every
/// connection its pool opens later must have opened.
pub(super) struct OpenedFile {
    path: PathBuf,
    id: Id,
}

impl OpenedFile {
    /// The file at `path` now; `None` where it cannot be told (not a Unix host, or a name
    /// SQLite resolves and `stat` does not).
    pub(super) fn of(path: &Path) -> Option<Self> {
        Some(Self {
            path: path.to_owned(),
            id: Id::at(path)?,
        })
    }

    /// Refuses a connection just opened (before it reads a page) unless the path still names
    /// the file first opened and, where the host tells (Linux), no descriptor of this process
    /// under the name is on another file: the path alone would pass a connection that opened
    /// another file renamed in and away again before this ran.
    pub(super) fn check(&self) -> Result<(), sqlx::Error> {
        if Id::at(&self.path) != Some(self.id) {
            return Err(refused(&format!(
                "{} is not the database file this store opened: it was deleted or replaced \
                 under the running store; stop the server, delete the -wal and -shm beside \
                 the file (the old one's), and start it again to open the one there now",
                self.path.display()
            )));
        }
        if open_under(&self.path).others(Some(self.id)) {
            return Err(refused(&format!(
                "this process has another file open under {}'s name (a connection opened \
                 while another was renamed over it)",
                self.path.display()
            )));
        }
        Ok(())
    }
}

/// Refuses to open `path` while this process has another file open under its name, or
/// uses its `-wal`/`-shm` for another (a store still running on a file since deleted,
/// replaced or moved away): the first read would mix the two (see the module's doc).
pub(super) fn check_unshared(path: &Path) -> Result<(), sqlx::Error> {
    let seen = open_under(path);
    let now = Id::at(path);
    if seen.others(now) || (seen.side && !now.is_some_and(|now| seen.files.contains(&now))) {
        return Err(refused(&format!(
            "this process still has the database file that was at {} open (another store or \
             connection on it runs, sharing its -wal and -shm names): close it before opening \
             the file there now",
            path.display()
        )));
    }
    Ok(())
}

fn refused(why: &str) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::other(why.to_owned()))
}

/// What this process has open under a database's name.
#[derive(Default)]
struct Seen {
    /// The files of descriptors opened under the name (since deleted or replaced or not).
    files: Vec<Id>,
    /// Whether a descriptor is on the `-wal` or `-shm` now under the name.
    side: bool,
}

impl Seen {
    /// Whether a file under the name is not `this`.
    fn others(&self, this: Option<Id>) -> bool {
        self.files.iter().any(|f| Some(*f) != this)
    }
}

/// Reads `/proc/self/fd`: the kernel names each descriptor's file by the path it was opened
/// under, ` (deleted)` added once that name is gone (deleted, or another renamed over it).
#[cfg(target_os = "linux")]
fn open_under(path: &Path) -> Seen {
    let Some(name) = canonical(path) else {
        return Seen::default();
    };
    let name = name.into_os_string();
    let mut deleted = name.clone();
    deleted.push(" (deleted)");
    let (mut wal, mut shm) = (name.clone(), name.clone());
    wal.push("-wal");
    shm.push("-shm");
    let mut seen = Seen::default();
    let Ok(descriptors) = std::fs::read_dir("/proc/self/fd") else {
        return seen;
    };
    for descriptor in descriptors.flatten() {
        let Ok(target) = std::fs::read_link(descriptor.path()) else {
            continue;
        };
        let target = target.into_os_string();
        if target == wal || target == shm {
            seen.side = true;
        } else if target == name || target == deleted {
            // The descriptor's own file, however it is named now.
            if let Some(id) = Id::at(&descriptor.path())
                && !seen.files.contains(&id)
            {
                seen.files.push(id);
            }
        }
    }
    seen
}

#[cfg(not(target_os = "linux"))]
fn open_under(_: &Path) -> Seen {
    Seen::default()
}

/// `path` as the kernel names it (links followed), even where the file itself is gone.
#[cfg(target_os = "linux")]
fn canonical(path: &Path) -> Option<PathBuf> {
    std::fs::canonicalize(path).ok().or_else(|| {
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
    })
}
