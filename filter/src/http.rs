//! The proxy-wasm face of a [`Request`]: Envoy's HTTP context callbacks, each passed on to
//! the state machine, its [`request::Action`] mapped to proxy-wasm's. No logic lives here.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::host::Envoy;
use crate::request::{self, Request};
use crate::shared::Shared;

/// One HTTP stream's context in Envoy.
pub struct RequestContext(Request<Envoy>);

impl RequestContext {
    /// A context for a new stream in Envoy.
    pub fn new(shared: Rc<RefCell<Shared>>, context_id: u32) -> Self {
        RequestContext(Request::new(Envoy, shared, context_id))
    }
}

impl From<request::Action> for Action {
    fn from(action: request::Action) -> Action {
        match action {
            request::Action::Continue => Action::Continue,
            request::Action::Pause => Action::Pause,
        }
    }
}

impl Context for RequestContext {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        self.0.on_call_response(token, num_headers, body_size);
    }
}

impl HttpContext for RequestContext {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.0.on_request_headers(end_of_stream).into()
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.0.on_request_body(body_size, end_of_stream).into()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.0.on_request_trailers().into()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.0.on_response_headers().into()
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.0.on_response_body(body_size, end_of_stream).into()
    }

    fn on_log(&mut self) {
        self.0.on_log();
    }
}
