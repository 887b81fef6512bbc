//! The floor plan holds (issue 20): no import circle between the files of `kvrelay-core` or
//! `kvrelay-model-check`, and no core file over 1,000 lines without a reason written at its top.
//!
//! An import edge is a `use` of `crate::…`, `super::…` or `self::…` that is not a re-export
//! (`pub use` only names what a room offers). Each imported name is resolved to the file that
//! defines it: the file of the module it names, or else the file defining an item of that name
//! whose module path shares the longest prefix with the imported path (names are unique per
//! room, so re-exports resolve to their definition).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A core file longer than this must say why at its top.
const MAX_LINES: usize = 1_000;
/// What a long file's module docs must contain.
const LONG_FILE_REASON: &str = "Why this file is long";

struct Crate {
    /// Source file → its module path (`scheduler/schedule.rs` → `["scheduler", "schedule"]`).
    files: BTreeMap<PathBuf, Vec<String>>,
    /// Item name → the files defining it.
    defs: BTreeMap<String, BTreeSet<PathBuf>>,
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source directory") {
        let p = entry.expect("directory entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The name an item definition line introduces, if it is one (top level or one indent deep:
/// items inside `impl` blocks are methods, not importable).
fn defined_name(line: &str) -> Option<String> {
    let indent = line.len() - line.trim_start().len();
    if indent > 4 {
        return None;
    }
    let mut rest = line.trim_start();
    if let Some(r) = rest.strip_prefix("pub") {
        rest = r.trim_start();
        if rest.starts_with('(') {
            rest = rest[rest.find(')')? + 1..].trim_start();
        }
    }
    if let Some(r) = rest.strip_prefix("macro_rules!") {
        return Some(ident(r.trim_start()));
    }
    for kw in [
        "struct ", "enum ", "trait ", "fn ", "type ", "const ", "static ", "union ",
    ] {
        if let Some(r) = rest.strip_prefix(kw) {
            let name = ident(r);
            return (!name.is_empty()).then_some(name);
        }
    }
    None
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

fn load(src: &Path) -> Crate {
    let mut paths = Vec::new();
    rust_files(src, &mut paths);
    paths.sort();
    let mut files = BTreeMap::new();
    let mut defs: BTreeMap<String, BTreeSet<PathBuf>> = BTreeMap::new();
    for p in paths {
        let text = std::fs::read_to_string(&p).expect("readable source");
        for line in text.lines() {
            if let Some(name) = defined_name(line) {
                defs.entry(name).or_default().insert(p.clone());
            }
        }
        files.insert(p.clone(), module_path(src, &p));
    }
    Crate { files, defs }
}

/// The `use` statements of a file that import from this crate and are not re-exports, as
/// statement texts without whitespace (`crate::a::{B,c::D}`).
fn crate_uses(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        let Some(stmt) = t.strip_prefix("use ") else {
            continue;
        };
        let mut stmt = String::from(stmt);
        while !stmt.trim_end().ends_with(';') {
            match lines.next() {
                Some(l) => stmt.push_str(l),
                None => break,
            }
        }
        let stmt: String = stmt
            .trim_end()
            .trim_end_matches(';')
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if ["crate::", "super::", "self::"]
            .iter()
            .any(|p| stmt.starts_with(p))
        {
            out.push(stmt);
        }
    }
    out
}

/// `a::{b, c::{d, e}}` → `[a::b, a::c::d, a::c::e]` (renames dropped).
fn flatten(path: &str) -> Vec<String> {
    let path = path.trim();
    let Some(open) = path.find('{') else {
        let p = path.split(" as ").next().unwrap_or(path).replace(' ', "");
        return vec![p];
    };
    let prefix = &path[..open];
    let inner = &path[open + 1..path.rfind('}').expect("balanced braces")];
    let mut parts = Vec::new();
    let (mut depth, mut cur) = (0, String::new());
    for ch in inner.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if ch == ',' && depth == 0 {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(ch);
        }
    }
    parts.push(cur);
    parts
        .iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| flatten(&format!("{prefix}{}", p.trim())))
        .collect()
}

/// The file an imported path refers to, if it is in this crate.
fn resolve(krate: &Crate, from: &[String], path: &str) -> Option<PathBuf> {
    let segs: Vec<&str> = path.split("::").collect();
    let mut module: Vec<String> = from.to_vec();
    let mut i = 0;
    match segs[0] {
        "crate" => {
            module.clear();
            i = 1;
        }
        "self" => i = 1,
        _ => {}
    }
    while segs.get(i) == Some(&"super") {
        module.pop();
        i += 1;
    }
    let (last, mids) = segs[i..].split_last()?;
    module.extend(mids.iter().map(|s| String::from(*s)));
    let name = match *last {
        "*" => return file_of_module(krate, &module),
        "self" => {
            return file_of_module(krate, &module);
        }
        n => n,
    };
    let mut as_module = module.clone();
    as_module.push(String::from(name));
    if let Some(f) = file_of_module(krate, &as_module) {
        return Some(f);
    }
    krate
        .defs
        .get(name)?
        .iter()
        .max_by_key(|f| {
            let m = &krate.files[*f];
            m.iter().zip(&module).take_while(|(a, b)| a == b).count()
        })
        .cloned()
}

fn file_of_module(krate: &Crate, module: &[String]) -> Option<PathBuf> {
    krate
        .files
        .iter()
        .find(|(_, m)| m.as_slice() == module)
        .map(|(f, _)| f.clone())
}

fn import_graph(krate: &Crate) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for (file, module) in &krate.files {
        let text = std::fs::read_to_string(file).expect("readable source");
        let out = edges.entry(file.clone()).or_default();
        for stmt in crate_uses(&text) {
            for path in flatten(&stmt) {
                if let Some(to) = resolve(krate, module, &path)
                    && &to != file
                {
                    out.insert(to);
                }
            }
        }
    }
    edges
}

/// Strongly connected components with more than one file (Tarjan).
fn circles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct Tarjan<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a PathBuf) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().expect("on the stack");
                    self.on_stack.remove(w);
                    comp.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

fn src_of(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

fn assert_no_circles(krate: &str) {
    let src = src_of(krate);
    let loaded = load(&src);
    let edges = import_graph(&loaded);
    let found = circles(&edges);
    let show = |p: &PathBuf| p.strip_prefix(&src).unwrap_or(p).display().to_string();
    let report: Vec<String> = found
        .iter()
        .map(|comp| {
            let inside: Vec<String> = comp
                .iter()
                .flat_map(|a| {
                    edges[a]
                        .iter()
                        .filter(|b| comp.contains(b))
                        .map(move |b| format!("{} → {}", show(a), show(b)))
                })
                .collect();
            inside.join(", ")
        })
        .collect();
    assert!(
        report.is_empty(),
        "{krate}: import circles: {}",
        report.join(" | ")
    );
}

#[test]
fn the_core_has_no_import_circle() {
    assert_no_circles("core");
}

#[test]
fn the_model_checker_has_no_import_circle() {
    assert_no_circles("model-check");
}

#[test]
fn no_core_file_is_long_without_a_reason_at_its_top() {
    let src = src_of("core");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut long = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable source");
        let lines = text.lines().count();
        let docs: String = text
            .lines()
            .take_while(|l| l.starts_with("//!") || l.trim().is_empty())
            .collect();
        if lines > MAX_LINES && !docs.contains(LONG_FILE_REASON) {
            long.push(format!(
                "{} ({lines} lines)",
                f.strip_prefix(&src).unwrap_or(&f).display()
            ));
        }
    }
    assert!(
        long.is_empty(),
        "core files over {MAX_LINES} lines without a `{LONG_FILE_REASON}` note in their module \
         docs: {}",
        long.join(", ")
    );
}

/// The check itself finds a circle: two files importing each other.
#[test]
fn the_circle_check_finds_a_circle() {
    let dir = std::env::temp_dir().join(format!("kvrelay-layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("room")).expect("temp dir");
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod room;\n").expect("write");
    std::fs::write(dir.join("a.rs"), "use crate::room::B;\npub struct A;\n").expect("write");
    std::fs::write(dir.join("room").join("mod.rs"), "mod b;\npub use b::B;\n").expect("write");
    std::fs::write(
        dir.join("room").join("b.rs"),
        "use crate::a::A;\npub struct B(A);\n",
    )
    .expect("write");
    let loaded = load(&dir);
    let found = circles(&import_graph(&loaded));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found.len(), 1, "a.rs ↔ room/b.rs: {found:?}");
    assert_eq!(found[0].len(), 2);
}

// Protects the boundary of unsafe code: the workspace forbids it, the runtime denies it, and only
// the CUDA backend (driver copies and allocations) may allow it.
#[test]
fn only_the_cuda_backend_allows_unsafe_code() {
    let mut files = Vec::new();
    for krate in ["core", "model-check", "runtime", "tests"] {
        rust_files(&src_of(krate), &mut files);
    }
    let allowing: Vec<PathBuf> = files
        .into_iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.lines()
                .any(|l| l.trim_start().starts_with("#") && l.contains("allow(unsafe_code)"))
        })
        .collect();
    let expected = src_of("runtime").join("run").join("cuda.rs");
    assert_eq!(allowing, vec![expected]);
}
