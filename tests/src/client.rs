//! HTTP helpers for talking to the gateway and the engines like an OpenAI client would.

use std::io::Read;
use std::time::{Duration, Instant};

use reqwest::blocking::Client;
use serde_json::Value;

/// A blocking client with a generous timeout.
pub fn client() -> Client {
    Client::builder().timeout(Duration::from_secs(60)).build().expect("a TLS-less reqwest client always builds")
}

/// A complete (non-streaming) reply.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Response headers, lowercase names.
    pub headers: reqwest::header::HeaderMap,
    /// The body.
    pub body: String,
}

impl Reply {
    /// A header's value, or "".
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    /// The body as JSON (Null if it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// POSTs raw bytes with extra headers.
pub fn post(url: &str, body: impl Into<reqwest::blocking::Body>, headers: &[(&str, &str)]) -> anyhow::Result<Reply> {
    let mut req = client().post(url).header("content-type", "application/json").body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send()?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    Ok(Reply { status, headers, body: resp.text()? })
}

/// A streamed reply, read to the end.
#[derive(Debug)]
pub struct Streamed {
    /// HTTP status.
    pub status: u16,
    /// Response headers.
    pub headers: reqwest::header::HeaderMap,
    /// Time from sending the request to the first content chunk.
    pub ttft: Duration,
    /// The final `usage` object, if the server sent one.
    pub usage: Option<Value>,
}

impl Streamed {
    /// A header's value, or "".
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    /// `usage.prompt_tokens_details.cached_tokens`, or 0.
    pub fn cached_tokens(&self) -> u64 {
        self.usage.as_ref().and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64()).unwrap_or(0)
    }
}

/// Sends a streaming request (`stream` and `stream_options.include_usage` are set) and reads
/// the SSE stream to `[DONE]`, timing the first content chunk.
pub fn stream(url: &str, mut body: Value) -> anyhow::Result<Streamed> {
    body["stream"] = Value::Bool(true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let started = Instant::now();
    let mut resp = client().post(url).header("content-type", "application/json").body(body.to_string()).send()?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let mut ttft = None;
    let mut usage = None;
    let mut pending = String::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = resp.read(&mut buf)?;
        if n == 0 {
            break;
        }
        pending.push_str(&String::from_utf8_lossy(&buf[..n]));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let chunk: Value = serde_json::from_str(data)?;
            let has_content = chunk["choices"].as_array().is_some_and(|cs| {
                cs.iter().any(|c| {
                    c["text"].as_str().is_some_and(|t| !t.is_empty())
                        || c["delta"]["content"].as_str().is_some_and(|t| !t.is_empty())
                })
            });
            if has_content && ttft.is_none() {
                ttft = Some(started.elapsed());
            }
            if chunk.get("usage").is_some_and(|u| !u.is_null()) {
                usage = Some(chunk["usage"].clone());
            }
        }
    }
    Ok(Streamed { status, headers, ttft: ttft.unwrap_or_else(|| started.elapsed()), usage })
}
