//! The deployment files in `deploy/` as CI sees them: the Grafana dashboard is JSON
//! whose queries name only metrics docs/operations.md documents, the Prometheus, Compose,
//! Grafana provisioning and Kubernetes files are YAML of the expected kinds, and
//! every radixgate config among them (the annotated example, the Compose config,
//! the ConfigMap's) passes `radixgate check-config`.

// A test thread, not a shard: reading files is fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use common::documented_metrics;
use std::path::{Path, PathBuf};
use std::process::Command;
use yaml_rust2::{Yaml, YamlLoader};

const BIN: &str = env!("CARGO_BIN_EXE_radixgate");

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn yaml_docs(path: &str) -> Vec<Yaml> {
    YamlLoader::load_from_str(&read(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn check_config(file: &Path) {
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn dashboard_is_json_and_queries_documented_metrics() {
    let text = read("grafana/radixgate-dashboard.json");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    assert_eq!(dash["uid"], "radixgate");
    let panels = dash["panels"].as_array().expect("panels");
    let documented = documented_metrics();
    assert!(documented.len() > 20, "the metrics table: {documented:?}");
    let mut titles = Vec::new();
    for p in panels {
        titles.push(p["title"].as_str().unwrap().to_string());
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{p}");
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            for name in expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("radixgate_"))
            {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(name);
                assert!(
                    documented.iter().any(|d| d == base),
                    "panel `{}` queries `{base}`, not in the metrics table (docs/operations.md)",
                    p["title"]
                );
            }
        }
    }
    // What the issue asks the dashboard to show.
    for want in [
        "TTFT",
        "Engine cache hit rate",
        "Load: in flight per backend",
        "Errors by reason (4xx/5xx)",
        "Admission decisions",
    ] {
        assert!(titles.iter().any(|t| t == want), "no panel `{want}`");
    }
}

#[test]
fn prometheus_and_grafana_provisioning_are_yaml() {
    let prom = &yaml_docs("prometheus/prometheus.yml")[0];
    let jobs: Vec<&str> = prom["scrape_configs"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|j| j["job_name"].as_str().unwrap())
        .collect();
    assert!(jobs.contains(&"radixgate"), "{jobs:?}");
    let ds = &yaml_docs("grafana/provisioning/datasources/prometheus.yml")[0];
    assert_eq!(ds["datasources"][0]["type"].as_str(), Some("prometheus"));
    // The dashboard's panels use this datasource uid.
    assert_eq!(ds["datasources"][0]["uid"].as_str(), Some("prometheus"));
    let dash = &yaml_docs("grafana/provisioning/dashboards/radixgate.yml")[0];
    assert_eq!(dash["providers"][0]["type"].as_str(), Some("file"));
}

#[test]
fn compose_file_has_the_gateway_split_pools_and_monitoring() {
    let compose = &yaml_docs("compose/docker-compose.yml")[0];
    let services = compose["services"].as_hash().expect("services");
    let names: Vec<&str> = services.keys().filter_map(Yaml::as_str).collect();
    for want in [
        "radixgate",
        "vllm-prefill-0",
        "vllm-prefill-1",
        "vllm-decode-0",
        "vllm-decode-1",
        "prometheus",
        "grafana",
    ] {
        assert!(names.contains(&want), "no service {want}: {names:?}");
    }
    let gw = &compose["services"]["radixgate"];
    assert_eq!(
        gw["build"]["dockerfile"].as_str(),
        Some("deploy/docker/Dockerfile")
    );
    assert!(deploy("docker/Dockerfile").exists());
    // Every file the compose project mounts from the repository exists.
    for svc in services.values() {
        for v in svc["volumes"].as_vec().into_iter().flatten() {
            let v = v.as_str().unwrap();
            if let Some(src) = v.split(':').next().filter(|s| s.starts_with('.')) {
                assert!(deploy("compose").join(src).exists(), "missing {src}");
            }
        }
    }
    // The engines the gateway routes to are the compose network's addresses.
    let config = read("compose/radixgate.toml");
    for svc in ["vllm-prefill-0", "vllm-decode-1"] {
        let ip = compose["services"][svc]["networks"]["fleet"]["ipv4_address"]
            .as_str()
            .unwrap();
        assert!(config.contains(&format!("http://{ip}:8000")), "{svc} {ip}");
    }
    // Two replicas in cluster mode, joined over the compose project's bus.
    assert!(names.contains(&"radixgate-1") && names.contains(&"valkey"));
    let bus = compose["services"]["valkey"]["networks"]["fleet"]["ipv4_address"]
        .as_str()
        .unwrap();
    assert!(
        config.contains(&format!("url = \"redis://{bus}:6379\"")),
        "{bus}"
    );
}

#[test]
fn kubernetes_manifests_have_the_expected_kinds() {
    let mut kinds = Vec::new();
    for file in [
        "configmap.yaml",
        "deployment.yaml",
        "service.yaml",
        "engines.yaml",
        "pdb.yaml",
        "hpa.yaml",
        "bus.yaml",
        "engines-autoscale.yaml",
        "discovery.yaml",
    ] {
        for doc in yaml_docs(&format!("k8s/{file}")) {
            let kind = doc["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{file}: no kind"));
            assert!(
                doc["apiVersion"].as_str().is_some(),
                "{file}: no apiVersion"
            );
            assert!(
                doc["metadata"]["name"].as_str().is_some(),
                "{file}: no name"
            );
            kinds.push(kind.to_string());
        }
    }
    for want in [
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "StatefulSet",
        "ScaledObject",
    ] {
        assert!(kinds.iter().any(|k| k == want), "no {want}: {kinds:?}");
    }
    // The engine autoscalers follow the capacity signal of their own pool.
    for (doc, pool) in yaml_docs("k8s/engines-autoscale.yaml")
        .iter()
        .zip(["prefill", "decode"])
    {
        let target = doc["spec"]["scaleTargetRef"]["name"].as_str().unwrap();
        assert_eq!(target, format!("vllm-{pool}"));
        let trigger = &doc["spec"]["triggers"][0];
        assert_eq!(trigger["type"].as_str(), Some("prometheus"));
        let query = trigger["metadata"]["query"].as_str().unwrap();
        assert!(
            query.contains(&format!(
                "radixgate_capacity_recommended_engines{{pool=\"{pool}\"}}"
            )),
            "{query}"
        );
    }
    let deployment = &yaml_docs("k8s/deployment.yaml")[0];
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/ready")
    );
    assert_eq!(
        deployment["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"]
    );
}

#[test]
fn every_config_example_passes_check_config() {
    check_config(&deploy("radixgate.example.toml"));
    check_config(&deploy("compose/radixgate.toml"));
    // The ConfigMap's embedded config, written out as a file.
    let cm = &yaml_docs("k8s/configmap.yaml")[0];
    let toml = cm["data"]["radixgate.toml"]
        .as_str()
        .expect("radixgate.toml key");
    let path = std::env::temp_dir().join(format!("radixgate-k8s-{}.toml", std::process::id()));
    std::fs::write(&path, toml).unwrap();
    check_config(&path);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn kubernetes_discovery_names_a_headless_service() {
    let docs = yaml_docs("k8s/discovery.yaml");
    let service = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("Service"))
        .expect("a Service");
    assert_eq!(service["spec"]["clusterIP"].as_str(), Some("None"));
    let name = service["metadata"]["name"].as_str().unwrap();
    let port = service["spec"]["ports"][0]["port"].as_i64().unwrap();
    let cm = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("ConfigMap"))
        .expect("a ConfigMap");
    let toml = cm["data"]["radixgate.toml"]
        .as_str()
        .expect("radixgate.toml key");
    let config = radixgate::config::Config::from_toml(toml).unwrap_or_else(|e| panic!("{e}"));
    let d = &config.discovery[0];
    assert!(d.name.starts_with(&format!("{name}.")), "{}", d.name);
    assert_eq!(
        d.lookup,
        radixgate::config::DiscoveryLookup::Address { port: port as u16 }
    );
    let path = std::env::temp_dir().join(format!(
        "radixgate-k8s-discovery-{}.toml",
        std::process::id()
    ));
    std::fs::write(&path, toml).unwrap();
    check_config(&path);
    let _ = std::fs::remove_file(&path);
}
