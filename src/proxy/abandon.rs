//! Ends upstream calls when the client they serve has left, for calls that run
//! beside one another in the client's own task (a workflow's nodes, an SGLang split
//! request's prefill leg) and so cannot watch the client's socket themselves.
//!
//! The owner watches the socket; when the client leaves it calls [`Abandon::now`]
//! and polls its calls once more. Each call was given [`Abandon::watch`] as the
//! `leave` future of [`super::exchange::Exchange::fetch`], which then resolves: the
//! call drops its upstream connection (so the engine stops working on the request),
//! releases its guards and ends with `client_closed`. A flag in a `Cell`, no channel
//! and no waker: the owner's next poll is what delivers it.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

#[derive(Default)]
pub struct Abandon(Cell<bool>);

impl Abandon {
    /// Abandons every call watching this; the owner must poll them once more.
    pub fn now(&self) {
        self.0.set(true);
    }

    pub fn is_abandoned(&self) -> bool {
        self.0.get()
    }

    /// A call's `leave` future: ready at its first poll after [`Abandon::now`].
    pub fn watch(&self) -> Abandoned<'_> {
        Abandoned(&self.0)
    }
}

pub struct Abandoned<'a>(&'a Cell<bool>);

impl Future for Abandoned<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
        if self.0.get() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    #[test]
    fn a_watch_is_ready_only_after_the_owner_abandons() {
        let abandon = Abandon::default();
        let mut watch = std::pin::pin!(abandon.watch());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(watch.as_mut().poll(&mut cx).is_pending());
        assert!(!abandon.is_abandoned());
        abandon.now();
        assert!(watch.as_mut().poll(&mut cx).is_ready());
        assert!(abandon.is_abandoned());
    }
}
