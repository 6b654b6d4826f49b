//! radixgate: a cache-aware, thread-per-core, OpenAI-compatible LLM inference gateway.
//!
//! This crate is the data plane (the "muscle"): shards that speak HTTP/1.1 on
//! io_uring or epoll (`server`, `http`, `proxy`, `pool`), the coordinator thread
//! that owns fleet state (`coordinator`, `fleet`), configuration, errors, metrics,
//! and the simulated engine used by tests, the demo and the bench. Every routing
//! decision comes from the `radixgate-orchestrator` crate (the "brain"). See
//! DESIGN.md for the map.

#![deny(clippy::await_holding_refcell_ref)]

pub mod access_log;
pub mod adapters;
pub mod admin;
pub mod backends;
pub mod capacity;
pub mod chat_template;
pub mod cluster;
pub mod config;
pub mod control;
pub mod coordinator;
pub mod demo;
pub mod discovery;
pub mod engine_metrics;
pub mod engine_sim;
pub mod error;
pub mod fleet;
pub mod gateway;
pub mod http;
pub mod kv_events;
pub mod learned;
pub mod log_writer;
pub mod metrics;
pub mod observe;
pub mod open_conns;
pub mod openai;
pub mod otlp;
pub mod pending_prefill;
pub mod placement;
pub mod pool;
pub mod proxy;
pub mod rag;
pub mod reload;
pub mod replica;
pub mod runtime;
pub mod server;
pub mod shard;
pub mod stall;
pub mod status;
pub mod tenants;
pub mod tls;
pub mod token_mode;
pub mod trace;
pub mod workflow;

pub use config::Config;
pub use gateway::Gateway;
