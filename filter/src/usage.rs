//! Asking the engine for `usage` on the client's behalf.
//!
//! The closed loop (every prediction checked against the engine) needs the engine's
//! `usage.prompt_tokens` and `cached_tokens` for every request. A non-streamed response always
//! carries them, and so does a Responses stream; a streamed completion carries them only when
//! the client sent `stream_options.include_usage`. For a stream that did not, the filter adds
//! that option to the body ([`with_usage_requested`]) and takes the extra event back out of
//! the response ([`UsageStripper`]), so the client receives exactly the stream it asked for.

use kvgate_shared::prompt::openai::Envelope;

/// The member the filter adds at the start of the body.
const ASK: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// For a streamed request that has no `stream_options` (its [`Envelope`], already read): how
/// to rewrite its body's start so it asks for usage, as `(bytes to replace, replacement)` —
/// everything up to and including the opening `{`, replaced by `{` and the option. The rest
/// of the body is untouched, so a body of any size costs a few bytes, never a copy. `None` for
/// any other body.
///
/// ```
/// use kvgate_filter::usage::with_usage_requested;
/// use kvgate_shared::prompt::openai::envelope;
/// let asks = |body: &[u8]| with_usage_requested(body, &envelope(body).unwrap());
/// let body = br#" {"model":"m","stream":true,"prompt":"hi"}"#;
/// let (replaced, start) = asks(body).unwrap();
/// let rewritten = [&start[..], &body[replaced..]].concat();
/// let v: serde_json::Value = serde_json::from_slice(&rewritten).unwrap();
/// assert_eq!(v["stream_options"]["include_usage"], true);
/// assert_eq!(v["prompt"], "hi");
/// assert!(asks(br#"{"model":"m","prompt":"hi"}"#).is_none(), "not streamed");
/// assert!(asks(br#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#).is_none());
/// assert!(asks(br#"{"model":"m","stream":true,"stream_options":null}"#).is_none());
/// ```
pub fn with_usage_requested(body: &[u8], envelope: &Envelope<'_>) -> Option<(usize, Vec<u8>)> {
    if !envelope.stream || envelope.stream_options {
        return None;
    }
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    (body[open] == b'{').then(|| (open + 1, [&b"{"[..], ASK].concat()))
}

/// The most bytes held back waiting for an event to complete. An event longer than that is
/// sent on as it is, and the stream is left alone from then on.
const MAX_HELD: usize = 64 << 10;

/// Takes the usage-only event (`data: {…"choices":[],"usage":{…}}`) out of an SSE stream
/// whose client did not ask for it. Events end at a blank line, with any of SSE's line ends
/// (`\n`, `\r\n`, `\r`). Chunks may split an event anywhere: the bytes after the last complete
/// event are held back until it completes (the next chunk, as engines write one event per
/// write), at most [`MAX_HELD`] bytes.
#[derive(Debug, Default)]
pub struct UsageStripper {
    held: Vec<u8>,
    /// An event outgrew [`MAX_HELD`]: the rest of the stream is not framed as expected.
    gave_up: bool,
    /// Usage events taken out so far.
    pub stripped: u32,
}

impl UsageStripper {
    /// What to send on instead of `chunk`; `None` to send `chunk` as it is.
    ///
    /// ```
    /// use kvgate_filter::usage::UsageStripper;
    /// let mut s = UsageStripper::default();
    /// let token = b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n";
    /// assert_eq!(s.filter(token, false), None, "nothing to hold or take out");
    /// assert_eq!(s.filter(b"data: {\"choices\":[],\"us", false), Some(Vec::new()), "held");
    /// let rest = b"age\":{\"prompt_tokens\":3}}\r\n\r\ndata: [DONE]\r\n\r\n";
    /// assert_eq!(s.filter(rest, true), Some(b"data: [DONE]\r\n\r\n".to_vec()));
    /// assert_eq!(s.stripped, 1);
    /// ```
    pub fn filter(&mut self, chunk: &[u8], end_of_stream: bool) -> Option<Vec<u8>> {
        if self.gave_up || (self.held.is_empty() && !mentions_usage_object(chunk) && last_event(chunk).is_empty()) {
            return None;
        }
        let mut pending = std::mem::take(&mut self.held);
        pending.extend_from_slice(chunk);
        let complete = pending.len() - last_event(&pending).len();
        if pending.len() - complete > MAX_HELD {
            self.gave_up = true;
        } else if !end_of_stream {
            self.held = pending.split_off(complete);
        }
        let mut out = Vec::with_capacity(pending.len());
        let mut rest = &pending[..];
        while !rest.is_empty() {
            let (event, tail) = rest.split_at(event_end(rest).unwrap_or(rest.len()));
            if is_usage_only(event) {
                self.stripped += 1;
            } else {
                out.extend_from_slice(event);
            }
            rest = tail;
        }
        Some(out)
    }
}

/// Where the first event of `bytes` (which starts at an event's start) ends: after the blank
/// line that closes it; `None` if none does yet. A `\r` at the very end may be the first half
/// of a `\r\n`, so it ends nothing yet.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let mut at = 0;
    let mut line_start = true;
    while at < bytes.len() {
        let ending = match bytes[at] {
            b'\n' => 1,
            b'\r' => match bytes.get(at + 1) {
                Some(b'\n') => 2,
                Some(_) => 1,
                None => return None,
            },
            _ => 0,
        };
        if ending == 0 {
            line_start = false;
            at += 1;
        } else if line_start && at > 0 {
            return Some(at + ending);
        } else {
            line_start = true;
            at += ending;
        }
    }
    None
}

/// The bytes after the last complete event (all of them if none is complete).
fn last_event(bytes: &[u8]) -> &[u8] {
    let mut rest = bytes;
    while let Some(end) = event_end(rest) {
        rest = &rest[end..];
    }
    rest
}

/// Whether `bytes` has a `"usage"` member whose value is an object (not `null`, as SGLang
/// sends with every token).
fn mentions_usage_object(bytes: &[u8]) -> bool {
    let mut rest = bytes;
    while let Some(at) = find(rest, b"\"usage\"") {
        rest = &rest[at + 7..];
        let value = rest.trim_ascii_start().strip_prefix(b":").map(<[u8]>::trim_ascii_start);
        if value.is_some_and(|v| v.starts_with(b"{")) {
            return true;
        }
    }
    false
}

/// Whether an SSE event is only a usage report: its data is a JSON object whose `choices` is
/// empty and whose `usage` is an object (vLLM's and SGLang's last event before `[DONE]`).
fn is_usage_only(event: &[u8]) -> bool {
    if !mentions_usage_object(event) {
        return false;
    }
    let data: Vec<&[u8]> = event
        .split(|b| *b == b'\n' || *b == b'\r')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .map(|d| d.strip_prefix(b" ").unwrap_or(d))
        .collect();
    let Ok(serde_json::Value::Object(chunk)) = serde_json::from_slice(&data.join(&b'\n')) else { return false };
    chunk.get("choices").and_then(serde_json::Value::as_array).is_some_and(Vec::is_empty)
        && chunk.get("usage").is_some_and(serde_json::Value::is_object)
}

/// Where `needle` first stands in `haystack`.
pub(crate) fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `stream` through a stripper in three chunks cut at `cuts`.
    fn through(stream: &str, cuts: (usize, usize)) -> (String, u32) {
        let mut s = UsageStripper::default();
        let b = stream.as_bytes();
        let mut out = Vec::new();
        for (i, chunk) in [&b[..cuts.0], &b[cuts.0..cuts.1], &b[cuts.1..]].iter().enumerate() {
            match s.filter(chunk, i == 2) {
                Some(replaced) => out.extend(replaced),
                None => out.extend_from_slice(chunk),
            }
        }
        (String::from_utf8(out).unwrap(), s.stripped)
    }

    /// A vLLM chat stream with usage (and SGLang's, with `"usage":null` on every token and
    /// CRLF line ends), cut into chunks at every possible place.
    #[test]
    fn the_usage_event_is_taken_out_wherever_the_chunks_split() {
        let vllm = (
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}",
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}",
            "\n\n",
        );
        let sglang = (
            "data: {\"id\":\"c\",\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"hi\"}}], \"usage\": null}",
            "data: {\"id\":\"c\",\"choices\": [], \"usage\": {\"prompt_tokens\": 9}}",
            "\r\n\r\n",
        );
        for (content, usage, end) in [vllm, sglang] {
            let stream = format!("{content}{end}{content}{end}{usage}{end}data: [DONE]{end}");
            let expected = format!("{content}{end}{content}{end}data: [DONE]{end}");
            for cut in 0..=stream.len() {
                for second in cut..=stream.len() {
                    assert_eq!(through(&stream, (cut, second)), (expected.clone(), 1), "cut at {cut} and {second}");
                }
            }
        }
    }

    #[test]
    fn what_is_not_a_usage_event_goes_through_as_it_came() {
        let token = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"usage\":{\"prompt_tokens\":1}}\n\n";
        let quoted = "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\":{\"}}]}\n\n";
        let error = r#"{"object":"error","message":"bad \"choices\": [], \"usage\": {} request","code":400}"#;
        for stream in [token, quoted, error] {
            for cut in 0..=stream.len() {
                assert_eq!(through(stream, (cut, stream.len())), (stream.to_owned(), 0), "cut at {cut}");
            }
        }
    }

    #[test]
    fn a_split_event_is_held_until_it_completes() {
        let mut s = UsageStripper::default();
        assert_eq!(s.filter(b"data: {\"choices\":[{\"text\":", false), Some(Vec::new()));
        let out = s.filter(b"\"a\"}]}\n\ndata: {", false).unwrap();
        assert_eq!(out, b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n", "sent once whole");
        assert_eq!(s.filter(b"}\n\n", true).unwrap(), b"data: {}\n\n");
    }

    #[test]
    fn what_may_be_held_is_bounded() {
        let mut s = UsageStripper::default();
        let data = [&b"data: "[..], &[b'x'; 994]].concat();
        let mut sent = 0;
        for _ in 0..100 {
            sent += s.filter(&data, false).map_or(data.len(), |out| out.len());
        }
        assert!(sent >= 100 * 1000 - MAX_HELD, "held {} bytes", 100 * 1000 - sent);
        assert_eq!(s.filter(b"\n\n", false), None, "a stream framed otherwise is left alone");
    }
}
