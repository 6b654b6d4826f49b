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

/// Drops the first `n` bytes of `buf` (already consumed), keeping its allocation.
pub fn consume_front(buf: &mut Vec<u8>, n: usize) {
    if n >= buf.len() {
        buf.clear();
    } else if n > 0 {
        buf.drain(..n);
    }
}
