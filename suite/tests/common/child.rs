//! A child process of the running test binary: one test run again by name with a variable set
//! (the test then does its child's half, a server most often), its stdout read line by line,
//! killed (SIGKILL) when dropped. For what needs a process of its own: a server killed mid
//! write, servers of separate processes on one SQLite file, a process's file-size limit.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A child process of this binary, killed (SIGKILL) when dropped.
pub struct Proc {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    addr: Option<SocketAddr>,
}

impl Proc {
    /// Runs `test` of this binary again with `var` set to `mode` and `env`, its stderr
    /// dropped; `wrap` goes before it (`sh -c` to ignore SIGXFSZ, `setpriv` to drop root).
    /// Does not wait for it.
    pub fn spawn(test: &str, var: &str, mode: &str, env: &[(&str, String)], wrap: &[&str]) -> Self {
        let exe = std::env::current_exe().expect("this binary");
        let mut command = match wrap.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        command
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(var, mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawn the child");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            addr: None,
        }
    }

    /// Waits (up to 60 s) for the child's `LISTENING <addr>` banner.
    pub fn listening(mut self) -> Self {
        let line = self.wait_for("LISTENING ").expect("the server's banner");
        self.addr = line.strip_prefix("LISTENING ").and_then(|a| a.parse().ok());
        assert!(self.addr.is_some(), "no address in {line:?}");
        self
    }

    /// The address the child's banner gave.
    pub fn addr(&self) -> SocketAddr {
        self.addr.expect("a server")
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The first line holding `prefix`, from it on, within 60 s.
    pub fn wait_for(&self, prefix: &str) -> Option<String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                // The harness's `test name ... ` has no newline: the banner may follow it.
                Ok(line) if line.contains(prefix) => {
                    let at = line.find(prefix).unwrap_or_default();
                    return Some(line[at..].to_owned());
                }
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
