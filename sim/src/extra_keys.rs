//! What salts a request's block hashes besides its tokens, as vLLM's
//! `generate_block_hash_extra_keys` does: its LoRA adapter (every block) and its
//! `cache_salt` (the prompt's first block only). The hash uses the tagged forms
//! (`("lora", name, path)`, `("cache_salt", salt)`); `BlockStored` events carry the untagged
//! ones in `extra_keys` (the adapter's name, the salt).

use std::sync::Arc;

use crate::lora::Lora;

/// A request's extra keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// The LoRA adapter the request runs under.
    pub lora: Option<Arc<Lora>>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<Arc<str>>,
}

impl ExtraKeys {
    /// The salt, for the prompt's first block (`first`) only.
    pub fn salt_of(&self, first: bool) -> Option<&str> {
        self.cache_salt.as_deref().filter(|_| first)
    }
}
