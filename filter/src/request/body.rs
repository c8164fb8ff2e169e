//! The request body as it goes upstream, and the one place it is rewritten: taking a
//! client's transfer fields out, forwarding the prompt as token ids, asking for usage, a
//! disaggregated request's decode body. Each rewrite keeps `content-length`, if the request
//! has one, equal to the body's new size.

use kvgate_shared::prompt::openai::{members, Envelope, Members};

use crate::disagg::{self, LegError};
use crate::host::{Host, HostStatus};

/// A body's [`Envelope`] (`None` if it is not a JSON object with a string `model`), and
/// whether it may carry a transfer field ([`disagg::may_carry_transfer_fields`]), in one pass.
pub(super) fn read(body: &[u8]) -> (Option<Envelope<'static>>, bool) {
    let members = members(body);
    let may_carry = disagg::may_carry_transfer_fields(body, members.as_ref());
    (members.and_then(Members::envelope).map(Envelope::into_owned), may_carry)
}

/// Why a client's transfer fields could not be taken out of its body: the request must not
/// go upstream.
#[derive(Debug)]
pub(super) struct Uncleanable(pub(super) String);

/// Answers the client 400, OpenAI-style: its body's transfer fields could not be taken out
/// (`why`), so the request must not go upstream.
pub(super) fn refuse(host: &impl Host, why: &Uncleanable) {
    let message = format!(
        "the request may carry kv_transfer_params, ec_transfer_params (or either in vllm_xargs), bootstrap_* \
         or data-parallel rank fields, which this gateway does not take from clients, and it cannot read the body to take them out \
         ({}): send plain JSON (no NaN, no lone surrogates, UTF-8)",
        why.0
    );
    let error = serde_json::json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": null,
        "code": "unreadable_transfer_fields",
    }});
    let headers = [("content-type", "application/json")];
    if let Err(status) = host.send_local_reply(400, &headers, error.to_string().as_bytes()) {
        log::warn!("kvgate: cannot refuse a request: {status:?}");
    }
}

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

    /// Takes a client's transfer fields out of `body` (this body as it is now), which
    /// [`read`] said `may_carry` them; `keep_ids` keeps a trusted client's forwarded prompt.
    /// `Some` with the body as it goes upstream if it changed.
    pub(super) fn clean(
        &mut self,
        host: &impl Host,
        body: &[u8],
        may_carry: bool,
        keep_ids: bool,
    ) -> Result<Option<Vec<u8>>, Uncleanable> {
        if !may_carry {
            return Ok(None);
        }
        match disagg::without_transfer_fields(body, keep_ids) {
            Ok(None) => Ok(None),
            Ok(Some(clean)) if self.replace(host, &clean) => Ok(Some(clean)),
            Ok(Some(_)) => Err(Uncleanable("the body could not be replaced".into())),
            // JSON, but no object: no member to take out, and no request to the engine.
            Err(LegError::NotAnObject) => Ok(None),
            Err(e) => Err(Uncleanable(e.to_string())),
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
