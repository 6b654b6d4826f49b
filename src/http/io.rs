//! Rent-style socket reads shared by every HTTP peer on a shard.
//!
//! monoio reads take ownership of the buffer for the duration of the I/O (io_uring
//! writes into it from the kernel). These helpers append into a `Vec<u8>`'s spare
//! capacity and hand the same allocation back, so a connection reuses one buffer
//! for its whole life.

use monoio::buf::IoBufMut;
use monoio::io::AsyncReadRent;
use monoio::net::TcpStream;
use std::io;

/// Reads at least one byte more into `buf` (appended after its current contents),
/// growing it by at least `min_spare`. Returns the number of bytes read; 0 means EOF.
pub async fn read_append(
    stream: &mut TcpStream,
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
pub async fn read_up_to(
    stream: &mut TcpStream,
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
