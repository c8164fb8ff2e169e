//! Deterministic prompt material for tests and the demo.

/// A deterministic pseudo-document of `words` words (about one token each with Qwen3):
/// different seeds give different texts from the first word on.
pub fn document(seed: u32, words: usize) -> String {
    const VOCAB: [&str; 12] = [
        "kernel", "router", "cache", "block", "prefix", "tensor", "replica", "envoy", "token", "latency", "decode",
        "prefill",
    ];
    let mut out = format!("Document {seed}:");
    for i in 0..words {
        out.push(' ');
        out.push_str(VOCAB[(i * 7 + seed as usize * 13 + i / 5) % VOCAB.len()]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_are_deterministic_and_distinct() {
        assert_eq!(document(1, 50), document(1, 50));
        assert_ne!(document(1, 50)[..12], document(2, 50)[..12]);
        assert_eq!(document(3, 10).split(' ').count(), 12);
    }
}
