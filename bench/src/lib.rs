//! radixgate-bench: the load generator (and, later, the simulator, traces and replay)
//! that drives radixgate or an engine from outside, over real sockets.
//!
//! Everything here is deliberately plain: blocking std TCP, one thread per connection,
//! no async runtime and no JSON library, so that the tool measuring the gateway shares
//! none of its machinery. The `radixgate-bench` binary in `main.rs` is a thin CLI over
//! [`load::run`].

pub mod chunked;
pub mod http;
pub mod json;
pub mod load;
pub mod report;
pub mod workload;
