//! Unit tests of the offloading connector's private parts.

use super::*;
use crate::messages::{CacheEvent, KvEvent, Medium};
use crate::scheduler::SchedulerConnector;

fn connector() -> OffloadingConnector {
    let manager = ManagerConfig {
        capacity_chunks: 8,
        policy: PolicyKind::Lru,
        store_threshold: 0,
    };
    OffloadingConnector::new(
        OffloadingConfig::new(2, 1, manager),
        &SchedulerConfig::default(),
    )
    .unwrap()
}

/// A job of `kind`: `'s'` store, `'l'` async load, `'y'` sync load.
fn job(request: RequestId, kind: char) -> JobStatus {
    JobStatus {
        request,
        pending: 1,
        keys: Vec::new(),
        is_store: kind == 's',
        is_sync_load: kind == 'y',
        fenced: Vec::new(),
        deferred_fence: Vec::new(),
        failed: false,
    }
}

/// A connector with jobs 0.. (one per kind, all of request 1, listed by it).
fn with_jobs(kinds: &str) -> OffloadingConnector {
    let mut conn = connector();
    let r = RequestId(1);
    let mut st = ReqState::new(1, None, None);
    for (i, kind) in kinds.chars().enumerate() {
        let id = conn.new_job_id();
        assert_eq!(id, JobId(i as u64));
        conn.jobs.insert(id, job(r, kind));
        st.jobs.insert(id);
    }
    conn.requests.insert(r, st);
    conn
}

/// A connector with `groups` (block size 4, 3 blocks per chunk: 12-token chunks) and a
/// request whose chunk keys in group `g` are as `patterns[g]` says, chunk by chunk: `h`
/// stored, `p` being stored (write-pending), `.` missing.
fn lookup_fixture(groups: &[GroupKind], patterns: &[&str]) -> (OffloadingConnector, ReqState) {
    let sched = SchedulerConfig {
        block_size: 4,
        groups: groups.to_vec(),
        ..SchedulerConfig::default()
    };
    let manager = ManagerConfig {
        capacity_chunks: 64,
        policy: PolicyKind::Lru,
        store_threshold: 0,
    };
    let mut conn = OffloadingConnector::new(OffloadingConfig::new(3, 1, manager), &sched)
        .expect("a valid configuration");
    let mut st = ReqState::new(groups.len(), None, None);
    st.chunk_hashes = (0..patterns[0].len() as u64)
        .map(|c| BlockHash(1000 + c))
        .collect();
    for (g, pattern) in patterns.iter().enumerate() {
        for (c, kind) in pattern.chars().enumerate() {
            if kind == '.' {
                continue;
            }
            let key = [st.key(c, g)];
            let access = Access {
                request: None,
                positions: None,
            };
            let out = cpu(&mut conn).prepare_store(&key, access).expect("room");
            assert_eq!(out.keys_to_store, key);
            if kind == 'h' {
                cpu(&mut conn).complete_store(&key, true);
            }
        }
    }
    (conn, st)
}

/// The connector's CPU manager (these tests build no tiers).
fn cpu(conn: &mut OffloadingConnector) -> &mut CpuOffloadingManager {
    match &mut conn.manager {
        OffloadingManager::Cpu(m) => m,
        OffloadingManager::Tiering(_) => panic!("built without tiers"),
    }
}

/// `lookup_chunks` for a fresh request of `num_tokens` tokens: `(locally computed tokens,
/// max_load_tokens)`.
fn hit(
    groups: &[GroupKind],
    patterns: &[&str],
    num_tokens: u32,
    bounds: (u32, Option<u32>),
) -> Option<u32> {
    let (mut conn, mut st) = lookup_fixture(groups, patterns);
    st.num_locally_computed_tokens = bounds.0;
    st.max_load_tokens = bounds.1;
    conn.lookup_chunks(&st, RequestId(0), num_tokens)
}

#[test]
fn the_sliding_window_lookup_on_holes_and_write_pending_keys() {
    // `_sliding_window_lookup` scans from the end for a window's worth of consecutive
    // chunks (16 tokens: 2 chunks); a run reaching chunk 0 is a hit however short; a
    // write-pending key inside the chosen run means "ask again" (`None`), one outside it
    // does not matter. 49 tokens: at most 48 hit (the last token is recomputed).
    let swa = [GroupKind::SlidingWindow { window: 16 }];
    for (pattern, want) in [
        ("hhhh", Some(48)),
        (".hhh", Some(48)),
        ("..hh", Some(48)),
        ("h.hh", Some(48)),
        ("p.hh", Some(48)),
        ("hhh.", Some(36)),
        ("hh.h", Some(24)), // the last chunk alone is no window
        ("h...", Some(12)), // a run at the start needs no whole window
        (".h.h", Some(0)),
        ("...h", Some(0)),
        ("hhhp", None),
        ("h.hp", None),
        ("hp.h", None),
        ("ph.h", None),
    ] {
        assert_eq!(hit(&swa, &[pattern], 49, (0, None)), want, "{pattern}");
    }
    // A chunk-aligned prompt hits one token short of its end.
    assert_eq!(hit(&swa, &["h.hh"], 48, (0, None)), Some(47));
    // After a local hit of one chunk the scan starts at chunk 1.
    assert_eq!(hit(&swa, &[".h.h"], 49, (12, None)), Some(12));
}

#[test]
fn the_prefix_lookup_stops_at_the_first_miss() {
    // `_maximal_prefix_lookup`: consecutive keys from the first uncomputed chunk; a
    // write-pending key before the first miss means "ask again".
    let full = [GroupKind::FullAttention];
    for (pattern, want) in [
        ("hhhh", Some(48)),
        ("hh.h", Some(24)),
        ("hh.p", Some(24)),
        (".hhh", Some(0)),
        ("hhp.", None),
        ("p...", None),
    ] {
        assert_eq!(hit(&full, &[pattern], 49, (0, None)), want, "{pattern}");
    }
    assert_eq!(hit(&full, &[".hhh"], 49, (12, None)), Some(36));
}

#[test]
fn max_load_tokens_bounds_the_hit_to_whole_chunks_past_the_local_hit() {
    let full = [GroupKind::FullAttention];
    for (bounds, want) in [
        ((0, Some(30)), Some(24)),
        ((12, Some(30)), Some(24)),
        ((12, Some(36)), Some(36)),
        ((0, Some(11)), Some(0)),
        ((0, Some(100)), Some(48)),
        ((24, Some(12)), Some(12)),
    ] {
        assert_eq!(hit(&full, &["hhhh"], 49, bounds), want, "{bounds:?}");
    }
}

#[test]
fn the_hybrid_lookup_converges_on_a_hit_every_group_can_serve() {
    // `_lookup_complete_chunks`: full attention first, then sliding windows by decreasing
    // window; a group that shrinks the hit sends the lookup round again.
    let fa_swa = [
        GroupKind::FullAttention,
        GroupKind::SlidingWindow { window: 16 },
    ];
    assert_eq!(hit(&fa_swa, &["hhh.", "hhhh"], 49, (0, None)), Some(36));
    assert_eq!(hit(&fa_swa, &["hhhh", "hh.h"], 49, (0, None)), Some(24));
    // Full attention's write-pending chunk 3 defers, but the window group's hit ends at
    // chunk 1, so a second round looks again below chunk 3 and hits.
    assert_eq!(hit(&fa_swa, &["hhhp", "hh.h"], 49, (0, None)), Some(24));
    assert_eq!(hit(&fa_swa, &["hhhp", "hhhh"], 49, (0, None)), None);
    // Two windows, 40 tokens (4 chunks) then 16 (2): the 16-token group cuts the hit to
    // 48, where the 40-token group's window (tokens 8..48) reaches the missing chunk 1, so
    // the hit falls to the run at the start, 12 tokens.
    let two = [
        GroupKind::SlidingWindow { window: 16 },
        GroupKind::SlidingWindow { window: 40 },
    ];
    assert_eq!(hit(&two, &["hhhh.h", "h.hhhh"], 73, (0, None)), Some(12));
    assert_eq!(hit(&two, &["hhhh.h", "hhhhhh"], 73, (0, None)), Some(48));
}

#[test]
fn sealing_sorts_and_dedups_the_allocated_blocks() {
    // The fence and stale-entry checks binary-search this list: allocation order is the
    // free queue's (not sorted), and a block may be reported twice in a step.
    let mut batch = Batch {
        allocated: [9, 3, 7, 3].map(BlockId).to_vec(),
        ..Batch::default()
    };
    batch.seal_allocated();
    assert_eq!(batch.allocated, [3, 7, 9].map(BlockId));
    assert!(batch.allocated_sealed);
}

#[test]
fn check_invariants_rejects_corrupt_job_tables() {
    // Protects I-38…I-45 as the model checker sees them: the public calls never build these
    // states, so only a corrupted connector shows that each check looks at all.
    // Stores plus a sync load are fine.
    assert_eq!(with_jobs("ssy").check_invariants(), Ok(()));
    let mut unlisted = with_jobs("s");
    unlisted
        .requests
        .get_mut(&RequestId(1))
        .unwrap()
        .jobs
        .clear();
    let e = unlisted.check_invariants().unwrap_err();
    assert!(format!("{e:?}").contains("not listed"), "{e:?}");
    // An async load only ever runs alone.
    let e = with_jobs("ls").check_invariants().unwrap_err();
    assert!(format!("{e:?}").contains("async load next to"), "{e:?}");
}

#[test]
fn cpu_events_render_as_before_and_are_kept_structured_only_when_on() {
    // Protects the conformance strings of the CPU events (byte-identical to those the connector
    // formatted itself before it built `CacheEvent`s: one `BlockStored` per key with block size
    // 0, one `BlockRemoved` per group of a removal) and the structured switch: off keeps
    // nothing, on keeps the last `take_events` call's events, in the same order.
    let key = |h: u64, group: u32| OffloadKey {
        hash: BlockHash(h),
        group,
    };
    let access = Access {
        request: None,
        positions: None,
    };
    // Stores `ok` (completed) then `failed` (a failed store: a removal), returns the strings.
    let cycle = |conn: &mut OffloadingConnector, ok: &[OffloadKey], failed: &[OffloadKey]| {
        cpu(conn).prepare_store(ok, access).expect("room");
        cpu(conn).complete_store(ok, true);
        cpu(conn).prepare_store(failed, access).expect("room");
        cpu(conn).complete_store(failed, false);
        SchedulerConnector::take_events(conn)
    };
    let texts = |v: &[&str]| -> Vec<KvEvent> { v.iter().map(|s| KvEvent((*s).into())).collect() };
    let mut conn = connector();
    let got = cycle(
        &mut conn,
        &[key(10, 0), key(11, 1)],
        &[key(20, 1), key(21, 0), key(22, 1)],
    );
    assert_eq!(
        got,
        texts(&[
            "BlockStored(medium=CPU, group=0, hashes=[10], block_size=0)",
            "BlockStored(medium=CPU, group=1, hashes=[11], block_size=0)",
            "BlockRemoved(medium=CPU, group=0, hashes=[21])",
            "BlockRemoved(medium=CPU, group=1, hashes=[20, 22])",
        ])
    );
    assert_eq!(conn.take_cache_events(), Vec::new());
    assert_eq!(conn.cache_events, None, "off: nothing kept");
    conn.set_cache_events(true);
    let got = cycle(&mut conn, &[key(12, 0)], &[key(23, 1), key(24, 1)]);
    let cpu_stored = |h: u64, group: u32| CacheEvent::Stored {
        medium: Medium::Cpu,
        group,
        hashes: alloc::vec![BlockHash(h)],
        parent: None,
        tokens: Vec::new(),
        block_size: 0,
    };
    let structured = alloc::vec![
        cpu_stored(12, 0),
        CacheEvent::Removed {
            medium: Medium::Cpu,
            group: 1,
            hashes: alloc::vec![BlockHash(23), BlockHash(24)],
        },
    ];
    assert_eq!(
        got,
        texts(&[
            "BlockStored(medium=CPU, group=0, hashes=[12], block_size=0)",
            "BlockRemoved(medium=CPU, group=1, hashes=[23, 24])",
        ])
    );
    assert_eq!(
        got,
        structured.iter().map(KvEvent::from).collect::<Vec<_>>()
    );
    // At most one call's events are kept: a second `take_events` replaces them.
    SchedulerConnector::take_events(&mut conn);
    assert_eq!(conn.take_cache_events(), Vec::new());
    let _ = cycle(&mut conn, &[key(13, 1)], &[]);
    assert_eq!(conn.take_cache_events(), alloc::vec![cpu_stored(13, 1)]);
    assert_eq!(conn.take_cache_events(), Vec::new(), "drained");
    conn.set_cache_events(false);
    assert_eq!(conn.cache_events, None);
}
