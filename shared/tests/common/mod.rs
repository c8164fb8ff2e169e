//! What the parity tests share: a case's reference ids, where ours part from them, and the
//! check of a file of request cases.

use std::path::PathBuf;

use kvgate_shared::prompt::openai::{parse, Endpoint, ParsedRequest};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde_json::Value;

/// A reference case's `ids`.
pub fn reference_ids(case: &Value) -> Vec<u32> {
    case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// Where `ours` first differs from `reference`, with a few ids of each from there; `None`
/// when they are equal.
pub fn divergence(ours: &[u32], reference: &[u32]) -> Option<String> {
    if ours == reference {
        return None;
    }
    let at = ours.iter().zip(reference).take_while(|(a, b)| a == b).count();
    Some(format!(
        "ids differ at {at} of {}: ours {:?} vs the reference's {:?}",
        reference.len(),
        &ours[at..(at + 6).min(ours.len())],
        &reference[at..(at + 6).min(reference.len())]
    ))
}

/// The repository's root.
#[allow(dead_code)] // each test file is its own crate; only the endpoint files use it
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The template families vLLM renders with their template (gpt-oss aside), by directory.
#[allow(dead_code)] // each test file is its own crate; only the endpoint files use it
pub const TEMPLATE_FAMILIES: [&str; 5] =
    ["llama-3.2-1b-instruct", "deepseek-v3", "gemma-3-1b-it", "mistral-nemo-instruct-2407", "phi-3.5-mini-instruct"];

/// A reference file of requests to one endpoint for one model, and the model it renders with.
#[allow(dead_code)] // each test file is its own crate; only the endpoint files use it
pub struct EndpointCases {
    /// The file: `now_unix`, and `cases`, each a `request` with its `ids` or vLLM's `error`.
    pub reference: Value,
    /// The model's bundle (`qwen3` is the repository's model, a family the shared test data's).
    pub bundle: ModelBundle,
}

#[allow(dead_code)] // each test file is its own crate; only the endpoint files use it
impl EndpointCases {
    /// `testdata/parity/<kind>/<model>-<kind>.json` and the model's bundle.
    pub fn load(kind: &str, model: &str) -> EndpointCases {
        let repo = repo();
        let file = repo.join("testdata/parity").join(kind).join(format!("{model}-{kind}.json"));
        let reference = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        let dir = match model {
            "qwen3" => repo.join("models/qwen3-0.6b"),
            family => repo.join("../shared/testdata/tokenizers").join(family),
        };
        EndpointCases { reference, bundle: ModelBundle::from_dir(model, &dir, 16).unwrap() }
    }

    /// The instant the file was rendered at (what templates print as the date).
    pub fn now(&self) -> i64 {
        self.reference["now_unix"].as_i64().unwrap()
    }

    /// Requires every case, sent to `endpoint` and rendered at [`EndpointCases::now`], to give
    /// the reference's ids or to be refused where vLLM refuses it; `is_shape` says whether the
    /// parsed request has the endpoint's prompt kind. Returns how many cases there are.
    pub fn check(&self, endpoint: Endpoint, is_shape: impl Fn(&ParsedRequest) -> bool) -> usize {
        let model = self.bundle.model.as_str();
        let tokenizer = ModelTokenizer::from_bundle(&self.bundle).unwrap();
        let cases = self.reference["cases"].as_array().unwrap();
        let mut failures = Vec::new();
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let mut body = case["request"].clone();
            body["model"] = model.into();
            let ids = parse(endpoint, body.to_string().as_bytes()).and_then(|request| {
                assert!(is_shape(&request), "{model} {name}");
                tokenizer.prompt_head_at(&request, usize::MAX, self.now()).map(|head| head.tokens)
            });
            match (ids, case.get("error")) {
                (Err(_), Some(_)) => {}
                (Ok(_), Some(e)) => failures.push(format!("{name}: rendered, but vLLM refuses it ({e})")),
                (Err(e), None) => failures.push(format!("{name}: {e}")),
                (Ok(ids), None) => {
                    if let Some(d) = divergence(&ids, &reference_ids(case)) {
                        failures.push(format!("{name}: {d}"));
                    }
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{model}: {} of {} cases differ:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
        cases.len()
    }
}
