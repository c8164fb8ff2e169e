//! The README's configuration reference names every key the filter's configuration accepts.

use std::path::Path;

use kvgate_filter::config::FilterConfig;

#[test]
fn the_readme_names_every_filter_key() {
    // The keys, as the configuration lists them when it refuses an unknown one.
    let refused = FilterConfig::parse(br#"{"kvgate_unknown_key": 0}"#).err().unwrap_or_default();
    let listed = refused.split_once("expected").map_or("", |(_, listed)| listed);
    let keys: Vec<&str> = listed.split('`').skip(1).step_by(2).collect();
    assert!(keys.len() > 1, "the keys could not be listed: {refused}");
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let missing: Vec<&&str> = keys.iter().filter(|k| !readme.contains(&format!("`{k}`"))).collect();
    assert!(missing.is_empty(), "README.md's filter configuration does not name: {missing:?}");
}
