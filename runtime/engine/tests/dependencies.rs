//! The engine an inference server embeds carries none of the project's checking machinery: its
//! normal dependency tree (as `cargo build -p kvrelay-engine` resolves it) has no model checker,
//! no property-testing crate, no test doubles of the core (`kvrelay-core`'s `testing` and
//! `fault-injection` features) and no tokio `test-util` (a paused clock).

use std::process::Command;

/// `(package, features)` of every package in kvrelay-engine's normal dependency tree.
fn normal_tree() -> Vec<(String, Vec<String>)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "tree",
            "-p",
            "kvrelay-engine",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["-f", "{p}|{f}", "--offline"])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .filter_map(|l| l.split_once('|'))
        .map(|(p, f)| {
            let name = p.split_whitespace().next().unwrap_or_default().to_string();
            let features = f.split(',').filter(|x| !x.is_empty()).map(String::from);
            (name, features.collect())
        })
        .collect()
}

// Protects the embedder's dependency tree (issue 33): what an engine gets when it depends on
// kvrelay-engine.
#[test]
fn the_engine_depends_on_no_checker_no_test_double_and_no_paused_clock() {
    let tree = normal_tree();
    assert!(
        tree.iter().any(|(p, _)| p == "kvrelay-core"),
        "the tree was read: {tree:?}"
    );
    for (package, features) in &tree {
        for banned in [
            "stateright",
            "proptest",
            "proptest-state-machine",
            "kvrelay-model-check",
        ] {
            assert_ne!(package, banned, "kvrelay-engine depends on {banned}");
        }
        assert!(
            !package.starts_with("kvrelay-")
                || ["kvrelay-engine", "kvrelay-core"].contains(&package.as_str()),
            "kvrelay-engine depends on {package}"
        );
        if package == "kvrelay-core" {
            for f in ["testing", "fault-injection"] {
                assert!(!features.iter().any(|x| x == f), "kvrelay-core with `{f}`");
            }
        }
        if package == "tokio" {
            assert!(
                !features.iter().any(|x| x == "test-util"),
                "tokio with `test-util`"
            );
        }
    }
}
