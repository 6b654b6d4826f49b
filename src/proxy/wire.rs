//! The upstream request as it goes on the wire: the head the gateway wrote (a pooled
//! buffer) and the request body, sent together in one vectored write. The body is
//! shared (`Rc`) with the request, so it goes out from the buffer it was read into,
//! without a copy, and is still there for a retry or failover on another backend.
//! While a write is in flight the runtime owns this value (and with it the head, the
//! body and the iovecs the kernel reads), so a cancelled write cannot free them early.

use crate::tls::Stream;
use monoio::buf::IoVecBuf;
use monoio::io::AsyncWriteRent;
use std::rc::Rc;

/// A request head and optional body, with the iovecs still to be written.
pub(crate) struct Outgoing {
    head: Vec<u8>,
    body: Option<Rc<Vec<u8>>>,
    /// Boxed so that the pointer handed to the kernel stays put when this moves.
    iov: Box<[libc::iovec; 2]>,
    /// `iov[first..count]` is what remains to be written.
    first: usize,
    count: usize,
}

impl Outgoing {
    pub(crate) fn new(head: Vec<u8>, body: Option<Rc<Vec<u8>>>) -> Self {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let mut out = Self {
            head,
            body,
            iov: Box::new([empty; 2]),
            first: 0,
            count: 0,
        };
        out.rewind();
        out
    }

    /// Everything is to be written again (for a fresh connection).
    pub(crate) fn rewind(&mut self) {
        let pieces = [Some(&self.head[..]), self.body.as_deref().map(|b| &b[..])];
        self.first = 0;
        self.count = 0;
        for piece in pieces.into_iter().flatten().filter(|p| !p.is_empty()) {
            self.iov[self.count] = libc::iovec {
                iov_base: piece.as_ptr() as *mut libc::c_void,
                iov_len: piece.len(),
            };
            self.count += 1;
        }
    }

    fn remaining(&self) -> usize {
        self.iov[self.first..self.count]
            .iter()
            .map(|v| v.iov_len)
            .sum()
    }

    /// Marks `n` more bytes as written.
    fn consume(&mut self, mut n: usize) {
        while n > 0 && self.first < self.count {
            let v = &mut self.iov[self.first];
            let k = n.min(v.iov_len);
            // SAFETY: `k` is within the piece `v` points into.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(k) }.cast();
            v.iov_len -= k;
            n -= k;
            if v.iov_len == 0 {
                self.first += 1;
            }
        }
    }

    /// The head's buffer, to go back to the shard's pool.
    pub(crate) fn into_head(self) -> Vec<u8> {
        self.head
    }

    /// Writes all that remains; hands the value back either way.
    pub(crate) async fn write_to(mut self, stream: &mut Stream) -> (std::io::Result<()>, Self) {
        while self.remaining() > 0 {
            let (r, out) = stream.writev(self).await;
            self = out;
            match r {
                Ok(0) => return (Err(std::io::ErrorKind::WriteZero.into()), self),
                Ok(n) => self.consume(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return (Err(e), self),
            }
        }
        (Ok(()), self)
    }
}

// SAFETY: the iovecs point into `head` and `body`, which this value owns (the body
// through an `Rc`, never mutated while shared) and which do not move when it moves;
// the iovec array itself is boxed, so its address is stable too.
unsafe impl IoVecBuf for Outgoing {
    fn read_iovec_ptr(&self) -> *const libc::iovec {
        self.iov[self.first..].as_ptr()
    }

    fn read_iovec_len(&self) -> usize {
        self.count - self.first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(out: &Outgoing) -> Vec<u8> {
        out.iov[out.first..out.count]
            .iter()
            // SAFETY: each iovec points into `out`'s head or body.
            .flat_map(|v| unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) })
            .copied()
            .collect()
    }

    #[test]
    fn partial_writes_resume_where_they_stopped_and_rewind_restarts() {
        let body = Rc::new(b"{\"a\":1}".to_vec());
        let mut out = Outgoing::new(b"POST / HTTP/1.1\r\n\r\n".to_vec(), Some(body.clone()));
        let whole = b"POST / HTTP/1.1\r\n\r\n{\"a\":1}".to_vec();
        assert_eq!(pending(&out), whole);
        out.consume(5);
        assert_eq!(pending(&out), whole[5..]);
        out.consume(whole.len() - 5 - 3);
        assert_eq!(pending(&out), b":1}");
        assert_eq!(out.read_iovec_len(), 1);
        out.consume(3);
        assert_eq!(out.remaining(), 0);
        out.rewind();
        assert_eq!(pending(&out), whole);
        // The body is shared, not copied, and survives the request.
        assert_eq!(Rc::strong_count(&body), 2);
        drop(out);
        assert_eq!(Rc::strong_count(&body), 1);
    }

    #[test]
    fn empty_pieces_are_left_out() {
        let out = Outgoing::new(
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            Some(Rc::new(Vec::new())),
        );
        assert_eq!(out.read_iovec_len(), 1);
        let out = Outgoing::new(b"x".to_vec(), None);
        assert_eq!(pending(&out), b"x");
    }
}
