//! Where the `tracing` subscriber's lines go: stderr, buffered on the thread that
//! writes the access log.
//!
//! `tracing-subscriber` formats each event into one string and writes it with one
//! `write_all` on the writer [`Stderr`] makes. On most threads (start-up, reloads,
//! warnings: a few lines) that goes straight to the unbuffered stderr. The
//! `radixgate-log` thread, which writes a line per request, calls [`buffer`] first:
//! its lines then collect in a thread-local buffer that [`flush`] writes out in one
//! syscall, which [`crate::access_log::run`] does [`crate::access_log::LINGER`] after
//! the first line it buffered (so a burst of requests costs one write and a quiet
//! gateway's lines are not held back long), when the buffer passes [`FLUSH_AT`], and
//! when it ends.

use std::cell::RefCell;
use std::io::{self, Write};

/// A buffer this large is written out even while records keep coming.
pub const FLUSH_AT: usize = 64 << 10;

thread_local! {
    /// `Some` on a thread that called [`buffer`].
    static BUFFER: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// The subscriber's writer: `tracing_subscriber::fmt().with_writer(Stderr)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line
    }
}

/// One event's write: into this thread's buffer if it has one, else to stderr.
pub struct Line;

impl Write for Line {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let buffered = BUFFER.with(|b| match b.try_borrow_mut() {
            Ok(mut b) => match b.as_mut() {
                Some(buf) => {
                    buf.extend_from_slice(bytes);
                    true
                }
                None => false,
            },
            Err(_) => false,
        });
        if buffered {
            return Ok(bytes.len());
        }
        io::stderr().write(bytes)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// From now on, this thread's lines collect until [`flush`].
pub fn buffer() {
    BUFFER.with(|b| *b.borrow_mut() = Some(Vec::with_capacity(FLUSH_AT)));
}

/// Bytes waiting in this thread's buffer.
pub fn pending() -> usize {
    BUFFER.with(|b| b.borrow().as_ref().map_or(0, Vec::len))
}

/// Writes this thread's buffered lines to stderr in one `write_all`.
pub fn flush() {
    BUFFER.with(|b| {
        if let Some(buf) = b.borrow_mut().as_mut() {
            if !buf.is_empty() {
                // Nothing useful to do when stderr is gone.
                let _ = io::stderr().lock().write_all(buf);
                buf.clear();
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_only_on_a_thread_that_asks() {
        std::thread::spawn(|| {
            assert_eq!(pending(), 0);
            buffer();
            Line.write_all(b"one\n").unwrap();
            Line.write_all(b"two\n").unwrap();
            assert_eq!(pending(), 8);
            flush();
            assert_eq!(pending(), 0);
        })
        .join()
        .unwrap();
        // Another thread's lines go straight out.
        assert_eq!(pending(), 0);
        Line.write_all(b"").unwrap();
        assert_eq!(pending(), 0);
    }
}
