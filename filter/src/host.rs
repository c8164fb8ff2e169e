//! Header mutations that cannot panic.
//!
//! proxy-wasm's own wrappers `panic!` on any status but `Ok`, and a panic kills the VM (every
//! later request then fails or bypasses the filter). Envoy answers `BadArgument` when headers
//! can no longer be changed, so these two calls go through our own imports and return the
//! status instead.

use proxy_wasm::types::MapType;

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
