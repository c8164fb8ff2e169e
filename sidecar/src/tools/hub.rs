//! `kvgate-sidecar fetch-tokenizer`: a model's tokenizer files from the Hugging Face Hub, or
//! any server with its layout (`{endpoint}/{repo}/resolve/{revision}/{file}`, a mirror or a
//! proxy), into the directory a pool's `tokenizer` names — what an init step runs before the
//! sidecar starts, so that any model can be routed without baking its files into an image.
//!
//! - `tokenizer.json` is required; `tokenizer_config.json` and `chat_template.jinja` are
//!   fetched when the repository has them.
//! - A gated model needs a token (`HF_TOKEN`, from a Secret): sent as `Authorization: Bearer`.
//! - Pin `revision` to a commit: `main` moves, and the engines must run the same files.
//! - Each file is written whole or not at all (a temporary name, then a rename), and the
//!   directory is checked by loading it as a pool would: a tokenizer kvgate cannot build fails
//!   the step, by name, instead of the sidecar's start.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;

/// The Hub itself.
pub const HUB: &str = "https://huggingface.co";
/// The files fetched: the first is required.
pub const FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"];
/// The largest file accepted (the biggest tokenizers are ~35 MB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// What to fetch, from where, to where.
#[derive(Debug, Clone)]
pub struct Fetch {
    /// The Hub's address (`HF_ENDPOINT`), [`HUB`] by default.
    pub endpoint: String,
    /// The repository, e.g. `Qwen/Qwen3-8B`.
    pub repo: String,
    /// A commit (or a branch or tag).
    pub revision: String,
    /// A token for gated or private repositories.
    pub token: Option<String>,
    /// The directory to fill.
    pub dest: PathBuf,
}

/// Why the files could not be had.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The Hub refused: a gated or private repository, and no token or the wrong one.
    #[error("{url}: the Hub answered {status}: a gated or private repository needs a token with access (HF_TOKEN)")]
    Refused {
        /// The file's address.
        url: String,
        /// The status.
        status: u16,
    },
    /// The repository has no `tokenizer.json` at this revision (or does not exist).
    #[error("{url}: not found; check the repository and the revision")]
    Missing {
        /// The file's address.
        url: String,
    },
    /// Any other answer, or none.
    #[error("{url}: {why}")]
    Http {
        /// The file's address.
        url: String,
        /// What happened.
        why: String,
    },
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The files are there, and kvgate cannot build a tokenizer from them.
    #[error("the fetched files do not load as a tokenizer: {0}")]
    Unusable(String),
}

/// Fetches the files into `f.dest` and checks that they load; returns the files written.
pub fn fetch(f: &Fetch) -> Result<Vec<&'static str>, FetchError> {
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .map_err(|e| FetchError::Http { url: f.endpoint.clone(), why: e.to_string() })?;
    std::fs::create_dir_all(&f.dest).map_err(|source| write_error(&f.dest, source))?;
    let mut written = Vec::new();
    for (i, name) in FILES.into_iter().enumerate() {
        let url = format!("{}/{}/resolve/{}/{name}", f.endpoint.trim_end_matches('/'), f.repo, f.revision);
        let mut request = client.get(&url);
        if let Some(token) = &f.token {
            request = request.bearer_auth(token);
        }
        let reply = request.send().map_err(|e| FetchError::Http { url: url.clone(), why: e.to_string() })?;
        match reply.status().as_u16() {
            200 => {}
            401 | 403 => return Err(FetchError::Refused { url, status: reply.status().as_u16() }),
            404 if i == 0 => return Err(FetchError::Missing { url }),
            404 => continue,
            status => return Err(FetchError::Http { url, why: format!("answered {status}") }),
        }
        let mut bytes = Vec::new();
        reply
            .take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| FetchError::Http { url: url.clone(), why: e.to_string() })?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(FetchError::Http { url, why: format!("larger than {MAX_FILE_BYTES} bytes") });
        }
        write_whole(&f.dest.join(name), &bytes)?;
        written.push(name);
    }
    // Loaded as a pool loads it (the block size does not matter to the tokenizer).
    let bundle = ModelBundle::from_dir(&f.repo, &f.dest, 16).map_err(|e| FetchError::Unusable(e.to_string()))?;
    ModelTokenizer::from_bundle(&bundle).map_err(|e| FetchError::Unusable(e.to_string()))?;
    Ok(written)
}

/// Writes `bytes` to `path` under a temporary name, then renames it into place.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), FetchError> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes).map_err(|source| write_error(&partial, source))?;
    std::fs::rename(&partial, path).map_err(|source| write_error(path, source))
}

fn write_error(path: &Path, source: std::io::Error) -> FetchError {
    FetchError::Write { path: path.display().to_string(), source }
}
