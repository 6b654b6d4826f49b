//! One TLS connection on a shard: rustls over a monoio `TcpStream`, driven by
//! readiness rather than by owned-buffer reads.
//!
//! The gateway cancels reads: a client's read between requests is raced against its
//! park and idle deadlines, and the request path races reads against timeouts. A TLS
//! stream must survive that. Here the only await points are `readable`/`writable`
//! (which consume nothing) and bytes move between the socket and rustls with
//! non-blocking `recv`/`send` calls made synchronously after readiness, so a dropped
//! future loses no TLS bytes and leaves the stream usable. (monoio-rustls reads
//! into a buffer it lends to the driver, and a cancelled read leaves it without
//! that buffer: its next read panics.)
//!
//! A read hands out plaintext rustls has already decrypted before it touches the
//! socket; a write encrypts into rustls and sends until rustls holds nothing more
//! (a cancelled write may leave its record queued; the next write or flush sends it).

use monoio::buf::{IoBuf, IoBufMut, IoVecBuf, IoVecBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent};
use monoio::net::TcpStream;
use monoio::BufResult;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

/// Most plaintext one read hands out (a TLS record carries at most 16 KiB).
const READ_CHUNK: usize = 64 << 10;

pub struct TlsStream {
    tcp: TcpStream,
    conn: Connection,
}

impl TlsStream {
    /// The server side of a handshake on an accepted connection.
    pub async fn accept(tcp: TcpStream, config: Arc<ServerConfig>) -> io::Result<Self> {
        let conn = ServerConnection::new(config).map_err(io::Error::other)?;
        let mut s = Self {
            tcp,
            conn: conn.into(),
        };
        s.handshake().await?;
        Ok(s)
    }

    /// The client side of a handshake with `name` (checked against its certificate).
    pub async fn connect(
        tcp: TcpStream,
        config: Arc<ClientConfig>,
        name: ServerName<'static>,
    ) -> io::Result<Self> {
        let conn = ClientConnection::new(config, name).map_err(io::Error::other)?;
        let mut s = Self {
            tcp,
            conn: conn.into(),
        };
        s.handshake().await?;
        Ok(s)
    }

    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    /// The protocol agreed by ALPN, if any.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        self.conn.alpn_protocol()
    }

    async fn handshake(&mut self) -> io::Result<()> {
        while self.conn.is_handshaking() {
            self.send_pending().await?;
            if self.conn.is_handshaking() && self.conn.wants_read() && self.fill().await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "peer closed during the TLS handshake",
                ));
            }
        }
        self.send_pending().await
    }

    /// Resolves when a read would not wait: plaintext is already decrypted, or the
    /// socket is readable.
    pub async fn readable(&mut self) -> io::Result<()> {
        if self.plaintext_ready()? > 0 {
            return Ok(());
        }
        self.tcp.readable(false).await
    }

    fn plaintext_ready(&mut self) -> io::Result<usize> {
        let state = self
            .conn
            .process_new_packets()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok(state.plaintext_bytes_to_read())
    }

    /// Sends every TLS byte rustls holds. Bytes leave rustls only once the kernel
    /// took them, so cancelling this loses nothing.
    async fn send_pending(&mut self) -> io::Result<()> {
        let fd = self.tcp.as_raw_fd();
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut Socket(fd)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.tcp.writable(false).await?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what the socket has into rustls and processes it; 0 at end of file.
    async fn fill(&mut self) -> io::Result<usize> {
        let fd = self.tcp.as_raw_fd();
        loop {
            match self.conn.read_tls(&mut Socket(fd)) {
                Ok(n) => {
                    if let Err(e) = self.conn.process_new_packets() {
                        // rustls queued an alert for the peer: best effort, no wait.
                        let _ = self.conn.write_tls(&mut Socket(fd));
                        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                    }
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.tcp.readable(false).await?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits for decrypted plaintext, reading records as needed: how many bytes
    /// are ready, 0 at the end of the stream (a close_notify, or the socket closed:
    /// HTTP/1.1's framing says whether a message was cut short).
    async fn plaintext(&mut self) -> io::Result<usize> {
        loop {
            let state = self
                .conn
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if state.plaintext_bytes_to_read() > 0 {
                return Ok(state.plaintext_bytes_to_read());
            }
            if state.peer_has_closed() {
                return Ok(0);
            }
            // Replies the handshake or a key update left for the peer.
            self.send_pending().await?;
            if self.fill().await? == 0 {
                return self.plaintext_ready();
            }
        }
    }

    /// Copies up to `room` bytes of plaintext to `ptr`; 0 at the end of the stream.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `room` bytes until the call returns.
    async unsafe fn read_into(&mut self, ptr: *mut u8, room: usize) -> io::Result<usize> {
        let ready = self.plaintext().await?;
        let n = ready.min(room).min(READ_CHUNK);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: the caller lends `room` >= `n` writable bytes at `ptr`; they are
        // zeroed first, so the slice is initialized.
        let out = unsafe {
            std::ptr::write_bytes(ptr, 0, n);
            std::slice::from_raw_parts_mut(ptr, n)
        };
        self.conn.reader().read(out)
    }

    /// Encrypts what fits of `bufs` and sends it; the plaintext bytes taken.
    async fn write_plain(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.send_pending().await?;
        let n = self.conn.writer().write_vectored(bufs)?;
        self.send_pending().await?;
        Ok(n)
    }
}

/// The socket as `std::io` for rustls: one non-blocking `recv`/`send` per call.
struct Socket(RawFd);

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `self.0` is the stream's open socket for the call; `buf` is valid
        // for `buf.len()` bytes; MSG_DONTWAIT never blocks.
        let n = unsafe {
            libc::recv(
                self.0,
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: as in `read`; MSG_NOSIGNAL turns a closed peer into EPIPE rather
        // than a signal.
        let n = unsafe {
            libc::send(
                self.0,
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// === impl AsyncReadRent, AsyncWriteRent for TlsStream ===

impl AsyncReadRent for TlsStream {
    async fn read<T: IoBufMut>(&mut self, mut buf: T) -> BufResult<usize, T> {
        let room = buf.bytes_total();
        // SAFETY: `write_ptr` is valid for `bytes_total()` writable bytes while `buf`
        // lives (IoBufMut), and `buf` is held across the call.
        let r = unsafe { self.read_into(buf.write_ptr(), room).await };
        if let Ok(n) = r {
            // SAFETY: `n` bytes from the start of the room were written.
            unsafe { buf.set_init(n) };
        }
        (r, buf)
    }

    async fn readv<T: IoVecBufMut>(&mut self, mut buf: T) -> BufResult<usize, T> {
        // Into the first buffer only, as a short read may.
        // SAFETY: the iovec array is valid for `write_iovec_len()` entries while
        // `buf` lives (IoVecBufMut).
        let first = unsafe {
            let iov = buf.write_iovec_ptr();
            (buf.write_iovec_len() > 0).then(|| *iov)
        };
        let Some(iov) = first else {
            return (Ok(0), buf);
        };
        // SAFETY: the first iovec points at `iov_len` writable bytes while `buf`
        // lives, and `buf` is held across the call.
        let r = unsafe { self.read_into(iov.iov_base.cast::<u8>(), iov.iov_len).await };
        if let Ok(n) = r {
            // SAFETY: `n` bytes were written at the start of the first buffer.
            unsafe { buf.set_init(n) };
        }
        (r, buf)
    }
}

impl AsyncWriteRent for TlsStream {
    async fn write<T: IoBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        // SAFETY: `read_ptr` is valid for `bytes_init` initialized bytes (IoBuf),
        // and `buf` outlives the slice.
        let bytes = unsafe { std::slice::from_raw_parts(buf.read_ptr(), buf.bytes_init()) };
        let r = self.write_plain(&[io::IoSlice::new(bytes)]).await;
        (r, buf)
    }

    async fn writev<T: IoVecBuf>(&mut self, buf: T) -> BufResult<usize, T> {
        // SAFETY: the iovecs (IoVecBuf) point at initialized bytes that live as long
        // as `buf`, which outlives the slices.
        let slices: Vec<io::IoSlice<'_>> = unsafe {
            std::slice::from_raw_parts(buf.read_iovec_ptr(), buf.read_iovec_len())
                .iter()
                .map(|v| {
                    io::IoSlice::new(std::slice::from_raw_parts(
                        v.iov_base.cast::<u8>(),
                        v.iov_len,
                    ))
                })
                .collect()
        };
        let r = self.write_plain(&slices).await;
        drop(slices);
        (r, buf)
    }

    async fn flush(&mut self) -> io::Result<()> {
        self.send_pending().await
    }

    async fn shutdown(&mut self) -> io::Result<()> {
        self.conn.send_close_notify();
        self.send_pending().await?;
        self.tcp.shutdown().await
    }
}
