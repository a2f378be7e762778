//! An event stream (SSE) read as it arrives, for the call's final response.

use bytes::Bytes;
use http::{HeaderMap, header};

use super::id::Id;
use super::reply::{Reply, read};

/// Whether a response is an event stream (`text/event-stream`, in any case: media types are
/// case-insensitive).
pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    const SSE: &[u8] = b"text/event-stream";
    crate::lines::get(headers, &header::CONTENT_TYPE).is_some_and(|ct| {
        // Whitespace around a value is not part of it (an in-process service may leave some).
        let ct = ct.as_bytes().trim_ascii_start();
        ct.len() >= SSE.len()
            && ct[..SSE.len()].eq_ignore_ascii_case(SSE)
            && matches!(ct.get(SSE.len()), None | Some(b';' | b' ' | b'\t'))
    })
}

/// An event stream read as it arrives, as the WHATWG EventSource parser reads it: lines end in
/// CRLF, LF or CR; `data` fields gather; a blank line ends an event. Each byte is looked at
/// once, so the cost is linear however the stream is cut into chunks.
#[derive(Debug, Default)]
pub(crate) struct Events {
    /// The line being read.
    line: Vec<u8>,
    /// The `data` of the event being read, lines joined by `\n`.
    data: Vec<u8>,
    /// Whether the event has a `data` field at all.
    has_data: bool,
    /// The last byte was a CR: a LF right after it ends no second line.
    after_cr: bool,
    /// Whether a line has ended yet: the stream's first line may start with a byte-order mark.
    past_first_line: bool,
    /// Whether an event said the call's key goes back: an interim result to it, or an error
    /// to a `null` id before any other message (after one, the server had read the call).
    gives_back: bool,
    /// Whether an event has carried a JSON-RPC message yet (a priming event carries none).
    spoke: bool,
}

impl Events {
    /// Takes the next bytes of the stream; the final response to `id`, the first time an
    /// event carrying one is complete.
    pub(crate) fn feed(&mut self, data: &[u8], id: &Id) -> Option<Bytes> {
        let mut found = None;
        for &b in data {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            let event = match b {
                b'\r' => {
                    self.after_cr = true;
                    self.end_line()
                }
                b'\n' => self.end_line(),
                _ => {
                    self.line.push(b);
                    None
                }
            };
            if found.is_none()
                && let Some(event) = event
            {
                found = self.final_message(&event, id);
            }
        }
        found
    }

    /// Whether a stream that ended without the call's final response gives the key back
    /// ([`Answer::NotFinal`](super::Answer::NotFinal)) rather than being taken as done
    /// ([`Answer::Unseen`](super::Answer::Unseen)).
    pub(crate) fn gives_back(&self) -> bool {
        self.gives_back
    }

    /// The stream ended: an event cut short of its blank line still counts (the server
    /// answered; readers that wait for the blank line would lose it).
    pub(crate) fn finish(&mut self, id: &Id) -> Option<Bytes> {
        let pending = if self.line.is_empty() {
            None
        } else {
            self.end_line()
        };
        let event = pending.or_else(|| self.dispatch());
        event.and_then(|event| self.final_message(&event, id))
    }

    /// The final response to `id` in one event's data, if it is one; notes an event that
    /// gives the key back.
    pub(super) fn final_message(&mut self, data: &[u8], id: &Id) -> Option<Bytes> {
        let reply = read(data, id)?;
        let first = !self.spoke;
        self.spoke |= data.trim_ascii_start().starts_with(b"{");
        match reply {
            Reply::Final => return Some(Bytes::copy_from_slice(data)),
            Reply::Interim => self.gives_back = true,
            Reply::NotRead if first => self.gives_back = true,
            Reply::NotRead | Reply::Other => {}
        }
        None
    }

    /// Ends the current line: a field, or (when empty) the end of an event, whose data it
    /// hands back.
    fn end_line(&mut self) -> Option<Vec<u8>> {
        if self.line.is_empty() {
            self.past_first_line = true;
            return self.dispatch();
        }
        let line = std::mem::take(&mut self.line);
        let first = !std::mem::replace(&mut self.past_first_line, true);
        // The stream may start with a byte-order mark: not part of the first field's name.
        let line = match line.strip_prefix(b"\xef\xbb\xbf") {
            Some(rest) if first => rest,
            _ => &line[..],
        };
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        None
    }

    fn dispatch(&mut self) -> Option<Vec<u8>> {
        if !self.has_data {
            return None;
        }
        self.has_data = false;
        Some(std::mem::take(&mut self.data))
    }
}
