//! The cache-hit ceiling of a run: the hit ratio a single infinite prefix cache shared by the
//! whole fleet would give the same prompts, sent in the same order. No placement does better:
//! every engine's cache is a subset of it. Counted as vLLM counts hits — whole blocks of the
//! prompt's leading run found, never its last token — on the prompts the harness rendered and
//! tokenized with the engines' own pipeline (kvgate's, which the simulator uses too). An
//! engine also keeps the blocks of what it generated, which the next turn's prompt repeats:
//! each answer's text, tokenized, is stored after its prompt.

use std::collections::HashSet;
use std::path::Path;

use kvgate_shared::hash::{prompt_block_hashes, Salt, SequenceHash};
use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;

use super::loadgen::Outcome;

/// A request served, as the engines saw it: the run's outcomes tokenized once, for the
/// ceiling here and the replayed placements ([`super::oracle`]).
#[derive(Debug, Clone)]
pub struct Served {
    /// Sent at, simulated seconds from the start of the run.
    pub at_s: f64,
    /// The replica that served it.
    pub replica: String,
    /// Its prompt's token ids, rendered and tokenized with the engines' own pipeline.
    pub prompt: Vec<u32>,
    /// Its answer's token ids: the text tokenized, as many as the engine generated.
    pub answer: Vec<u32>,
    /// Prompt tokens the ceiling's infinite cache held when it was sent.
    pub best_cached: usize,
}

/// The outcomes served that kept their body ([`Outcome::body`]), tokenized, in the order they
/// were sent.
pub fn served(model_dir: &Path, block_size: u32, outcomes: &[Outcome]) -> anyhow::Result<Vec<Served>> {
    let mut sent: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok() && o.body.is_some()).collect();
    if sent.is_empty() {
        return Ok(Vec::new());
    }
    sent.sort_by(|a, b| a.sent_at.total_cmp(&b.sent_at));
    let bundle = ModelBundle::from_dir("ceiling", model_dir, block_size)?;
    let tokenizer = ModelTokenizer::from_bundle(&bundle)?;
    let mut cache = Cache { seen: HashSet::new(), block_size: block_size as usize };
    let mut out = Vec::with_capacity(sent.len());
    for o in sent {
        let (path, body) = o.body.as_ref().expect("filtered");
        let endpoint =
            Endpoint::from_path(path).ok_or_else(|| anyhow::anyhow!("{path} is not an endpoint kvgate routes"))?;
        let prompt = tokenizer.prompt_tokens(&parse(endpoint, &serde_json::to_vec(body)?)?)?;
        let mut answer = tokenizer.encode(&o.text, false)?;
        // The engine generated `output_tokens`; its text may tokenize to a few more or fewer.
        answer.resize(o.output_tokens.max(1) as usize, answer.last().copied().unwrap_or(0));
        let best_cached = cache.lookup_then_store(&prompt);
        cache.store(&[prompt.as_slice(), answer.as_slice()].concat());
        out.push(Served { at_s: o.sent_at, replica: o.replica.clone(), prompt, answer, best_cached });
    }
    Ok(out)
}

/// The ceiling over `served`; `None` if it is empty.
pub fn infinite_cache_hit_ratio(served: &[Served]) -> Option<f64> {
    let prompt: usize = served.iter().map(|s| s.prompt.len()).sum();
    (prompt > 0).then(|| served.iter().map(|s| s.best_cached).sum::<usize>() as f64 / prompt as f64)
}

/// Every block any prompt stored.
struct Cache {
    seen: HashSet<SequenceHash>,
    block_size: usize,
}

impl Cache {
    /// Tokens of `ids` found cached (vLLM's count: whole leading blocks, and at most all but
    /// the last token), then stores its blocks.
    fn lookup_then_store(&mut self, ids: &[u32]) -> usize {
        let hashes = prompt_block_hashes(ids, self.block_size, Salt::NONE);
        let found = hashes.iter().take_while(|h| self.seen.contains(h)).count();
        let most = ids.len().saturating_sub(1) / self.block_size;
        self.seen.extend(hashes);
        found.min(most) * self.block_size
    }

    /// Stores the blocks of a sequence (a prompt and its answer).
    fn store(&mut self, ids: &[u32]) {
        self.seen.extend(prompt_block_hashes(ids, self.block_size, Salt::NONE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_finds_the_leading_blocks_any_earlier_prompt_stored() {
        let mut c = Cache { seen: HashSet::new(), block_size: 4 };
        let first: Vec<u32> = (0..10).collect();
        assert_eq!(c.lookup_then_store(&first), 0);
        let longer: Vec<u32> = (0..20).collect();
        assert_eq!(c.lookup_then_store(&longer), 8, "two whole blocks of the first");
        assert_eq!(c.lookup_then_store(&longer[..16]), 12, "never the last token: 3 of 4 blocks");
        let other: Vec<u32> = (100..120).collect();
        assert_eq!(c.lookup_then_store(&other), 0);
    }
}
