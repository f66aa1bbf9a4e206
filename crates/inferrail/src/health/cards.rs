//! The `/v1/models` answer: the configured models and their aliases, with
//! what the engines' own model cards say, refreshed in the background.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use serde_json::{Value, json};

use crate::router::Router;

/// The cards' HTTP client (2 s timeout). One that cannot be built stops
/// start-up: a card read without a timeout could hang the refresh forever.
pub fn client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder().timeout(Duration::from_secs(2)).build().context("cannot build the model cards' HTTP client")
}

/// The `/v1/models` answer: configured models in order, then their aliases,
/// with what the engines' own cards say (`max_model_len`, `root`).
pub fn models_json(router: &Router, cards: &[Value]) -> String {
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let card = |name: &str| cards.iter().find(|c| c["id"] == name);
    let mut data = Vec::new();
    let routing = router.routing();
    for m in routing.config.models.iter().filter_map(|m| routing.names.get(&m.name)).map(|&i| router.core.model(i)) {
        let engine = card(&m.name);
        let entry = |id: &str, parent: Option<&str>| {
            json!({
                "id": id, "object": "model", "created": created, "owned_by": "inferrail",
                "root": engine.map_or(json!(m.name), |c| c["root"].clone()),
                "parent": parent,
                "max_model_len": engine.map_or(Value::Null, |c| c["max_model_len"].clone()),
            })
        };
        data.push(entry(&m.name, None));
        data.extend(m.aliases.iter().map(|a| entry(a, Some(&m.name))));
        // Adapters as the engines list them: their own root, no context length.
        data.extend(m.adapters.iter().map(|a| {
            json!({
                "id": a, "object": "model", "created": created, "owned_by": "inferrail",
                "root": card(a).map_or(json!(a), |c| c["root"].clone()), "parent": m.name, "max_model_len": null,
            })
        }));
    }
    json!({"object": "list", "data": data}).to_string()
}

/// Refreshes the `/v1/models` answer from the engines' own cards, in the
/// background, so that listing models never waits on an engine.
pub async fn cards_loop(router: Arc<Router>, out: Arc<ArcSwap<String>>, http: reqwest::Client) {
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    loop {
        tick.tick().await;
        let mut cards = Vec::new();
        for r in &router.fleet().replicas {
            let url = format!("http://{}/v1/models", r.addr);
            if let Ok(resp) = http.get(url).send().await
                && let Ok(v) = resp.json::<Value>().await
                && let Some(list) = v["data"].as_array()
            {
                cards.extend(list.iter().cloned());
            }
        }
        out.store(Arc::new(models_json(&router, &cards)));
    }
}
