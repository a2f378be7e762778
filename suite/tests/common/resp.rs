//! Reading the Redis protocol (RESP) a client sends, for proxies that act on one command.

/// One RESP command (an array of bulk strings, as redis-rs sends them) at the head of `buf`:
/// its length and its arguments; `None` while incomplete.
pub fn parse_command(buf: &[u8]) -> Option<(usize, Vec<Vec<u8>>)> {
    fn line(buf: &[u8], from: usize) -> Option<(i64, usize)> {
        let end = buf[from..].windows(2).position(|w| w == b"\r\n")? + from;
        let n = std::str::from_utf8(&buf[from..end]).ok()?.parse().ok()?;
        Some((n, end + 2))
    }
    if buf.is_empty() {
        return None;
    }
    if buf[0] != b'*' {
        let end = buf.windows(2).position(|w| w == b"\r\n")?;
        return Some((end + 2, vec![buf[..end].to_vec()]));
    }
    let (n, mut pos) = line(buf, 1)?;
    let mut args = Vec::new();
    for _ in 0..n.max(0) {
        if pos >= buf.len() {
            return None;
        }
        let (len, p) = line(buf, pos + 1)?;
        let len = len.max(0) as usize;
        if buf.len() < p + len + 2 {
            return None;
        }
        args.push(buf[p..p + len].to_vec());
        pos = p + len + 2;
    }
    Some((pos, args))
}
