//! Driving an engine through the shared tier's test workload, step by step: shared by the
//! engine's tier tests (`tests/tier.rs`) and the CLI crate's, whose worker processes need the
//! `kvrelay` binary (`runtime/cli/tests/tier_workers.rs`).

use kvrelay_core::RequestId;
use kvrelay_engine::Engine;
use kvrelay_engine::engine::Figures;

/// Twelve requests: four prefixes of 96 tokens, each with three suffixes.
fn requests() -> Vec<(RequestId, Vec<u32>)> {
    (0..12u32)
        .map(|i| {
            let mut p: Vec<u32> = (0..96).map(|t| t * 7 + (i % 4) * 10_000).collect();
            p.extend([50_000 + i; 8]);
            (RequestId(i), p)
        })
        .collect()
}

/// Runs the requests on `engine`; `between` runs after every step with the engine's figures.
pub(crate) async fn drive(mut engine: Engine, mut between: impl FnMut(&Engine)) -> Figures {
    for (id, prompt) in requests() {
        engine.add(id, prompt, 4).unwrap();
    }
    let mut steps = 0;
    while engine.has_work() {
        let out = engine.step().await.expect("the run goes on");
        between(&engine);
        if out.idle {
            engine.wait_idle().await;
        }
        steps += 1;
        assert!(steps < 10_000, "the run ends");
    }
    let (figures, _ranks) = engine.shutdown().await;
    assert_eq!(figures.finished, 12, "every request finishes");
    figures
}
