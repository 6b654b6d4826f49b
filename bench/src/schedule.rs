//! Which request a load thread sends next: request numbers in order, except that a
//! request that follows another ([`Workload::follows`]: a conversation's next turn)
//! waits until that one has been answered, and a waiting request does not hold up
//! the others. This is how users behave: each reads the reply before writing the next
//! turn, while other users go on.
//!
//! Without it, at a concurrency near the number of conversations, a turn was often
//! sent while the previous turn was still being prefilled. No engine can reuse a
//! prefix it has not finished computing, so every policy missed those prefixes, and
//! the ceiling (computed in issue order) counted hits no router could get.
//!
//! Requests passed over while they wait are kept and handed out first, lowest number
//! first, once they are free to go. The look-ahead stops once every conversation has
//! a turn waiting: nothing further on can go before one of those.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::workload::Workload;

/// What [`Schedule::take`] hands out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Send request `i`; call [`Schedule::finish`] with it once it is answered (or
    /// has failed).
    Send(u64),
    /// Every remaining request waits for one in flight (only from `try_take`).
    Wait,
    /// The run's requests are all handed out, or its deadline has passed.
    Done,
}

pub struct Schedule<'w> {
    workload: &'w Workload,
    /// Requests in the run (`None`: no count limit).
    limit: Option<u64>,
    /// Conversations: once each has a turn waiting, looking further finds nothing.
    conversations: usize,
    state: Mutex<State>,
    answered: Condvar,
}

#[derive(Default)]
struct State {
    /// Lowest request number never looked at.
    next: u64,
    /// Looked at, not yet sent: each follows a request still pending.
    passed_over: BTreeSet<u64>,
    /// Sent and not yet answered.
    in_flight: HashSet<u64>,
}

impl State {
    /// Request `p` has been sent and answered.
    fn answered(&self, p: u64) -> bool {
        p < self.next && !self.in_flight.contains(&p) && !self.passed_over.contains(&p)
    }
}

impl<'w> Schedule<'w> {
    pub fn new(workload: &'w Workload, limit: Option<u64>) -> Self {
        Schedule {
            workload,
            limit,
            conversations: workload.config().conversations.max(1),
            state: Mutex::new(State::default()),
            answered: Condvar::new(),
        }
    }

    /// The next request to send, waiting while every remaining one follows a request
    /// in flight; [`Next::Done`] when none is left or `deadline` has passed.
    pub fn take(&self, deadline: Option<Instant>) -> Next {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.try_take_locked(&mut state) {
                Next::Wait => {}
                taken => return taken,
            }
            state = match deadline {
                None => self.answered.wait(state).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Next::Done;
                    }
                    self.answered
                        .wait_timeout(state, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// As [`Self::take`], but answers [`Next::Wait`] instead of waiting.
    pub fn try_take(&self) -> Next {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.try_take_locked(&mut state)
    }

    /// Request `i` has been answered (or failed): what follows it may go.
    pub fn finish(&self, i: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.in_flight.remove(&i);
        drop(state);
        self.answered.notify_all();
    }

    /// Conversations with a turn passed over: the passed-over requests that do not
    /// follow another passed-over one.
    fn waiting_conversations(&self, state: &State) -> usize {
        let follows_waiting = |i: u64| {
            self.workload
                .follows(i)
                .is_some_and(|p| state.passed_over.contains(&p))
        };
        state
            .passed_over
            .iter()
            .filter(|&&i| !follows_waiting(i))
            .count()
    }

    fn try_take_locked(&self, state: &mut State) -> Next {
        let free = |state: &State, i: u64| match self.workload.follows(i) {
            None => true,
            Some(p) => state.answered(p),
        };
        let ready = state.passed_over.iter().copied().find(|&i| free(state, i));
        if let Some(i) = ready {
            state.passed_over.remove(&i);
            state.in_flight.insert(i);
            return Next::Send(i);
        }
        while self.waiting_conversations(state) < self.conversations {
            let i = state.next;
            if self.limit.is_some_and(|n| i >= n) {
                break;
            }
            let go = free(state, i);
            state.next += 1;
            if go {
                state.in_flight.insert(i);
                return Next::Send(i);
            }
            state.passed_over.insert(i);
        }
        let all_sent = self.limit.is_some_and(|n| state.next >= n);
        if all_sent && state.passed_over.is_empty() {
            Next::Done
        } else {
            Next::Wait
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Kind, WorkloadConfig};

    fn multiturn(conversations: usize, turns: usize) -> Workload {
        Workload::new(WorkloadConfig {
            kind: Kind::Multiturn,
            conversations,
            turns,
            ..WorkloadConfig::default()
        })
    }

    #[test]
    fn independent_requests_go_in_order() {
        let w = Workload::new(WorkloadConfig {
            kind: Kind::Docs,
            ..WorkloadConfig::default()
        });
        let s = Schedule::new(&w, Some(3));
        assert_eq!(s.try_take(), Next::Send(0));
        assert_eq!(s.try_take(), Next::Send(1));
        assert_eq!(s.try_take(), Next::Send(2));
        assert_eq!(s.try_take(), Next::Done);
    }

    #[test]
    fn a_turn_waits_for_its_previous_turn_and_lets_others_pass() {
        // 2 conversations × 3 turns: requests 0 2 4 are conversation 0, 1 3 5 are 1.
        let w = multiturn(2, 3);
        let s = Schedule::new(&w, Some(6));
        assert_eq!(s.try_take(), Next::Send(0));
        assert_eq!(s.try_take(), Next::Send(1));
        // 2 follows 0 and 3 follows 1, both in flight.
        assert_eq!(s.try_take(), Next::Wait);
        s.finish(1);
        // Conversation 1 goes on while conversation 0's turn still waits.
        assert_eq!(s.try_take(), Next::Send(3));
        assert_eq!(s.try_take(), Next::Wait);
        s.finish(0);
        assert_eq!(s.try_take(), Next::Send(2));
        assert_eq!(s.try_take(), Next::Wait);
        s.finish(3);
        assert_eq!(s.try_take(), Next::Send(5));
        s.finish(2);
        assert_eq!(s.try_take(), Next::Send(4));
        assert_eq!(s.try_take(), Next::Done);
    }

    #[test]
    fn a_slow_conversation_does_not_stop_a_fast_one() {
        // Conversation 0 (requests 0 2 4 6) stays on its first turn; conversation 1
        // (1 3 5 7) runs through all four while 2, then 4, wait behind it.
        let w = multiturn(2, 4);
        let s = Schedule::new(&w, Some(8));
        assert_eq!(s.try_take(), Next::Send(0));
        for i in [1, 3, 5, 7] {
            assert_eq!(s.try_take(), Next::Send(i));
            assert_eq!(s.try_take(), Next::Wait);
            s.finish(i);
        }
        s.finish(0);
        for i in [2, 4, 6] {
            assert_eq!(s.try_take(), Next::Send(i));
            s.finish(i);
        }
        assert_eq!(s.try_take(), Next::Done);
    }

    #[test]
    fn waiting_threads_wake_when_the_turn_they_follow_is_answered() {
        let w = multiturn(1, 4);
        let s = Schedule::new(&w, Some(4));
        let sent = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    while let Next::Send(i) = s.take(None) {
                        // Every earlier turn has been answered when this one goes.
                        let mut sent = sent.lock().unwrap();
                        assert_eq!(sent.len() as u64, i, "{sent:?}");
                        sent.push(i);
                        drop(sent);
                        s.finish(i);
                    }
                });
            }
        });
        assert_eq!(sent.into_inner().unwrap(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_deadline_ends_a_wait() {
        let w = multiturn(1, 4);
        let s = Schedule::new(&w, None);
        assert_eq!(s.take(None), Next::Send(0));
        let soon = Instant::now() + std::time::Duration::from_millis(20);
        assert_eq!(s.take(Some(soon)), Next::Done);
    }
}
