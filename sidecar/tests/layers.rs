//! The sidecar's modules form layers: a module imports only from layers below its own, so
//! nothing runs back up (the pool never imports a driver) and no two modules import each
//! other. The table is `lib.rs`'s, checked against every `crate::` path in the code.

use std::collections::BTreeSet;
use std::path::Path;

/// Each top-level module's layer, bottom up.
const LAYERS: &[&[&str]] = &[
    &["health", "heap"],
    &["watch"],
    &["index", "latency", "metrics", "niceness", "poll"],
    &["score", "accuracy", "msg"],
    &["load"],
    &["admission"],
    &["pool"],
    &["events", "sync", "engine_poller", "api"],
    &["discovery"],
    &["config", "tools"],
];

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

/// Every `.rs` file under `dir`, with its top-level module.
fn files(dir: &Path, module: Option<&str>, out: &mut Vec<(String, std::path::PathBuf)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let top = module.map_or(name.clone(), str::to_owned);
        if path.is_dir() {
            files(&path, Some(&top), out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push((top, path));
        }
    }
}

/// The top-level modules `code` names as `crate::<module>`, outside comments and tests.
fn imports(code: &str) -> BTreeSet<String> {
    let code = code.split("#[cfg(test)]").next().unwrap_or(code);
    let mut found = BTreeSet::new();
    for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for (at, _) in line.match_indices("crate::") {
            let name: String = line[at + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            found.insert(name);
        }
    }
    found
}

#[test]
fn every_import_runs_down_a_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, None, &mut all);
    let mut wrong = Vec::new();
    for (module, path) in &all {
        if matches!(module.as_str(), "lib" | "main") || path.ends_with("tests.rs") {
            continue;
        }
        let own = layer(module).unwrap_or_else(|| panic!("{module} (in {}) is in no layer of LAYERS", path.display()));
        for dep in imports(&std::fs::read_to_string(path).unwrap()) {
            if dep == *module {
                continue;
            }
            let theirs = layer(&dep).unwrap_or_else(|| panic!("{dep} (imported by {}) is in no layer", path.display()));
            if theirs >= own {
                wrong.push(format!("{} imports crate::{dep} (layer {theirs}, its own {own})", path.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "imports that do not run down a layer:\n{}", wrong.join("\n"));
}
