//! radixgate's brain: every routing decision, and nothing else.
//!
//! This crate knows nothing of sockets, runtimes, clocks or logs. The gateway (`src/`)
//! parses a request, feeds its prompt to a [`PromptHasher`] to get chained block
//! hashes and an affinity key, hands a [`RoutingPolicy`] the candidate backends with
//! their in-flight counts and a seeded RNG, and gets back a [`Pick`] with its
//! [`Reason`]; [`admission`] decides, before that, whether the request may go at
//! all. Logging and metrics about the pick happen in the caller. The simulator
//! in `bench/` replays the very same code, so decisions stay unit-testable and
//! reproducible.

pub mod admission;
pub mod breaker;
pub mod dag;
pub mod disagg;
pub mod engine_cache;
pub mod index;
pub mod media;
pub mod policy;
pub mod prompt;
pub mod quota;
pub mod rag;
pub mod retry;
pub mod route;

pub use admission::{AdmissionInput, Estimate, ShedReason, Verdict};
pub use breaker::{Breaker, BreakerConfig, BreakerState};
pub use disagg::{DecodeCandidate, DisaggPolicy, LocalWhy, PairDecision, PairInput};
pub use engine_cache::EngineCache;
pub use index::{IndexConfig, PrefixIndex, PrefixMatch};
pub use media::{Capabilities, MediaNeeds};
pub use policy::{
    build_policy, BackendIdx, Candidate, Pick, Policy, PolicyConfig, PolicyName, PrefixAwareConfig,
    Reason, RouteInput, RoutingPolicy, UnknownPolicy,
};
pub use prompt::{model_seed, PromptHasher};
pub use rag::{ChunkIndex, ChunkPick};
pub use retry::RetryBudget;
