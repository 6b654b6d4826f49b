//! The shard's edge queue: admitted requests that must wait because every candidate
//! backend is saturated, ordered by tier priority (higher first), then deadline
//! (earlier first), then arrival.
//!
//! One queue per shard, bounded by `admission.queue_capacity`: there is no global
//! order across shards (a gold request on shard 0 does not overtake a free one on
//! shard 1), which keeps the queue lock-free. Only the head polls for capacity (the
//! fleet's in-flight counts change on other shards too, so there is nothing local to
//! wait on); everyone else sleeps until woken as the new head or until its deadline.
//! Leaving — admitted, shed, timed out, or dropped with the client — wakes the next
//! head. Shard-local (`RefCell`, never borrowed across an `.await`).

use monoio::time::Instant;
use std::cell::{Cell, RefCell};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

/// How often the head re-checks the fleet while it waits.
pub const HEAD_POLL: Duration = Duration::from_millis(1);

struct Entry {
    priority: u8,
    deadline: Instant,
    seq: u64,
    wake: flume::Sender<()>,
}

impl Entry {
    fn key(&self) -> (u8, std::cmp::Reverse<Instant>, std::cmp::Reverse<u64>) {
        (
            self.priority,
            std::cmp::Reverse(self.deadline),
            std::cmp::Reverse(self.seq),
        )
    }
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.seq == other.seq
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        self.key().cmp(&other.key())
    }
}

pub struct EdgeQueue {
    heap: RefCell<BinaryHeap<Entry>>,
    capacity: Cell<usize>,
    next_seq: Cell<u64>,
}

impl EdgeQueue {
    pub fn new(capacity: usize) -> Self {
        Self {
            heap: RefCell::new(BinaryHeap::with_capacity(capacity.min(1024))),
            capacity: Cell::new(capacity),
            next_seq: Cell::new(0),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity.get()
    }

    /// A reloaded `admission.queue_capacity`: bounds the next joins (requests
    /// already waiting keep their places).
    pub fn set_capacity(&self, capacity: usize) {
        self.capacity.set(capacity);
    }

    pub fn len(&self) -> usize {
        self.heap.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place in the queue, or `None` when it is full.
    pub fn join(&self, priority: u8, deadline: Instant) -> Option<Place<'_>> {
        let mut heap = self.heap.borrow_mut();
        if heap.len() >= self.capacity.get() {
            return None;
        }
        let seq = self.next_seq.get();
        self.next_seq.set(seq + 1);
        let (wake, woken) = flume::bounded(1);
        heap.push(Entry {
            priority,
            deadline,
            seq,
            wake,
        });
        Some(Place {
            queue: self,
            seq,
            woken,
        })
    }

    fn head_seq(&self) -> Option<u64> {
        self.heap.borrow().peek().map(|e| e.seq)
    }

    fn wake_head(&self) {
        if let Some(e) = self.heap.borrow().peek() {
            let _ = e.wake.try_send(());
        }
    }
}

/// A request's place in the queue; dropping it leaves the queue.
pub struct Place<'q> {
    queue: &'q EdgeQueue,
    seq: u64,
    woken: flume::Receiver<()>,
}

impl Place<'_> {
    pub fn is_head(&self) -> bool {
        self.queue.head_seq() == Some(self.seq)
    }

    /// Waits until this place may be the head (woken) or `until` passes. The caller
    /// re-checks [`Place::is_head`] and the time.
    pub async fn wait(&self, until: Instant) {
        if self.is_head() {
            let left = until.saturating_duration_since(Instant::now());
            monoio::time::sleep(left.min(HEAD_POLL)).await;
        } else {
            let _ = monoio::time::timeout_at(until, self.woken.recv_async()).await;
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let was_head = self.is_head();
        let seq = self.seq;
        if was_head {
            self.queue.heap.borrow_mut().pop();
        } else {
            self.queue.heap.borrow_mut().retain(|e| e.seq != seq);
        }
        if was_head {
            self.queue.wake_head();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[monoio::test(timer_enabled = true)]
    async fn orders_by_priority_then_deadline_and_is_bounded() {
        let q = EdgeQueue::new(3);
        let now = Instant::now();
        let later = now + Duration::from_secs(2);
        let sooner = now + Duration::from_secs(1);
        let low = q.join(0, sooner).unwrap();
        let high_late = q.join(5, later).unwrap();
        assert!(high_late.is_head());
        let high_soon = q.join(5, sooner).unwrap();
        assert!(high_soon.is_head(), "same tier: earlier deadline first");
        assert!(q.join(9, sooner).is_none(), "full");
        drop(high_soon);
        assert!(high_late.is_head());
        // The new head was woken: its wait returns at once.
        let t = Instant::now();
        high_late.wait(later).await;
        assert!(t.elapsed() < Duration::from_millis(500));
        drop(low);
        assert_eq!(q.len(), 1);
        drop(high_late);
        assert!(q.is_empty());
    }

    #[monoio::test(timer_enabled = true)]
    async fn a_waiter_times_out() {
        let q = EdgeQueue::new(2);
        let head = q.join(1, Instant::now() + Duration::from_secs(5)).unwrap();
        let until = Instant::now() + Duration::from_millis(20);
        let other = q.join(0, until).unwrap();
        other.wait(until).await;
        assert!(Instant::now() >= until);
        assert!(!other.is_head());
        drop(head);
        assert!(other.is_head());
    }
}
