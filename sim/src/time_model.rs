//! How long one engine step takes.
//!
//! A step runs one forward pass over a batch that mixes prefill chunks and decodes (vLLM v1's
//! continuous batching with chunked prefill). Its duration is linear in what it does:
//!
//! ```text
//! step = c0                                  fixed cost: weights read once, launch overhead
//!      + c_prefill · prefill_tokens          the GEMMs, per prompt token computed
//!      + c_attn    · Σ prefill_tokens·context  prefill attention, quadratic in the prompt
//!      + c_decode  · decode_seqs             per-sequence decode overhead
//!      + c_kv      · kv_tokens_read          decode attention reads every context token's KV
//!      + c_load    · cpu_blocks_loaded       CPU-tier hits copied back to the GPU
//! ```
//!
//! Presets are calibrated against published vLLM numbers; see the sim's README for the
//! sources and [`Preset::targets`] for the numbers each preset must reproduce (a unit test
//! checks them).

use std::fmt;

use clap::ValueEnum;

/// Coefficients of the step-time model, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Fixed cost of a step.
    pub base_us: f64,
    /// Per prompt token computed.
    pub prefill_us_per_token: f64,
    /// Per (prompt token × context token) pair of prefill attention.
    pub attn_us_per_token_pair: f64,
    /// Per decoding sequence.
    pub decode_us_per_seq: f64,
    /// Per context token whose KV a decode reads.
    pub kv_read_us_per_token: f64,
    /// Per block loaded from the CPU tier.
    pub cpu_load_us_per_block: f64,
}

/// What one step does, as the time model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepWork {
    /// Prompt tokens computed (all prefill chunks).
    pub prefill_tokens: u64,
    /// Σ over prefill chunks of chunk tokens × the context they attend to.
    pub attn_pairs: f64,
    /// Sequences decoding one token.
    pub decode_seqs: u64,
    /// Context tokens read by the decodes.
    pub kv_tokens_read: u64,
    /// Blocks loaded from the CPU tier.
    pub cpu_blocks_loaded: u64,
}

impl StepWork {
    /// Adds a prefill chunk of `tokens` tokens after `context` already-computed ones.
    pub fn prefill(&mut self, context: usize, tokens: usize) {
        self.prefill_tokens += tokens as u64;
        // Token i of the chunk attends to context + i + 1 tokens.
        self.attn_pairs += tokens as f64 * (context as f64 + (tokens as f64 + 1.0) / 2.0);
    }

    /// Adds one decoding sequence with `context` tokens of KV.
    pub fn decode(&mut self, context: usize) {
        self.decode_seqs += 1;
        self.kv_tokens_read += context as u64;
    }

    /// Whether the step does anything.
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

impl StepCost {
    /// The step's duration in microseconds.
    pub fn step_us(&self, w: &StepWork) -> f64 {
        self.base_us
            + self.prefill_us_per_token * w.prefill_tokens as f64
            + self.attn_us_per_token_pair * w.attn_pairs
            + self.decode_us_per_seq * w.decode_seqs as f64
            + self.kv_read_us_per_token * w.kv_tokens_read as f64
            + self.cpu_load_us_per_block * w.cpu_blocks_loaded as f64
    }
}

/// Named, calibrated hardware/model pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Fast, round numbers for functional tests: 5 ms steps, 100 µs per prompt token.
    Test,
    /// Llama-3.1-8B (BF16) on one H100 SXM.
    Llama8bH100,
    /// A 32B dense model (Qwen2.5-32B, BF16) on two H100 SXM with tensor parallelism.
    Dense32bH100Tp2,
}

/// A published number a preset must reproduce.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// What is measured.
    pub what: &'static str,
    /// The value (tokens/s or milliseconds, per `what`).
    pub value: f64,
}

impl Preset {
    /// The preset's coefficients.
    pub fn cost(self) -> StepCost {
        match self {
            Preset::Test => StepCost {
                base_us: 5000.0,
                prefill_us_per_token: 100.0,
                attn_us_per_token_pair: 0.0,
                decode_us_per_seq: 0.0,
                kv_read_us_per_token: 0.0,
                cpu_load_us_per_block: 50.0,
            },
            // 16 GB of weights at 3.35 TB/s is 4.8 ms a step; 2·8e9 FLOP per prompt token at
            // ~45 % of 989 TFLOP/s dense BF16; 128 KiB of KV per token (32 layers × 8 KV heads
            // × 128 × 2 × 2 B) read at ~3 TB/s; attention 4·32·4096 FLOP per token pair.
            Preset::Llama8bH100 => StepCost {
                base_us: 6200.0,
                prefill_us_per_token: 48.0,
                attn_us_per_token_pair: 0.0013,
                decode_us_per_seq: 60.0,
                kv_read_us_per_token: 0.043,
                cpu_load_us_per_block: 25.0,
            },
            // 64 GB of weights over two GPUs plus all-reduces; 2·32e9 FLOP per prompt token on
            // two GPUs; 256 KiB of KV per token (64 layers × 8 × 128 × 2 × 2 B) split in two.
            Preset::Dense32bH100Tp2 => StepCost {
                base_us: 13000.0,
                prefill_us_per_token: 95.0,
                attn_us_per_token_pair: 0.0017,
                decode_us_per_seq: 110.0,
                kv_read_us_per_token: 0.043,
                cpu_load_us_per_block: 25.0,
            },
        }
    }

    /// KV bytes per token of the preset's model (all layers, K and V, BF16), if it has one:
    /// what a prefill/decode transfer moves.
    pub fn kv_bytes_per_token(self) -> Option<u64> {
        match self {
            Preset::Test => None,
            // 32 layers × 8 KV heads × 128 × (K, V) × 2 B.
            Preset::Llama8bH100 => Some(32 * 8 * 128 * 2 * 2),
            // 64 layers × 8 KV heads × 128 × (K, V) × 2 B, both TP ranks together.
            Preset::Dense32bH100Tp2 => Some(64 * 8 * 128 * 2 * 2),
        }
    }

    /// The published numbers the preset is calibrated to (sources in the sim's README):
    /// prefill throughput for one 2048-token prompt, and decode inter-token latency at batch 1
    /// and batch 64 with 1024 tokens of context each.
    pub fn targets(self) -> [Target; 3] {
        let (prefill, itl1, itl64) = match self {
            Preset::Test => (9760.0, 5.0, 5.0),
            Preset::Llama8bH100 => (19000.0, 6.3, 13.0),
            Preset::Dense32bH100Tp2 => (9600.0, 13.1, 23.0),
        };
        [
            Target { what: "prefill tokens/s, one 2048-token prompt", value: prefill },
            Target { what: "decode ITL ms, batch 1, 1024-token context", value: itl1 },
            Target { what: "decode ITL ms, batch 64, 1024-token context", value: itl64 },
        ]
    }
}

/// Every preset with its coefficients and calibration targets (`kvgate-sim --list-presets`).
pub fn describe_presets() -> String {
    let mut out = String::new();
    for preset in Preset::value_variants() {
        let c = preset.cost();
        out += &format!(
            "{preset}\n  base {} µs, prefill {} µs/token, attention {} µs/token², decode {} µs/seq, KV read {} µs/token, CPU load {} µs/block\n",
            c.base_us, c.prefill_us_per_token, c.attn_us_per_token_pair, c.decode_us_per_seq, c.kv_read_us_per_token, c.cpu_load_us_per_block
        );
        for t in preset.targets() {
            out += &format!("  target: {} = {}\n", t.what, t.value);
        }
    }
    out
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Preset::Test => "test",
            Preset::Llama8bH100 => "llama8b-h100",
            Preset::Dense32bH100Tp2 => "dense32b-h100-tp2",
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the model predicts for each calibration point.
    fn measure(cost: &StepCost) -> [f64; 3] {
        let mut prefill = StepWork::default();
        prefill.prefill(0, 2048);
        let prefill_tps = 2048.0 / (cost.step_us(&prefill) / 1e6);
        let decode = |batch: usize| {
            let mut w = StepWork::default();
            for _ in 0..batch {
                w.decode(1024);
            }
            cost.step_us(&w) / 1000.0
        };
        [prefill_tps, decode(1), decode(64)]
    }

    #[test]
    fn presets_reproduce_their_published_targets_within_10_percent() {
        for preset in [Preset::Test, Preset::Llama8bH100, Preset::Dense32bH100Tp2] {
            let got = measure(&preset.cost());
            for (target, got) in preset.targets().iter().zip(got) {
                let err = (got - target.value).abs() / target.value;
                assert!(err < 0.10, "{preset}: {} = {got:.1}, published {}", target.what, target.value);
            }
        }
    }

    #[test]
    fn prefill_attention_is_quadratic_in_the_chunk_and_linear_in_the_context() {
        let mut a = StepWork::default();
        a.prefill(0, 1);
        assert_eq!(a.attn_pairs, 1.0);
        let mut b = StepWork::default();
        b.prefill(0, 4);
        assert_eq!(b.attn_pairs, 1.0 + 2.0 + 3.0 + 4.0);
        let mut c = StepWork::default();
        c.prefill(100, 4);
        assert_eq!(c.attn_pairs, 400.0 + 10.0);
    }

    #[test]
    fn a_cache_hit_makes_the_prefill_step_shorter() {
        let cost = Preset::Llama8bH100.cost();
        let mut cold = StepWork::default();
        cold.prefill(0, 4096);
        let mut warm = StepWork::default();
        warm.prefill(3584, 512);
        assert!(cost.step_us(&warm) * 4.0 < cost.step_us(&cold));
    }
}
