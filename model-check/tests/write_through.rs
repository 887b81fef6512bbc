//! "Check your own connector": the write-through example connector (an engine's connector,
//! written outside kvrelay-core) model-checked with kvrelay's system model and properties.

#[allow(unreachable_pub, dead_code)]
#[path = "../examples/write_through.rs"]
mod write_through;

use kvrelay_model_check::{CheckOptions, SystemModel, check, system_properties};
use write_through::{Publish, WriteThroughPair, config};

fn run(publish: Publish, depth: u32) -> kvrelay_model_check::CheckReport {
    let model = SystemModel::new(
        WriteThroughPair {
            publish,
            capacity: 4,
        },
        config(depth),
    )
    .expect("a valid configuration");
    check(model, &CheckOptions::default(), &mut |_| {})
}

#[test]
fn the_correct_write_through_connector_passes_every_property() {
    for (depth, unique) in [(1, 657), (2, 4351)] {
        let r = run(Publish::AfterOutput, depth);
        assert!(r.passed(), "async depth {depth}: {:#?}", r.properties);
        assert_eq!(
            r.unique_states, unique,
            "async depth {depth}: explored space changed"
        );
    }
}

#[test]
fn fire_and_forget_stores_are_caught_rewriting_a_block_under_a_copy() {
    let r = run(Publish::FireAndForget, 1);
    let p = r
        .property(system_properties::NO_WRITE_UNDER_STORE)
        .expect("the property exists");
    assert!(!p.holds, "the checker must find the hazard");
    let path = p.path.as_ref().expect("a counterexample");
    assert!(
        path.last().unwrap().contains("while store job"),
        "{path:#?}"
    );
}
