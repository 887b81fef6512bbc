//! The generic runner and the Mermaid diagrams, on the completion model (run them in release:
//! `cargo test --release -p kvrelay-model-check`).

use kvrelay_model_check::{
    Arrow, CheckOptions, CheckReport, CompletionConfig, CompletionModel, Explain, ExploreError,
    Progress, Stop, Strategy, check, check_completions, check_with_symmetry, explorer_address,
    mermaid, property_names,
};
use stateright::Model;

fn double_report() -> CompletionConfig {
    CompletionConfig {
        faulty_double_report: true,
        ..CompletionConfig::ci()
    }
}

#[test]
fn the_double_report_counterexample_renders_as_a_sequence_diagram() {
    // One thread, breadth-first: the shortest counterexample, pinned in tests/completion.rs.
    let report = check_completions(double_report(), 1, &mut |_| {});
    assert_eq!(report.stop, Stop::FirstViolation);
    assert_eq!(
        report.participants,
        ["env", "rank 0", "rank 1", "aggregator", "scheduler"]
    );
    let i21 = report.property(property_names::EXACTLY_ONCE).unwrap();
    let (path, raw, arrows) = (
        i21.path.as_ref().unwrap(),
        i21.raw_path.as_ref().unwrap(),
        i21.diagram.as_ref().unwrap(),
    );
    assert_eq!(path.len(), 8);
    assert_eq!(raw.len(), 8);
    assert_eq!(arrows.len(), 8);
    assert_eq!(
        i21.encoded_path.as_deref().unwrap().split('/').count(),
        9,
        "the initial state's index and one index per action"
    );

    // The fault is armed by the environment on rank 0, and the last aggregate emits early.
    let fault = arrows
        .iter()
        .find(|s| s.note.as_deref() == Some("FAULT: double report armed"))
        .expect("the armed fault is a noted step");
    assert_eq!((fault.from, fault.to), (0, 1));
    let last = arrows.last().unwrap();
    assert_eq!((last.from, last.to), (3, 4), "aggregator → scheduler");
    assert!(
        last.note
            .as_deref()
            .unwrap()
            .contains("emitted before every rank reported"),
        "{last:?}"
    );

    let diagram = report.mermaid(property_names::EXACTLY_ONCE).unwrap();
    println!("{diagram}");
    assert!(diagram.starts_with("sequenceDiagram\n"));
    for line in [
        "    participant p0 as env",
        "    participant p1 as rank 0",
        "    participant p2 as rank 1",
        "    participant p3 as aggregator",
        "    participant p4 as scheduler",
        // `#` (in `req#0`) is an entity code in Mermaid: escaped.
        "    p0->>p1: recv of req#35;0 completes",
        "    p1->>p3: step (forward): sending {} recving {req#35;0} failed {}",
        "    Note over p0,p1: FAULT: double report armed",
        "    p3->>p4: emitted sending {} recving {req#35;0} failed {}",
        "    Note over p3,p4: VIOLATION: emitted before every rank reported",
    ] {
        assert!(
            diagram.lines().any(|l| l == line),
            "missing {line:?} in\n{diagram}"
        );
    }
    assert_eq!(diagram.matches("->>").count(), 8, "one arrow per action");
    assert!(
        diagram
            .trim_end()
            .ends_with("counterexample to always \"exactly-once emission after all ranks (I-21)\""),
        "{diagram}"
    );
    // The same diagram from the free function, without the closing note.
    let plain = mermaid(&report.participants, arrows);
    assert!(diagram.starts_with(plain.as_str()));
    assert!(
        report.mermaid(property_names::PROTOCOL).is_none(),
        "a holding property has no diagram"
    );
}

/// Needs the `scheduler-faults` feature: the bind-first runner is the core's rank driver with
/// that fault injected.
#[cfg(feature = "scheduler-faults")]
#[test]
fn a_rejected_protocol_call_is_a_self_arrow_with_a_note() {
    let config = CompletionConfig {
        faulty_bind_first: true,
        ..CompletionConfig::ci()
    };
    let report = check_completions(config, 1, &mut |_| {});
    let p = report.property(property_names::PROTOCOL).unwrap();
    let arrows = p.diagram.as_ref().unwrap();
    assert_eq!(arrows.len(), 1);
    let Arrow { from, to, note, .. } = &arrows[0];
    assert_eq!((*from, *to), (1, 1), "rank 0 on itself");
    let note = note.as_deref().unwrap();
    assert!(
        note.contains("bind") && note.contains("VIOLATION: step protocol violated"),
        "{note}"
    );
    let diagram = report.mermaid(property_names::PROTOCOL).unwrap();
    assert!(
        diagram.contains("    Note over p1: protocol violation"),
        "{diagram}"
    );
}

#[test]
fn describe_and_arrow_agree_with_the_model() {
    let model = CompletionModel::new(CompletionConfig::ci());
    let init = model.init_states().remove(0);
    let mut actions = Vec::new();
    model.actions(&init, &mut actions);
    for a in &actions {
        let line = model.describe(&init, a);
        let step = model.arrow(&init, a);
        assert!(!line.is_empty());
        assert!(step.from < model.participants().len() && step.to < model.participants().len());
    }
}

#[test]
fn depth_first_explores_the_same_space_as_breadth_first() {
    let options = CheckOptions {
        threads: 2,
        strategy: Strategy::Dfs,
        ..CheckOptions::default()
    };
    let report = check(
        CompletionModel::new(CompletionConfig::ci()),
        &options,
        &mut |_| {},
    );
    assert_eq!(report.strategy, Strategy::Dfs);
    assert!(!report.symmetry);
    assert_eq!(report.stop, Stop::Exhaustive);
    assert!(report.complete && report.passed());
    assert_eq!(report.unique_states, 83_592, "as pinned for breadth-first");
}

#[test]
fn a_depth_bound_is_reported_as_such() {
    let options = CheckOptions {
        target_max_depth: Some(4),
        ..CheckOptions::default()
    };
    let report = check(
        CompletionModel::new(CompletionConfig::ci()),
        &options,
        &mut |_| {},
    );
    assert_eq!(report.stop, Stop::DepthBound { depth: 4 });
    assert!(!report.complete);
    assert!(report.max_depth <= 4);
    assert!(!report.passed(), "a bounded run is no proof");
    // The `sometimes` example is deeper than 4 actions.
    assert!(!report.passed_within_bound());
}

#[test]
fn keep_going_finds_a_counterexample_and_explores_the_rest() {
    let config = CompletionConfig {
        requests: 1,
        ..double_report()
    };
    let options = CheckOptions {
        stop_at_first_violation: false,
        ..CheckOptions::default()
    };
    let report = check(CompletionModel::new(config), &options, &mut |_| {});
    assert_ne!(report.stop, Stop::FirstViolation);
    assert!(!report.property(property_names::EXACTLY_ONCE).unwrap().holds);
    // The `sometimes` property got its example too, which a stop at the violation can miss.
    let all = report.property(property_names::ALL_EMITTED).unwrap();
    assert!(all.holds && all.diagram.is_some());
    assert!(!report.passed());
    assert_eq!(
        report.first_failure().map(|p| p.name),
        Some(property_names::EXACTLY_ONCE)
    );
}

#[test]
fn the_explorer_is_loopback_only_unless_allowed() {
    assert!(matches!(
        explorer_address("0.0.0.0:1", false),
        Err(ExploreError::NotLoopback { .. })
    ));
    let e = explorer_address("0.0.0.0:1", false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--allow-remote"), "{e}");
    assert!(explorer_address("0.0.0.0:1", true).is_ok());
    assert_eq!(
        explorer_address("127.0.0.1:3000", false)
            .unwrap()
            .to_string(),
        "127.0.0.1:3000"
    );
    assert!(explorer_address("[::1]:3000", false).is_ok());
    assert!(matches!(
        explorer_address("no-port", false),
        Err(ExploreError::BadAddress { .. })
    ));
}

/// Three interchangeable processes, each counting 0 → 1 → 2: 27 states, 10 up to permutation.
#[derive(Clone, Debug)]
struct Counters;

#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Counts(Vec<u8>);

impl stateright::Representative for Counts {
    fn representative(&self) -> Self {
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        Counts(sorted)
    }
}

impl Model for Counters {
    type State = Counts;
    type Action = usize;

    fn init_states(&self) -> Vec<Counts> {
        vec![Counts(vec![0; 3])]
    }

    fn actions(&self, state: &Counts, actions: &mut Vec<usize>) {
        actions.extend((0..3).filter(|&i| state.0[i] < 2));
    }

    fn next_state(&self, state: &Counts, i: usize) -> Option<Counts> {
        let mut next = state.clone();
        next.0[i] += 1;
        Some(next)
    }

    fn properties(&self) -> Vec<stateright::Property<Self>> {
        vec![stateright::Property::sometimes(
            "all done",
            |_, s: &Counts| s.0.iter().all(|&c| c == 2),
        )]
    }
}

impl Explain for Counters {
    fn describe(&self, state: &Counts, i: &usize) -> String {
        format!("process {i} counts {} → {}", state.0[*i], state.0[*i] + 1)
    }

    fn participants(&self) -> Vec<String> {
        (0..3).map(|i| format!("process {i}")).collect()
    }

    fn arrow(&self, state: &Counts, i: &usize) -> Arrow {
        Arrow::new(*i, *i, self.describe(state, i))
    }
}

#[test]
fn symmetry_reduction_counts_equivalence_classes() {
    // The signature `kvrelay check` takes a checker run as.
    type Run = fn(Counters, &CheckOptions, &mut dyn FnMut(&Progress)) -> CheckReport;
    let (plain, symmetric): (Run, Run) = (check::<Counters>, check_with_symmetry::<Counters>);
    let options = CheckOptions {
        stop_at_first_violation: false,
        ..CheckOptions::default()
    };
    let full = plain(Counters, &options, &mut |_| {});
    assert_eq!(full.unique_states, 27);
    assert!(!full.symmetry);
    // `sometimes` found; exploring stopped once every property had a discovery, or exhausted.
    assert!(full.passed(), "{:?}", full.stop);
    let reduced = symmetric(Counters, &options, &mut |_| {});
    assert!(reduced.symmetry);
    assert_eq!(
        reduced.strategy,
        Strategy::Dfs,
        "symmetry is depth-first only"
    );
    assert!(reduced.passed());
    let example = reduced.property("all done").unwrap();
    assert_eq!(example.path.as_ref().unwrap().len(), 6);
    let diagram = reduced.mermaid("all done").unwrap();
    assert!(diagram.contains("participant p2 as process 2"), "{diagram}");
}
