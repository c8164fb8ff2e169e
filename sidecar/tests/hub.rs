//! `fetch-tokenizer` against a local server that speaks the Hugging Face Hub's file layout
//! (`/{org}/{name}/resolve/{revision}/{file}`, bearer tokens for gated repositories, 404 for
//! what a repository lacks): the files arrive byte for byte and load, a gated repository
//! without the token is refused by name, a missing one is named, and the binary's command
//! does the same.

use std::path::{Path, PathBuf};
use std::process::Command;

use axum::extract::Path as UrlPath;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use kvgate_sidecar::tools::hub::{fetch, Fetch, FetchError};

const TOKEN: &str = "hf_test_token";
const REVISION: &str = "0123456789abcdef0123456789abcdef01234567";

fn source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/testdata/tokenizers/qwen3-0.6b")
}

/// Serves `gated/qwen3` (token required) and `open/qwen3` at [`REVISION`] from the test data.
async fn file(
    UrlPath((org, name, rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> impl IntoResponse {
    let authorized = headers.get("authorization").is_some_and(|v| v.as_bytes() == format!("Bearer {TOKEN}").as_bytes());
    if org == "gated" && !authorized {
        return (StatusCode::UNAUTHORIZED, Vec::new());
    }
    if name != "qwen3" || rev != REVISION {
        return (StatusCode::NOT_FOUND, Vec::new());
    }
    match std::fs::read(source().join(&file)) {
        Ok(bytes) => (StatusCode::OK, bytes),
        Err(_) => (StatusCode::NOT_FOUND, Vec::new()),
    }
}

fn hub() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let app = axum::Router::new().route("/{org}/{name}/resolve/{rev}/{file}", get(file));
            axum::serve(tokio::net::TcpListener::from_std(listener).unwrap(), app).await.unwrap();
        });
    });
    format!("http://{addr}")
}

fn dest(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-hub-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn tokenizers_come_from_a_hub_byte_for_byte_and_gated_ones_need_the_token() {
    let endpoint = hub();
    let ask = |repo: &str, token: Option<&str>, to: &Path| Fetch {
        endpoint: endpoint.clone(),
        repo: repo.into(),
        revision: REVISION.into(),
        token: token.map(str::to_owned),
        dest: to.to_path_buf(),
    };

    let to = dest("gated");
    let refused = fetch(&ask("gated/qwen3", None, &to)).unwrap_err();
    assert!(matches!(refused, FetchError::Refused { status: 401, .. }), "{refused}");
    assert!(refused.to_string().contains("HF_TOKEN"), "{refused}");
    assert!(!to.join("tokenizer.json").exists(), "nothing written");

    let written = fetch(&ask("gated/qwen3", Some(TOKEN), &to)).unwrap();
    assert_eq!(written, ["tokenizer.json", "tokenizer_config.json"], "what the repository has");
    for file in written {
        assert_eq!(std::fs::read(to.join(file)).unwrap(), std::fs::read(source().join(file)).unwrap(), "{file}");
    }

    let missing = fetch(&ask("open/no-such-model", None, &dest("missing"))).unwrap_err();
    assert!(matches!(missing, FetchError::Missing { .. }), "{missing}");

    // The command the chart's init step runs, token from the environment.
    let to = dest("cli");
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"))
        .args(["fetch-tokenizer", "--repo", "gated/qwen3", "--revision", REVISION, "--dest"])
        .arg(&to)
        .env("HF_ENDPOINT", &endpoint)
        .env("HF_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("loads"));
    let check = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"))
        .args(["fetch-tokenizer", "--repo", "gated/qwen3", "--revision", REVISION, "--dest"])
        .arg(dest("cli-no-token"))
        .env("HF_ENDPOINT", &endpoint)
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    assert!(!check.status.success(), "a gated repository without the token fails the step");
}
