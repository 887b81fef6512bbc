//! The conformance runner itself: bad cases are FAIL lines with clear messages, never panics,
//! and a wrong expectation is reported in the format of FORMAT.md.

use kvrelay_conformance::AnyCase;

fn outcome(text: &str) -> Result<(), String> {
    match AnyCase::parse(text, "<inline>") {
        Ok(case) => case.run(),
        Err((_, e)) => Err(e.0),
    }
}

fn fails_with(text: &str, needle: &str) {
    let msg = outcome(text).expect_err("case must fail");
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
}

#[test]
fn a_wrong_expectation_fails_in_the_documented_format() {
    let case = r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[
        {"call":"aggregate","args":{"outputs":[{"finished_sending":["a"]}]},
         "expect":{"finished_sending":null,"finished_recving":null,"invalid_block_ids":[],
                   "failed_recving":[],"worker_meta":null,"kv_events":null,"expected_finished_count":1}}]}"#;
    let msg = outcome(case).expect_err("a is emitted, so the case is wrong");
    assert!(msg.starts_with("call 0 (aggregate): expected {"), "{msg}");
    assert!(msg.contains(r#""finished_sending":["a"]"#), "{msg}");
}

#[test]
fn an_error_where_a_result_was_expected_fails_and_the_reverse_too() {
    fails_with(
        r#"{"name":"x","machine":"worker_protocol","calls":[{"call":"bind","expect":"ok"}]}"#,
        r#"got {"error":"protocol_violation"}"#,
    );
    fails_with(
        r#"{"name":"x","machine":"worker_protocol","calls":[{"call":"begin_step","expect_error":"protocol_violation"}]}"#,
        r#"expected {"error":"protocol_violation"}, got "ok""#,
    );
    fails_with(
        r#"{"name":"x","machine":"worker_meta","calls":[{"call":"merge","args":{"a":{"set":[]},"b":{"offload":{}}},"expect_error":"duplicate_report"}]}"#,
        r#"got {"error":"meta_mismatch"}"#,
    );
}

#[test]
fn sets_in_expectations_may_be_written_in_any_order() {
    let case = r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[
        {"call":"aggregate","args":{"outputs":[{"finished_sending":["b","a"],"invalid_block_ids":[3,1]}]},
         "expect":{"finished_sending":["b","a"],"finished_recving":null,"invalid_block_ids":[3,1,3],
                   "failed_recving":[],"worker_meta":null,"kv_events":null,"expected_finished_count":1}}]}"#;
    assert_eq!(outcome(case), Ok(()));
}

#[test]
fn null_and_empty_are_different_values() {
    let case = r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[
        {"call":"aggregate","args":{"outputs":[{}]},
         "expect":{"finished_sending":[],"finished_recving":null,"invalid_block_ids":[],
                   "failed_recving":[],"worker_meta":null,"kv_events":null,"expected_finished_count":1}}]}"#;
    assert!(outcome(case).is_err());
}

#[test]
fn malformed_cases_fail_with_clear_messages() {
    fails_with("{ not json", "malformed case");
    fails_with(
        r#"{"name":"x","machine":"aggregator","calls":[]}"#,
        "missing field `quorum`",
    );
    fails_with(
        r#"{"name":"x","machine":"aggregator","config":{"quorum":0},"calls":[]}"#,
        "at least 1",
    );
    fails_with(
        r#"{"name":"x","machine":"aggregator","config":{"quorum":1,"colour":2},"calls":[]}"#,
        "unknown field `colour`",
    );
    fails_with(
        r#"{"name":"x","machine":"teleporter","calls":[]}"#,
        "unknown machine `teleporter`",
    );
    fails_with(
        r#"{"name":"x","machine":"multi","config":{"children":0},"calls":[]}"#,
        "`children` must be at least 1",
    );
    fails_with(
        r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[{"call":"explode"}]}"#,
        "call 0 (explode): unknown call `explode`",
    );
    fails_with(
        r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[{"call":"aggregate","args":{"outputs":[],"rank":1}}]}"#,
        "unknown argument `rank`",
    );
    fails_with(
        r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[{"call":"aggregate","args":{"outputs":[{"finished_sending":[1]}]}}]}"#,
        "argument `outputs[0].finished_sending[0]`: invalid type: integer `1`, expected a string",
    );
    fails_with(
        r#"{"name":"x","machine":"aggregator","config":{"quorum":1},"calls":[{"call":"aggregate","args":{"outputs":[{"finished_sending":["a"],"colour":1}]}}]}"#,
        "unknown field `colour`",
    );
    fails_with(
        r#"{"name":"x","machine":"worker_protocol","calls":[{"call":"begin_step","args":{"forward":"yes"}}]}"#,
        "argument `forward`",
    );
    fails_with(
        r#"{"name":"x","machine":"event_accumulator","calls":[{"call":"update","args":{"kv_events":{"events":[],"workers":0}}}]}"#,
        "argument `kv_events.workers`: invalid value: integer `0`, expected a nonzero u32",
    );
    fails_with(
        r#"{"name":"x","machine":"worker_meta","calls":[{"call":"merge","args":{"a":{"bag":[]}}}]}"#,
        "argument `a`",
    );
    fails_with(
        r#"{"name":"x","machine":"worker_meta","calls":[{"call":"merge","args":{"a":null,"b":null},"expect":{"set":7}}]}"#,
        "`expect` is not a valid result",
    );
    fails_with(
        r#"{"name":"x","machine":"worker_meta","calls":[{"call":"merge","expect":null,"expect_error":"meta_mismatch"}]}"#,
        "both `expect` and `expect_error`",
    );
}

#[test]
fn the_name_survives_a_case_that_does_not_parse() {
    let (name, _) = AnyCase::parse(
        r#"{"name":"mine","machine":"aggregator","calls":7}"#,
        "file.json",
    )
    .expect_err("calls must be an array");
    assert_eq!(name, "mine");
    let (name, _) = AnyCase::parse("[", "file.json").expect_err("not JSON");
    assert_eq!(name, "file.json");
}
