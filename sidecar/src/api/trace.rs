//! W3C trace context (`traceparent`): the trace a call about one request belongs to, so that
//! what the sidecar logs about it can be found from the request's trace.

/// The trace id of a `traceparent` value — `version-traceid-parentid-flags`, lowercase hex —
/// if it is one a tracer honours: a version other than `ff` (version `00` exactly four fields),
/// ids not all zeros.
///
/// ```
/// use kvgate_sidecar::api::trace::trace_id;
/// let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// assert_eq!(trace_id(header), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
/// assert_eq!(trace_id("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), None);
/// assert_eq!(trace_id("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"), None);
/// assert_eq!(trace_id("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), None);
/// assert_eq!(trace_id("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"), None);
/// ```
pub fn trace_id(traceparent: &str) -> Option<&str> {
    let mut fields = traceparent.trim().split('-');
    let (version, trace, parent, flags) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
    let hex =
        |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    let valid = hex(version, 2)
        && version != "ff"
        && (version != "00" || fields.next().is_none())
        && hex(trace, 32)
        && nonzero(trace)
        && hex(parent, 16)
        && nonzero(parent)
        && hex(flags, 2);
    valid.then_some(trace)
}
