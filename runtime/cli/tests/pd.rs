//! `kvrelay pd` across processes: the report's figures agree with each other (every block
//! served is loaded and verified, every handoff acknowledged, nothing left behind); a prefill
//! engine killed after handing out params costs the decode engine recomputation, never a
//! request or a leak; a decode-side abort while a request loads still releases the prefill
//! engine's blocks; bad flags are refused.

use std::path::Path;
use std::process::Command;

use kvrelay_core::{PdParams, RequestId};
use kvrelay_engine::pd::{
    EngineProcess, EngineSummary, PdLink, Routed, Tick, Ticked, pair_configs, route,
};
use kvrelay_engine::workload::WorkloadConfig;
use kvrelay_engine::{RunConfig, RunError, requests};

const EXE: &str = env!("CARGO_BIN_EXE_kvrelay");

fn kvrelay(args: &[&str]) -> std::process::Output {
    Command::new(EXE).args(args).output().expect("kvrelay runs")
}

// Protects the report and the whole path across processes: every request finishes, every
// handoff is acknowledged once, the decode ranks load exactly what the prefill engine served
// and verify every block as it lands, nothing is left behind.
#[test]
fn pd_runs_a_workload_through_two_engine_processes_verified() {
    let out = kvrelay(&["pd", "--conversations", "12", "--check", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let n = |v: &serde_json::Value| v.as_u64().unwrap();
    assert_eq!(n(&r["finished"]), n(&r["requests"]));
    assert!(n(&r["handed_off"]) > 0);
    assert_eq!(n(&r["prefill"]["pd"]["acks"]), n(&r["handed_off"]));
    let (p, d) = (&r["prefill"], &r["decode"]);
    assert_eq!(n(&d["remote_blocks_loaded"]), n(&p["served_blocks"]));
    assert_eq!(n(&d["loaded_blocks_verified"]), n(&d["blocks_loaded"]));
    assert_eq!(n(&d["failed_loads"]), 0);
    assert_eq!(p["leaks"], serde_json::json!([]));
    assert_eq!(d["leaks"], serde_json::json!([]));
}

// Protects flag checking, before any engine process starts: a lease is strict mode's
// departure (compat refuses it); the KV server reads in-process arenas in host memory.
#[test]
fn what_a_pair_cannot_run_is_refused_with_its_reason() {
    for (flags, says) in [
        (&["--lease-steps", "4"][..], "--mode strict"),
        (&["--workers", "process"][..], "in-process ranks"),
        (&["--backend", "cuda"][..], "host backend"),
    ] {
        let mut args = vec!["pd", "--conversations", "2"];
        args.extend_from_slice(flags);
        let out = kvrelay(&args);
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "{flags:?}"
        );
    }
}

fn config() -> RunConfig {
    RunConfig {
        check: true,
        workload: WorkloadConfig {
            conversations: 12,
            ..WorkloadConfig::default()
        },
        ..RunConfig::default()
    }
}

/// Both engine processes of `c`, then the workload routed through `wrap`ped links.
async fn run_wrapped<P: PdLink, D: PdLink>(
    c: &RunConfig,
    wrap: impl FnOnce(EngineProcess, EngineProcess) -> (P, D),
) -> (Result<Routed, RunError>, EngineSummary, EngineSummary) {
    let records = requests(c).unwrap();
    let max_len = kvrelay_engine::run::longest(&records);
    let exe = Some(Path::new(EXE));
    let (p, _) = pair_configs(c, None, "", 2_000);
    let (prefill, addr) = EngineProcess::spawn("prefill", exe, &p, max_len)
        .await
        .unwrap();
    let (_, d) = pair_configs(c, None, &addr.unwrap(), 2_000);
    let (decode, _) = EngineProcess::spawn("decode", exe, &d, max_len)
        .await
        .unwrap();
    let (mut prefill, mut decode) = wrap(prefill, decode);
    let routed = route(c, &records, &mut prefill, &mut decode, |_, _| {}).await;
    let p = prefill.finish().await.unwrap();
    let d = decode.finish().await.unwrap();
    (routed, p, d)
}

/// A prefill engine process killed right after it handed out its `after`-th params; from then
/// on the router finds it gone: new requests are refused, acknowledgements go nowhere.
struct KilledAfter {
    engine: Option<EngineProcess>,
    handed_out: u64,
    after: u64,
}

impl PdLink for KilledAfter {
    async fn tick(&mut self, t: Tick) -> Result<Ticked, RunError> {
        let Some(e) = &mut self.engine else {
            let gone = |s: &kvrelay_engine::pd::Submit| (s.id, "prefill engine gone".into());
            return Ok(Ticked {
                refused: t.submit.iter().map(gone).collect(),
                ..Ticked::default()
            });
        };
        let out = e.tick(t).await?;
        self.handed_out += out
            .outputs
            .iter()
            .filter(|o| o.kv_transfer_params.is_some())
            .count() as u64;
        if self.handed_out >= self.after {
            e.kill();
            self.engine = None;
        }
        Ok(out)
    }

    async fn finish(self) -> Result<EngineSummary, RunError> {
        match self.engine {
            Some(e) => e.finish().await,
            None => Ok(EngineSummary::default()),
        }
    }
}

// Protects the decode side against a prefill engine that dies after handing out params: the
// loads it can no longer serve fail (connection reset or refused, within the read deadline),
// the decode engine recomputes them, every request handed off finishes, nothing leaks there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_killed_after_handing_out_params_costs_recomputation() {
    let c = config();
    let (routed, _, d) = run_wrapped(&c, |p, d| {
        let p = KilledAfter {
            engine: Some(p),
            handed_out: 0,
            after: 3,
        };
        (p, d)
    })
    .await;
    let routed = routed.unwrap();
    assert_eq!(
        routed.counts.finished + routed.counts.refused,
        routed.counts.requests,
        "{:?}",
        routed.counts
    );
    assert!(
        routed.counts.handed_off >= 3 && routed.counts.refused > 0,
        "{:?}",
        routed.counts
    );
    assert!(d.failed_loads > 0, "{d:?}");
    assert_eq!(d.loaded_blocks_verified, d.blocks_loaded);
    assert_eq!(d.leaks, Vec::<String>::new());
}

/// A decode engine whose client aborts the first request handed off with params, one tick
/// after it arrived (its load in flight).
struct AbortsFirstLoad {
    engine: EngineProcess,
    victim: Option<RequestId>,
    aborted: bool,
}

impl PdLink for AbortsFirstLoad {
    async fn tick(&mut self, mut t: Tick) -> Result<Ticked, RunError> {
        match self.victim {
            Some(v) if !self.aborted => {
                t.aborts.push(v);
                self.aborted = true;
            }
            None => {
                let handed = |s: &&kvrelay_engine::pd::Submit| {
                    s.params.as_ref().is_some_and(|p| {
                        PdParams::parse(p).is_ok_and(|p| p.remote_prefill.is_some())
                    })
                };
                self.victim = t.submit.iter().find(handed).map(|s| s.id);
            }
            _ => {}
        }
        self.engine.tick(t).await
    }

    async fn finish(self) -> Result<EngineSummary, RunError> {
        self.engine.finish().await
    }
}

// Protects the prefill side when the decode side aborts a request while its KV loads: the
// abort's finish is acknowledged, the prefill engine releases the blocks, and neither engine
// leaves anything behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_side_abort_while_loading_releases_the_prefill_blocks() {
    let c = config();
    let (routed, p, d) = run_wrapped(&c, |p, d| {
        let d = AbortsFirstLoad {
            engine: d,
            victim: None,
            aborted: false,
        };
        (p, d)
    })
    .await;
    let routed = routed.unwrap();
    assert_eq!(routed.counts.finished, routed.counts.requests);
    assert_eq!(
        d.pd.remote_loads, routed.counts.handed_off,
        "the victim's load had started when it was aborted"
    );
    assert_eq!(p.pd.acks, routed.counts.handed_off, "{p:?}");
    assert_eq!(p.leaks, Vec::<String>::new());
    assert_eq!(d.leaks, Vec::<String>::new());
}
