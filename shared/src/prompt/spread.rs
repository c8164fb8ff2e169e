//! Tokenizing a long prompt on several threads, to exactly the ids of tokenizing it whole.
//!
//! The text is cut only between an ASCII letter and an ASCII space that an ASCII letter
//! follows (`…word| next…`). Tokenizing the parts gives the whole's ids when
//! ([`Spread::for_tokenizer`] checks each, and gives no spread otherwise):
//!
//! - **the model is BPE**, which runs on each pre-token by itself;
//! - **the normalizers are NFC and the byte-level map only.** Neither acts across the cut: a
//!   space is a starter that composes with nothing, and the byte map is per byte;
//! - **the pre-tokenizer splits by a pattern analysed for it**: GPT-2's, cl100k's (Llama 3, and
//!   Qwen 2 with single digits), o200k's, Tekken's, or DeepSeek V3's three. In each, a match
//!   that holds a letter is a run of letters (with marks and an apostrophe suffix) after at
//!   most one other character, so no match holds a letter followed by a space; none looks
//!   behind; and the match that ends in the cut's letter looks one character past it, which is
//!   not a letter on either side of the cut. So the whole text's matches end at the cut and the
//!   ones after it are the second part's own;
//! - **no added token holds a space** (nor, if matched on normalized text, the byte map's `Ġ`
//!   standing for one), strips whitespace or must stand as a single word. Added tokens are
//!   cut out first, so none spans the cut or reaches across it.
//!
//! A parity test runs every family the rule admits on prose, code, digits, CJK and emoji,
//! cut at every admitted place, against the whole (`tests/tokenizer_parity.rs`).

use tokenizers::pipeline::{PipelineModel, PipelineNormalizer, PipelinePreTokenizer, PipelineTokenizer};
use tokenizers::pre_tokenizers::split::SplitPattern;
use tokenizers::utils::Grammar;
use tokenizers::vocab::bucket_added_vocabulary::AddedToken;
use tokenizers::SplitDelimiterBehavior;

/// Bytes of text worth a thread of its own (about 8k tokens, a few hundred µs): smaller
/// parts cost more in starting the thread than they save.
pub const MIN_PART_BYTES: usize = 32 << 10;

/// How far past an even share a cut may move to find its place, in bytes.
const CUT_WINDOW: usize = 4 << 10;

/// Proof that this tokenizer may be cut between a letter and a space (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread(());

impl Spread {
    /// `Some` if every condition of the module docs holds for `tokenizer`.
    pub fn for_tokenizer(tokenizer: &PipelineTokenizer) -> Option<Spread> {
        let bpe = matches!(tokenizer.get_model(), PipelineModel::BPE(_));
        let normalizers = tokenizer
            .get_normalizers()
            .iter()
            .all(|n| matches!(n, PipelineNormalizer::NFC(_) | PipelineNormalizer::ByteLevel(_)));
        let added = tokenizer.get_added_vocabulary().get_added_tokens_decoder();
        // A token matched on normalized text would meet a space as the byte map's `Ġ`.
        let reaches_across = |t: &AddedToken| {
            t.lstrip
                || t.rstrip
                || t.single_word
                || t.content.contains(' ')
                || t.normalized && t.content.contains('\u{120}')
        };
        let added_tokens = !added.values().any(reaches_across);
        (bpe && normalizers && added_tokens && splits_at_words(tokenizer.get_pre_tokenizer())).then_some(Spread(()))
    }

    /// `text` in at most `parts` pieces of at least [`MIN_PART_BYTES`] each, cut near even
    /// shares where the rule allows (fewer pieces where it finds no place).
    pub fn cut<'a>(&self, text: &'a str, parts: usize) -> Vec<&'a str> {
        let parts = parts.min(text.len() / MIN_PART_BYTES).max(1);
        let share = text.len() / parts;
        let mut pieces = Vec::with_capacity(parts);
        let mut start = 0;
        for k in 1..parts {
            let Some(at) = cut_near(text.as_bytes(), (k * share).max(start + MIN_PART_BYTES)) else { continue };
            if text.len() - at < MIN_PART_BYTES {
                break;
            }
            pieces.push(&text[start..at]);
            start = at;
        }
        pieces.push(&text[start..]);
        pieces
    }
}

/// Whether the pre-tokenizer is one of the analysed patterns (a sequence of them, with the
/// byte-level map's empty step).
fn splits_at_words(pre: &PipelinePreTokenizer) -> bool {
    match pre {
        PipelinePreTokenizer::Sequence(sequence) if sequence.is_deepseek() => {
            sequence.pre_tokenizers()[3..].iter().all(|p| matches!(p, PipelinePreTokenizer::None))
        }
        PipelinePreTokenizer::Sequence(sequence) => {
            let mut splits = sequence.pre_tokenizers().iter().filter(|p| !matches!(p, PipelinePreTokenizer::None));
            splits.next().is_some_and(splits_at_words) && splits.next().is_none()
        }
        PipelinePreTokenizer::Split(split) => {
            let analysed = matches!(
                split.grammar(),
                Some(Grammar::Gpt2 | Grammar::Cl100k { .. } | Grammar::O200k | Grammar::Tekken)
            );
            analysed
                && matches!(split.pattern, SplitPattern::Regex(_))
                && split.behavior == SplitDelimiterBehavior::Isolated
                && !split.invert
        }
        _ => false,
    }
}

/// The first place at or after `from` (within [`CUT_WINDOW`]) where the text may be cut.
fn cut_near(bytes: &[u8], from: usize) -> Option<usize> {
    let end = (from + CUT_WINDOW).min(bytes.len());
    (from..end).find(|&i| is_place(bytes, i))
}

/// Every place where [`Spread`] may cut `text`, in order.
pub fn places(text: &str) -> impl Iterator<Item = usize> + '_ {
    (0..text.len()).filter(|&i| is_place(text.as_bytes(), i))
}

/// Whether `i` is between an ASCII letter and a space that an ASCII letter follows. ASCII
/// bytes never sit inside a multi-byte character, so such a place is a character boundary.
fn is_place(bytes: &[u8], i: usize) -> bool {
    i > 0
        && i + 1 < bytes.len()
        && bytes[i] == b' '
        && bytes[i - 1].is_ascii_alphabetic()
        && bytes[i + 1].is_ascii_alphabetic()
}

/// Encodes each of `pieces` with `encode`, on up to `threads` threads: pieces larger than a
/// thread's share are cut (where `spread` allows), and the parts are dealt out in runs of
/// about equal bytes, in order. The first run is encoded on the calling thread. Returns each
/// piece's ids, in order; the first error, if any.
pub fn encode_pieces<E: Send>(
    pieces: &[&str],
    threads: usize,
    spread: Option<Spread>,
    encode: impl Fn(&str) -> Result<Vec<u32>, E> + Sync,
) -> Result<Vec<Vec<u32>>, E> {
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let threads = if cfg!(target_family = "wasm") { 1 } else { threads.min(total / MIN_PART_BYTES) };
    if threads <= 1 {
        return pieces.iter().map(|p| encode(p)).collect();
    }
    let share = total.div_ceil(threads);
    let mut parts: Vec<(usize, &str)> = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        match spread {
            Some(spread) if piece.len() > share => {
                parts.extend(spread.cut(piece, piece.len().div_ceil(share)).into_iter().map(|p| (i, p)));
            }
            _ => parts.push((i, piece)),
        }
    }
    let runs = deal(&parts, share, threads);
    let encode = &encode;
    // Each run's parts: the piece each came from, and its ids.
    type Run<E> = Vec<(usize, Result<Vec<u32>, E>)>;
    let results: Vec<Run<E>> = std::thread::scope(|scope| {
        let run = |run: &[(usize, &str)]| run.iter().map(|&(i, p)| (i, encode(p))).collect::<Vec<_>>();
        let spawned: Vec<_> = runs[1..].iter().map(|r| scope.spawn(move || run(r))).collect();
        let mut results = vec![run(runs[0])];
        results.extend(spawned.into_iter().map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))));
        results
    });
    let mut out = vec![Vec::new(); pieces.len()];
    for (i, ids) in results.into_iter().flatten() {
        out[i].extend(ids?);
    }
    Ok(out)
}

/// `parts` in at most `runs` consecutive runs, each closed once it holds `share` bytes.
fn deal<'p, 'a>(parts: &'p [(usize, &'a str)], share: usize, runs: usize) -> Vec<&'p [(usize, &'a str)]> {
    let mut out = Vec::with_capacity(runs);
    let (mut start, mut bytes) = (0, 0);
    for (k, (_, part)) in parts.iter().enumerate() {
        bytes += part.len();
        if bytes >= share && out.len() + 1 < runs {
            out.push(&parts[start..=k]);
            (start, bytes) = (k + 1, 0);
        }
    }
    if start < parts.len() || out.is_empty() {
        out.push(&parts[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize) -> String {
        (0..n).map(|i| format!("word{} alpha", i % 7)).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn cuts_land_between_a_letter_and_a_spaced_letter_and_lose_nothing() {
        let text = words(40_000);
        let pieces = Spread(()).cut(&text, 4);
        assert_eq!(pieces.len(), 4);
        assert_eq!(pieces.concat(), text);
        for pair in pieces.windows(2) {
            let (before, after) = (pair[0].as_bytes(), pair[1].as_bytes());
            assert!(before.last().unwrap().is_ascii_alphabetic(), "{:?}", &pair[0][pair[0].len() - 8..]);
            assert!(after[0] == b' ' && after[1].is_ascii_alphabetic(), "{:?}", &pair[1][..8]);
        }
        assert!(pieces.iter().all(|p| p.len() >= MIN_PART_BYTES));
    }

    #[test]
    fn text_with_no_place_to_cut_stays_whole() {
        let digits = "1 2 3 ".repeat(40_000);
        assert_eq!(Spread(()).cut(&digits, 4), vec![digits.as_str()]);
        let short = words(100);
        assert_eq!(Spread(()).cut(&short, 4), vec![short.as_str()]);
    }

    #[test]
    fn runs_are_consecutive_and_cover_every_part() {
        let parts: Vec<(usize, &str)> = ["aaaa", "bb", "cccccc", "d", "ee"].iter().copied().enumerate().collect();
        let runs = deal(&parts, 5, 3);
        assert_eq!(runs.len(), 3);
        assert_eq!(runs.concat(), parts);
        assert_eq!(deal(&parts, 100, 3), vec![&parts[..]]);
    }

    #[test]
    fn pieces_come_back_in_order_with_their_own_ids() {
        let text = words(60_000);
        let pieces = [text.as_str(), "short", text.as_str()];
        // Each byte's value stands for its id: any reordering or loss would show.
        let encode = |p: &str| Ok::<_, ()>(p.bytes().map(u32::from).collect());
        let spread = encode_pieces(&pieces, 4, Some(Spread(())), encode).unwrap();
        let serial = encode_pieces(&pieces, 1, None, encode).unwrap();
        assert_eq!(spread, serial);
        let failing = |p: &str| if p.len() > 10 { Err(p.len()) } else { Ok(vec![]) };
        assert!(encode_pieces(&pieces, 4, Some(Spread(())), failing).is_err());
    }
}
