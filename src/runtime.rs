//! Builds a shard's monoio runtime on the configured I/O driver.
//!
//! `io = "auto"` resolves once, at start: io_uring when the kernel grants it,
//! otherwise the epoll driver, with one warning. Every shard (and every simulated
//! engine) then builds the same driver.

use crate::config::IoMode;
use monoio::time::TimeDriver;
use monoio::{IoUringDriver, LegacyDriver, Runtime, RuntimeBuilder};
use std::future::Future;
use std::io;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    IoUring,
    Epoll,
}

impl Driver {
    pub fn as_str(self) -> &'static str {
        match self {
            Driver::IoUring => "io_uring",
            Driver::Epoll => "epoll",
        }
    }

    /// Resolves `auto` (logging the fallback once per call site, at start-up).
    pub fn resolve(mode: IoMode) -> Driver {
        match mode {
            IoMode::IoUring => Driver::IoUring,
            IoMode::Epoll => Driver::Epoll,
            IoMode::Auto => {
                if monoio::utils::detect_uring() {
                    Driver::IoUring
                } else {
                    tracing::warn!(
                        "io_uring is unavailable on this kernel; shards use the epoll driver"
                    );
                    Driver::Epoll
                }
            }
        }
    }
}

pub enum ShardRuntime {
    IoUring(Runtime<TimeDriver<IoUringDriver>>),
    Epoll(Runtime<TimeDriver<LegacyDriver>>),
}

impl ShardRuntime {
    pub fn build(driver: Driver) -> io::Result<ShardRuntime> {
        Ok(match driver {
            Driver::IoUring => ShardRuntime::IoUring(
                RuntimeBuilder::<IoUringDriver>::new()
                    .with_entries(1024)
                    .enable_timer()
                    .build()?,
            ),
            Driver::Epoll => ShardRuntime::Epoll(
                RuntimeBuilder::<LegacyDriver>::new()
                    .enable_timer()
                    .build()?,
            ),
        })
    }

    pub fn block_on<F: Future>(&mut self, fut: F) -> F::Output {
        match self {
            ShardRuntime::IoUring(rt) => rt.block_on(fut),
            ShardRuntime::Epoll(rt) => rt.block_on(fut),
        }
    }
}

/// Binds `addr` with SO_REUSEPORT (so every shard can bind the same address) and
/// returns a std listener ready for `monoio::net::TcpListener::from_std`.
pub fn bind_reuseport(
    addr: std::net::SocketAddr,
    driver: Driver,
) -> io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    // The epoll driver needs non-blocking sockets; io_uring polls internally.
    socket.set_nonblocking(driver == Driver::Epoll)?;
    Ok(socket.into())
}

/// Shuts a listening socket down so the kernel refuses new connections at once (an
/// accept parked in io_uring would otherwise keep it open past a plain drop).
pub fn stop_listening(listener: &monoio::net::TcpListener) {
    use std::os::fd::{AsRawFd, BorrowedFd};
    // SAFETY: `listener` is alive for this whole call, so its fd is open and ours.
    let fd = unsafe { BorrowedFd::borrow_raw(listener.as_raw_fd()) };
    let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Both);
}
