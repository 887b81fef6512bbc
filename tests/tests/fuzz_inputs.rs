//! The fuzz entry points ([`kvrelay_tests::fuzz`]) on proptest's inputs, on every CI run: the
//! same functions the coverage-guided targets in `tests/fuzz/` call. Protects "bad input gets a
//! typed error, never a panic" at the process boundary (frames), for case files, and for any
//! order of calls into the core.

use kvrelay_tests::fuzz;
use proptest::prelude::*;

/// Inputs that start from valid ones: every conformance case file, with bytes flipped,
/// truncated or spliced.
fn case_files() -> Vec<Vec<u8>> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/conformance/cases");
    let mut out = Vec::new();
    let mut dirs = vec![std::path::PathBuf::from(root)];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "json") {
                out.push(std::fs::read(&p).unwrap());
            }
        }
    }
    out.sort();
    assert!(!out.is_empty(), "no case files under {root}");
    out
}

fn mutate(base: Vec<u8>, edits: Vec<(usize, u8)>, cut: usize) -> Vec<u8> {
    let mut v = base;
    for (at, byte) in edits {
        if !v.is_empty() {
            let i = at % v.len();
            v[i] = byte;
        }
    }
    let keep = v.len().saturating_sub(cut % 64);
    v.truncate(keep);
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn frames_decode_or_fail_typed(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzz::frame(&data);
    }

    #[test]
    fn frames_with_a_valid_header_decode_or_fail_typed(
        tag in 0u8..8,
        rest in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut data = kvrelay_engine::transport::wire::WIRE_VERSION.to_le_bytes().to_vec();
        data.push(tag);
        data.extend(rest);
        fuzz::frame(&data);
    }

    #[test]
    fn mutated_case_files_parse_or_fail_typed(
        pick in any::<usize>(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in any::<usize>(),
    ) {
        let files = case_files();
        let base = files[pick % files.len()].clone();
        fuzz::case_json(&mutate(base, edits, cut));
    }

    #[test]
    fn any_program_of_core_calls_keeps_the_invariants(
        data in proptest::collection::vec(any::<u8>(), 0..2048),
    ) {
        fuzz::core_calls(&data);
    }
}

/// Fuzz findings, kept as regression inputs.
#[test]
fn fuzz_findings_stay_fixed() {
    // frame: a worker's figures whose per-request map re-encoded in another order (a HashMap;
    // now ordered). Found by the first `cargo fuzz run frame`.
    let stats_in_hash_order: &[u8] = &[
        0x03, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x5b, 0x00, 0x00,
        0x5c, 0x00, 0x03, 0x03, 0x00, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0xff, 0xff, 0xff, 0xa7, 0xa7, 0x01,
    ];
    fuzz::frame(stats_in_hash_order);
}
