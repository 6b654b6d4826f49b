//! The connections a shard (or a simulated engine) has open, so that stopping it
//! really closes them.
//!
//! A monoio runtime that stops does not close the sockets of tasks still parked on
//! I/O; a peer would then wait on a silent connection. Each connection registers its
//! fd here for its lifetime; [`OpenConnections::shutdown_all`] shuts every one down
//! (both directions), which fails the parked reads and writes so the tasks finish.

use monoio::net::TcpStream;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::rc::Rc;

#[derive(Default)]
pub struct OpenConnections {
    fds: RefCell<HashMap<u64, RawFd>>,
    next: Cell<u64>,
    /// The most open at once since [`OpenConnections::take_peak`] last asked.
    peak: Cell<usize>,
}

/// Keeps a connection registered until dropped.
pub struct Registration {
    registry: Rc<OpenConnections>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.fds.borrow_mut().remove(&self.id);
    }
}

impl OpenConnections {
    /// Registers `stream`; keep the returned value alive exactly as long as the
    /// stream (drop it before the stream closes).
    pub fn register(self: &Rc<Self>, stream: &TcpStream) -> Registration {
        let id = self.next.get();
        self.next.set(id + 1);
        let open = {
            let mut fds = self.fds.borrow_mut();
            fds.insert(id, stream.as_raw_fd());
            fds.len()
        };
        self.peak.set(self.peak.get().max(open));
        Registration {
            registry: self.clone(),
            id,
        }
    }

    pub fn len(&self) -> usize {
        self.fds.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.fds.borrow().is_empty()
    }

    /// The most connections open at once since the last call, and the number open
    /// now; the peak starts again from now.
    pub fn take_peak(&self) -> (usize, usize) {
        let open = self.len();
        (self.peak.replace(open).max(open), open)
    }

    /// Gives back the registry's room for connections no longer open.
    pub fn shrink(&self) {
        self.fds.borrow_mut().shrink_to_fit();
    }

    /// Shuts down every registered connection in both directions.
    pub fn shutdown_all(&self) {
        for &fd in self.fds.borrow().values() {
            // SAFETY: a connection unregisters (its `Registration` drops) before its
            // stream closes the fd, so every fd in the map is open right now, and
            // this borrow does not outlive this statement.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Both);
        }
    }
}
