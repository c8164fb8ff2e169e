//! The tokenizer kvgate runs (`tokenizers` 1.0, SIMD pre-tokenizer) gives exactly the ids of
//! `tokenizers` 0.22 (the library vLLM's Python stack wraps, kept here as `tokenizers-legacy`)
//! for every tokenizer the repo ships or tests against (`models/` and
//! `../shared/testdata/tokenizers/`):
//!
//! - on every reference text in the repo (the Qwen3 samples, the rendered parity chats);
//! - on a fixed corpus of adversarial text, with and without added special tokens;
//! - on random text built from the pieces pre-tokenizers split on (proptest).
//!
//! Each tokenizer is loaded the way kvgate loads it: `ModelBundle::from_dir` (which rewrites
//! the file into the canonical form) and `ModelTokenizer::from_bundle`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::spread::{places, Spread, MIN_PART_BYTES};
use kvgate_shared::prompt::tokenizer::{load_tokenizer, ModelTokenizer};
use kvgate_shared::wire::ModelBundle;
use proptest::prelude::*;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// One model's tokenizer, loaded both ways.
struct Pair {
    name: String,
    dir: PathBuf,
    ours: ModelTokenizer,
    legacy: tokenizers_legacy::Tokenizer,
}

impl Pair {
    fn load(dir: &Path) -> Pair {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let bundle = ModelBundle::from_dir(&name, dir, 16).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours = ModelTokenizer::from_bundle(&bundle).unwrap_or_else(|e| panic!("{name}: {e}"));
        let legacy = tokenizers_legacy::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        Pair { name, dir: dir.to_path_buf(), ours, legacy }
    }

    /// `None` if both agree, else where they first differ.
    fn diverges(&self, text: &str, add_special_tokens: bool) -> Option<String> {
        let ours = self.ours.encode(text, add_special_tokens).unwrap();
        let legacy = self.legacy.encode_fast(text, add_special_tokens).unwrap().get_ids().to_vec();
        (ours != legacy).then(|| {
            let i = ours.iter().zip(&legacy).position(|(a, b)| a != b).unwrap_or(ours.len().min(legacy.len()));
            format!(
                "{} (add_special_tokens={add_special_tokens}) on {:?}: at token {i}, ours {:?} vs 0.22 {:?}",
                self.name,
                text.chars().take(80).collect::<String>(),
                &ours[i..(i + 6).min(ours.len())],
                &legacy[i..(i + 6).min(legacy.len())]
            )
        })
    }
}

/// Every tokenizer: the shipped one and the families in the shared test data.
fn pairs() -> &'static [Pair] {
    static PAIRS: OnceLock<Vec<Pair>> = OnceLock::new();
    PAIRS.get_or_init(|| {
        let mut dirs = vec![repo().join("models/qwen3-0.6b")];
        let testdata = repo().join("../shared/testdata/tokenizers");
        let mut more: Vec<PathBuf> = std::fs::read_dir(&testdata)
            .unwrap_or_else(|e| panic!("{}: {e}", testdata.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|dir| dir.join("tokenizer.json").exists())
            .collect();
        more.sort();
        dirs.extend(more);
        std::thread::scope(|s| {
            let loading: Vec<_> = dirs.iter().map(|dir| s.spawn(|| Pair::load(dir))).collect();
            loading.into_iter().map(|h| h.join().unwrap()).collect()
        })
    })
}

fn check_all(texts: impl IntoIterator<Item = String>) {
    let texts: Vec<String> = texts.into_iter().collect();
    let failures: Vec<String> = pairs()
        .iter()
        .flat_map(|pair| {
            texts.iter().flat_map(move |t| [false, true].into_iter().filter_map(move |add| pair.diverges(t, add)))
        })
        .collect();
    assert!(failures.is_empty(), "{} divergences:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_family_is_tested() {
    let names: Vec<&str> = pairs().iter().map(|p| p.name.as_str()).collect();
    for family in ["qwen3", "llama-3.2", "gpt-oss", "deepseek-v3", "gemma-3", "mistral-nemo", "phi-3.5"] {
        assert!(names.iter().any(|n| n.starts_with(family)), "{family} missing from {names:?}");
    }
}

#[test]
fn reference_texts_match() {
    let mut texts = Vec::new();
    let qwen: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("../shared/testdata/tokenizers/qwen3-0.6b/reference.json")).unwrap(),
    )
    .unwrap();
    for sample in qwen["samples"].as_object().unwrap().values() {
        texts.push(sample["text"].as_str().unwrap().to_owned());
    }
    for file in ["qwen3-chat.json", "openai-format-chat.json"] {
        let parity: Value =
            serde_json::from_str(&std::fs::read_to_string(repo().join("testdata/parity").join(file)).unwrap()).unwrap();
        for case in parity["cases"].as_array().unwrap() {
            texts.push(case["rendered"].as_str().unwrap().to_owned());
        }
    }
    assert!(texts.len() > 20, "only {} reference texts", texts.len());
    check_all(texts);
}

/// Literal text of every family's special tokens, so each tokenizer meets its own and others'.
const SPECIALS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|start|>",
    "<|message|>",
    "<|channel|>",
    "<|end|>",
    "<|return|>",
    "<｜begin▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "[INST]",
    "[/INST]",
    "</s>",
    "<s>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
];

/// The pieces adversarial text is made of: what pre-tokenizer patterns treat specially.
const PIECES: &[&str] = &[
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    " it's",
    "don't",
    "I'M",
    "0",
    "7",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "3.14",
    "1,000",
    "٣٤٥",
    "१२३",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    " \n ",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "a",
    "Hello",
    " world",
    "WORLD",
    "_",
    "__init__",
    "-",
    "--",
    "...",
    "!?",
    "“quoted”",
    "(x)",
    "e\u{301}",
    "é",
    "Å",
    "ﬁ",
    "Ｋ",
    "ǅ",
    "ß",
    "İ",
    "中文",
    "日本語の",
    "한국어",
    "ไทย",
    "עברית",
    "العربية",
    "Ελληνικά",
    "русский",
    "😀",
    "👍🏽",
    "🇺🇸",
    "👨\u{200d}👩\u{200d}👧",
    "\u{fe0f}",
    "\u{200b}",
    "\u{feff}",
    "\u{fffd}",
    "\u{0}",
    "\u{1b}[0m",
    "\u{7f}",
    "\u{10ffff}",
    "aGVsbG8gd29ybGQ=",
    "iVBORw0KGgoAAAANSUhEUgAA",
    "https://example.com/a?b=c&d=e",
    "fn main() {\n    println!(\"hi\");\n}",
    "<div class=\"x\">",
    "▁",
    "▁▁word",
    "Ġ",
    "Ċ",
];

#[test]
fn adversarial_corpus_matches() {
    let mut texts: Vec<String> = PIECES.iter().chain(SPECIALS).map(|p| p.to_string()).collect();
    texts.extend([
        "x".repeat(10_000),
        "ab".repeat(3_000),
        "9".repeat(2_000),
        " ".repeat(1_000),
        "\n".repeat(500) + "end",
        "word ".repeat(2_000) + "   ",
        "aGVsbG8gd29ybGQ=".repeat(500),
        "😀".repeat(300),
        "trailing spaces   \n   \n".into(),
        "   leading spaces".into(),
        SPECIALS.join(""),
        SPECIALS.join(" "),
        SPECIALS.join("\n text "),
        PIECES.join(""),
        PIECES.join(" "),
        std::fs::read_to_string(repo().join("README.md")).unwrap(),
    ]);
    check_all(texts);
}

/// The segment cache (pieces cut before each special token, encoded apart) gives the ids of
/// one whole encode for every family it accepts, and refuses the others.
#[test]
fn the_segment_cache_is_exact_where_it_is_on() {
    use kvgate_shared::prompt::segments::SegmentCache;
    use tokenizers::pipeline::{EncodeOptions, PipelineToken};
    let mut failures = Vec::new();
    let mut cached = Vec::new();
    for pair in pairs() {
        let tokenizer = load_tokenizer(&std::fs::read_to_string(pair.dir.join("tokenizer.json")).unwrap()).unwrap();
        let Some(cache) = SegmentCache::for_tokenizer(&tokenizer, 1 << 20) else { continue };
        cached.push(pair.name.clone());
        let encode = |text: &str| -> Result<Vec<u32>, String> {
            let mut out: Vec<PipelineToken> = Vec::new();
            tokenizer.encode_into(text, &EncodeOptions::no_specials(), &mut out).map_err(|e| e.to_string())?;
            Ok(PipelineToken::cast_slice(&out).to_vec())
        };
        let turns = |sep: &str| {
            (0..4)
                .map(|i| format!("{sep}turn {i}: 'tis   a  test\n\n {}", PIECES[i * 7 % PIECES.len()]))
                .collect::<String>()
        };
        for text in SPECIALS.iter().map(|s| turns(s)).chain([SPECIALS.join("x y "), turns("")]) {
            let whole = encode(&text).unwrap();
            for round in ["first", "again"] {
                let pieces = cache.encode(&text, |pieces| pieces.iter().map(|p| encode(p)).collect()).unwrap();
                if pieces != whole {
                    failures.push(format!("{} ({round}) on {:?}", pair.name, &text[..text.len().min(60)]));
                }
            }
        }
    }
    assert!(cached.iter().any(|n| n.starts_with("qwen3")), "the cache is on for Qwen3: {cached:?}");
    assert!(failures.is_empty(), "segment cache diverges:\n{}", failures.join("\n"));
}

/// The raw tokenizer of each family and its name, loaded as the segment test does.
fn raw_tokenizers() -> &'static [(String, tokenizers::pipeline::PipelineTokenizer)] {
    static RAW: OnceLock<Vec<(String, tokenizers::pipeline::PipelineTokenizer)>> = OnceLock::new();
    RAW.get_or_init(|| {
        pairs()
            .iter()
            .map(|pair| {
                let json = std::fs::read_to_string(pair.dir.join("tokenizer.json")).unwrap();
                (pair.name.clone(), load_tokenizer(&json).unwrap())
            })
            .collect()
    })
}

/// Where whole and cut encodes of `text` differ: at every `step`-th place [`places`] allows.
fn spread_divergences(
    name: &str,
    tokenizer: &tokenizers::pipeline::PipelineTokenizer,
    text: &str,
    step: usize,
) -> Vec<String> {
    use tokenizers::pipeline::{EncodeOptions, PipelineToken};
    let encode = |text: &str| {
        let mut out: Vec<PipelineToken> = Vec::new();
        tokenizer.encode_into(text, &EncodeOptions::no_specials(), &mut out).unwrap();
        PipelineToken::cast_slice(&out).to_vec()
    };
    let whole = encode(text);
    places(text)
        .step_by(step)
        .filter(|&at| [encode(&text[..at]), encode(&text[at..])].concat() != whole)
        .map(|at| format!("{name}: cut at {at} of {:?}", &text[at.saturating_sub(20)..(at + 20).min(text.len())]))
        .collect()
}

/// A prompt spread over threads (cut between a letter and a spaced letter, the parts encoded
/// apart) gives the ids of one whole encode, at every place the rule may cut, for every family
/// the rule admits; it refuses the families it has no proof for (a replacing or prepending
/// normalizer, whitespace-stripping added tokens).
#[test]
fn spread_cuts_are_exact_where_admitted() {
    let texts: Vec<String> = vec![
        PIECES.join(" "),
        PIECES.join(" a "),
        SPECIALS.join("x y "),
        SPECIALS.join(" word "),
        PIECES.iter().map(|p| format!("word{p} w{p}x y")).collect(),
        PIECES.iter().map(|p| format!("{p}a b{p}")).collect(),
    ];
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let mut admitted = Vec::new();
    let mut failures = Vec::new();
    for (name, tokenizer) in raw_tokenizers() {
        if Spread::for_tokenizer(tokenizer).is_none() {
            continue;
        }
        admitted.push(name.as_str());
        for text in &texts {
            failures.extend(spread_divergences(name, tokenizer, text, 1));
        }
        failures.extend(spread_divergences(name, tokenizer, &readme, 29));
    }
    assert!(failures.is_empty(), "{} cuts diverge:\n{}", failures.len(), failures.join("\n"));
    for family in ["qwen3", "llama-3.2", "mistral-nemo", "gpt-oss", "deepseek-v3"] {
        assert!(admitted.iter().any(|n| n.starts_with(family)), "{family} not admitted: {admitted:?}");
    }
    for family in ["gemma-3", "phi-3.5"] {
        assert!(!admitted.iter().any(|n| n.starts_with(family)), "{family} admitted: {admitted:?}");
    }
}

/// Through the whole pipeline: a long chat tokenized on four threads is the chat tokenized on
/// one, for each family that renders chats with a template and spreads.
#[test]
fn a_long_chat_spread_over_threads_has_the_ids_of_one_thread() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let document: String = readme.split_whitespace().cycle().take(60_000).collect::<Vec<_>>().join(" ");
    assert!(document.len() > 4 * MIN_PART_BYTES, "long enough to spread: {} bytes", document.len());
    let body = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": document},
        {"role": "user", "content": format!("{document} and again")},
    ]})
    .to_string();
    let request = parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
    let mut spread = Vec::new();
    for pair in pairs().iter().filter(|p| p.ours.spreads()) {
        let Ok(one) = pair.ours.prompt_tokens(&request) else { continue };
        assert_eq!(pair.ours.prompt_tokens_on(&request, 4).unwrap(), one, "{}", pair.name);
        spread.push(pair.name.as_str());
    }
    assert!(spread.iter().any(|n| n.starts_with("qwen3")), "{spread:?}");
    assert!(spread.iter().any(|n| n.starts_with("llama-3.2")), "{spread:?}");
}

/// Combining marks whose canonical combining class is newer than the Unicode tables of
/// `tokenizers` 0.22/0.23 (what vLLM's Python stack runs): next to another combining mark,
/// 1.0's NFC reorders them as current Unicode says and 0.22 does not, so Qwen3 (the NFC
/// normalizer among these tokenizers) tokenizes them differently. The complete list, from
/// [`scan_every_code_point_for_divergence`] over every tokenizer here: these 154, all for Qwen3.
/// Known and not handled: a prompt with such a mark beside another mark hashes differently
/// from that point on, so kvgate credits only the blocks before it. The random text leaves them
/// out so the test checks everything else.
const NEWER_COMBINING_MARKS: [u32; 154] = [
    0x7fd, 0x897, 0x898, 0x899, 0x89a, 0x89b, 0x89c, 0x89d, 0x89e, 0x89f, 0x8ca, 0x8cb, 0x8cc, 0x8cd, 0x8ce, 0x8cf,
    0x8d0, 0x8d1, 0x8d2, 0x8d3, 0x9fe, 0xc3c, 0xd3b, 0xd3c, 0xeba, 0x1715, 0x1abf, 0x1ac0, 0x1ac1, 0x1ac2, 0x1ac3,
    0x1ac4, 0x1ac5, 0x1ac6, 0x1ac7, 0x1ac8, 0x1ac9, 0x1aca, 0x1acb, 0x1acc, 0x1acd, 0x1ace, 0x1acf, 0x1ad0, 0x1ad1,
    0x1ad2, 0x1ad3, 0x1ad4, 0x1ad5, 0x1ad6, 0x1ad7, 0x1ad8, 0x1ad9, 0x1ada, 0x1adb, 0x1adc, 0x1add, 0x1ae0, 0x1ae1,
    0x1ae2, 0x1ae3, 0x1ae4, 0x1ae5, 0x1ae6, 0x1ae7, 0x1ae8, 0x1ae9, 0x1aea, 0x1aeb, 0x1df6, 0x1df7, 0x1df8, 0x1df9,
    0x1dfa, 0xa82c, 0x10d24, 0x10d25, 0x10d26, 0x10d27, 0x10d69, 0x10d6a, 0x10d6b, 0x10d6c, 0x10d6d, 0x10eab, 0x10eac,
    0x10efa, 0x10efb, 0x10efd, 0x10efe, 0x10eff, 0x10f46, 0x10f47, 0x10f48, 0x10f49, 0x10f4a, 0x10f4b, 0x10f4c,
    0x10f4d, 0x10f4e, 0x10f4f, 0x10f50, 0x10f82, 0x10f83, 0x10f84, 0x10f85, 0x11070, 0x1133b, 0x113ce, 0x113cf,
    0x113d0, 0x1145e, 0x11839, 0x1183a, 0x1193d, 0x1193e, 0x11943, 0x119e0, 0x11a34, 0x11a47, 0x11a99, 0x11d42,
    0x11d44, 0x11d45, 0x11d97, 0x11f41, 0x11f42, 0x1612f, 0x16ff0, 0x16ff1, 0x1e08f, 0x1e130, 0x1e131, 0x1e132,
    0x1e133, 0x1e134, 0x1e135, 0x1e136, 0x1e2ae, 0x1e2ec, 0x1e2ed, 0x1e2ee, 0x1e2ef, 0x1e4ec, 0x1e4ed, 0x1e4ee,
    0x1e4ef, 0x1e5ee, 0x1e5ef, 0x1e6e3, 0x1e6e6, 0x1e6ee, 0x1e6ef, 0x1e6f5,
];

#[test]
fn newer_combining_marks_are_the_known_divergence() {
    let qwen = pairs().iter().find(|p| p.name == "qwen3-0.6b").unwrap();
    for cp in [0x16ff0, 0x1df6] {
        let c = char::from_u32(cp).unwrap();
        let diverges = [format!("\u{300}{c}"), format!("{c}\u{300}")].iter().any(|t| qwen.diverges(t, false).is_some());
        assert!(diverges, "U+{cp:04X}: fixed upstream? drop it from the list");
    }
    assert!(qwen.diverges("\u{a4d}\u{300}", false).is_none(), "older marks agree");
}

/// Marks of every canonical combining class that occurs in the tables; a code point whose class
/// differs between the two libraries reorders differently beside at least one of them.
const PROBE_MARKS: [char; 9] =
    ['\u{334}', '\u{93c}', '\u{5b0}', '\u{5bc}', '\u{316}', '\u{300}', '\u{35c}', '\u{35d}', '\u{345}'];

/// Regenerates [`NEWER_COMBINING_MARKS`]: every code point that, alone or on either side of a
/// probe mark, tokenizes differently under 1.0 and 0.22, for any tokenizer here. Slow (every
/// code point); run it when either library moves:
/// `cargo test --release -p kvgate-shared --test tokenizer_parity -- --ignored --nocapture scan`.
#[test]
#[ignore = "scans every code point; run by hand when a tokenizer library moves"]
fn scan_every_code_point_for_divergence() {
    let mut found: Vec<u32> = std::thread::scope(|s| {
        let scans: Vec<_> = pairs()
            .iter()
            .map(|pair| {
                s.spawn(move || {
                    (0..=0x10ffff_u32)
                        .filter_map(char::from_u32)
                        .filter(|c| {
                            let alone = std::iter::once(c.to_string());
                            let beside = PROBE_MARKS.iter().flat_map(|m| [format!("{c}{m}"), format!("{m}{c}")]);
                            alone.chain(beside).any(|t| pair.diverges(&t, false).is_some())
                        })
                        .map(u32::from)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        scans.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    found.sort_unstable();
    found.dedup();
    let listed: Vec<u32> = NEWER_COMBINING_MARKS.to_vec();
    let hex: Vec<String> = found.iter().map(|cp| format!("{cp:#x}")).collect();
    println!("{} code points diverge: {}", found.len(), hex.join(", "));
    assert_eq!(found, listed, "NEWER_COMBINING_MARKS is out of date: paste the list above");
}

fn adversarial_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        6 => proptest::sample::select(PIECES).prop_map(str::to_owned),
        1 => proptest::sample::select(SPECIALS).prop_map(str::to_owned),
        2 => "\\PC{1,12}",
        1 => "[ \t\r\n]{1,6}",
        1 => "[0-9]{1,9}",
    ];
    proptest::collection::vec(piece, 1..40).prop_map(|pieces| {
        pieces.concat().chars().filter(|c| !NEWER_COMBINING_MARKS.contains(&u32::from(*c))).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7370_7265_6164),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_text_cut_for_spreading_matches(text in adversarial_text()) {
        for (name, tokenizer) in raw_tokenizers().iter().filter(|(_, t)| Spread::for_tokenizer(t).is_some()) {
            let failures = spread_divergences(name, tokenizer, &text, 1);
            prop_assert!(failures.is_empty(), "{}", failures.join("\n"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 192,
        failure_persistence: None,
        // One fixed stream of cases, so CI is the same on every run; change the seed to explore.
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b76_6761_7465),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_adversarial_text_matches(text in adversarial_text()) {
        for pair in pairs() {
            for add in [false, true] {
                let divergence = pair.diverges(&text, add);
                prop_assert!(divergence.is_none(), "{}", divergence.unwrap_or_default());
            }
        }
    }
}
