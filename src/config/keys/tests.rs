//! Every key of a full config is classified, and a reload that changes any one key
//! alone reports exactly that key and applies it (live) or keeps it (restart).

use super::*;
use crate::config::Config;
use serde_json::json;
use std::path::PathBuf;

/// Temporary files the full config names (a tokenizer, two admin token files, a
/// TLS certificate with its key and CA, and a copy of each under another name).
struct Files {
    dir: PathBuf,
}

impl Files {
    fn new(tag: &str) -> Files {
        let dir = std::env::temp_dir().join(format!("radixgate-keys-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        crate::token_mode::tests::word_tokenizer(&["hello"])
            .save(dir.join("tokenizer.json"), false)
            .unwrap();
        std::fs::write(dir.join("token"), "0123456789abcdef-one\n").unwrap();
        std::fs::write(dir.join("token2"), "0123456789abcdef-two\n").unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        for (name, pem) in [
            ("cert.pem", cert.pem()),
            ("key.pem", key.serialize_pem()),
            ("ca.pem", cert.pem()),
        ] {
            std::fs::write(dir.join(name), &pem).unwrap();
            std::fs::write(dir.join(format!("copy-{name}")), &pem).unwrap();
        }
        Files { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// A config that sets every table, with one of each kind of entry: a tier, a
/// tenant, a split model and its pool, and a backend serving whole (backends in
/// id order, the order [`unkeyed`] gives them back in).
fn full(files: &Files) -> Config {
    let digest = crate::tenants::hash_key("sk-acme");
    Config::from_toml(&format!(
        r#"
        [server]
        listen = "127.0.0.1:0"
        shards = 2
        cores = [0]
        coordinator_core = 0
        io = "epoll"
        [server.tls]
        cert = "{cert}"
        key = "{key}"
        [upstream]
        tls_ca = "{ca}"
        [routing]
        tokenizer = "{tokenizer}"
        chat_template = "none.jinja"
        [admin]
        listen = "127.0.0.1:0"
        token_file = "{token}"
        [traces]
        otlp_endpoint = "http://127.0.0.1:4318/v1/traces"
        [cluster]
        url = "redis://127.0.0.1:6379"
        node = "n1"
        username = "gw"
        password_env = "PATH"
        [admission]
        queue_capacity = 4
        anonymous_tier = "free"
        [tiers.free]
        ttft_budget_ms = 1000
        shed_pressure = 1.0
        [tiers.gold]
        priority = 5
        [[tenants]]
        name = "acme"
        tier = "gold"
        keys = ["{digest}"]
        requests_per_sec = 5.0
        tokens_per_sec = 1000.0
        max_concurrency = 4
        [models.split.disagg]
        protocol = "vllm"
        [[backends]]
        id = "b0"
        url = "http://127.0.0.1:9001"
        models = ["m"]
        [[backends]]
        id = "d0"
        url = "http://127.0.0.1:9003"
        models = ["split"]
        role = "decode"
        [[backends]]
        id = "d1"
        url = "http://127.0.0.1:9004"
        models = ["split"]
        role = "decode"
        [[backends]]
        id = "h0"
        url = "https://127.0.0.1:9005"
        models = ["m"]
        [[backends]]
        id = "p0"
        url = "http://127.0.0.1:9002"
        models = ["split"]
        role = "prefill"
        bootstrap_port = 8998
        [[discovery]]
        name = "engines.test"
        port = 8000
        resolver = "127.0.0.1:5353"
        models = ["m"]
        "#,
        tokenizer = files.path("tokenizer.json"),
        token = files.path("token"),
        cert = files.path("cert.pem"),
        key = files.path("key.pem"),
        ca = files.path("ca.pem"),
    ))
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Every node of a keyed tree (leaves and the objects above them) by path.
fn nodes(tree: &Value) -> Vec<Vec<String>> {
    fn walk(path: &mut Vec<String>, v: &Value, out: &mut Vec<Vec<String>>) {
        out.push(path.clone());
        if let Value::Object(m) = v {
            for (n, child) in m {
                path.push(n.clone());
                walk(path, child, out);
                path.pop();
            }
        }
    }
    let mut out = Vec::new();
    walk(&mut Vec::new(), tree, &mut out);
    out
}

fn exact(path: &[String]) -> Option<&'static Key> {
    key(path).filter(|k| matches(k.path, path))
}

#[test]
fn every_key_has_a_class() {
    let files = Files::new("class");
    let tree = full(&files).file;
    let unclassified: Vec<String> = leaves(&tree)
        .into_iter()
        .filter(|(path, _)| exact(path).is_none())
        .map(|(path, _)| render(&path))
        .collect();
    assert!(
        unclassified.is_empty(),
        "config keys without a class in config::keys::KEYS (live or restart required): \
         {unclassified:?}"
    );
    // And the table names no key the config does not have.
    let all = nodes(&tree);
    let stale: Vec<&str> = KEYS
        .iter()
        .filter(|k| !all.iter().any(|p| matches(k.path, p)))
        .map(|k| k.path)
        .collect();
    assert!(stale.is_empty(), "KEYS entries no config has: {stale:?}");
    // A path nobody classified counts as restart required.
    assert_eq!(class(&["server".into(), "warp".into()]), Class::Restart);
}

#[test]
fn secrets_are_redacted() {
    let files = Files::new("secrets");
    let config = full(&files);
    let digest = crate::tenants::hash_key("sk-acme");
    assert!(config.file.to_string().contains(&digest));
    let shown = redacted(config.file.clone());
    assert!(!shown.to_string().contains(&digest), "{shown}");
    assert_eq!(shown["tenants"]["acme"]["keys"], json!(["<redacted>"]));
    assert_eq!(shown["tenants"]["acme"]["requests_per_sec"], json!(5.0));
}

/// Values to try for a key where adding one (numbers) or flipping (bools) does not
/// do, by key pattern; the first that validates is used.
fn alternatives(pattern: &str, files: &Files) -> Vec<Value> {
    let digest2 = crate::tenants::hash_key("sk-acme-2");
    match pattern {
        "server.listen" | "admin.listen" => vec![json!("127.0.0.1:1")],
        "server.io" => vec![json!("auto")],
        "server.cores" => vec![json!([])],
        "routing.policy" => vec![json!("round_robin")],
        "routing.hashing" => vec![json!("tokens")],
        "routing.tokenizer" => vec![json!("other-tokenizer.json")],
        "routing.chat_template" => vec![json!("other.jinja")],
        "routing.rag_field" => vec![json!("retrieval")],
        "admin.token_file" => vec![json!(files.path("token2"))],
        "admin.token_env" => vec![json!("PATH")],
        "log.format" => vec![json!("json")],
        "log.level" => vec![json!("debug")],
        "traces.otlp_endpoint" => vec![json!("http://127.0.0.1:4319/v1/traces")],
        "traces.service_name" => vec![json!("svc")],
        "cluster.url" => vec![json!("valkey://127.0.0.1:6380")],
        "cluster.node" => vec![json!("n2")],
        "cluster.channel" => vec![json!("fleet-b")],
        "cluster.username" => vec![json!("")],
        "cluster.password_env" => vec![json!("")],
        "tenancy.prefix_isolation" => vec![json!("tenant")],
        "admission.anonymous_tier" | "tenants.*.tier" => vec![json!("gold"), json!("free")],
        "tiers.*.ttft_budget_ms" => vec![json!(500)],
        "tiers.*.shed_pressure" => vec![json!(2.0)],
        "tenants.*.keys" => vec![json!([digest2])],
        "backends.*.url" => vec![json!("http://127.0.0.1:9009")],
        "server.tls.cert" => vec![json!(files.path("copy-cert.pem"))],
        "server.tls.key" => vec![json!(files.path("copy-key.pem"))],
        "upstream.tls_ca" | "backends.*.tls_ca" => vec![json!(files.path("copy-ca.pem"))],
        "backends.*.tls_server_name" => vec![json!("localhost")],
        "backends.*.models" => vec![json!(["m2"])],
        "backends.*.api_key_env" => vec![json!("PATH")],
        "backends.*.compute_group" => vec![json!("gpu1")],
        "backends.*.capabilities" => vec![json!(["text", "image"])],
        "backends.*.role" => vec![json!("both"), json!("decode")],
        "models.*.disagg.protocol" => vec![json!("sglang")],
        "models.*.disagg.mode" => vec![json!("always")],
        "discovery.*.resolver" => vec![json!("127.0.0.1:5354")],
        "discovery.*.models" => vec![json!(["m2"])],
        "discovery.*.api_key_env" => vec![json!("PATH")],
        "discovery.*.capabilities" => vec![json!(["text", "image"])],
        _ => vec![],
    }
}

/// Keys no single change can exercise here, and why.
const UNCHANGEABLE: [(&str, &str); 14] = [
    (
        "discovery.*.name",
        "names the entry: a new name is an entry removed and one added",
    ),
    (
        "discovery.*.srv",
        "excludes port, which the full config sets",
    ),
    (
        "discovery.*.role",
        "its model `m` is served whole: another role needs a split model",
    ),
    (
        "discovery.*.bootstrap_port",
        "only a prefill entry takes one (the entry serves whole)",
    ),
    (
        "server.tls",
        "a table: its keys change alone here, and tests/tls.rs starts with and without it",
    ),
    (
        "backends.*.id",
        "names the entry: a new id is a backend removed and one added",
    ),
    (
        "tenants.*.name",
        "names the entry: a new name is a tenant removed and one added",
    ),
    (
        "backends.*.kv_events",
        "needs routing.hashing = \"precise\" (a chat template)",
    ),
    (
        "backends.*.kv_events_connect",
        "needs routing.hashing = \"precise\" (a chat template)",
    ),
    (
        "backends.*.kv_events_replay",
        "needs kv_events or kv_events_connect, and so precise mode",
    ),
    (
        "cluster.password_file",
        "excludes cluster.password_env, which the full config sets",
    ),
    (
        "cluster.ca_file",
        "needs a rediss:// URL and a PEM file (tests/cluster.rs covers it)",
    ),
    (
        "cluster.cert_file",
        "needs a rediss:// URL and PEM files (tests/cluster.rs covers it)",
    ),
    (
        "cluster.key_file",
        "needs a rediss:// URL and PEM files (tests/cluster.rs covers it)",
    ),
];

fn candidates(value: &Value, pattern: &str, files: &Files) -> Vec<Value> {
    let mut out = alternatives(pattern, files);
    match value {
        Value::Bool(b) => out.push(json!(!b)),
        Value::Number(n) if n.is_u64() => {
            let n = n.as_u64().unwrap();
            out.extend([json!(n + 1), json!(n.saturating_sub(1))]);
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap();
            out.extend([json!(x * 0.5), json!(x + 0.5)]);
        }
        _ => {}
    }
    out.retain(|v| v != value);
    out
}

fn set(tree: &mut Value, path: &[String], v: Value) {
    let mut at = tree;
    for p in path {
        at = &mut at[p.as_str()];
    }
    *at = v;
}

#[test]
fn a_reload_of_any_one_key_reports_it_and_applies_or_keeps_it() {
    let files = Files::new("reload");
    let running = full(&files);
    let debug = |c: &Config| format!("{c:#?}");
    let mut covered: Vec<&'static str> = Vec::new();
    let mut failures = Vec::new();
    for (path, value) in leaves(&running.file) {
        let k = exact(&path).expect("every_key_has_a_class");
        if UNCHANGEABLE.iter().any(|(p, _)| *p == k.path) {
            continue;
        }
        for v in candidates(value, k.path, &files) {
            let mut tree = running.file.clone();
            set(&mut tree, &path, v.clone());
            let Ok(new) = Config::from_json(unkeyed(tree)) else {
                continue;
            };
            let backends: Vec<_> = running.backends.iter().collect();
            let plan = crate::reload::plan(&running, &backends, &new);
            let key = render(&path);
            if plan.changes
                != [Change {
                    key: key.clone(),
                    class: k.class,
                }]
            {
                failures.push(format!("{key} = {v}: reported {:?}", plan.changes));
            }
            let expected = match k.class {
                Class::Live => &new,
                Class::Restart => &running,
            };
            if debug(&plan.config) != debug(expected) {
                failures.push(format!(
                    "{key} = {v} ({}): the config put in force is not {}",
                    k.class.status(),
                    match k.class {
                        Class::Live => "the new one",
                        Class::Restart => "the running one",
                    }
                ));
            }
            covered.push(k.path);
            break;
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    let missed: Vec<&str> = KEYS
        .iter()
        .filter(|k| !k.path.ends_with('*') && !k.path.ends_with(".disagg"))
        .map(|k| k.path)
        .filter(|p| !covered.contains(p) && !UNCHANGEABLE.iter().any(|(u, _)| u == p))
        .collect();
    assert!(
        missed.is_empty(),
        "no valid change found for {missed:?}: give them values in `alternatives`"
    );
}

#[test]
fn entries_added_and_removed() {
    let files = Files::new("entries");
    let running = full(&files);
    let mut tree = running.file.clone();
    let mut b9 = tree["backends"]["b0"].clone();
    b9["id"] = json!("b9");
    b9["kv_events"] = json!("tcp://127.0.0.1:5557");
    tree["backends"]["b9"] = b9;
    tree["tenants"].as_object_mut().unwrap().remove("acme");
    tree["tiers"].as_object_mut().unwrap().remove("gold");
    tree["admission"]["anonymous_tier"] = Value::Null;
    // Validation would refuse kv_events without precise mode: diff the trees alone.
    let changes: Vec<(String, Class)> = diff(&running.file, &tree)
        .into_iter()
        .map(|c| (c.key, c.class))
        .collect();
    assert_eq!(
        changes,
        [
            ("admission.anonymous_tier".into(), Class::Live),
            ("backends.b9".into(), Class::Live),
            ("backends.b9.kv_events".into(), Class::Restart),
            ("tenants.acme".into(), Class::Live),
            ("tiers.gold".into(), Class::Live),
        ]
    );
    let merged = merge(&running.file, &tree);
    assert_eq!(merged["backends"]["b9"]["kv_events"], Value::Null);
    assert_eq!(
        merged["backends"]["b9"]["url"],
        json!("http://127.0.0.1:9001")
    );
    assert!(merged["tenants"].as_object().unwrap().is_empty());
    assert_eq!(
        render(&["models".into(), "llama-3.1".into()]),
        "models.\"llama-3.1\""
    );
}
