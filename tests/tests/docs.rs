//! The docs point at things that exist (issue 33). Protects two properties:
//!
//! 1. Every file or folder path that `README.md` and `docs/*.md` cite exists, so a reader who
//!    follows the docs after a move or a rename lands on a file, not on nothing. A path is
//!    cited in an inline code span (relative to the repository root), in a fenced block marked
//!    `sh` (the commands a reader runs; same root), or as a link target (relative to the page
//!    that holds it). Something looks like a path when it contains a `/` or ends in `.rs`,
//!    `.md`, `.toml`, `.json`, `.py` or `.sh`. Not checked: URLs; `../…` (outside the
//!    repository: the shared folder beside it); absolute paths (`/tmp/…`, what a command
//!    writes); build outputs (`target/…`); revisions (`c43c51a:README.md`); globs;
//!    placeholders (`<…>`, `$VAR`, `FILE`, `CASE`, …); flags; and the code spans of
//!    `docs/SEMANTICS.md`, which name vLLM's files, not this repository's. Fenced blocks
//!    without `sh` are pictures or program output and are not read.
//! 2. Every invariant id `I-<n>` cited in the Rust sources (core, model-check, runtime, tests)
//!    or in the docs resolves to its definition `**I-<n>` in `docs/SEMANTICS.md`, the project's
//!    copy of vLLM 0.33.0's connector semantics.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The extensions that make a word without a `/` a path.
const PATH_EXTENSIONS: [&str; 6] = [".rs", ".md", ".toml", ".json", ".py", ".sh"];

/// Words that stand for a value the reader supplies (`core/src/FILE.rs`, `CASE.json`).
const PLACEHOLDERS: [&str; 13] = [
    "FILE", "CASE", "DIR", "PATH", "NAME", "SEED", "INDEX", "PORT", "ADDR", "STEPS", "N", "W",
    "LINES",
];

/// The page whose code spans name vLLM's files.
const SEMANTICS: &str = "docs/SEMANTICS.md";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository root")
        .to_path_buf()
}

/// `README.md` and every `docs/*.md`, relative to the root.
fn pages(root: &Path) -> Vec<String> {
    let mut out = vec!["README.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| format!("docs/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// A cited path, where it was cited, and what it is relative to.
#[derive(Debug)]
struct Citation {
    page: String,
    line: usize,
    path: String,
    /// Relative to the page's folder (a link) instead of the root (code).
    from_page: bool,
}

/// The word with the punctuation around it taken off, if it looks like a path that must exist.
fn as_path(word: &str) -> Option<&str> {
    let w = word.trim_matches(|c: char| "()[],;:'\"".contains(c));
    let w = w.trim_end_matches('.');
    let looks_like_path = w.contains('/') || PATH_EXTENSIONS.iter().any(|e| w.ends_with(e));
    if !looks_like_path || w.is_empty() {
        return None;
    }
    let skipped = w.starts_with('-')
        || w.starts_with('/')
        || w.starts_with("../")
        || w.starts_with('~')
        || w.starts_with("target/")
        || w.contains("://")
        || w.contains(|c: char| "*?{}<>$…=|:".contains(c))
        || w.contains("...")
        || w.split('/').any(|seg| {
            let stem = seg.split('.').next().unwrap_or(seg);
            PLACEHOLDERS.contains(&stem)
        });
    (!skipped).then_some(w)
}

/// Every path one page cites.
fn citations(page: &str, text: &str) -> Vec<Citation> {
    let mut out = Vec::new();
    let mut fence: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            fence = match fence {
                None => Some(info.trim().to_owned()),
                Some(_) => None,
            };
            continue;
        }
        let mut cite = |path: &str, from_page: bool| {
            out.push(Citation {
                page: page.to_owned(),
                line: n,
                path: path.to_owned(),
                from_page,
            })
        };
        if let Some(info) = &fence {
            if info == "sh" {
                for word in line.split_whitespace().take_while(|w| !w.starts_with('#')) {
                    if let Some(p) = as_path(word) {
                        cite(p, false);
                    }
                }
            }
            continue;
        }
        let parts: Vec<&str> = line.split('`').collect();
        assert!(
            parts.len() % 2 == 1 || page == SEMANTICS,
            "{page}:{n}: a code span opens and does not close on its line (keep spans on one line)"
        );
        for (k, part) in parts.iter().enumerate() {
            if k % 2 == 1 {
                // Inside a code span.
                if page != SEMANTICS {
                    for word in part.split_whitespace() {
                        if let Some(p) = as_path(word) {
                            cite(p, false);
                        }
                    }
                }
                continue;
            }
            // Outside code: link targets `](target)`.
            let mut rest = *part;
            while let Some(at) = rest.find("](") {
                let after = &rest[at + 2..];
                let end = after.find(')').unwrap_or(after.len());
                let target = after[..end].split('#').next().unwrap_or("");
                if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
                    cite(target, true);
                }
                rest = &after[end..];
            }
        }
    }
    assert!(fence.is_none(), "{page}: a fenced block is not closed");
    out
}

// Protects the docs' paths (issue 33): every file or folder the README and docs/*.md cite exists,
// so a move or a rename that leaves a page pointing at nothing fails here.
#[test]
fn every_path_the_docs_cite_exists() {
    let root = root();
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages(&root) {
        let text = std::fs::read_to_string(root.join(&page)).expect("a page");
        for c in citations(&page, &text) {
            let base = if c.from_page {
                root.join(&c.page).parent().unwrap().to_path_buf()
            } else {
                root.clone()
            };
            checked += 1;
            if !base.join(&c.path).exists() {
                missing.push(format!("{}:{}: {}", c.page, c.line, c.path));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "paths cited in the docs that do not exist:\n{}",
        missing.join("\n")
    );
}

/// `I-<n>` ids in a text: `I-` not preceded by a letter, digit or `_`, then digits.
fn invariant_ids(text: &str) -> Vec<(usize, u32)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = text[from..].find("I-") {
        let start = from + at;
        let digits_at = start + 2;
        let end = bytes[digits_at..]
            .iter()
            .position(|b| !b.is_ascii_digit())
            .map_or(bytes.len(), |k| digits_at + k);
        let bounded =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        if bounded && end > digits_at {
            let line = text[..start].matches('\n').count() + 1;
            out.push((line, text[digits_at..end].parse().expect("digits")));
        }
        from = digits_at;
    }
    out
}

fn files_under(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source directory") {
        let p = entry.expect("directory entry").path();
        let name = p.file_name().unwrap().to_string_lossy();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                files_under(&p, ext, out);
            }
        } else if name.ends_with(ext) {
            out.push(p);
        }
    }
}

// Protects the invariant ids (issue 33): every I-<n> the code or the docs cite is defined in the
// project's own docs/SEMANTICS.md, so a citation never points outside the repository or at no
// invariant.
#[test]
fn every_invariant_id_resolves_in_semantics() {
    let root = root();
    let semantics = std::fs::read_to_string(root.join(SEMANTICS)).expect("docs/SEMANTICS.md");
    let defined: BTreeSet<u32> = semantics
        .match_indices("**I-")
        .filter_map(|(at, def)| {
            let digits: String = semantics[at + def.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .collect();
    assert!(
        !defined.is_empty(),
        "no `**I-<n>` definition in {SEMANTICS}"
    );

    let mut sources = Vec::new();
    for dir in ["core", "model-check", "runtime", "tests"] {
        files_under(&root.join(dir), ".rs", &mut sources);
    }
    assert!(
        sources.len() > 100,
        "only {} Rust files found",
        sources.len()
    );
    for page in pages(&root) {
        if page != SEMANTICS {
            sources.push(root.join(page));
        }
    }

    let mut cited = 0;
    let mut unresolved = Vec::new();
    for file in &sources {
        let text = std::fs::read_to_string(file).expect("a source file");
        for (line, id) in invariant_ids(&text) {
            cited += 1;
            if !defined.contains(&id) {
                let rel = file.strip_prefix(&root).unwrap_or(file);
                unresolved.push(format!("{}:{line}: I-{id}", rel.display()));
            }
        }
    }
    assert!(
        cited > 100,
        "only {cited} invariant ids cited: is the scan broken?"
    );
    assert!(
        unresolved.is_empty(),
        "invariant ids with no `**I-<n>` definition in {SEMANTICS}:\n{}",
        unresolved.join("\n")
    );
}
