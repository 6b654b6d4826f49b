//! Where each shard runs: the core it was pinned to, its I/O driver and its OS
//! thread id, recorded once by the shard thread as it starts (and logged there as
//! `shard started`), and what the kernel says about that thread now.
//!
//! `GET /admin/shards` ([`crate::admin`]) reads these records from the admin thread,
//! adds the kernel's view of each shard thread from `/proc/self/task/<tid>/` (the
//! CPUs it may run on, the CPU it last ran on, its CPU time) and the shard's live
//! counters, collected over its command channel like a `/metrics` scrape. Nothing
//! here runs on the request path.

use crate::runtime::Driver;
use std::sync::OnceLock;

/// One shard's placement, fixed for its life.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    /// The configured core (`server.cores[k % len]`), if any.
    pub core: Option<usize>,
    /// Whether the thread was pinned there (false when the core is outside the
    /// process's affinity mask or pinning failed).
    pub pinned: bool,
    pub driver: Driver,
    /// The shard thread's kernel thread id (`gettid`), as in `/proc/<pid>/task/`.
    pub tid: i32,
}

/// Every shard's placement, written once by its own thread.
pub struct Placements(Box<[OnceLock<Placement>]>);

impl Placements {
    pub fn new(shards: usize) -> Self {
        Self((0..shards).map(|_| OnceLock::new()).collect())
    }

    /// Called by shard `shard`'s thread once its runtime is built: records where it
    /// runs and logs it.
    pub fn record(&self, shard: usize, core: Option<usize>, pinned: bool, driver: Driver) {
        let p = Placement {
            core,
            pinned,
            driver,
            tid: current_tid(),
        };
        tracing::info!(
            shard,
            core = p.core.map_or(-1, |c| c as i64),
            pinned,
            driver = driver.as_str(),
            thread_id = p.tid,
            cpus_allowed = thread_status(p.tid, "Cpus_allowed_list").unwrap_or_default(),
            "shard started"
        );
        let _ = self.0[shard].set(p);
    }

    pub fn get(&self, shard: usize) -> Option<Placement> {
        self.0.get(shard)?.get().copied()
    }
}

/// The calling thread's kernel thread id.
fn current_tid() -> i32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// A field of `/proc/self/task/<tid>/status` (e.g. `Cpus_allowed_list`).
// procfs (memory, never a disk): read by the admin thread, and once by each shard
// thread as it starts, before it serves anything.
#[allow(clippy::disallowed_methods)]
pub fn thread_status(tid: i32, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// From `/proc/self/task/<tid>/stat`: the CPU the thread last ran on and its user
/// and system CPU time in seconds.
#[allow(clippy::disallowed_methods)] // procfs, read by the admin thread only
pub fn thread_stat(tid: i32) -> Option<(u64, f64)> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // Fields after the parenthesised name, which may itself contain spaces.
    let f: Vec<&str> = text[text.rfind(')')? + 2..].split_whitespace().collect();
    // Field numbers of proc(5), counted from 1 with the pid as field 1: utime 14,
    // stime 15, processor 39; here index = number - 3.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    let cpu: u64 = f.get(36)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some((cpu, (utime + stime) as f64 / hz))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_threads_kernel_view() {
        let tid = current_tid();
        assert!(tid > 0);
        let allowed = thread_status(tid, "Cpus_allowed_list").expect("status has the field");
        assert!(allowed.chars().next().is_some_and(|c| c.is_ascii_digit()));
        let (cpu, seconds) = thread_stat(tid).expect("stat parses");
        assert!((cpu as usize) < 4096 && seconds >= 0.0);
        assert_eq!(thread_status(tid, "No_such_field"), None);
    }
}
