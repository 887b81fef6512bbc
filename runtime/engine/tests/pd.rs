//! Prefill/decode disaggregation between two engines of this process, through the router and
//! the prefill engine's KV server over TCP: every handed-off block verified when it lands,
//! nothing left held or leaked; a source that is gone or silent costs recomputation, never a
//! hang or a wrong byte; a silent decode side holds blocks for ever in compat and until its
//! lease in strict.

use kvrelay_core::Mode;
use kvrelay_engine::pd::{
    EngineSummary, PdLink, PdRole, PdRunConfig, Routed, Source, Tick, Ticked, route,
};
use kvrelay_engine::workload::WorkloadConfig;
use kvrelay_engine::{Engine, RunConfig, RunError, requests};

fn config(role: PdRole, mode: Mode, lease_steps: Option<u32>) -> RunConfig {
    RunConfig {
        check: true,
        mode,
        workload: WorkloadConfig {
            conversations: 16,
            ..WorkloadConfig::default()
        },
        pd: Some(PdRunConfig {
            role,
            engine: if role == PdRole::Prefill { 1 } else { 2 },
            lease_steps,
            listen: "127.0.0.1:0".into(),
            source: None,
        }),
        ..RunConfig::default()
    }
}

/// A decode engine reading from `addr`, each read within `deadline_ms`.
fn decode_config(addr: String, deadline_ms: u64) -> RunConfig {
    let mut c = config(PdRole::Decode, Mode::Compat, None);
    if let Some(p) = &mut c.pd {
        p.source = Some(Source { addr, deadline_ms });
    }
    c
}

/// The two engines started (`source`: where the decode engine reads; `None`: the prefill
/// engine's KV server), the workload routed through them, and what each did.
async fn run_pair(
    prefill_config: RunConfig,
    source: Option<String>,
    deadline_ms: u64,
    wrap: impl FnOnce(Engine) -> Box<dyn DynLink>,
) -> (Result<Routed, RunError>, EngineSummary, EngineSummary) {
    let records = requests(&prefill_config).unwrap();
    let max_len = kvrelay_engine::run::longest(&records);
    let prefill = Engine::start(&prefill_config, max_len).await.unwrap();
    let addr = prefill.kv_server().expect("a KV server").addr().to_string();
    let d = decode_config(source.unwrap_or(addr), deadline_ms);
    let mut decode = Engine::start(&d, max_len).await.unwrap();
    let mut prefill = Boxed(wrap(prefill));
    let routed = route(
        &prefill_config,
        &records,
        &mut prefill,
        &mut decode,
        |_, _| {},
    )
    .await;
    let p = prefill.0.finish_boxed().await.unwrap();
    let d = decode.finish().await.unwrap();
    (routed, p, d)
}

// Protects the whole path: every request finishes on the decode engine; those handed off are
// acknowledged once; the decode ranks load exactly the blocks the prefill engine served, each
// verified when it landed; both engines give everything back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_runs_through_prefill_then_decode_with_every_block_verified() {
    let c = config(PdRole::Prefill, Mode::Compat, None);
    let (routed, p, d) = run_pair(c, None, 5_000, |e| Box::new(e)).await;
    let routed = routed.unwrap();
    assert_eq!(
        routed.counts.finished, routed.counts.requests,
        "{:?}",
        routed.counts
    );
    assert!(
        routed.counts.handed_off > routed.counts.requests / 2,
        "{:?}",
        routed.counts
    );
    assert_eq!(routed.counts.acks_sent, routed.counts.handed_off);
    assert_eq!(p.pd.acks, routed.counts.handed_off, "{p:?}");
    assert_eq!(p.leaks, Vec::<String>::new());
    assert_eq!(d.leaks, Vec::<String>::new());
    assert_eq!(d.pd.remote_loads, routed.counts.handed_off);
    assert!(p.served_blocks > 0);
    assert_eq!(d.remote_blocks_loaded, p.served_blocks, "{d:?} {p:?}");
    assert_eq!(d.remote_bytes_loaded, p.served_bytes);
    assert_eq!(d.loaded_blocks_verified, d.blocks_loaded);
    assert_eq!(d.failed_loads, 0);
    assert_eq!(p.served_gone, 0);
}

// Protects recovery from a source that is gone (nothing listens): every load fails at once,
// the decode engine recomputes those blocks, every request still finishes, nothing leaks; the
// acknowledgement still releases the prefill engine's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_is_gone_costs_recomputation_not_requests() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let c = config(PdRole::Prefill, Mode::Compat, None);
    let (routed, p, d) = run_pair(c, Some(addr), 5_000, |e| Box::new(e)).await;
    let routed = routed.unwrap();
    assert_eq!(routed.counts.finished, routed.counts.requests);
    assert!(d.failed_loads > 0 && d.remote_blocks_loaded == 0, "{d:?}");
    assert_eq!(d.leaks, Vec::<String>::new());
    assert_eq!(p.leaks, Vec::<String>::new());
}

// Protects the deadline on every remote wait: a source that accepts and never answers fails
// each load at its deadline (50 ms), and the run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_source_fails_each_load_at_its_deadline() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let hold = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            open.push(s);
        }
    });
    let mut c = config(PdRole::Prefill, Mode::Compat, None);
    c.workload.conversations = 4;
    let (routed, _, d) = run_pair(c, Some(addr), 50, |e| Box::new(e)).await;
    hold.abort();
    let routed = routed.unwrap();
    assert_eq!(routed.counts.finished, routed.counts.requests);
    assert!(d.failed_loads > 0 && d.remote_blocks_loaded == 0, "{d:?}");
    assert_eq!(d.leaks, Vec::<String>::new());
}

/// A TCP proxy to `upstream` that holds every chunk of the server's answers for `delay`: a slow
/// transport.
async fn slow_proxy(upstream: String, delay: std::time::Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(delay).await;
                }
            });
        }
    });
    addr
}

// Protects determinism under a slow transport: with every answer held 2 ms per chunk (well
// within the deadline), every load still lands and is verified, and the run takes exactly the
// steps and moves exactly the blocks of the direct run (the lockstep clock waits for loads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_transport_changes_no_count() {
    let mut c = config(PdRole::Prefill, Mode::Compat, None);
    c.workload.conversations = 6;
    let (direct, p0, d0) = run_pair(c.clone(), None, 5_000, |e| Box::new(e)).await;
    let direct = direct.unwrap();
    let records = requests(&c).unwrap();
    let max_len = kvrelay_engine::run::longest(&records);
    let prefill = Engine::start(&c, max_len).await.unwrap();
    let upstream = prefill.kv_server().unwrap().addr().to_string();
    let proxy = slow_proxy(upstream, std::time::Duration::from_millis(2)).await;
    let mut decode = Engine::start(&decode_config(proxy, 5_000), max_len)
        .await
        .unwrap();
    let mut prefill = prefill;
    let slow = route(&c, &records, &mut prefill, &mut decode, |_, _| {})
        .await
        .unwrap();
    let (p1, d1) = (
        prefill.finish().await.unwrap(),
        decode.finish().await.unwrap(),
    );
    assert_eq!(slow.counts, direct.counts);
    assert_eq!(
        (d1.steps, d1.remote_blocks_loaded),
        (d0.steps, d0.remote_blocks_loaded)
    );
    assert_eq!(d1.loaded_blocks_verified, d1.blocks_loaded);
    assert_eq!(d1.failed_loads, 0);
    assert_eq!(p1.steps, p0.steps);
}

// Protects the lease (I-54) against a decode side that never acknowledges: in compat the
// prefill engine holds every handed-off request's blocks for ever (vLLM #46283) until its GPU
// pool is full and the run stops, stalled, naming the requests that can never run — never a
// hang; strict releases each at the end of its lease and the run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_decode_side_stalls_the_prefill_engine_in_compat_and_not_in_strict() {
    let c = config(PdRole::Prefill, Mode::Compat, None);
    let (routed, p, _) = run_pair(c, None, 5_000, |e| Box::new(Deaf(e))).await;
    match routed {
        Err(RunError::Stalled { requests, .. }) => assert!(!requests.is_empty()),
        other => panic!("expected a stall, got {other:?}"),
    }
    assert_eq!(p.pd.acks, 0);
    assert!(
        p.leaks
            .iter()
            .any(|l| l.starts_with("requests still held for a decode engine")),
        "{:?}",
        p.leaks
    );
    let c = config(PdRole::Prefill, Mode::Strict, Some(4));
    let (routed, p, _) = run_pair(c, None, 5_000, |e| Box::new(Deaf(e))).await;
    let routed = routed.unwrap();
    assert_eq!(routed.counts.finished, routed.counts.requests);
    assert_eq!(p.pd.acks, 0);
    assert_eq!(p.pd.leases_expired, routed.counts.handed_off, "{p:?}");
    assert_eq!(p.leaks, Vec::<String>::new());
}

/// A prefill engine that never hears the decode side's acknowledgements.
struct Deaf(Engine);

/// [`PdLink`] behind a box, so that one test helper takes the engine and its wrappers.
trait DynLink {
    fn tick_boxed(
        &mut self,
        t: Tick,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Ticked, RunError>> + Send + '_>>;
    fn finish_boxed(
        self: Box<Self>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<EngineSummary, RunError>> + Send>>;
}

impl DynLink for Engine {
    fn tick_boxed(
        &mut self,
        t: Tick,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Ticked, RunError>> + Send + '_>> {
        Box::pin(self.tick(t))
    }
    fn finish_boxed(
        self: Box<Self>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<EngineSummary, RunError>> + Send>> {
        Box::pin((*self).finish())
    }
}

impl DynLink for Deaf {
    fn tick_boxed(
        &mut self,
        mut t: Tick,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Ticked, RunError>> + Send + '_>> {
        t.acks.clear();
        Box::pin(self.0.tick(t))
    }
    fn finish_boxed(
        self: Box<Self>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<EngineSummary, RunError>> + Send>> {
        Box::pin(self.0.finish())
    }
}

struct Boxed(Box<dyn DynLink>);

impl PdLink for Boxed {
    async fn tick(&mut self, t: Tick) -> Result<Ticked, RunError> {
        self.0.tick_boxed(t).await
    }
    async fn finish(self) -> Result<EngineSummary, RunError> {
        self.0.finish_boxed().await
    }
}
