//! What the parity tests share: a case's reference ids, and where ours part from them.

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
