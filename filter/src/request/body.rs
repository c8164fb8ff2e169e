//! The request body as it goes upstream, and the one place it is rewritten: taking a
//! client's transfer fields out, forwarding the prompt as token ids, asking for usage, a
//! disaggregated request's decode body. Each rewrite keeps `content-length`, if the request
//! has one, equal to the body's new size.

use crate::host::{Host, HostStatus};

/// The request body upstream: its size (each rewrite changes it).
#[derive(Debug)]
pub(super) struct UpstreamBody {
    len: usize,
}

impl UpstreamBody {
    /// A body of `len` bytes, as the client sent it.
    pub(super) fn new(len: usize) -> UpstreamBody {
        UpstreamBody { len }
    }

    /// The body as it goes upstream now.
    pub(super) fn read(&self, host: &impl Host) -> Vec<u8> {
        host.request_body(self.len)
    }

    /// Replaces the whole body; false (and logged) if the host refused.
    pub(super) fn replace(&mut self, host: &impl Host, body: &[u8]) -> bool {
        match self.splice(host, self.len, body) {
            Ok(()) => true,
            Err(status) => {
                log::warn!("kvgate: cannot rewrite the request body: {status:?}");
                false
            }
        }
    }

    /// Replaces the body's first `replaced` bytes with `start`, the rest untouched.
    pub(super) fn splice(&mut self, host: &impl Host, replaced: usize, start: &[u8]) -> Result<(), HostStatus> {
        host.replace_request_body(replaced, start)?;
        self.len = self.len - replaced + start.len();
        if host.request_header("content-length").is_some() {
            if let Err(status) = host.set_request_header("content-length", &self.len.to_string()) {
                log::warn!("kvgate: cannot update content-length after rewriting the body: {status:?}");
            }
        }
        Ok(())
    }
}
