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

use aho_corasick::{AhoCorasick, MatchKind};
use lru::LruCache;

/// Tokenized pieces, keyed by their exact text.
pub struct SegmentCache {
    splitter: AhoCorasick,
    pieces: LruCache<String, Vec<u32>>,
    bytes: usize,
    budget: usize,
    hits: u64,
    misses: u64,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache").field("bytes", &self.bytes).field("budget", &self.budget).finish()
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
    pub fn for_tokenizer(tokenizer: &tokenizers::Tokenizer, budget: usize) -> Option<SegmentCache> {
        let added = tokenizer.get_added_tokens_decoder();
        let special: Vec<&tokenizers::AddedToken> = added.values().filter(|t| t.special).collect();
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
        Some(SegmentCache { splitter, pieces: LruCache::unbounded(), bytes: 0, budget, hits: 0, misses: 0 })
    }

    /// The cache's counters.
    pub fn stats(&self) -> SegmentStats {
        SegmentStats { hits: self.hits, misses: self.misses, bytes: self.bytes }
    }

    /// Encodes `text` (without added special tokens) piece by piece, through the cache.
    pub fn encode<E>(
        &mut self,
        text: &str,
        mut encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        let mut cuts: Vec<usize> = self.splitter.find_iter(text).map(|m| m.start()).collect();
        if cuts.first() != Some(&0) {
            cuts.insert(0, 0);
        }
        cuts.push(text.len());
        let mut ids = Vec::new();
        for w in cuts.windows(2) {
            let piece = &text[w[0]..w[1]];
            if piece.is_empty() {
                continue;
            }
            if let Some(cached) = self.pieces.get(piece) {
                self.hits += 1;
                ids.extend_from_slice(cached);
                continue;
            }
            self.misses += 1;
            let piece_ids = encode(piece)?;
            ids.extend_from_slice(&piece_ids);
            self.insert(piece.to_owned(), piece_ids);
        }
        Ok(ids)
    }

    fn insert(&mut self, piece: String, ids: Vec<u32>) {
        let size = piece.len() + ids.len() * 4 + 64;
        if size > self.budget {
            return;
        }
        self.bytes += size;
        if let Some((old_piece, old_ids)) = self.pieces.push(piece, ids) {
            self.bytes -= old_piece.len() + old_ids.len() * 4 + 64;
        }
        while self.bytes > self.budget {
            let Some((p, v)) = self.pieces.pop_lru() else { break };
            self.bytes -= p.len() + v.len() * 4 + 64;
        }
    }
}

/// Bytes a cache may hold unless configured otherwise.
pub const DEFAULT_BUDGET: usize = 16 << 20;
