//! Rent-style socket reads shared by every HTTP peer on a shard.
//!
//! monoio reads take ownership of the buffer for the duration of the I/O (io_uring
//! writes into it from the kernel). These helpers append into a `Vec<u8>`'s spare
//! capacity and hand the same allocation back, so a connection reuses one buffer
//! for its whole life. [`peer_closed`] watches a connection for its peer leaving
//! without reading from it.

use monoio::buf::IoBufMut;
use monoio::io::AsyncReadRent;
use monoio::net::TcpStream;
use std::io;
use std::os::fd::AsRawFd;

/// Reads at least one byte more into `buf` (appended after its current contents),
/// growing it by at least `min_spare`. Returns the number of bytes read; 0 means EOF.
pub async fn read_append<S: AsyncReadRent>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    min_spare: usize,
) -> io::Result<usize> {
    let len = buf.len();
    if buf.capacity() - len < min_spare {
        buf.reserve(min_spare);
    }
    let cap = buf.capacity();
    let owned = std::mem::take(buf);
    let (res, slice) = stream.read(owned.slice_mut(len..cap)).await;
    *buf = slice.into_inner();
    res
}

/// Reads at least one byte more into `buf`, never past a total length of `total`
/// (so nothing after a body of known length lands in it). Room grows geometrically
/// (at least doubling, from 64 KB) rather than to `total` at once, so a client that
/// declares a large body and sends little holds little memory, and a body costs at
/// most one extra copy of itself in reallocations (none once a reused buffer is
/// large enough). Returns the number of bytes read; 0 means EOF.
pub async fn read_up_to<S: AsyncReadRent>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    total: usize,
) -> io::Result<usize> {
    let len = buf.len();
    debug_assert!(len < total);
    if buf.capacity() == len {
        buf.reserve((total - len).min(len.max(64 << 10)));
    }
    let end = buf.capacity().min(total);
    let owned = std::mem::take(buf);
    let (res, slice) = stream.read(owned.slice_mut(len..end)).await;
    *buf = slice.into_inner();
    res
}

/// Drops the first `n` bytes of `buf` (already consumed), keeping its allocation.
pub fn consume_front(buf: &mut Vec<u8>, n: usize) {
    if n >= buf.len() {
        buf.clear();
    } else if n > 0 {
        buf.drain(..n);
    }
}

/// Resolves once the peer of `stream` has closed it (a read would return end of
/// file: a close or a half-close, as nginx reads it) or reset it, without reading
/// anything: it waits for readability (io_uring: one `PollAdd`; epoll: the
/// registered readiness, rechecked with `poll`) and then peeks. If bytes are waiting
/// instead (a pipelined request), a close can only show as `POLLRDHUP`, which is
/// checked once; otherwise this stays pending for good, since waiting again would
/// wake at once forever. An error while waiting also leaves it pending.
pub async fn peer_closed(stream: &TcpStream) {
    loop {
        if stream.readable(false).await.is_err() {
            return std::future::pending().await;
        }
        let fd = stream.as_raw_fd();
        let mut byte = 0u8;
        // SAFETY: `fd` is this stream's open socket (borrowed for the call), and the
        // buffer is one valid byte; MSG_DONTWAIT keeps the call from blocking.
        let n = unsafe {
            libc::recv(
                fd,
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return,
            n if n > 0 => {
                let mut pollfd = libc::pollfd {
                    fd,
                    events: libc::POLLRDHUP,
                    revents: 0,
                };
                // SAFETY: one valid pollfd; a zero timeout never blocks.
                let ready = unsafe { libc::poll(&mut pollfd, 1, 0) };
                if ready > 0
                    && pollfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
                {
                    return;
                }
                return std::future::pending().await;
            }
            _ => match io::Error::last_os_error().kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => continue,
                _ => return,
            },
        }
    }
}
