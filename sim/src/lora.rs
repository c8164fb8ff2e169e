//! LoRA adapters, served as vLLM serves them.
//!
//! - Registered at start with `--lora-modules name=path` (or vLLM's JSON form
//!   `{"name": …, "path": …}`), and at run time with `POST /v1/load_lora_adapter` /
//!   `POST /v1/unload_lora_adapter` when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true.
//! - Listed by `/v1/models` with `parent` = the base model, as vLLM lists them.
//! - A request selects one through its `model`. Its blocks are hashed with the adapter in
//!   their extra keys (vLLM 0.33: `("lora", name, path)`), so an adapter's prefix never
//!   matches the base model's, and its `BlockStored` events carry `lora_id`, `lora_name` and
//!   the name in each block's `extra_keys`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};

/// One adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    /// vLLM's `lora_int_id`: 1, 2, … in registration order.
    pub id: u32,
    /// The name requests use as their `model`.
    pub name: String,
    /// Where its weights are (the simulator never reads them).
    pub path: String,
}

/// Why an adapter cannot be registered or removed; the messages are vLLM's.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoraError {
    /// A name is registered twice.
    #[error("The lora adapter '{0}' has already been loaded.")]
    Exists(String),
    /// No adapter has that name.
    #[error("The lora adapter '{0}' cannot be found.")]
    NotFound(String),
    /// A `--lora-modules` value or request body that names no adapter.
    #[error("invalid LoRA module {0:?}: expected name=path or {{\"name\": …, \"path\": …}}")]
    Invalid(String),
}

/// Parses one `--lora-modules` value, `name=path` or JSON with `name` and `path`, into
/// `(name, path)`.
pub fn parse_module(value: &str) -> Result<(String, String), LoraError> {
    #[derive(serde::Deserialize)]
    struct Module {
        name: String,
        path: String,
    }
    let (name, path) = match serde_json::from_str::<Module>(value) {
        Ok(m) => (m.name, m.path),
        Err(_) => match value.split_once('=') {
            Some((name, path)) => (name.to_owned(), path.to_owned()),
            None => return Err(LoraError::Invalid(value.to_owned())),
        },
    };
    if name.is_empty() || path.is_empty() {
        return Err(LoraError::Invalid(value.to_owned()));
    }
    Ok((name, path))
}

/// The adapters this engine serves.
#[derive(Debug, Default)]
pub struct Registry {
    adapters: RwLock<Vec<Arc<Lora>>>,
    next_id: AtomicU32,
}

impl Registry {
    /// Registers an adapter under a fresh id.
    pub fn load(&self, name: &str, path: &str) -> Result<Arc<Lora>, LoraError> {
        let mut adapters = self.adapters.write().unwrap_or_else(|p| p.into_inner());
        if adapters.iter().any(|a| a.name == name) {
            return Err(LoraError::Exists(name.to_owned()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let lora = Arc::new(Lora { id, name: name.to_owned(), path: path.to_owned() });
        adapters.push(lora.clone());
        Ok(lora)
    }

    /// Removes an adapter (requests already running with it finish).
    pub fn unload(&self, name: &str) -> Result<(), LoraError> {
        let mut adapters = self.adapters.write().unwrap_or_else(|p| p.into_inner());
        let before = adapters.len();
        adapters.retain(|a| a.name != name);
        if adapters.len() == before {
            return Err(LoraError::NotFound(name.to_owned()));
        }
        Ok(())
    }

    /// The adapter named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Lora>> {
        self.adapters.read().unwrap_or_else(|p| p.into_inner()).iter().find(|a| a.name == name).cloned()
    }

    /// Every adapter, in registration order.
    pub fn list(&self) -> Vec<Arc<Lora>> {
        self.adapters.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_parse_in_both_forms() {
        assert_eq!(parse_module("sql=/a/sql").unwrap(), ("sql".into(), "/a/sql".into()));
        assert_eq!(parse_module(r#"{"name":"sql","path":"/a/sql","base_model_name":"m"}"#).unwrap().0, "sql");
        assert!(parse_module("sql").is_err());
        assert!(parse_module("=/a").is_err());
    }

    #[test]
    fn ids_count_up_and_names_are_unique() {
        let r = Registry::default();
        assert_eq!(r.load("a", "/a").unwrap().id, 1);
        assert_eq!(r.load("b", "/b").unwrap().id, 2);
        assert_eq!(r.load("a", "/x"), Err(LoraError::Exists("a".into())));
        r.unload("a").unwrap();
        assert_eq!(r.unload("a"), Err(LoraError::NotFound("a".into())));
        assert_eq!(r.load("a", "/a").unwrap().id, 3, "ids are never reused");
        assert_eq!(r.list().iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), ["b", "a"]);
    }
}
