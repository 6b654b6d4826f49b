//! Cluster mode with TLS to the bus (`rediss://`; `deploy/cluster/bus --tls`, a
//! TLS-only Redis with a throwaway CA): replicas share routing state over it; a
//! replica that does not trust the bus's certificate, or lacks the client
//! certificate a bus requires, starts as with a bus that does not answer (it
//! routes on local state) and says why it is out; bad TLS settings are config
//! errors naming their key.

use super::*;

/// `cluster_toml` plus keys of the `[cluster]` table (it ends there).
fn tls_toml(bus: &Bus, channel: &str, extra: &str, keys: &str) -> String {
    format!("{}{keys}", cluster_toml(bus, channel, extra))
}

fn ca_key(bus: &Bus) -> String {
    format!("ca_file = \"{}\"\n", bus.tls_file("ca.crt"))
}

fn client_cert_keys(bus: &Bus) -> String {
    format!(
        "cert_file = \"{}\"\nkey_file = \"{}\"\n",
        bus.tls_file("client.crt"),
        bus.tls_file("client.key")
    )
}

const ADMIN_TOKEN: &str = "cluster-tls-admin-token-0123456789";

/// An `[admin]` table, so a test can read `GET /admin/cluster`.
fn admin_table() -> String {
    let token = common::temp_file("cluster-tls-admin-token", &format!("{ADMIN_TOKEN}\n"));
    format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n",
        token.display()
    )
}

fn admin_cluster(gw: &Gateway) -> serde_json::Value {
    let mut c = Client::connect(gw.admin_addr().expect("an admin listener"));
    c.send(
        format!("GET /admin/cluster HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: 0\r\n\r\n")
            .as_bytes(),
    );
    let r = c.read_response();
    assert_eq!(r.status, 200);
    serde_json::from_str(&r.text()).expect("JSON")
}

/// Waits until `gw` reports the bus lost with an error containing `what`, and
/// returns that error.
fn refused_with(gw: &Gateway, what: &str) -> String {
    let mut last = serde_json::Value::Null;
    let ok = eventually(Duration::from_secs(10), || {
        last = admin_cluster(gw);
        last["connected"] == false
            && last["last_error"]
                .as_str()
                .is_some_and(|e| !e.is_empty() && e.to_ascii_lowercase().contains(what))
    });
    assert!(ok, "no bus error mentioning `{what}`: {last:#}");
    last["last_error"].as_str().unwrap().to_string()
}

#[test]
fn two_replicas_share_a_routed_prefix_over_tls() {
    let bus = Bus::start_tls(false);
    assert!(bus.url.starts_with("rediss://127.0.0.1:"), "{}", bus.url);
    // TLS only: the port does not answer plain RESP.
    assert!(bus.command(&[b"PING"]).is_none());
    let engines = engines(3);
    let toml = tls_toml(&bus, &channel("tls"), "", &ca_key(&bus));
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(a.local_addr(), 1);
    wait_peers(b.local_addr(), 1);
    let home = route_and_share(a.local_addr(), b.local_addr(), &doc_prompt(0, 0));
    for q in 1..3 {
        let (status, backend, reason) = ask(b.local_addr(), &doc_prompt(0, q));
        assert_eq!(status, 200);
        assert_eq!(
            (backend.as_str(), reason.as_str()),
            (home.as_str(), "longest-prefix")
        );
    }
    let home = route_and_share(b.local_addr(), a.local_addr(), &doc_prompt(1, 0));
    let (_, backend, reason) = ask(a.local_addr(), &doc_prompt(1, 1));
    assert_eq!((backend, reason.as_str()), (home, "longest-prefix"));
    for gw in [&a, &b] {
        let m = scrape(gw.local_addr());
        assert_eq!(metric(&m, "radixgate_cluster_connected "), Some(1.0));
        assert_eq!(metric(&m, "radixgate_cluster_outages_total"), Some(0.0));
    }
    a.shutdown();
    b.shutdown();
}

#[test]
fn a_replica_that_does_not_trust_the_bus_stays_out_and_says_why() {
    let bus = Bus::start_tls(false);
    // Another bus: another throwaway CA, which did not sign `bus`'s certificate.
    let other = Bus::start_tls(false);
    let engines = engines(1);
    let ch = channel("tls-ca");
    let trusting = replica(&engines, &tls_toml(&bus, &ch, "", &ca_key(&bus)));
    let wrong = replica(
        &engines,
        &tls_toml(&bus, &ch, &admin_table(), &ca_key(&other)),
    );
    // It starts, as with a bus that does not answer, and serves from local state.
    assert_eq!(ask(wrong.local_addr(), &doc_prompt(0, 0)).0, 200);
    let error = refused_with(&wrong, "certificate");
    assert!(error.contains("cluster.ca_file"), "no hint in: {error}");
    let m = scrape(wrong.local_addr());
    assert_eq!(metric(&m, "radixgate_cluster_connected "), Some(0.0));
    assert_eq!(metric(&m, "radixgate_cluster_outages_total"), Some(1.0));
    // Out of the fleet: not ready (a balancer keeps traffic off it), unheard by its
    // would-be peer, and it still serves.
    assert_eq!(ready(wrong.local_addr()), 503);
    assert_eq!(
        metric(&scrape(trusting.local_addr()), "radixgate_cluster_peers "),
        Some(0.0)
    );
    assert_eq!(ask(wrong.local_addr(), &doc_prompt(1, 0)).0, 200);
    drop(other);
    wrong.shutdown();
    trusting.shutdown();
}

#[test]
fn a_bus_that_requires_client_certificates_admits_only_replicas_with_one() {
    let bus = Bus::start_tls(true);
    let engines = engines(2);
    let ch = channel("mtls");
    let with_cert = tls_toml(&bus, &ch, "", &(ca_key(&bus) + &client_cert_keys(&bus)));
    let (a, b) = (replica(&engines, &with_cert), replica(&engines, &with_cert));
    wait_peers(a.local_addr(), 1);
    wait_peers(b.local_addr(), 1);
    let home = route_and_share(a.local_addr(), b.local_addr(), &doc_prompt(0, 0));
    let (_, backend, reason) = ask(b.local_addr(), &doc_prompt(0, 1));
    assert_eq!((backend, reason.as_str()), (home, "longest-prefix"));
    // Without a client certificate the bus ends the handshake.
    let without = replica(
        &engines,
        &tls_toml(&bus, &ch, &admin_table(), &ca_key(&bus)),
    );
    let error = refused_with(&without, "certificaterequired");
    assert!(error.contains("cluster.cert_file"), "no hint in: {error}");
    assert_eq!(ready(without.local_addr()), 503);
    assert_eq!(ask(without.local_addr(), &doc_prompt(0, 0)).0, 200);
    assert_eq!(
        metric(&scrape(a.local_addr()), "radixgate_cluster_peers "),
        Some(1.0)
    );
    without.shutdown();
    a.shutdown();
    b.shutdown();
}

#[test]
fn bad_tls_settings_are_config_errors_naming_the_key() {
    let not_pem = common::temp_file("cluster-tls-not-pem", "not a certificate\n");
    let not_pem = not_pem.display();
    let cases = [
        (
            "url = \"rediss://127.0.0.1:6390\"\nca_file = \"/nonexistent/radixgate-ca.pem\"".to_string(),
            "cluster.ca_file: cannot read `/nonexistent/radixgate-ca.pem`",
        ),
        (
            format!("url = \"rediss://127.0.0.1:6390\"\nca_file = \"{not_pem}\""),
            "cluster.ca_file",
        ),
        (
            format!("url = \"redis://127.0.0.1:6390\"\nca_file = \"{not_pem}\""),
            "cluster.ca_file: only for TLS",
        ),
        (
            format!("url = \"rediss://127.0.0.1:6390\"\ncert_file = \"{not_pem}\""),
            "a client certificate needs both",
        ),
        (
            format!("url = \"rediss://127.0.0.1:6390\"\ncert_file = \"{not_pem}\"\nkey_file = \"/nonexistent/k.pem\""),
            "cluster.key_file: cannot read `/nonexistent/k.pem`",
        ),
        (
            "url = \"rediss://127.0.0.1:6390/#insecure\"".to_string(),
            "cluster.url: a fragment",
        ),
        (
            "url = \"rediss://gw:secret@127.0.0.1:6390\"".to_string(),
            "cluster.url: must not carry credentials",
        ),
    ];
    for (keys, expected) in cases {
        let toml = common::gateway_toml(
            "epoll",
            1,
            &format!("[cluster]\n{keys}\n"),
            &[("e0", "http://127.0.0.1:9".into(), "sim")],
        );
        match radixgate::config::Config::from_toml(&toml) {
            Ok(_) => panic!("accepted:\n{keys}"),
            Err(e) => assert!(e.to_string().contains(expected), "{keys}\n=> {e}"),
        }
    }
    // valkeys:// is rediss://, and without ca_file the system's roots are trusted.
    let toml = common::gateway_toml(
        "epoll",
        1,
        "[cluster]\nurl = \"valkeys://127.0.0.1:6390\"\n",
        &[("e0", "http://127.0.0.1:9".into(), "sim")],
    );
    let config = radixgate::config::Config::from_toml(&toml).expect("valid");
    let cluster = config.cluster.expect("a cluster");
    assert_eq!(cluster.url, "rediss://127.0.0.1:6390");
    assert!(cluster
        .tls
        .is_some_and(|t| t.ca.is_none() && t.client.is_none()));
}
