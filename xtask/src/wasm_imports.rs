//! The filter module as every supported Envoy can load it.
//!
//! tokenizers' perfect hashing (`ptr_hash`) links `tempfile`, whose clean-up needs WASI calls —
//! `fd_readdir`, `path_remove_directory`, … — that Envoy provides only since 1.39. A module
//! importing a call its host lacks does not load, and Envoy then refuses the listener's whole
//! configuration (`FAIL_OPEN` covers a VM that fails, not one that cannot be created). The
//! filter never touches a filesystem in Envoy, so each WASI import outside [`ENVOY_WASI`]
//! becomes a function of the module that returns `ENOSYS`.

use std::path::Path;

use anyhow::Context;

/// The WASI calls every supported Envoy provides (proxy-wasm-cpp-host's list since before
/// Envoy 1.36, the oldest release with V8 on PyPI).
pub const ENVOY_WASI: &[&str] = &[
    "fd_write",
    "fd_read",
    "fd_seek",
    "fd_close",
    "fd_fdstat_get",
    "environ_get",
    "environ_sizes_get",
    "args_get",
    "args_sizes_get",
    "clock_time_get",
    "random_get",
    "proc_exit",
    "path_open",
    "fd_prestat_get",
    "fd_prestat_dir_name",
];

/// The module WASI's imports come from.
const WASI: &str = "wasi_snapshot_preview1";
/// WASI's "function not supported" errno.
const ENOSYS: i32 = 52;

/// Replaces each WASI import of the module at `path` that is not in [`ENVOY_WASI`] with a
/// function returning [`ENOSYS`], in place; returns the names replaced (none the second time).
pub fn stub_unprovided(path: &Path) -> anyhow::Result<Vec<String>> {
    let mut module = walrus::Module::from_file(path).with_context(|| format!("reading {}", path.display()))?;
    let unprovided: Vec<(walrus::FunctionId, String)> = module
        .imports
        .iter()
        .filter(|i| i.module == WASI && !ENVOY_WASI.contains(&i.name.as_str()))
        .filter_map(|i| match i.kind {
            walrus::ImportKind::Function(f) => Some((f, i.name.clone())),
            _ => None,
        })
        .collect();
    for (function, name) in &unprovided {
        let returns_errno = {
            let walrus::FunctionKind::Import(import) = &module.funcs.get(*function).kind else { continue };
            module.types.get(import.ty).results() == [walrus::ValType::I32]
        };
        anyhow::ensure!(returns_errno, "WASI import {name} does not return an errno");
        module.replace_imported_func(*function, |(body, _)| {
            body.i32_const(ENOSYS);
        })?;
    }
    if !unprovided.is_empty() {
        module.emit_wasm_file(path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(unprovided.into_iter().map(|(_, name)| name).collect())
}

/// The WASI calls the module at `path` imports.
pub fn wasi_imports(path: &Path) -> anyhow::Result<Vec<String>> {
    let module = walrus::Module::from_file(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(module.imports.iter().filter(|i| i.module == WASI).map(|i| i.name.clone()).collect())
}
