//! Operator tools that run the same code as the product:
//!
//! - `kvgate-sidecar events decode` / `events tap`: the sidecar's KV-event decoder. Output is
//!   one JSON object per line, with vLLM's field names (`seq`, `ts`, `dp_rank`,
//!   `events[].type`, `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`,
//!   `medium`, `lora_name`, `group_idx`, …).
//! - `kvgate-sidecar tokenize`: the filter's request → tokens → block hashes pipeline.
//! - `kvgate-sidecar fetch-tokenizer`: a model's tokenizer files from the Hugging Face Hub
//!   ([`hub`]).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};

use kvgate_shared::hash::{prompt_block_hashes, prompt_digest, Salt};
use kvgate_shared::prompt::content_format::ContentFormat;
use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;

pub mod hub;

use crate::events::decode::decode_batch;
use crate::events::transport::replay;

/// One decoded payload as a JSON line.
fn batch_json(payload: &[u8]) -> Value {
    match decode_batch(payload) {
        Ok(b) => json!({"ts": b.ts, "dp_rank": b.data_parallel_rank, "events": b.events}),
        Err(e) => json!({"error": e.to_string(), "bytes": payload.len()}),
    }
}

/// Decodes msgpack payload files (one payload per file), printing one JSON line each.
/// Undecodable files print an `error` line; the exit status is non-zero if any failed.
pub fn decode_files(files: &[PathBuf], out: &mut dyn Write) -> anyhow::Result<bool> {
    let mut all_ok = true;
    for file in files {
        let payload = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        let mut line = batch_json(&payload);
        all_ok &= line.get("error").is_none();
        line["file"] = json!(file.display().to_string());
        writeln!(out, "{line}")?;
    }
    Ok(all_ok)
}

/// Subscribes to a publisher and prints every batch; flags gaps, and replays them when a
/// replay endpoint is given. Stops after `count` messages if set.
pub fn tap(
    endpoint: &str,
    replay_endpoint: Option<&str>,
    topic: &str,
    count: Option<u64>,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_subscribe(topic.as_bytes())?;
    sub.set_rcvtimeo(Duration::from_secs(1).as_millis() as i32)?;
    sub.connect(endpoint).with_context(|| format!("connecting to {endpoint}"))?;
    let mut last: Option<u64> = None;
    let mut seen = 0u64;
    while count.is_none_or(|c| seen < c) {
        let frames = match sub.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => return Err(e.into()),
        };
        seen += 1;
        let [topic, seq, payload] =
            <[Vec<u8>; 3]>::try_from(frames).map_err(|f| anyhow::anyhow!("message with {} frames", f.len()))?;
        let seq = <[u8; 8]>::try_from(seq.as_slice())
            .map(u64::from_be_bytes)
            .map_err(|_| anyhow::anyhow!("seq frame is not 8 bytes"))?;
        if let Some(l) = last {
            if seq <= l {
                writeln!(out, "{}", json!({"restart": {"last_seq": l, "seq": seq}}))?;
            } else if seq > l + 1 {
                let mut note = json!({"gap": {"from": l + 1, "to": seq - 1}});
                if let Some(r) = replay_endpoint {
                    match replay(&ctx, r, l + 1) {
                        Ok(messages) => {
                            note["gap"]["replayed"] = json!(messages.iter().filter(|(s, _)| *s < seq).count());
                            writeln!(out, "{note}")?;
                            for (s, p) in messages.into_iter().filter(|(s, _)| *s < seq) {
                                let mut line = batch_json(&p);
                                line["seq"] = json!(s);
                                line["replayed"] = json!(true);
                                writeln!(out, "{line}")?;
                            }
                            note = Value::Null;
                        }
                        Err(e) => note["gap"]["replay_error"] = json!(e.to_string()),
                    }
                }
                if !note.is_null() {
                    writeln!(out, "{note}")?;
                }
            }
        }
        last = Some(seq);
        let mut line = batch_json(&payload);
        line["seq"] = json!(seq);
        line["topic"] = json!(String::from_utf8_lossy(&topic));
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(())
}

/// Tokenizes an OpenAI request body exactly as the filter does and returns
/// `{"num_tokens", "token_ids", "block_hashes", "digest"}` (block hashes as decimal strings:
/// u64 values exceed JSON's safe integers; `digest` is the filter's `x-kvgate-prompt-digest`
/// for the same request, in hex).
pub fn tokenize(
    model_dir: &std::path::Path,
    block_size: u32,
    content_format: ContentFormat,
    endpoint: Endpoint,
    body: &[u8],
) -> anyhow::Result<Value> {
    anyhow::ensure!(block_size > 0, "block size must be positive");
    let mut bundle = ModelBundle::from_dir("cli", model_dir, block_size)?;
    bundle.content_format = content_format;
    let tokenizer = ModelTokenizer::from_bundle(&bundle)?;
    let request = parse(endpoint, body)?;
    let ids = tokenizer.prompt_tokens(&request)?;
    let hashes: Vec<String> =
        prompt_block_hashes(&ids, block_size as usize, Salt::NONE).iter().map(|h| h.0.to_string()).collect();
    let digest = format!("{:016x}", prompt_digest(&ids));
    Ok(json!({"num_tokens": ids.len(), "token_ids": ids, "block_hashes": hashes, "digest": digest}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_matches_the_shared_pipeline() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
        let body = br#"{"model":"x","messages":[{"role":"user","content":"hello there, how are you doing today?"}]}"#;
        let out = tokenize(&dir, 4, ContentFormat::Auto, Endpoint::ChatCompletions, body).unwrap();
        let n = out["num_tokens"].as_u64().unwrap() as usize;
        assert_eq!(out["token_ids"].as_array().unwrap().len(), n);
        assert_eq!(out["token_ids"][0], 151644, "<|im_start|> opens the Qwen3 chat");
        assert_eq!(out["block_hashes"].as_array().unwrap().len(), n / 4);
        assert!(tokenize(&dir, 4, ContentFormat::Auto, Endpoint::Completions, b"{bad").is_err());
    }

    #[test]
    fn decode_files_prints_json_lines_and_flags_bad_files() {
        let dir = std::env::temp_dir().join(format!("kvgate-decode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.bin");
        // [1.0, [{"type": "AllBlocksCleared"}], 0]
        std::fs::write(&good, b"\x93\xcb\x3f\xf0\0\0\0\0\0\0\x91\x81\xa4type\xb0AllBlocksCleared\x00").unwrap();
        let bad = dir.join("bad.bin");
        std::fs::write(&bad, b"\xc1").unwrap();
        let mut out = Vec::new();
        let ok = decode_files(&[good, bad], &mut out).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!ok);
        let lines: Vec<Value> =
            String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines[0]["events"][0]["type"], "AllBlocksCleared");
        assert_eq!(lines[0]["dp_rank"], 0);
        assert!(lines[1]["error"].is_string());
    }
}
