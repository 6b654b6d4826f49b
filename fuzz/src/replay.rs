//! Replays saved fuzz inputs (a committed corpus, a crash artifact) through a
//! target's check, on any toolchain. Used by the `*_stable` runners (`src/stable.rs`)
//! and, included by path, by the root workspace's `tests/fuzz_corpus.rs`, which
//! replays the committed corpora in `cargo test` (and so in CI) without nightly.

#![allow(
    clippy::disallowed_methods,
    reason = "runners and tests, not shard threads: blocking file reads are fine"
)]

use std::path::Path;

/// Runs every input saved under `path` (a file, or every file in a directory, in
/// name order) through `check`; a failure panics naming the input. The number run.
pub fn replay(path: &Path, check: fn(&[u8])) -> usize {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        return entries.iter().map(|p| replay(p, check)).sum();
    }
    let input = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    if std::panic::catch_unwind(|| check(&input)).is_err() {
        panic!("{} fails its target's check", path.display());
    }
    1
}
