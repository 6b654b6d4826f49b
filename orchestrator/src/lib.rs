//! radixgate's brain: every routing decision, and nothing else.
//!
//! This crate knows nothing of sockets, runtimes, clocks or logs. The gateway (`src/`)
//! parses a request, feeds its prompt to a [`PromptHasher`] to get chained block
//! hashes and an affinity key, and asks its [`Router`] — the one place a routing
//! decision is composed — for a [`Decision`] over its [`Replica`] of the prefix index
//! and a [`FleetView`] of the backends; the decision carries the [`IndexOp`]s to apply
//! everywhere. [`admission`] decides, before that, whether the request may go at all
//! (with the router's estimate). Logging and metrics happen in the caller. The
//! simulators in `bench/` call the very same [`Router`], so what they measure is what
//! the gateway does.

pub mod admission;
pub mod breaker;
pub mod capacity;
pub mod dag;
pub mod disagg;
pub mod engine_cache;
pub mod index;
pub mod media;
pub mod policy;
pub mod prompt;
pub mod quota;
pub mod rag;
pub mod replica;
pub mod retry;
pub mod router;

pub use admission::{AdmissionInput, Estimate, ShedReason, Verdict};
pub use breaker::{Breaker, BreakerConfig, BreakerState};
pub use capacity::{CapacityInput, Recommendation};
pub use disagg::{DecodeCandidate, DisaggPolicy, LocalWhy, PairDecision, PairInput};
pub use engine_cache::EngineCache;
pub use index::{Held, IndexConfig, PrefixIndex, PrefixMatch};
pub use media::{Capabilities, MediaNeeds};
pub use policy::{
    build_policy, BackendIdx, Candidate, Pick, Policy, PolicyConfig, PolicyName, PrefixAwareConfig,
    Reason, RouteInput, RoutingPolicy, UnknownPolicy,
};
pub use prompt::{adapter_seed, adapter_seed_from, model_seed, PromptHasher};
pub use rag::{ChunkIndex, ChunkPick};
pub use replica::{IndexOp, Replica, SessionTable};
pub use retry::RetryBudget;
pub use router::{
    AdapterIdx, BackendState, Decision, FleetState, FleetView, ModelIdx, PairOutcome, Pool, Role,
    RouteError, Router, RouterConfig, RoutingFacts,
};
