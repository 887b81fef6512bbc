//! Unit tests of the tiering manager: the probe round trip, promotion, cascade pins, failed
//! promotions (vLLM #49176), strict deadlines (vLLM #49829), report validation, and that
//! `check_invariants()` catches a broken state.

use alloc::vec;
use alloc::vec::Vec;

use super::*;
use crate::offloading::{Access, ManagerConfig, PolicyKind};
use crate::tokens::BlockHash;

fn key(n: u64) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(n),
        group: 0,
    }
}

const R: RequestId = RequestId(1);

fn manager(capacity: u32, deadline: Option<u32>) -> TieringManager {
    let primary = ManagerConfig {
        capacity_chunks: capacity,
        policy: PolicyKind::Lru,
        store_threshold: 1,
    };
    let config = TieringConfig {
        tiers: 1,
        deadline_steps: deadline,
        promoted_most_recent: deadline.is_some(),
        hold_promoted: deadline.is_some(),
    };
    let mut m = TieringManager::new(primary, config).expect("valid config");
    m.on_new_request(R);
    m
}

fn access() -> Access<'static> {
    Access {
        request: Some(R),
        positions: None,
    }
}

fn step(m: &mut TieringManager) -> Vec<TierWork> {
    m.on_schedule_end();
    m.check_invariants().expect("invariants hold");
    m.take_tier_work()
}

/// Answers every probe of `work` with `found`.
fn answer(m: &mut TieringManager, work: &[TierWork], found: bool) {
    for w in work {
        if let TierWork::Probe { tier, keys } = w {
            for &(key, generation) in keys {
                let r = TierReport::Probed {
                    tier: *tier,
                    key,
                    generation,
                    found,
                };
                m.report(r).expect("a probe in flight");
            }
        }
    }
}

fn loads(work: &[TierWork]) -> Vec<(TierJobId, Vec<OffloadKey>)> {
    work.iter()
        .filter_map(|w| match w {
            TierWork::Load { job, keys, .. } => Some((*job, keys.clone())),
            _ => None,
        })
        .collect()
}

fn finish(m: &mut TieringManager, job: TierJobId, success: bool) {
    let r = TierReport::Finished {
        tier: TierId(0),
        job,
        success,
        successful_keys: None,
    };
    m.report(r).expect("a job in flight");
}

// Protects the promotion path (SEMANTICS.md §5.9): retry while probing, pending while loading,
// then a primary hit.
#[test]
fn a_secondary_hit_is_probed_promoted_then_read() {
    let mut m = manager(4, None);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::Retry);
    let work = step(&mut m);
    answer(&mut m, &work, true);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::HitPending);
    let work = step(&mut m);
    let jobs = loads(&work);
    assert_eq!(jobs.len(), 1, "one batched load per tier and request");
    assert!(m.has_pending_work());
    assert_eq!(
        m.lookup(key(1), R, 0),
        LookupResult::HitPending,
        "this step's poll"
    );
    finish(&mut m, jobs[0].0, true);
    assert_eq!(
        m.lookup(key(1), R, 0),
        LookupResult::HitPending,
        "polled once per step"
    );
    step(&mut m);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::Hit);
    assert!(!m.has_pending_work());
}

// Protects I-50 and the cascade: a stored chunk is copied to the tier with its primary chunk
// pinned, so it cannot be evicted until the copy ends.
#[test]
fn a_cascade_pins_its_chunk_until_it_ends() {
    let mut m = manager(1, None);
    let out = m
        .prepare_store(&[key(1)], access())
        .expect("known")
        .expect("room");
    assert_eq!(out.keys_to_store, vec![key(1)]);
    m.complete_store(&[key(1)], R, true).expect("in flight");
    let work = m.take_tier_work();
    let TierWork::Store { job, .. } = work[0] else {
        panic!("a cascade: {work:?}");
    };
    assert_eq!(
        m.prepare_store(&[key(2)], access()),
        Ok(None),
        "pinned: no eviction"
    );
    finish(&mut m, job, true);
    let out = m
        .prepare_store(&[key(2)], access())
        .expect("known")
        .expect("room now");
    assert_eq!(out.evicted, vec![key(1)]);
    m.check_invariants().expect("invariants hold");
}

// Protects the livelock fix of vLLM #49176: a failed promotion frees its chunk and marks the key
// missing for the request, so the next lookup misses instead of promoting again.
#[test]
fn a_failed_promotion_is_a_miss_not_a_retry_loop() {
    let mut m = manager(4, None);
    m.lookup(key(1), R, 0);
    let work = step(&mut m);
    answer(&mut m, &work, true);
    m.lookup(key(1), R, 0);
    let jobs = loads(&step(&mut m));
    finish(&mut m, jobs[0].0, false);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::Miss);
    assert_eq!(
        m.primary().ref_count(key(1)),
        None,
        "the reserved chunk is freed"
    );
    assert_eq!(m.stats().promotion_failures, 1);
}

// Protects the strict departure (vLLM #49829): a probe that is never answered stops being
// waited for after its deadline; in compat it is retried for ever.
#[test]
fn strict_gives_up_an_unanswered_probe() {
    for (deadline, after) in [(None, LookupResult::Retry), (Some(2), LookupResult::Miss)] {
        let mut m = manager(4, deadline);
        assert_eq!(m.lookup(key(1), R, 0), LookupResult::Retry);
        for _ in 0..3 {
            step(&mut m);
        }
        assert_eq!(m.lookup(key(1), R, 0), after, "deadline {deadline:?}");
    }
}

// Protects the strict departure for promotions: an overdue promotion looks missing, but its
// chunk stays reserved until the runtime reports the job (no late write into a reused chunk).
#[test]
fn strict_gives_up_a_silent_promotion_but_keeps_its_chunk() {
    let mut m = manager(4, Some(1));
    m.lookup(key(1), R, 0);
    let work = step(&mut m);
    answer(&mut m, &work, true);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::HitPending);
    let jobs = loads(&step(&mut m));
    step(&mut m);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::Miss);
    assert_eq!(m.primary().ref_count(key(1)), Some(-1), "still reserved");
    finish(&mut m, jobs[0].0, true);
    step(&mut m);
    assert_eq!(
        m.lookup(key(1), R, 0),
        LookupResult::Hit,
        "a late success still lands"
    );
    assert_eq!(m.stats().promotions_expired, 1);
}

// Protects report validation: what the manager did not hand out is refused and changes nothing.
#[test]
fn reports_of_unknown_work_are_refused() {
    let mut m = manager(4, None);
    let before = m.clone();
    let bad = [
        TierReport::Finished {
            tier: TierId(0),
            job: TierJobId(7),
            success: true,
            successful_keys: None,
        },
        TierReport::Finished {
            tier: TierId(3),
            job: TierJobId(0),
            success: true,
            successful_keys: None,
        },
        TierReport::Probed {
            tier: TierId(0),
            key: key(1),
            generation: 0,
            found: true,
        },
    ];
    let kinds: Vec<&str> = bad
        .into_iter()
        .map(|r| m.report(r).expect_err("refused").kind())
        .collect();
    assert_eq!(kinds, ["unknown_job", "unknown_tier", "unknown_probe"]);
    assert_eq!(m, before);
}

// Protects that the invariants can fail: a promoted key that is not write-pending is caught.
#[test]
fn check_invariants_catches_a_promotion_without_a_reserved_chunk() {
    let mut m = manager(4, None);
    m.promotions.push((
        TierId(0),
        vec![(
            R,
            Promotion {
                keys: vec![key(9)],
                chunks: vec![ChunkId(0)],
            },
        )],
    ));
    let err = m.check_invariants().expect_err("broken");
    assert_eq!(err.id, "I-50");
}

/// A promotion of `k` for `R`, from lookup to landing (the tier has it).
fn promote(m: &mut TieringManager, k: OffloadKey) {
    assert_eq!(m.lookup(k, R, 0), LookupResult::Retry);
    let work = step(m);
    answer(m, &work, true);
    assert_eq!(m.lookup(k, R, 0), LookupResult::HitPending);
    let work = step(m);
    finish(m, loads(&work)[0].0, true);
    step(m);
}

/// Under LRU, whether `R`'s second promotion evicts its first (rather than an idle chunk a
/// request that finished later left).
fn second_promotion_evicts_the_first(strict: bool) -> bool {
    const R2: RequestId = RequestId(2);
    let mut m = manager(2, strict.then_some(8));
    // R's provisional rank is taken now, by its first promotion's reservation.
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::Retry);
    let work = step(&mut m);
    answer(&mut m, &work, true);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::HitPending);
    // R2 stores a chunk and finishes: its chunk ranks above R's provisional rank.
    m.on_new_request(R2);
    let later = Access {
        request: Some(R2),
        positions: None,
    };
    m.prepare_store(&[key(9)], later)
        .expect("known")
        .expect("room");
    m.complete_store(&[key(9)], R2, true).expect("in flight");
    m.on_request_finished(R2).expect("known");
    for w in step(&mut m) {
        match w {
            TierWork::Store { job, .. } => finish(&mut m, job, true),
            TierWork::Load { job, .. } => finish(&mut m, job, true),
            TierWork::Probe { .. } => {}
        }
    }
    step(&mut m);
    assert_eq!(m.lookup(key(1), R, 0), LookupResult::Hit, "landed");
    promote(&mut m, key(2));
    m.lookup(key(1), R, 0) != LookupResult::Hit
}

// Protects strict's departure (docs/TIERING.md, "promotions that evict each other"): vLLM
// ranks a landed promotion with its request's old provisional rank, so under LRU a request's
// next promotion evicts its last one, not the idle chunk a later request left (the livelock
// the simulation found, seed 28473); strict ranks it most recent.
#[test]
fn strict_ranks_a_landed_promotion_most_recent() {
    assert!(
        second_promotion_evicts_the_first(false),
        "compat: vLLM's ranks"
    );
    assert!(
        !second_promotion_evicts_the_first(true),
        "strict: the idle chunk goes"
    );
}

/// One step of two requests that each want `keys` from the tier, as the connector looks them
/// up (in order: a hit goes on, a miss ends the request's hit, anything pending makes it wait)
/// and loads a hit prefix; every probe is found and every promotion lands. The requests that
/// loaded this step.
fn contend(m: &mut TieringManager, wants: &[(RequestId, [OffloadKey; 2])]) -> Vec<RequestId> {
    let mut loaded = Vec::new();
    for (r, keys) in wants {
        let mut hit = Vec::new();
        let mut waits = false;
        for (i, &k) in keys.iter().enumerate() {
            match m.lookup(k, *r, i as u32) {
                LookupResult::Hit => hit.push(k),
                LookupResult::Miss => break,
                LookupResult::HitPending | LookupResult::Retry => {
                    waits = true;
                    break;
                }
            }
        }
        if !waits && !hit.is_empty() {
            let access = Access {
                request: Some(*r),
                positions: None,
            };
            m.prepare_load(&hit, access).expect("a hit loads");
            m.complete_load(&hit).expect("pinned by its load");
            loaded.push(*r);
        }
    }
    let work = step(m);
    answer(m, &work, true);
    for (job, _) in loads(&work) {
        finish(m, job, true);
    }
    loaded
}

// Protects the strict departure from vLLM's promotion livelock (docs/TIERING.md, "promotions
// that evict each other"): two requests whose promotions need more chunks than the primary
// tier holds. In compat each step's promotions evict the other request's, and neither ever
// loads; in strict a promoted chunk stays pinned for its request, the promotion that finds no
// room is a miss, and each request loads what it has.
#[test]
fn promotions_that_outgrow_the_primary_tier_evict_each_other_only_in_compat() {
    const B: RequestId = RequestId(2);
    for strict in [false, true] {
        let mut m = manager(2, strict.then_some(50));
        m.on_new_request(B);
        let wants = [(R, [key(1), key(2)]), (B, [key(3), key(4)])];
        let mut loaded = Vec::new();
        for _ in 0..30 {
            loaded.extend(contend(&mut m, &wants));
        }
        if strict {
            assert!(loaded.contains(&R) && loaded.contains(&B), "{loaded:?}");
            assert!(m.stats().promotion_allocation_failures > 0);
        } else {
            assert_eq!(loaded, Vec::<RequestId>::new(), "vLLM's livelock");
        }
        m.on_request_finished(R).unwrap();
        m.on_request_finished(B).unwrap();
        m.check_invariants().expect("nothing held past its request");
        assert!(m.held.is_empty());
    }
}
