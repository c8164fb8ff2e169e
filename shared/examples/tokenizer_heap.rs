//! What loading a tokenizer costs in heap, as the filter loads it: the bundle decoded from the
//! sidecar's bytes, then `ModelTokenizer::from_bundle`. Prints, per model directory, the heap
//! the load peaked at above the bundle and what the tokenizer keeps once the bundle is gone. In
//! a wasm VM the peak is what stays resident: its linear memory never shrinks.
//!
//! ```text
//! cargo run --release -p kvgate-shared --example tokenizer_heap -- ../shared/testdata/tokenizers/*
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvgate_shared::codec;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;

/// The system allocator, counting the bytes live and the most ever live.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let live = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(live, Relaxed);
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        match size.checked_sub(layout.size()) {
            Some(more) => grew(more),
            None => {
                LIVE.fetch_sub(layout.size() - size, Relaxed);
            }
        }
        unsafe { System.realloc(ptr, layout, size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("| model | bundle | load peak above the bundle | kept |\n|---|---|---|---|");
    for dir in std::env::args().skip(1) {
        let path = std::path::Path::new(&dir);
        let name = path.file_name().map_or(dir.clone(), |n| n.to_string_lossy().into_owned());
        let bytes = codec::encode(&ModelBundle::from_dir(&name, path, 16)?)?;
        let before = LIVE.load(Relaxed);
        let bundle: ModelBundle = codec::decode(&bytes)?;
        let with_bundle = LIVE.load(Relaxed);
        PEAK.store(with_bundle, Relaxed);
        let tokenizer = ModelTokenizer::from_bundle(&bundle)?;
        let peak = PEAK.load(Relaxed) - with_bundle;
        drop(bundle);
        let kept = LIVE.load(Relaxed) - before;
        println!("| {name} | {:.1} MiB | {:.1} MiB | {:.1} MiB |", mib(bytes.len()), mib(peak), mib(kept));
        drop(tokenizer);
    }
    Ok(())
}
