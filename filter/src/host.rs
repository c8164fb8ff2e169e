//! The host behind a trait, and header mutations that cannot panic.
//!
//! [`Host`] is everything the per-request state machine asks of Envoy, so the state machine
//! runs natively against a fake in unit tests; [`Envoy`] is the real one.
//!
//! proxy-wasm's own header wrappers `panic!` on any status but `Ok`, and a panic kills the VM
//! (every later request then fails or bypasses the filter). Envoy answers `BadArgument` when
//! headers can no longer be changed, so those calls go through our own imports and return the
//! status instead.

use std::time::{Duration, SystemTime};

use kvgate_shared::wire::{CONTENT_TYPE, WIRE_VERSION, WIRE_VERSION_HEADER};

/// The header every call to the sidecar carries: the wire version this filter encodes.
pub const WIRE: (&str, &str) = (WIRE_VERSION_HEADER, WIRE_VERSION);
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};

// The same imports proxy-wasm declares, with the status as a plain u32 so that an unexpected
// value from the host is data, not undefined behaviour.
#[allow(clashing_extern_declarations)]
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_replace_header_map_value(
        map: MapType,
        key: *const u8,
        key_len: usize,
        value: *const u8,
        value_len: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map: MapType, key: *const u8, key_len: usize) -> u32;
}

/// A non-zero proxy-wasm status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStatus(pub u32);

fn check(status: u32) -> Result<(), HostStatus> {
    if status == 0 {
        Ok(())
    } else {
        Err(HostStatus(status))
    }
}

/// Sets (replaces) a request header.
pub fn set_request_header(name: &str, value: &str) -> Result<(), HostStatus> {
    // SAFETY: pointers and lengths come from live &str values for the duration of the call.
    check(unsafe {
        proxy_replace_header_map_value(
            MapType::HttpRequestHeaders,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// Removes a request header (absent is fine).
pub fn remove_request_header(name: &str) -> Result<(), HostStatus> {
    // SAFETY: as above.
    check(unsafe { proxy_remove_header_map_value(MapType::HttpRequestHeaders, name.as_ptr(), name.len()) })
}

/// Adds a response header (debug headers only).
pub fn set_response_header(name: &str, value: &str) -> Result<(), HostStatus> {
    // SAFETY: as above.
    check(unsafe {
        proxy_replace_header_map_value(
            MapType::HttpResponseHeaders,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// Where the filter's counters and histograms go.
pub trait MetricSink {
    /// Defines a metric named `name`; `None` if the host refuses.
    fn define(&self, kind: MetricType, name: &str) -> Option<u32>;
    /// Adds `by` to a counter.
    fn increment(&self, id: u32, by: i64);
    /// Records a histogram value, or sets a gauge.
    fn record(&self, id: u32, value: u64);
}

/// Calls to the sidecar and their answers: what both the request contexts and the root
/// context need.
pub trait SidecarCalls: MetricSink {
    /// POSTs `body` to `path` on `cluster`, with `headers` beside the call's own (a request's
    /// trace context); the answer comes to `on_http_call_response`.
    fn dispatch(
        &self,
        cluster: &str,
        path: &str,
        authority: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostStatus>;
    /// The `:status` of the call being answered.
    fn call_status(&self) -> Option<String>;
    /// A header of the call being answered.
    fn call_header(&self, name: &str) -> Option<String>;
    /// The body of the call being answered, its first `size` bytes.
    fn call_body(&self, size: usize) -> Option<Vec<u8>>;
}

/// What the per-request state machine ([`crate::request::Request`]) needs from its host:
/// Envoy, through proxy-wasm, in production ([`Envoy`]); a fake in native unit tests. Every
/// call returns what the host said instead of panicking.
pub trait Host: SidecarCalls {
    /// A request header.
    fn request_header(&self, name: &str) -> Option<String>;
    /// Sets (replaces) a request header.
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostStatus>;
    /// Removes a request header (absent is fine).
    fn remove_request_header(&self, name: &str) -> Result<(), HostStatus>;
    /// Sets a response header.
    fn set_response_header(&self, name: &str, value: &str) -> Result<(), HostStatus>;
    /// A response header (`:status` included).
    fn response_header(&self, name: &str) -> Option<String>;
    /// Removes a response header (absent is fine).
    fn remove_response_header(&self, name: &str) -> Result<(), HostStatus>;
    /// The buffered request body, `size` bytes.
    fn request_body(&self, size: usize) -> Vec<u8>;
    /// Replaces the first `old_len` bytes of the buffered request body with `body`.
    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> Result<(), HostStatus>;
    /// `size` bytes of the current response body chunk, from `start`.
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>>;
    /// Replaces the first `old_len` bytes of the current response body chunk with `body`.
    fn replace_response_body(&self, old_len: usize, body: &[u8]) -> Result<(), HostStatus>;
    /// Resumes the paused request.
    fn resume(&self) -> Result<(), HostStatus>;
    /// The upstream host the request went to (Envoy's `upstream.address`), once known.
    fn upstream_address(&self) -> Option<String>;
    /// Pushes an item onto a shared queue.
    fn enqueue(&self, queue: u32, item: &[u8]) -> Result<(), HostStatus>;
    /// Answers the client itself (the request goes no further).
    fn send_local_reply(&self, code: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostStatus>;
    /// Sets a property of the request (Envoy: the filter state `wasm.<name>`, which access
    /// logs read as `%FILTER_STATE(wasm.<name>:PLAIN)%`).
    fn set_property(&self, name: &str, value: &str) -> Result<(), HostStatus>;
    /// Sends a request of the filter's own (a prefill leg) to `cluster` with these headers
    /// (pseudo-headers included); the answer comes to `on_http_call_response`.
    fn call(&self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout: Duration) -> Result<u32, HostStatus>;
}

/// What the root context ([`crate::root::Root`]) needs from its host: calls to the sidecar,
/// the lifecycle queue, the clock and gauges. Envoy in production ([`Envoy`]); a fake in
/// native unit tests.
pub trait RootHost: SidecarCalls {
    /// GETs `path` on `cluster`; the answer comes to `on_http_call_response`.
    fn get(&self, cluster: &str, path: &str, authority: &str, timeout: Duration) -> Result<u32, HostStatus>;
    /// The next item of a shared queue, if any.
    fn dequeue(&self, queue: u32) -> Option<Vec<u8>>;
    /// The host's clock.
    fn now(&self) -> SystemTime;
    /// Calls the root's `on_tick` every `period` from now on.
    fn set_tick_period(&self, period: Duration);
}

/// Envoy, through proxy-wasm's host calls.
#[derive(Debug, Clone, Copy, Default)]
pub struct Envoy;

impl RootHost for Envoy {
    fn get(&self, cluster: &str, path: &str, authority: &str, timeout: Duration) -> Result<u32, HostStatus> {
        let headers = vec![(":method", "GET"), (":path", path), (":authority", authority), WIRE];
        hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout).map_err(status)
    }

    fn dequeue(&self, queue: u32) -> Option<Vec<u8>> {
        hostcalls::dequeue_shared_queue(queue).ok().flatten()
    }

    fn now(&self) -> SystemTime {
        hostcalls::get_current_time().unwrap_or(SystemTime::UNIX_EPOCH)
    }

    fn set_tick_period(&self, period: Duration) {
        if hostcalls::set_tick_period(period).is_err() {
            log::warn!("kvgate: cannot set the tick period to {period:?}");
        }
    }
}

fn status(s: proxy_wasm::types::Status) -> HostStatus {
    HostStatus(s as u32)
}

impl MetricSink for Envoy {
    fn define(&self, kind: MetricType, name: &str) -> Option<u32> {
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment(&self, id: u32, by: i64) {
        let _ = hostcalls::increment_metric(id, by);
    }

    fn record(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}

impl SidecarCalls for Envoy {
    fn dispatch(
        &self,
        cluster: &str,
        path: &str,
        authority: &str,
        extra: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostStatus> {
        let mut headers =
            vec![(":method", "POST"), (":path", path), (":authority", authority), ("content-type", CONTENT_TYPE), WIRE];
        headers.extend_from_slice(extra);
        hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout).map_err(status)
    }

    fn call_status(&self) -> Option<String> {
        self.call_header(":status")
    }

    fn call_header(&self, name: &str) -> Option<String> {
        header(MapType::HttpCallResponseHeaders, name)
    }

    fn call_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten()
    }
}

/// A header's value as text: UTF-8 if it is, else each byte a Latin-1 character, as the
/// engines' server (Starlette) reads headers. A client may send any byte of 0x80–0xFF in a
/// header (HTTP's obs-text); `hostcalls::get_map_value` would panic on it, and a panic kills
/// the worker's VM, so every later request there would pass unfiltered.
fn header(map: MapType, name: &str) -> Option<String> {
    let value = hostcalls::get_map_value_bytes(map, name).ok().flatten()?;
    Some(String::from_utf8(value).unwrap_or_else(|e| e.into_bytes().iter().map(|&b| char::from(b)).collect()))
}

impl Host for Envoy {
    fn set_property(&self, name: &str, value: &str) -> Result<(), HostStatus> {
        hostcalls::set_property(vec![name], Some(value.as_bytes())).map_err(status)
    }

    fn request_header(&self, name: &str) -> Option<String> {
        header(MapType::HttpRequestHeaders, name)
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostStatus> {
        set_request_header(name, value)
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostStatus> {
        remove_request_header(name)
    }

    fn set_response_header(&self, name: &str, value: &str) -> Result<(), HostStatus> {
        set_response_header(name, value)
    }

    fn response_header(&self, name: &str) -> Option<String> {
        header(MapType::HttpResponseHeaders, name)
    }

    fn remove_response_header(&self, name: &str) -> Result<(), HostStatus> {
        // SAFETY: pointers and lengths come from a live &str for the duration of the call.
        check(unsafe { proxy_remove_header_map_value(MapType::HttpResponseHeaders, name.as_ptr(), name.len()) })
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok().flatten().unwrap_or_default()
    }

    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> Result<(), HostStatus> {
        hostcalls::set_buffer(BufferType::HttpRequestBody, 0, old_len, body).map_err(status)
    }

    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, start, size).ok().flatten()
    }

    fn replace_response_body(&self, old_len: usize, body: &[u8]) -> Result<(), HostStatus> {
        hostcalls::set_buffer(BufferType::HttpResponseBody, 0, old_len, body).map_err(status)
    }

    fn resume(&self) -> Result<(), HostStatus> {
        hostcalls::resume_http_request().map_err(status)
    }

    fn upstream_address(&self) -> Option<String> {
        let address = hostcalls::get_property(vec!["upstream", "address"]).ok().flatten()?;
        String::from_utf8(address).ok()
    }

    fn enqueue(&self, queue: u32, item: &[u8]) -> Result<(), HostStatus> {
        hostcalls::enqueue_shared_queue(queue, Some(item)).map_err(status)
    }

    fn send_local_reply(&self, code: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostStatus> {
        hostcalls::send_http_response(code, headers.to_vec(), Some(body)).map_err(status)
    }

    fn call(&self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout: Duration) -> Result<u32, HostStatus> {
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), Some(body), vec![], timeout).map_err(status)
    }
}
