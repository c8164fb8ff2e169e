//! Giving the heap's free pages back to the system after start-up.
//!
//! Loading a tokenizer peaks at several times what it keeps (the whole `tokenizer.json` as a
//! document tree, then the vocabulary and merge tables beside it), and glibc's allocator keeps
//! the pages a freed peak leaves inside its heap. With three models (Qwen3, Llama 3.2, Gemma 3)
//! the sidecar sat at 744 MiB resident after start-up, about 100 MiB of it live. Giving the
//! free pages back after reading the tokenizer files, then loading the tokenizers one after
//! another on one thread (each load reuses what the one before freed) and giving them back
//! again: 111 MiB resident, measured (`docs/benchmarks/2026-12-05-sidecar-tokenizers`).

/// Returns the heap's free pages to the system (glibc's `malloc_trim`); elsewhere, nothing.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_pages() {
    // SAFETY: malloc_trim takes an integer and touches only the allocator's own free lists;
    // it is safe to call at any time from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Returns the heap's free pages to the system (glibc's `malloc_trim`); elsewhere, nothing.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_pages() {}
