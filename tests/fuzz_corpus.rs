//! The committed fuzz corpora (`fuzz/corpus/<target>/`, saved by libFuzzer runs)
//! replayed through the fuzz targets' own checks on the stable toolchain, so that
//! `cargo test --workspace` — and CI — catches a regression on any saved input
//! without nightly or libFuzzer. The checks and the replay loop are the fuzz crate's
//! modules, included by path: that crate is its own workspace (it pulls in
//! libfuzzer-sys), see `fuzz/README.md`.

#[path = "../fuzz/src/http.rs"]
mod http;
#[path = "../fuzz/src/json.rs"]
mod json;
#[path = "../fuzz/src/prompt.rs"]
mod prompt;
#[path = "../fuzz/src/replay.rs"]
mod replay;

fn corpus(target: &str, check: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    // An empty or missing corpus is a failure, not a pass.
    assert!(replay::replay(&dir, check) > 0, "{}", dir.display());
}

#[test]
fn http_request_corpus() {
    corpus("http_request", http::http_request);
}

#[test]
fn json_body_corpus() {
    corpus("json_body", json::json_body);
}

#[test]
fn prompt_hash_corpus() {
    corpus("prompt_hash", prompt::prompt_hash);
}
