//! The shape of the house, checked: no import cycle among the top-level modules of
//! `src/`, and no `too_many_arguments` allowance anywhere in the crate.
//!
//! A top-level module is a file `src/X.rs` or a folder `src/X/` (with everything
//! under it). Module X depends on Y when code in X (outside its tests and comments)
//! names `crate::Y`. The dependency graph must be acyclic: the control plane's
//! shared types live in `control` and the cross-thread status in `status`, below
//! both the data plane (`shard`, `proxy`, `server`) and the control threads
//! (`coordinator`, `admin`, `cluster`, ...); docs/architecture.md draws the layers.
//! A failure names the cycle and, for each edge, a file that makes it.

#![allow(clippy::disallowed_methods)] // reads source files; a test, not a shard

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file that counts for dependencies: not its test module (a file
/// named `tests.rs`, or what follows `#[cfg(test)]`), not its comments.
fn code(path: &Path) -> String {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return String::new();
    }
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::NAME` in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let preceded = rest[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[i + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !preceded && !name.is_empty() {
            names.insert(name);
        }
    }
    names
}

/// Module → (module it names → a file that names it).
fn graph() -> BTreeMap<String, BTreeMap<String, PathBuf>> {
    let src = src();
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            rust_files(&path, modules.entry(stem).or_default());
        } else if path.extension().is_some_and(|e| e == "rs") && stem != "lib" && stem != "main" {
            modules.entry(stem).or_default().push(path);
        }
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    modules
        .iter()
        .map(|(module, files)| {
            let mut edges = BTreeMap::new();
            for file in files {
                for target in crate_paths(&code(file)) {
                    if target != *module && names.contains(&target) {
                        edges.entry(target).or_insert_with(|| file.clone());
                    }
                }
            }
            (module.clone(), edges)
        })
        .collect()
}

/// A cycle through the graph, if there is one (depth-first search).
fn find_cycle(graph: &BTreeMap<String, BTreeMap<String, PathBuf>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeMap<String, PathBuf>>,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for next in graph[node].keys() {
            match marks[next.as_str()] {
                Mark::Open => {
                    let start = path.iter().position(|n| n == next).unwrap();
                    let mut cycle = path[start..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Mark::New => {
                    if let Some(c) = visit(next, graph, marks, path) {
                        return Some(c);
                    }
                }
                Mark::Done => {}
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks: BTreeMap<String, Mark> = graph.keys().map(|k| (k.clone(), Mark::New)).collect();
    for node in graph.keys() {
        if marks[node.as_str()] == Mark::New {
            if let Some(c) = visit(node, graph, &mut marks, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn no_import_cycle_among_top_level_modules() {
    let graph = graph();
    assert!(graph.len() > 20, "found only {} modules", graph.len());
    if let Some(cycle) = find_cycle(&graph) {
        let edges: Vec<String> = cycle
            .windows(2)
            .map(|w| {
                let file = &graph[&w[0]][&w[1]];
                let file = file.strip_prefix(src()).unwrap_or(file);
                format!("  {} -> {} ({})", w[0], w[1], file.display())
            })
            .collect();
        panic!(
            "import cycle among the top-level modules of src/:\n{}",
            edges.join("\n")
        );
    }
}

#[test]
fn the_cycle_check_sees_a_cycle() {
    // The checker itself: a graph with a -> b -> c -> a has a cycle, a -> b -> c not.
    let edge = |to: &str| (to.to_string(), PathBuf::new());
    let mut g: BTreeMap<String, BTreeMap<String, PathBuf>> = BTreeMap::new();
    g.insert("a".into(), [edge("b")].into());
    g.insert("b".into(), [edge("c")].into());
    g.insert("c".into(), BTreeMap::new());
    assert_eq!(find_cycle(&g), None);
    g.insert("c".into(), [edge("a")].into());
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(
        crate_paths("use crate::shard::Shard; my_crate::no; crate::http"),
        ["http".to_string(), "shard".to_string()].into()
    );
}

#[test]
fn no_too_many_arguments_allowance() {
    let mut files = Vec::new();
    for dir in ["src", "orchestrator/src", "bench/src"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        if dir.is_dir() {
            rust_files(&dir, &mut files);
        }
    }
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .contains(concat!("too_many", "_arguments"))
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "functions take a struct of their inputs instead of a long argument list; \
         allowances found in:\n{}",
        offenders.join("\n")
    );
}
