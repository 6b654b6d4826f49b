//! A shard: one monoio runtime on one (optionally pinned) core, with its own
//! SO_REUSEPORT listener and all of its request-path state.
//!
//! Everything a request touches lives here, owned by the shard's thread (`Rc`,
//! `RefCell`): the router and its index replica, the upstream connection pool, the
//! parsing scratch, the metrics. The only cross-thread state on the request path is
//! the immutable [`Shared`] (start-up config) and the relaxed in-flight
//! counters. The coordinator reaches a shard through its command channel: new fleet
//! snapshots (which carry the backend table and live settings), index events,
//! metric collection. A snapshot with new live settings is installed between
//! requests: per-backend state grows to the new slots, retired backends' pooled
//! connections close, the router is reconfigured and the edge queue's bound
//! follows the new settings.

pub mod edge_queue;
pub mod reclaim;

use crate::config::Hashing;
use crate::control::{ShardCommand, Shared};
use crate::fleet::FleetSnapshot;
use crate::metrics::ShardMetrics;
use crate::open_conns::OpenConnections;
use crate::openai::BodyParser;
use crate::pool::UpstreamPool;
use crate::replica::new_replica;
use crate::token_mode::TokenHasher;
use edge_queue::EdgeQueue;
use radixgate_orchestrator::{PromptHasher, Replica, RetryBudget, Router};
use std::cell::{Cell, Ref, RefCell};
use std::rc::Rc;
use std::sync::Arc;

pub struct Shard {
    pub id: usize,
    pub shared: Arc<Shared>,
    pub fleet: RefCell<Arc<FleetSnapshot>>,
    /// Makes every routing decision (and SLO admission's estimate) for this shard.
    pub router: RefCell<Router>,
    /// This shard's replica of the prefix index, session bindings and RAG chunk
    /// holdings.
    pub replica: RefCell<Replica>,
    /// Request ids and SGLang bootstrap rooms (routing has its own).
    pub rng: RefCell<fastrand::Rng>,
    pub pool: RefCell<UpstreamPool>,
    pub metrics: RefCell<ShardMetrics>,
    pub parser: RefCell<BodyParser>,
    /// The canonical prompt's hasher (bytes mode's blocks; records the stream in
    /// tokens mode).
    pub hasher: RefCell<PromptHasher>,
    /// Tokens mode only: the token-id blocks that replace the byte blocks.
    pub tokens: Option<RefCell<TokenHasher>>,
    /// Requests admitted but waiting for a backend with room (`admission.queue_capacity`).
    pub edge_queue: EdgeQueue,
    /// What this shard alone knows about each backend, by backend slot.
    pub per_backend: RefCell<Vec<PerBackend>>,
    pub retry_budget: RefCell<RetryBudget>,
    /// Spare I/O buffers, so requests stop allocating once the shard is warm.
    pub buffers: RefCell<Vec<Vec<u8>>>,
    /// Client connections open on this shard (closed for real on stop).
    pub conns: Rc<OpenConnections>,
    /// Requests being answered right now.
    pub active_requests: Cell<usize>,
    /// Stopping: finish the requests in flight, keep no connection alive.
    pub draining: Cell<bool>,
}

/// What one shard knows about one backend that no other shard needs.
#[derive(Clone, Copy, Debug, Default)]
pub struct PerBackend {
    /// Its speed, learned from this shard's requests ([`crate::learned`]).
    pub learned: crate::learned::LearnedCost,
    /// This shard's requests in flight to it while it is half-open (its probes).
    pub probes: u32,
    /// Whether this shard's last request to it failed (so the first success after
    /// failures is reported to the breaker).
    pub last_failed: bool,
}

impl Shard {
    pub fn new(id: usize, shared: Arc<Shared>, fleet: Arc<FleetSnapshot>) -> Rc<Shard> {
        let c = &shared.config;
        let backends = fleet.live.backends.len();
        let models = fleet.live.backends.models().names().len();
        let replica = new_replica(&shared.config, &fleet.live);
        let router = Router::new(fleet.live.router.clone(), 0x5eed ^ id as u64);
        let mut hasher = PromptHasher::new(c.routing.block_bytes);
        let tokens = match &c.routing.hashing {
            Hashing::Bytes => None,
            Hashing::Tokens {
                tokenizer,
                block_tokens,
                ..
            } => {
                hasher.set_recording(true);
                Some(RefCell::new(TokenHasher::new(
                    tokenizer.clone(),
                    *block_tokens,
                )))
            }
        };
        Rc::new(Shard {
            id,
            fleet: RefCell::new(fleet),
            router: RefCell::new(router),
            replica: RefCell::new(replica),
            rng: RefCell::new(fastrand::Rng::with_seed(0x1d5 ^ id as u64)),
            pool: RefCell::new(UpstreamPool::new(
                backends,
                c.upstream.pool_max_idle,
                c.upstream.pool_idle_expiry,
            )),
            metrics: RefCell::new(ShardMetrics::new(models, backends)),
            parser: RefCell::new(BodyParser::default()),
            hasher: RefCell::new(hasher),
            tokens,
            edge_queue: EdgeQueue::new(c.admission.queue_capacity),
            per_backend: RefCell::new(vec![PerBackend::default(); backends]),
            retry_budget: RefCell::new(RetryBudget::new(
                c.retry.budget_ratio,
                c.retry.min_retries_per_sec,
                shared.now_ms(),
            )),
            buffers: RefCell::new(Vec::new()),
            conns: Rc::default(),
            active_requests: Cell::new(0),
            draining: Cell::new(false),
            shared,
        })
    }

    /// The current prompt's blocks for the index: token-id blocks in tokens mode,
    /// canonical-byte blocks otherwise.
    pub fn prompt_blocks(&self) -> Ref<'_, [u64]> {
        match &self.tokens {
            Some(t) => Ref::map(t.borrow(), |t| t.blocks()),
            None => Ref::map(self.hasher.borrow(), |h| h.blocks()),
        }
    }

    /// The backend in `slot` as of this shard's snapshot (a retired slot keeps its
    /// config, so requests still running there can finish).
    pub fn backend(&self, slot: usize) -> Arc<crate::config::BackendConfig> {
        self.fleet.borrow().live.backends.config(slot).clone()
    }

    pub fn backend_id(&self, slot: usize) -> String {
        self.fleet.borrow().live.backends.id(slot).to_string()
    }

    /// Hands a request's record to the log thread (never blocks, never writes here).
    pub fn log_access(&self, record: crate::access_log::AccessRecord) {
        if let Some(log) = &self.shared.access_log {
            let _ = log.send(record);
        }
    }

    /// Tells the coordinator's breaker how a request to `backend` ended. Failures are
    /// always reported; successes only when they end a failure streak seen here or the
    /// breaker is not closed (so healthy traffic costs the coordinator nothing).
    pub fn report_outcome(&self, backend: usize, ok: bool) {
        let was_failing =
            std::mem::replace(&mut self.per_backend.borrow_mut()[backend].last_failed, !ok);
        let breaker_closed =
            self.fleet.borrow().breaker[backend] == radixgate_orchestrator::BreakerState::Closed;
        if !ok || was_failing || !breaker_closed {
            let _ = self
                .shared
                .outcomes
                .send(crate::control::Outcome { backend, ok });
        }
    }

    pub fn take_buffer(&self) -> Vec<u8> {
        self.buffers
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(16 << 10))
    }

    pub fn give_buffer(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut spare = self.buffers.borrow_mut();
        if spare.len() < 64 && buf.capacity() <= (1 << 20) {
            spare.push(buf);
        }
    }

    /// Installs a new fleet snapshot. When it carries new live settings, per-backend
    /// state grows to the new slots, retired or re-addressed backends' idle pooled
    /// connections close, and the router (policies, cost model), the edge queue's
    /// bound and the retry budget follow the new settings.
    fn install(&self, snapshot: Arc<FleetSnapshot>) {
        let old = std::mem::replace(&mut *self.fleet.borrow_mut(), snapshot.clone());
        if Arc::ptr_eq(&old.live, &snapshot.live) {
            return;
        }
        let (before, after) = (&*old.live, &*snapshot.live);
        let slots = after.backends.len();
        self.per_backend
            .borrow_mut()
            .resize(slots, PerBackend::default());
        self.metrics
            .borrow_mut()
            .resize(after.backends.models().names().len(), slots);
        let upstream = &after.config.upstream;
        let mut pool = self.pool.borrow_mut();
        pool.configure(slots, upstream.pool_max_idle, upstream.pool_idle_expiry);
        for slot in 0..before.backends.len() {
            let gone = !after.backends.is_live(slot)
                || after.backends.config(slot).addr != before.backends.config(slot).addr;
            if gone {
                pool.close(slot);
            }
        }
        drop(pool);
        self.router.borrow_mut().reconfigure(after.router.clone());
        self.edge_queue
            .set_capacity(after.config.admission.queue_capacity);
        let (r0, r1) = (&before.config.retry, &after.config.retry);
        if (r0.budget_ratio, r0.min_retries_per_sec) != (r1.budget_ratio, r1.min_retries_per_sec) {
            *self.retry_budget.borrow_mut() = RetryBudget::new(
                r1.budget_ratio,
                r1.min_retries_per_sec,
                self.shared.now_ms(),
            );
        }
    }

    /// Applies coordinator commands between requests.
    pub async fn command_loop(self: Rc<Self>, commands: flume::Receiver<ShardCommand>) {
        while let Ok(cmd) = commands.recv_async().await {
            match cmd {
                ShardCommand::Fleet(snapshot) => self.install(snapshot),
                ShardCommand::Replicate(event) => {
                    self.replica.borrow_mut().apply(&event.op);
                    let mut m = self.metrics.borrow_mut();
                    m.replica_applied += 1;
                    m.replica_age.observe(event.created.elapsed());
                }
                ShardCommand::CollectMetrics(reply) => {
                    let mut copy = self.metrics.borrow().clone();
                    copy.shard = self.id;
                    copy.replica_blocks = self.replica.borrow().index.total_blocks() as u64;
                    copy.learned = self
                        .per_backend
                        .borrow()
                        .iter()
                        .map(|b| b.learned)
                        .collect();
                    copy.queue_depth = self.edge_queue.len() as u64;
                    copy.open_connections = self.conns.len() as u64;
                    copy.active_requests = self.active_requests.get() as u64;
                    let _ = reply.send(copy);
                }
            }
        }
    }
}
