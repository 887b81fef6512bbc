//! kvrelay's own depth-first search with symmetry reduction: what [`crate::check_with_symmetry`]
//! runs for a model whose properties are all `always` or `sometimes`.
//!
//! It explores exactly the states stateright 0.31's depth-first checker explores with
//! `.symmetry()`: a state is new when the fingerprint of its
//! [`Representative::representative`] was not seen, the fingerprint is stateright's own (aHash
//! with stateright's fixed seeds), and the search goes on from the state itself, not from its
//! representative. So the state counts are the same, collisions included (the pinned counts in
//! `model-check/tests` hold with either). What it does not do is what made stateright's search
//! cost more than the model on the deep configurations:
//!
//! - **No path copied per state.** Stateright keeps, with every state waiting on the stack, the
//!   action indices of its whole path from the initial state, copied for every successor. Here
//!   a waiting state holds one shared link to its parent's ([`Link`]: the action index taken,
//!   and the parent's link), so a path costs one small allocation per new state and lives only
//!   as long as a state below it waits. A discovery keeps its link; its path is replayed
//!   forward once, at the end (the model's `actions` and `next_state` are deterministic), and
//!   must end in a state of the discovery's fingerprint.
//! - **One fingerprint per new state.** Stateright hashes the representative and then the
//!   state itself, whose fingerprint it never reads.
//! - **Work shared only when a thread is hungry.** Threads keep their own stacks and hand half of
//!   theirs (the oldest states, nearest the root) to the pool only when another thread waits;
//!   the visited set is sharded by fingerprint bits, one lock per shard.
//!
//! The visited set holds fingerprints only (8 bytes per unique state in a hash table, as
//! stateright's); the threads' stacks hold states and their links.
//!
//! `eventually` properties (stateright tracks them per path) are not supported: a model with
//! one is checked by stateright's checker instead ([`supports`]).

use core::hash::{BuildHasherDefault, Hash, Hasher};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use stateright::{Checker, Expectation, Model, Path, Property, Representative};

/// Shards of the visited set (a power of two); a fingerprint's bits 32.. pick its shard.
const SHARDS: usize = 64;
/// States a thread expands between looks at the shared state (counters, stop, hungry threads).
const BLOCK: usize = 1024;

/// Whether [`SymmetricDfs`] can check `model`: every property is `always` or `sometimes`.
pub(crate) fn supports<M: Model>(model: &M) -> bool {
    model
        .properties()
        .iter()
        .all(|p| p.expectation != Expectation::Eventually)
}

/// When the search stops early.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Threads (at least one).
    pub threads: usize,
    /// States at this depth (the initial states are at depth 1) are counted, not expanded.
    pub target_max_depth: Option<usize>,
    /// Stop at the first discovery of an `always` property; otherwise when every property has
    /// one (or the space is exhausted).
    pub stop_at_first_violation: bool,
}

/// The fingerprint stateright 0.31 gives a state: aHash with its fixed seeds (so counts and
/// collisions are stateright's).
fn fingerprint<T: Hash>(value: &T) -> u64 {
    const KEY1: u64 = 123_456_789_987_654_321;
    const KEY2: u64 = 98_765_432_123_456_789;
    ahash::RandomState::with_seeds(KEY1, KEY2, 0, 0).hash_one(value)
}

/// A fingerprint is already a hash: the table uses it as is.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// How a waiting state was reached: the index of the action taken in its parent (for an
/// initial state, its index among the initial states) and the parent's link (`None` for an
/// initial state).
#[derive(Debug)]
struct Link {
    action: u32,
    parent: Option<Arc<Link>>,
}

impl Drop for Link {
    /// Unlinks iteratively: a long path dropped recursively could exhaust the stack.
    fn drop(&mut self) {
        let mut next = self.parent.take();
        while let Some(link) = next {
            next = match Arc::try_unwrap(link) {
                Ok(mut only) => only.parent.take(),
                Err(_) => None,
            };
        }
    }
}

/// One shard of the visited set.
type Shard = HashSet<u64, BuildHasherDefault<Identity>>;

/// The visited set of fingerprints, sharded.
struct Visited {
    shards: Box<[Mutex<Shard>]>,
}

impl Visited {
    fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }

    fn shard(&self, fp: u64) -> MutexGuard<'_, Shard> {
        let i = (fp >> 32) as usize & (SHARDS - 1);
        // A poisoned shard means a checker thread panicked; the table itself is intact (an
        // insert is one call), so go on with it.
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `fp`; `false` if it was already there.
    fn insert(&self, fp: u64) -> bool {
        self.shard(fp).insert(fp)
    }
}

/// States handed between threads, and who waits for them.
struct Pool<S> {
    chunks: Vec<Vec<Frame<S>>>,
    idle: usize,
    closed: bool,
}

/// A state waiting to be expanded: the state, its representative's fingerprint, its depth, how
/// it was reached.
struct Frame<S> {
    state: S,
    fp: u64,
    depth: usize,
    link: Arc<Link>,
}

struct Common<M: Model> {
    model: Arc<M>,
    limits: Limits,
    visited: Visited,
    states: AtomicUsize,
    unique: AtomicUsize,
    max_depth: AtomicUsize,
    /// Threads waiting for work (mirrors `Pool::idle`, read without the lock).
    hungry: AtomicUsize,
    stop: AtomicBool,
    /// Threads still running.
    running: AtomicUsize,
    /// Property name → the fingerprint of the state that discovered it and its link, first one
    /// only.
    discoveries: Mutex<Vec<(&'static str, u64, Arc<Link>)>>,
    pool: Mutex<Pool<M::State>>,
    wake: Condvar,
}

/// The checker; see the module docs. It implements stateright's [`Checker`], so the runner
/// drives it as it drives stateright's.
pub(crate) struct SymmetricDfs<M: Model> {
    common: Arc<Common<M>>,
    handles: Vec<JoinHandle<()>>,
}

impl<M> SymmetricDfs<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Clone + Hash + Representative + Send + 'static,
    M::Action: Clone,
{
    /// Starts the search on `limits.threads` threads.
    pub(crate) fn spawn(model: M, limits: Limits) -> Self {
        let threads = limits.threads.max(1);
        let limits = Limits { threads, ..limits };
        let common = Arc::new(Common {
            model: Arc::new(model),
            limits,
            visited: Visited::new(),
            states: AtomicUsize::new(0),
            unique: AtomicUsize::new(0),
            max_depth: AtomicUsize::new(0),
            hungry: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            running: AtomicUsize::new(threads),
            discoveries: Mutex::new(Vec::new()),
            pool: Mutex::new(Pool {
                chunks: Vec::new(),
                idle: 0,
                closed: false,
            }),
            wake: Condvar::new(),
        });
        let mut first = Vec::new();
        for (i, s) in common.model.init_states().into_iter().enumerate() {
            if !common.model.within_boundary(&s) {
                continue;
            }
            common.states.fetch_add(1, Ordering::Relaxed);
            let fp = fingerprint(&s.representative());
            if common.visited.insert(fp) {
                common.unique.fetch_add(1, Ordering::Relaxed);
                let link = Arc::new(Link {
                    action: i as u32,
                    parent: None,
                });
                first.push(Frame {
                    state: s,
                    fp,
                    depth: 1,
                    link,
                });
            }
        }
        common.lock_pool().chunks.push(first);
        let handles = (0..threads)
            .map(|t| {
                let common = Arc::clone(&common);
                std::thread::Builder::new()
                    .name(format!("kvrelay-check-{t}"))
                    .spawn(move || {
                        common.work();
                        common.running.fetch_sub(1, Ordering::Release);
                    })
                    .expect("spawning a checker thread")
            })
            .collect();
        Self { common, handles }
    }
}

impl<M> Common<M>
where
    M: Model,
    M::State: Clone + Hash + Representative,
{
    fn lock_pool(&self) -> MutexGuard<'_, Pool<M::State>> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One thread's search: expand states from its own stack, take from the pool when it is
    /// empty, give to the pool when another thread is hungry.
    fn work(&self) {
        let model = &*self.model;
        let properties = model.properties();
        let mut stack: Vec<Frame<M::State>> = Vec::new();
        let mut actions = Vec::new();
        let mut max_depth = 0;
        loop {
            if stack.is_empty() {
                match self.take() {
                    Some(chunk) => stack = chunk,
                    None => return,
                }
            }
            let (mut states, mut unique) = (0, 0);
            for _ in 0..BLOCK {
                let Some(Frame {
                    state,
                    fp,
                    depth,
                    link,
                }) = stack.pop()
                else {
                    break;
                };
                max_depth = max_depth.max(depth);
                if self.limits.target_max_depth.is_some_and(|d| depth >= d) {
                    continue;
                }
                if !self.evaluate(&properties, &state, fp, &link) {
                    continue;
                }
                model.actions(&state, &mut actions);
                for (i, action) in actions.drain(..).enumerate() {
                    let Some(next) = model.next_state(&state, action) else {
                        continue;
                    };
                    if !model.within_boundary(&next) {
                        continue;
                    }
                    states += 1;
                    let next_fp = fingerprint(&next.representative());
                    if self.visited.insert(next_fp) {
                        unique += 1;
                        let link = Arc::new(Link {
                            action: i as u32,
                            parent: Some(Arc::clone(&link)),
                        });
                        stack.push(Frame {
                            state: next,
                            fp: next_fp,
                            depth: depth + 1,
                            link,
                        });
                    }
                }
            }
            self.states.fetch_add(states, Ordering::Relaxed);
            self.unique.fetch_add(unique, Ordering::Relaxed);
            self.max_depth.fetch_max(max_depth, Ordering::Relaxed);
            if self.finished(&properties) {
                self.halt();
                return;
            }
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            if stack.len() > 1 && self.hungry.load(Ordering::Relaxed) > 0 {
                // The oldest half: nearest the root, the largest subtrees.
                let rest = stack.split_off(stack.len() / 2);
                let given = core::mem::replace(&mut stack, rest);
                self.lock_pool().chunks.push(given);
                self.wake.notify_one();
            }
        }
    }

    /// Evaluates every property on `state` (fingerprint `fp`), recording first discoveries;
    /// `false` when nothing is left to learn from its successors (every property discovered
    /// here, as stateright decides).
    fn evaluate(
        &self,
        properties: &[Property<M>],
        state: &M::State,
        fp: u64,
        link: &Arc<Link>,
    ) -> bool {
        let model = &*self.model;
        let mut awaiting = false;
        for p in properties {
            let found = match p.expectation {
                Expectation::Always => !(p.condition)(model, state),
                Expectation::Sometimes => (p.condition)(model, state),
                Expectation::Eventually => false,
            };
            if found {
                let mut d = self.discoveries.lock().unwrap_or_else(|e| e.into_inner());
                if !d.iter().any(|(name, ..)| *name == p.name) {
                    d.push((p.name, fp, Arc::clone(link)));
                }
            } else {
                awaiting = true;
            }
        }
        awaiting
    }

    /// Whether the run is done with what it was asked (see [`Limits::stop_at_first_violation`]).
    fn finished(&self, properties: &[Property<M>]) -> bool {
        let d = self.discoveries.lock().unwrap_or_else(|e| e.into_inner());
        let found = |p: &Property<M>| d.iter().any(|(name, ..)| *name == p.name);
        if self.limits.stop_at_first_violation
            && properties
                .iter()
                .any(|p| p.expectation == Expectation::Always && found(p))
        {
            return true;
        }
        !properties.is_empty() && properties.iter().all(found)
    }

    /// Stops every thread (the others see `stop` at their next block or wake up).
    fn halt(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.lock_pool().closed = true;
        self.wake.notify_all();
    }

    /// Work from the pool, waiting while other threads still expand states; `None` when the
    /// search is over (every thread waits and the pool is empty, or it was stopped).
    fn take(&self) -> Option<Vec<Frame<M::State>>> {
        let mut pool = self.lock_pool();
        loop {
            if pool.closed || self.stop.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(chunk) = pool.chunks.pop() {
                return Some(chunk);
            }
            pool.idle += 1;
            if pool.idle == self.limits.threads {
                pool.closed = true;
                self.wake.notify_all();
                return None;
            }
            self.hungry.fetch_add(1, Ordering::Relaxed);
            pool = self.wake.wait(pool).unwrap_or_else(|e| e.into_inner());
            self.hungry.fetch_sub(1, Ordering::Relaxed);
            pool.idle -= 1;
        }
    }

    /// The path to the state of fingerprint `fp` reached by `link`: the links back to an
    /// initial state, then the action indices replayed forward.
    fn path(&self, fp: u64, link: &Link) -> Path<M::State, M::Action>
    where
        M::Action: Clone + PartialEq,
        M::State: PartialEq,
    {
        let model = &*self.model;
        let mut indices = Vec::new();
        let mut at = link;
        let init = loop {
            match &at.parent {
                None => break at.action as usize,
                Some(parent) => {
                    indices.push(at.action as usize);
                    at = parent;
                }
            }
        };
        let init_state = model
            .init_states()
            .into_iter()
            .nth(init)
            .expect("the initial state recorded as a discovery's root");
        let mut state = init_state.clone();
        let mut taken = Vec::with_capacity(indices.len());
        let mut actions = Vec::new();
        for &i in indices.iter().rev() {
            actions.clear();
            model.actions(&state, &mut actions);
            let action = actions.swap_remove(i);
            state = model
                .next_state(&state, action.clone())
                .expect("replaying an action the search took");
            taken.push(action);
        }
        assert_eq!(
            fingerprint(&state.representative()),
            fp,
            "a replayed path ends in the state it was recorded for"
        );
        Path::from_actions(model, init_state, taken.iter())
            .expect("the model's actions and next states are deterministic")
    }
}

impl<M> Checker<M> for SymmetricDfs<M>
where
    M: Model,
    M::State: Clone + Hash + Representative,
{
    fn model(&self) -> &M {
        &self.common.model
    }

    fn state_count(&self) -> usize {
        self.common.states.load(Ordering::Relaxed)
    }

    fn unique_state_count(&self) -> usize {
        self.common.unique.load(Ordering::Relaxed)
    }

    fn max_depth(&self) -> usize {
        self.common.max_depth.load(Ordering::Relaxed)
    }

    fn discoveries(&self) -> std::collections::HashMap<&'static str, Path<M::State, M::Action>>
    where
        M::State: Clone + PartialEq,
        M::Action: Clone + PartialEq,
    {
        let found = self
            .common
            .discoveries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        found
            .into_iter()
            .map(|(name, fp, link)| (name, self.common.path(fp, &link)))
            .collect()
    }

    fn handles(&mut self) -> Vec<JoinHandle<()>> {
        core::mem::take(&mut self.handles)
    }

    fn is_done(&self) -> bool {
        self.common.running.load(Ordering::Acquire) == 0
    }
}
