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

/// The most bytes held back waiting for an event to complete; past it they are sent on as
/// they are (a stream that is not framed as vLLM frames it is never held up).
const MAX_HELD: usize = 64 << 10;

/// Takes the usage-only event (`data: {…"choices":[],"usage":{…}}`) out of an SSE stream
/// whose client did not ask for it. Chunks may split an event anywhere: the bytes after the
/// last complete event are held back until it completes (or the stream ends).
#[derive(Debug, Default)]
pub struct UsageStripper {
    held: Vec<u8>,
    /// Usage events taken out so far.
    pub stripped: u32,
}

impl UsageStripper {
    /// What to send on instead of `chunk`; `None` to send `chunk` as it is.
    ///
    /// ```
    /// use kvgate_filter::usage::UsageStripper;
    /// let mut s = UsageStripper::default();
    /// let token = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
    /// assert_eq!(s.filter(token, false), None, "nothing to hold or take out");
    /// assert_eq!(s.filter(b"data: {\"choices\":[],\"us", false), Some(Vec::new()), "held");
    /// let rest = b"age\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n";
    /// assert_eq!(s.filter(rest, true), Some(b"data: [DONE]\n\n".to_vec()));
    /// assert_eq!(s.stripped, 1);
    /// ```
    pub fn filter(&mut self, chunk: &[u8], end_of_stream: bool) -> Option<Vec<u8>> {
        if self.held.is_empty() && chunk.ends_with(b"\n\n") && find(chunk, b"\"usage\"").is_none() {
            return None;
        }
        let mut pending = std::mem::take(&mut self.held);
        pending.extend_from_slice(chunk);
        let complete = if end_of_stream || pending.len() > MAX_HELD {
            pending.len()
        } else {
            rfind(&pending, b"\n\n").map_or(0, |at| at + 2)
        };
        self.held = pending.split_off(complete);
        let mut out = Vec::with_capacity(pending.len());
        for event in pending.split_inclusive_events() {
            if is_usage_only(event) {
                self.stripped += 1;
            } else {
                out.extend_from_slice(event);
            }
        }
        Some(out)
    }
}

/// Whether an SSE event is only a usage report: data whose `choices` is empty and that has a
/// `usage` object (vLLM's and SGLang's last event before `[DONE]`).
fn is_usage_only(event: &[u8]) -> bool {
    event.starts_with(b"data:") && find(event, b"\"choices\":[]").is_some() && find(event, b"\"usage\":{").is_some()
}

/// Splitting bytes into SSE events, each with its blank-line terminator.
trait Events {
    fn split_inclusive_events(&self) -> impl Iterator<Item = &[u8]>;
}

impl Events for Vec<u8> {
    fn split_inclusive_events(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest: &[u8] = self;
        std::iter::from_fn(move || {
            if rest.is_empty() {
                return None;
            }
            let end = find(rest, b"\n\n").map_or(rest.len(), |at| at + 2);
            let (event, tail) = rest.split_at(end);
            rest = tail;
            Some(event)
        })
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn rfind(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vLLM chat stream with usage, cut into chunks at every possible place.
    #[test]
    fn the_usage_event_is_taken_out_wherever_the_chunks_split() {
        let content = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let usage = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"total_tokens\":10,\"completion_tokens\":1}}\n\n";
        let done = "data: [DONE]\n\n";
        let stream = format!("{content}{content}{usage}{done}");
        let expected = format!("{content}{content}{done}");
        for cut in 0..=stream.len() {
            for second in cut..=stream.len() {
                let mut s = UsageStripper::default();
                let chunks = [&stream.as_bytes()[..cut], &stream.as_bytes()[cut..second], &stream.as_bytes()[second..]];
                let mut out = Vec::new();
                for (i, chunk) in chunks.iter().enumerate() {
                    match s.filter(chunk, i == 2) {
                        Some(replaced) => out.extend(replaced),
                        None => out.extend_from_slice(chunk),
                    }
                }
                assert_eq!(String::from_utf8(out).unwrap(), expected, "cut at {cut} and {second}");
                assert_eq!(s.stripped, 1);
            }
        }
    }

    #[test]
    fn content_that_mentions_usage_is_kept() {
        let mut s = UsageStripper::default();
        for chunk in [
            &b"data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\":{\"}}]}\n\n"[..],
            b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"usage\":{\"prompt_tokens\":1}}\n\n",
        ] {
            assert_eq!(s.filter(chunk, false).unwrap_or_else(|| chunk.to_vec()), chunk);
        }
        assert_eq!(s.stripped, 0, "a token with continuous usage stats is content");
    }

    #[test]
    fn a_stream_framed_otherwise_is_never_held_long() {
        let mut s = UsageStripper::default();
        let line = vec![b'x'; 1000];
        let mut sent = 0;
        for _ in 0..100 {
            sent += s.filter(&line, false).map_or(line.len(), |out| out.len());
        }
        assert!(sent >= 100 * 1000 - MAX_HELD, "held {} bytes", 100 * 1000 - sent);
    }
}
