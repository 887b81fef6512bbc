//! The router over real engines and real loopback ZMQ: routing by the engines' own events beats
//! round robin on shared prefixes; a subscriber that joins late catches up by replay; a stream
//! that never delivers fails at its deadline.

use std::time::Duration;

use kvrelay_core::RequestId;
use kvrelay_engine::events::{KvEventsConfig, WireEvent};
use kvrelay_engine::{Engine, RunConfig};
use kvrelay_router::{Policy, PrefixIndex, StreamError, Subscriber, route};

fn small() -> (RunConfig, Vec<kvrelay_engine::workload::TraceRecord>) {
    let c = RunConfig {
        requests: Some(40),
        ..RunConfig::default()
    };
    let records = kvrelay_engine::requests(&c).unwrap();
    (c, records)
}

/// Protects the router's point (issue 38 item 3): on the generated workload, whose requests
/// share prefixes, sending each request where its prefix is cached reuses more prompt tokens
/// and computes fewer than round robin; both engines get work; no event is lost.
#[test]
fn kv_aware_routing_reuses_more_than_round_robin() {
    let (c, records) = small();
    let kv = route(&c, &records, 2, Policy::KvAware).unwrap();
    let rr = route(&c, &records, 2, Policy::RoundRobin).unwrap();
    assert_eq!(kv.prompt_tokens, rr.prompt_tokens);
    assert!(
        kv.reused_tokens > rr.reused_tokens,
        "{} vs {}",
        kv.reused_tokens,
        rr.reused_tokens
    );
    assert!(kv.tokens_computed < rr.tokens_computed);
    for r in [&kv, &rr] {
        assert_eq!(r.engines.iter().map(|s| s.requests).sum::<u64>(), 40);
        assert!(
            r.engines
                .iter()
                .all(|s| s.requests > 0 && s.unknown_removals == 0)
        );
        assert!(r.engines.iter().all(|s| s.report.finished == s.requests));
    }
    assert!(kv.engines.iter().map(|s| s.by_prefix).sum::<u64>() > 0);
}

fn with_events() -> RunConfig {
    RunConfig {
        kv_events: Some(KvEventsConfig {
            endpoint: "tcp://*:0".into(),
            replay: Some("tcp://*:0".into()),
            ..KvEventsConfig::default()
        }),
        ..RunConfig::default()
    }
}

fn local(e: &str) -> String {
    e.replacen("0.0.0.0", "127.0.0.1", 1)
}

/// Protects gap recovery: batches published before the subscriber existed never come live
/// (a PUB socket sends only to subscribers it has), and `sync` fetches every one by replay.
#[test]
fn a_late_subscriber_catches_up_by_replay() {
    let rt = kvrelay_engine::run::runtime().unwrap();
    rt.block_on(async {
        let mut e = Engine::start(&with_events(), 4096).await.unwrap();
        for i in 0..4 {
            e.add(RequestId(i), (0..200).map(|t| t * 7 + i).collect(), 40)
                .unwrap();
        }
        while e.has_work() {
            e.step().await.unwrap();
        }
        let want = e.kv_events_published().unwrap();
        assert!(want >= 3, "{want} batches");
        let (p, r) = e.kv_events_endpoints().unwrap();
        let mut s = Subscriber::connect(&local(p), &local(r.unwrap()))
            .await
            .unwrap();
        let mut ix = PrefixIndex::default();
        s.sync(want, Duration::from_secs(30), &mut |b| {
            b.events.iter().for_each(|ev| ix.apply(ev))
        })
        .await
        .unwrap();
        assert_eq!(s.seen(), want);
        assert_eq!(s.replayed, want, "every batch came by replay");
        assert!(ix.sizes().0 > 0, "the GPU blocks stored are held");
        e.shutdown().await;
    });
}

/// Protects the deadline on the router's one remote wait: batches that never come end `sync`
/// with a timeout saying how far it got.
#[test]
fn a_stream_that_never_delivers_times_out() {
    let rt = kvrelay_engine::run::runtime().unwrap();
    rt.block_on(async {
        let e = Engine::start(&with_events(), 4096).await.unwrap();
        let (p, r) = e.kv_events_endpoints().unwrap();
        let mut s = Subscriber::connect(&local(p), &local(r.unwrap()))
            .await
            .unwrap();
        let err = s
            .sync(3, Duration::from_secs(1), &mut |_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                StreamError::Timeout {
                    want: 3,
                    have: 0,
                    ..
                }
            ),
            "{err}"
        );
        e.shutdown().await;
    });
}

/// Protects `AllBlocksCleared` on a reset, end to end: once every request finished, a prefix
/// cache reset succeeds, the next step publishes the event (and only it), and a follower's
/// index drops the engine's GPU blocks.
#[test]
fn a_reset_clears_the_followers_gpu_index() {
    let rt = kvrelay_engine::run::runtime().unwrap();
    rt.block_on(async {
        let mut e = Engine::start(&with_events(), 4096).await.unwrap();
        let (p, r) = e.kv_events_endpoints().unwrap();
        let mut s = Subscriber::connect(&local(p), &local(r.unwrap()))
            .await
            .unwrap();
        e.add(RequestId(0), (0..100).collect(), 8).unwrap();
        while e.has_work() {
            e.step().await.unwrap();
        }
        let mut events = Vec::new();
        let want = e.kv_events_published().unwrap();
        s.sync(want, Duration::from_secs(30), &mut |b| {
            events.extend(b.events)
        })
        .await
        .unwrap();
        let mut ix = PrefixIndex::default();
        events.iter().for_each(|ev| ix.apply(ev));
        assert!(ix.sizes().0 > 0);
        assert!(e.reset_prefix_cache().unwrap());
        e.step().await.unwrap();
        let mut after = Vec::new();
        let want = e.kv_events_published().unwrap();
        s.sync(want, Duration::from_secs(30), &mut |b| {
            after.extend(b.events)
        })
        .await
        .unwrap();
        assert_eq!(after, vec![WireEvent::AllCleared]);
        after.iter().for_each(|ev| ix.apply(ev));
        assert_eq!(ix.sizes().0, 0);
        e.shutdown().await;
    });
}
