//! An interactive `sqlite3` CLI holding a file's write lock: an operator's session, a backup
//! or migration tool, as the SQLite reviews meet it.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};

/// An interactive `sqlite3` process holding `BEGIN IMMEDIATE` (the write lock) until
/// [`HeldCli::release`], killed when dropped. It waits for the lock (`.timeout`) and bails on
/// any error, so a `LOCKED` answer means it holds it.
pub struct HeldCli {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl HeldCli {
    /// Takes the write lock on the database at `path`; `None` (reported through
    /// [`super::unreachable`], which fails under `CI=true`) when there is no `sqlite3` CLI.
    pub fn hold(path: &Path) -> Option<Self> {
        let mut child = match Command::new("sqlite3")
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                super::unreachable("the sqlite3 CLI (Debian: sqlite3)", &e);
                return None;
            }
        };
        let mut stdin = child.stdin.take().expect("stdin");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        stdin
            .write_all(b".bail on\n.timeout 10000\nBEGIN IMMEDIATE;\nSELECT 'LOCKED';\n")
            .expect("to the CLI");
        stdin.flush().expect("flush");
        let mut line = String::new();
        out.read_line(&mut line).expect("the CLI's answer");
        assert_eq!(line.trim(), "LOCKED", "the CLI took the write lock");
        Some(Self {
            child,
            stdin: Some(stdin),
        })
    }

    /// Rolls back and quits: the CLI closes its connection (checkpointing, and removing the
    /// `-wal`/`-shm` if it finds itself the file's last connection).
    pub fn release(mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.write_all(b"ROLLBACK;\n.quit\n");
        }
        let _ = self.child.wait();
    }
}

impl Drop for HeldCli {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
