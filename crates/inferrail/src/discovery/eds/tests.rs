//! The EDS file: what it says of each replica, and that it follows the fleet.

use inferrail_config::Config;

use super::*;

fn statuses(file: &Value) -> Vec<(String, u64, String)> {
    let assignment = &file["resources"][0];
    assert_eq!(assignment["@type"], "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment");
    assert_eq!(assignment["cluster_name"], "engines");
    let endpoints = assignment["endpoints"][0]["lb_endpoints"].as_array().unwrap();
    endpoints
        .iter()
        .map(|e| {
            let a = &e["endpoint"]["address"]["socket_address"];
            (
                a["address"].as_str().unwrap().to_string(),
                a["port_value"].as_u64().unwrap(),
                e["health_status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn read(path: &Path) -> Option<Value> {
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok())
}

/// Waits (3 s at most) until the file reads and satisfies `done`.
async fn until(path: &Path, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..300 {
        if let Some(file) = read(path)
            && done(&file)
        {
            return file;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the file never showed {what}: {:?}", read(path));
}

#[tokio::test]
async fn the_file_says_which_replicas_drain_or_are_unhealthy_and_follows_each_change() {
    let dir = std::env::temp_dir().join(format!("inferrail-eds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replicas.json");
    let yaml = format!(
        "models: [{{name: m}}]\neds: {{path: {path:?}, cluster: engines}}\nreplicas:\n{}",
        (1..=3).map(|i| format!("  - {{id: r{i}, address: 10.0.0.{i}:8000, models: [m]}}\n")).collect::<String>()
    );
    let router = Arc::new(Router::new(Config::parse(&yaml).unwrap()).unwrap());
    let fleet = router.fleet();
    fleet.replicas[1].set_draining(true);
    fleet.replicas[2].set_probe(false);
    let want = |second: &str| {
        vec![
            ("10.0.0.1".to_string(), 8000, "HEALTHY".to_string()),
            ("10.0.0.2".to_string(), 8000, second.to_string()),
            ("10.0.0.3".to_string(), 8000, "UNHEALTHY".to_string()),
        ]
    };
    assert_eq!(statuses(&assignment(&fleet, "engines", router.now_ms(), 1)), want("DRAINING"));

    tokio::spawn(run(router.clone()));
    let first = until(&path, "the drain", |f| statuses(f) == want("DRAINING")).await;
    // Resumed: the file is rewritten, under a new version.
    fleet.replicas[1].set_draining(false);
    let second = until(&path, "the resume", |f| statuses(f) == want("HEALTHY")).await;
    assert_ne!(first["version_info"], second["version_info"]);
    assert!(!dir.join("replicas.json.next").exists(), "written beside, then renamed");
}

/// A replica held until Envoy knows it is announced once the file lists it,
/// even when the file need not change: here a reload replaces an unhealthy
/// replica (a new cache shape) by a held one at the same address, which the
/// file says the same of.
#[tokio::test]
async fn a_held_replica_is_announced_though_the_file_already_says_the_same() {
    let dir = std::env::temp_dir().join(format!("inferrail-eds-held-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replicas.json");
    let yaml = |blocks: u32| {
        format!(
            "models: [{{name: m}}]\neds: {{path: {path:?}}}\nreplicas: [{{id: r1, address: 10.0.0.1:8000, models: [m], kv_blocks: {blocks}}}]\n"
        )
    };
    let router = Arc::new(Router::new(Config::parse(&yaml(100)).unwrap()).unwrap());
    router.fleet().replicas[0].set_probe(false);
    tokio::spawn(run(router.clone()));
    until(&path, "the unhealthy replica", |f| f["resources"][0]["endpoints"][0]["lb_endpoints"][0]["health_status"] == "UNHEALTHY").await;
    let written = read(&path).unwrap()["version_info"].clone();
    router.hold_joiners.probe.store(true, std::sync::atomic::Ordering::Relaxed);
    router.hold_joiners.eds.store(true, std::sync::atomic::Ordering::Relaxed);
    router.reload(Config::parse(&yaml(200)).unwrap()).unwrap();
    let held = router.fleet().replicas[0].clone();
    assert!(!held.announced(), "the replacement starts held");
    for _ in 0..300 {
        if held.announced() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(held.announced(), "announced by the file that already lists it");
    assert_eq!(read(&path).unwrap()["version_info"], written, "with nothing to rewrite");
}
