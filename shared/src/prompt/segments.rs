//! An exact cache of tokenized prompt segments.
//!
//! HF `tokenizers` first splits the input at added tokens, then normalizes, pre-tokenizes and
//! runs the model on each piece separately. So a rendered chat, cut just before each special
//! token (`<|im_start|>…`), tokenizes piece by piece to exactly the same ids as in one go —
//! provided the special tokens neither strip whitespace nor match after normalization, which
//! [`SegmentCache::for_tokenizer`] checks (otherwise there is no cache).
//!
//! In a multi-turn chat every earlier turn is a piece seen before: only the new turn is
//! tokenized. Pieces are kept in an LRU bounded by a byte budget.

//!
//! The cache is shared by threads (the sidecar tokenizes offloaded prompts on several): its
//! lock is held only to look pieces up and to keep new ones, never while a piece is
//! tokenized, so two prompts tokenize at once.

use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};
use lru::LruCache;
use tokenizers::pipeline::PipelineTokenizer;
use tokenizers::vocab::bucket_added_vocabulary::AddedToken;

/// Tokenized pieces, keyed by their exact text.
pub struct SegmentCache {
    splitter: AhoCorasick,
    pieces: Mutex<Pieces>,
}

/// What the lock guards.
struct Pieces {
    lru: LruCache<String, Arc<[u32]>>,
    bytes: usize,
    budget: usize,
    hits: u64,
    misses: u64,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stats = self.stats();
        f.debug_struct("SegmentCache").field("bytes", &stats.bytes).finish()
    }
}

/// What the cache did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Pieces served from the cache.
    pub hits: u64,
    /// Pieces tokenized.
    pub misses: u64,
    /// Bytes held.
    pub bytes: usize,
}

impl SegmentCache {
    /// A cache for `tokenizer` holding at most `budget` bytes, or `None` if its special
    /// tokens make piecewise tokenization inexact (or there are none to split at).
    pub fn for_tokenizer(tokenizer: &PipelineTokenizer, budget: usize) -> Option<SegmentCache> {
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        let special: Vec<&AddedToken> = added.values().filter(|t| t.special).collect();
        if special.is_empty() || budget == 0 {
            return None;
        }
        if added.values().any(|t| t.special && (t.lstrip || t.rstrip || t.single_word || t.normalized)) {
            return None;
        }
        let splitter = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(special.iter().map(|t| t.content.as_str()))
            .ok()?;
        let pieces = Pieces { lru: LruCache::unbounded(), bytes: 0, budget, hits: 0, misses: 0 };
        Some(SegmentCache { splitter, pieces: Mutex::new(pieces) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pieces> {
        self.pieces.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cache's counters.
    pub fn stats(&self) -> SegmentStats {
        let p = self.lock();
        SegmentStats { hits: p.hits, misses: p.misses, bytes: p.bytes }
    }

    /// Encodes `text` (without added special tokens) piece by piece, through the cache: the
    /// pieces it holds are looked up, the others tokenized together by `encode` (each piece's
    /// ids, in order) with no lock held, then kept.
    pub fn encode<E>(
        &self,
        text: &str,
        encode: impl FnOnce(&[&str]) -> Result<Vec<Vec<u32>>, E>,
    ) -> Result<Vec<u32>, E> {
        let mut cuts: Vec<usize> = self.splitter.find_iter(text).map(|m| m.start()).collect();
        if cuts.first() != Some(&0) {
            cuts.insert(0, 0);
        }
        cuts.push(text.len());
        let pieces: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).filter(|p| !p.is_empty()).collect();
        let cached: Vec<Option<Arc<[u32]>>> = {
            let mut p = self.lock();
            pieces.iter().map(|piece| p.lookup(piece)).collect()
        };
        let missed: Vec<&str> = pieces.iter().zip(&cached).filter(|(_, c)| c.is_none()).map(|(p, _)| *p).collect();
        let new = encode(&missed)?;
        assert_eq!(new.len(), missed.len(), "one encoding per piece");
        // Sized once: a long prompt's ids grown by doubling were copied about once more.
        let len = cached.iter().flatten().map(|c| c.len()).sum::<usize>() + new.iter().map(Vec::len).sum::<usize>();
        let mut new = new.into_iter();
        let mut ids = Vec::with_capacity(len);
        let mut kept = Vec::new();
        for (piece, cached) in pieces.iter().zip(cached) {
            match cached {
                Some(piece_ids) => ids.extend_from_slice(&piece_ids),
                None => {
                    let piece_ids = new.next().unwrap_or_default();
                    ids.extend_from_slice(&piece_ids);
                    kept.push((*piece, piece_ids));
                }
            }
        }
        if !kept.is_empty() {
            let mut p = self.lock();
            for (piece, piece_ids) in kept {
                p.insert(piece, piece_ids);
            }
        }
        Ok(ids)
    }
}

impl SegmentCache {
    /// Encodes `piece` as one segment, through the cache, with `encode` (which may take
    /// special-token text literally, as harmony does). A piece holding special-token text is
    /// encoded without the cache: [`SegmentCache::encode`] would split it there and give other
    /// ids for the same key.
    pub fn encode_piece<E>(
        &self,
        piece: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        if piece.is_empty() || self.splitter.is_match(piece) {
            return encode(piece);
        }
        if let Some(ids) = self.lock().lookup(piece) {
            return Ok(ids.to_vec());
        }
        let ids = encode(piece)?;
        self.lock().insert(piece, ids.clone());
        Ok(ids)
    }
}

impl Pieces {
    fn lookup(&mut self, piece: &str) -> Option<Arc<[u32]>> {
        let found = self.lru.get(piece).cloned();
        match found {
            Some(_) => self.hits += 1,
            None => self.misses += 1,
        }
        found
    }

    fn insert(&mut self, piece: &str, ids: Vec<u32>) {
        let size = piece.len() + ids.len() * 4 + 64;
        if size > self.budget || self.lru.contains(piece) {
            return;
        }
        self.bytes += size;
        self.lru.push(piece.to_owned(), ids.into());
        while self.bytes > self.budget {
            let Some((p, v)) = self.lru.pop_lru() else { break };
            self.bytes -= p.len() + v.len() * 4 + 64;
        }
    }
}

/// Bytes a cache may hold unless configured otherwise.
pub const DEFAULT_BUDGET: usize = 16 << 20;
