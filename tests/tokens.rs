//! Token mode (`routing.hashing = "tokens"`) end to end: prompts sharing a long
//! prefix match in blocks of `block_tokens` token ids, and `check-config` refuses
//! tokens mode without a loadable tokenizer. No tokenizer file can be downloaded, so
//! each test builds a word-level one with the tokenizers crate and saves it.

mod common;

use common::*;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::Tokenizer;

const BIN: &str = env!("CARGO_BIN_EXE_radixgate");
const BLOCK_TOKENS: usize = 4;

/// 60 sentences of three tokens each ("doc7", "-", "sentence3"): 180 tokens.
fn doc(d: usize) -> String {
    (0..60).map(|i| format!("doc{d}-sentence{i} ")).collect()
}

fn doc_question(d: usize, q: usize) -> String {
    format!(
        r#"{{"model":"sim","max_tokens":2,"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"question {q} about doc{d}"}}]}}"#,
        doc(d)
    )
}

/// A word-level tokenizer knowing the tests' words (anything else is `[UNK]`),
/// split on whitespace and punctuation, saved as a `tokenizer.json`.
fn tokenizer_file(tag: &str) -> (Tokenizer, PathBuf) {
    let mut words: Vec<String> = ["[UNK]", "system", "user", "question", "about", "-"]
        .map(String::from)
        .to_vec();
    words.extend((0..10).map(|d| format!("doc{d}")));
    words.extend((0..60).map(|i| format!("sentence{i}")));
    words.extend((0..100).map(|i| i.to_string()));
    let vocab: HashMap<String, u32> = words
        .into_iter()
        .enumerate()
        .map(|(i, w)| (w, i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_pre_tokenizer(Some(Whitespace {}));
    let path = std::env::temp_dir().join(format!(
        "radixgate-tokens-{}-{tag}.json",
        std::process::id()
    ));
    tokenizer.save(&path, false).unwrap();
    (tokenizer, path)
}

fn match_blocks(r: &Response) -> usize {
    r.header("x-router-match-blocks").unwrap().parse().unwrap()
}

fn shared_prefix_matches_in_token_blocks(io: &str) {
    let (tokenizer, path) = tokenizer_file(io);
    let (_engines, gw) = instant_fleet(
        io,
        3,
        1,
        &format!(
            "[routing]\npolicy = \"prefix_aware\"\nhashing = \"tokens\"\ntokenizer = \"{}\"\nblock_tokens = {BLOCK_TOKENS}",
            path.display()
        ),
    );
    std::fs::remove_file(&path).ok();
    let doc_tokens = tokenizer.encode(doc(3), false).unwrap().get_ids().len();
    assert_eq!(doc_tokens, 180);

    let mut c = Client::connect(gw.local_addr());
    let first = c.post("/v1/chat/completions", &doc_question(3, 0), &[]);
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-router-reason"), Some("no-match"));
    let home = first.header("x-router-backend").unwrap().to_string();
    for q in 1..4 {
        let r = c.post("/v1/chat/completions", &doc_question(3, q), &[]);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-router-reason"), Some("longest-prefix"));
        assert_eq!(r.header("x-router-backend"), Some(home.as_str()));
        // The shared prefix is the role, a separator and the document's 180 tokens:
        // at least 180 / 4 = 45 blocks of 4 tokens. In bytes mode the same ~1.1 KB
        // prefix is only ~17 blocks of 64 bytes.
        let matched = match_blocks(&r);
        assert!(
            (doc_tokens / BLOCK_TOKENS..=doc_tokens / BLOCK_TOKENS + 3).contains(&matched),
            "matched {matched} blocks"
        );
    }
    // Another document shares no prefix block with the first.
    let other = c.post("/v1/chat/completions", &doc_question(4, 0), &[]);
    assert_eq!(other.header("x-router-reason"), Some("no-match"));
    assert_eq!(match_blocks(&other), 0);
}
both_drivers!(shared_prefix_matches_in_token_blocks);

fn check_config(tag: &str, routing: &str) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("radixgate-tokens-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{tag}.toml"));
    std::fs::write(
        &file,
        format!(
            "[routing]\n{routing}\n[[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n"
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    std::fs::remove_file(&file).ok();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_requires_a_loadable_tokenizer_in_tokens_mode() {
    let (ok, err) = check_config("none", "hashing = \"tokens\"");
    assert!(!ok);
    assert!(err.contains("routing.tokenizer: required"), "{err}");

    let (ok, err) = check_config(
        "missing",
        "hashing = \"tokens\"\ntokenizer = \"/nonexistent/tokenizer.json\"",
    );
    assert!(!ok);
    assert!(
        err.contains("routing.tokenizer: `/nonexistent/tokenizer.json`"),
        "{err}"
    );

    let (_, path) = tokenizer_file("check-config");
    let not_json = path.with_extension("txt");
    std::fs::write(&not_json, "not a tokenizer").unwrap();
    let (ok, err) = check_config(
        "garbage",
        &format!(
            "hashing = \"tokens\"\ntokenizer = \"{}\"",
            not_json.display()
        ),
    );
    assert!(!ok);
    assert!(err.contains("routing.tokenizer: "), "{err}");

    let (ok, err) = check_config(
        "good",
        &format!(
            "hashing = \"tokens\"\ntokenizer = \"{}\"\nblock_tokens = 16",
            path.display()
        ),
    );
    assert!(ok, "{err}");
    std::fs::remove_file(&path).ok();
    std::fs::remove_file(&not_json).ok();
}
