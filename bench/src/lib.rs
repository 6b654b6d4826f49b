//! radixgate-bench: measuring radixgate from outside. The load generator, trace
//! generation and replay drive the gateway or an engine over real sockets; the
//! simulator runs the orchestrator's own routing code against simulated engines.
//!
//! Everything here is deliberately plain: blocking std TCP, one thread per connection,
//! no async runtime and no JSON library, so that the tool measuring the gateway shares
//! none of its machinery (the simulator shares exactly one thing on purpose: the
//! orchestrator's decision code). The one exception is [`bus`], which measures the
//! cluster-bus client crates themselves (async-nats on tokio, redis-rs) on their own
//! threads. The `radixgate-bench` binary in `main.rs` is a thin CLI over
//! [`load::run`], [`sim`], [`trace`], [`replay::run`] and [`bus::run`].

pub mod bus;
pub mod ceiling;
pub mod chat;
/// The gateway's chunked-transfer decoder, compiled here from its one source file
/// (`src/http/chunked.rs`, std only): one decoder for both, so the bench reads a
/// response's framing exactly as the gateway does.
#[path = "../../src/http/chunked.rs"]
pub mod chunked;
pub mod cluster;
/// The gateway's cluster wire format, compiled here from its one source file in the
/// gateway crate (`src/cluster/wire.rs`, std only) so that `radixgate-bench wire`
/// measures exactly that code, optimised, without building the whole gateway.
#[path = "../../src/cluster/wire.rs"]
#[allow(dead_code)]
pub mod cluster_wire;
pub mod haproxy;
pub mod http;
pub mod json;
pub mod load;
pub mod plots;
pub mod real;
pub mod replay;
pub mod report;
pub mod schedule;
pub mod sim;
pub mod tail;
pub mod trace;
pub mod wire_cost;
pub mod workload;
