//! radixgate-bench: measuring radixgate from outside. The load generator, trace
//! generation and replay drive the gateway or an engine over real sockets; the
//! simulator runs the orchestrator's own routing code against simulated engines.
//!
//! Everything here is deliberately plain: blocking std TCP, one thread per connection,
//! no async runtime and no JSON library, so that the tool measuring the gateway shares
//! none of its machinery (the simulator shares exactly one thing on purpose: the
//! orchestrator's decision code). The `radixgate-bench` binary in `main.rs` is a thin
//! CLI over [`load::run`], [`sim`], [`trace`] and [`replay::run`].

pub mod chat;
pub mod chunked;
pub mod http;
pub mod json;
pub mod load;
pub mod plots;
pub mod real;
pub mod replay;
pub mod report;
pub mod sim;
pub mod trace;
pub mod workload;
