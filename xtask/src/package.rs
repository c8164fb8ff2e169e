//! `cargo xtask package`: what a deployment ships, written without docker.
//!
//! - `target/package/kvgate_filter.wasm` and its sha256 (for a WasmPlugin `url: https://…`
//!   with `sha256:`).
//! - `target/package/oci/`: an OCI image layout holding the filter in the Wasm image format
//!   Istio and Envoy Gateway pull (`oci://…`): one config blob of media type
//!   `application/vnd.module.wasm.config.v1+json` and one layer, the module itself, of media
//!   type `application/vnd.module.wasm.content.layer.v1+wasm`. Push it to a registry with
//!   `oras cp --from-oci-layout target/package/oci:TAG REGISTRY/kvgate-filter:TAG` or
//!   `skopeo copy oci:target/package/oci:TAG docker://REGISTRY/kvgate-filter:TAG`.
//!
//! The sidecar's image is built from `sidecar/Dockerfile`.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The image manifest's media type.
pub const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// The image index's media type.
pub const INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// The Wasm image config's media type.
pub const WASM_CONFIG: &str = "application/vnd.module.wasm.config.v1+json";
/// The Wasm module layer's media type.
pub const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";

/// `sha256:<hex>` of some bytes.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// What [`write_layout`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The manifest's digest: the image digest (`…@sha256:…`).
    pub manifest_digest: String,
    /// The module's digest.
    pub wasm_digest: String,
}

/// Writes an OCI image layout at `dir` with `wasm` as its only layer, tagged `tag`.
pub fn write_layout(dir: &Path, wasm: &[u8], tag: &str) -> anyhow::Result<Written> {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    let put = |bytes: &[u8]| -> anyhow::Result<(String, usize)> {
        let d = digest(bytes);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), bytes)?;
        Ok((d, bytes.len()))
    };
    let config = serde_json::to_vec(&json!({"type": "envoy_proxy_wasm_http_filter", "rootIds": ["kvgate"]}))?;
    let (config_digest, config_size) = put(&config)?;
    let (wasm_digest, wasm_size) = put(wasm)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": WASM_CONFIG, "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": WASM_LAYER, "digest": wasm_digest, "size": wasm_size,
                    "annotations": {"org.opencontainers.image.title": "plugin.wasm"}}],
        "annotations": {"org.opencontainers.image.title": "kvgate-filter",
                        "org.opencontainers.image.version": env!("CARGO_PKG_VERSION")},
    }))?;
    let (manifest_digest, manifest_size) = put(&manifest)?;
    let index = json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": [{"mediaType": MANIFEST, "digest": manifest_digest, "size": manifest_size,
                       "annotations": {"org.opencontainers.image.ref.name": tag}}],
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec_pretty(&index)?)?;
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    Ok(Written { manifest_digest, wasm_digest })
}

/// Reads the image tagged `tag` back from an OCI image layout, checking it against the
/// image-layout spec as it goes — `oci-layout` version, the index and manifest media types,
/// every blob present with the digest and size its descriptor claims, one Wasm layer — and
/// returns the module.
pub fn read_layout(dir: &Path, tag: &str) -> anyhow::Result<Vec<u8>> {
    let layout: Value = serde_json::from_slice(&std::fs::read(dir.join("oci-layout"))?)?;
    ensure!(layout["imageLayoutVersion"] == "1.0.0", "oci-layout: imageLayoutVersion must be 1.0.0");
    let index: Value = serde_json::from_slice(&std::fs::read(dir.join("index.json"))?)?;
    ensure!(index["schemaVersion"] == 2, "index.json: schemaVersion must be 2");
    let manifests = index["manifests"].as_array().context("index.json: no manifests")?;
    let entry = manifests
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .with_context(|| format!("index.json: no manifest tagged {tag:?}"))?;
    ensure!(entry["mediaType"] == MANIFEST, "index.json: the entry is not an image manifest");
    let blob = |descriptor: &Value| -> anyhow::Result<Vec<u8>> {
        let d = descriptor["digest"].as_str().context("descriptor without digest")?;
        let Some(hex) = d.strip_prefix("sha256:") else { bail!("unsupported digest algorithm in {d}") };
        ensure!(
            hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
            "bad digest {d}"
        );
        let bytes = std::fs::read(dir.join("blobs/sha256").join(hex)).with_context(|| format!("blob {d} missing"))?;
        ensure!(digest(&bytes) == d, "blob {d} does not hash to its digest");
        ensure!(descriptor["size"].as_u64() == Some(bytes.len() as u64), "blob {d}: size differs from its descriptor");
        Ok(bytes)
    };
    let manifest: Value = serde_json::from_slice(&blob(entry)?)?;
    ensure!(
        manifest["schemaVersion"] == 2 && manifest["mediaType"] == MANIFEST,
        "manifest: wrong schema or media type"
    );
    ensure!(manifest["config"]["mediaType"] == WASM_CONFIG, "manifest: config is not a Wasm image config");
    serde_json::from_slice::<Value>(&blob(&manifest["config"])?).context("config blob is not JSON")?;
    let layers = manifest["layers"].as_array().context("manifest: no layers")?;
    ensure!(layers.len() == 1 && layers[0]["mediaType"] == WASM_LAYER, "manifest: expected one Wasm layer");
    blob(&layers[0])
}

/// `cargo xtask package [--out DIR] [--tag TAG]`.
pub fn run(raw: &[String]) -> anyhow::Result<()> {
    let (mut out, mut tag) = (kvgate_e2e::repo_root().join("target/package"), env!("CARGO_PKG_VERSION").to_owned());
    let mut args = raw.iter();
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--out", Some(v)) => out = PathBuf::from(v),
            ("--tag", Some(v)) => tag = v.clone(),
            _ => bail!("usage: cargo xtask package [--out DIR] [--tag TAG]"),
        }
    }
    crate::build_wasm()?;
    let built = kvgate_e2e::repo_root().join("target/wasm32-wasip1/release/kvgate_filter.wasm");
    let wasm = std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    std::fs::create_dir_all(&out)?;
    std::fs::write(out.join("kvgate_filter.wasm"), &wasm)?;
    let oci = out.join("oci");
    if oci.exists() {
        std::fs::remove_dir_all(&oci)?;
    }
    let written = write_layout(&oci, &wasm, &tag)?;
    ensure!(read_layout(&oci, &tag)? == wasm, "the OCI layout does not give back the built module");
    let sha = written.wasm_digest.trim_start_matches("sha256:");
    std::fs::write(out.join("kvgate_filter.wasm.sha256"), format!("{sha}  kvgate_filter.wasm\n"))?;
    println!("wasm:   {} ({} bytes)", out.join("kvgate_filter.wasm").display(), wasm.len());
    println!("sha256: {sha}   (WasmPlugin `sha256:` for an https:// url)");
    println!("image:  {} tagged {tag}, digest {}", oci.display(), written.manifest_digest);
    println!(
        "push:   oras cp --from-oci-layout {}:{tag} REGISTRY/kvgate-filter:{tag}\n        then WasmPlugin url: oci://REGISTRY/kvgate-filter@{}",
        oci.display(),
        written.manifest_digest
    );
    println!("sidecar image: docker build -f sidecar/Dockerfile -t REGISTRY/kvgate-sidecar:{tag} .");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_round_trips_and_tampering_is_caught() {
        let dir = std::env::temp_dir().join(format!("kvgate-oci-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let wasm = b"\0asm\x01\0\0\0 a module".to_vec();
        let written = write_layout(&dir, &wasm, "0.1.0").unwrap();
        assert_eq!(written.wasm_digest, digest(&wasm));
        assert_eq!(read_layout(&dir, "0.1.0").unwrap(), wasm);
        assert!(read_layout(&dir, "latest").is_err(), "unknown tag");
        let blob = dir.join("blobs/sha256").join(written.wasm_digest.trim_start_matches("sha256:"));
        std::fs::write(&blob, b"\0asm tampered").unwrap();
        assert!(read_layout(&dir, "0.1.0").unwrap_err().to_string().contains("does not hash"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn digests_are_sha256_hex() {
        assert_eq!(digest(b""), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }
}
