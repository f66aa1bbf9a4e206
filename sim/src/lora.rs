//! LoRA adapters as vLLM 0.32 serves them.
//!
//! [`Adapters`] is the server's list: the `--lora-modules` given at start,
//! and those loaded and unloaded at run time (`POST /v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`, only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`),
//! in load order, each with the id vLLM gives it (counting from 1; a failed
//! load uses one up). An adapter is named in a request's `model`; its blocks
//! are hashed under its name and path, so no other adapter or the base
//! model shares them.
//!
//! [`Weights`] is the engine's side: the adapters whose weights are in host
//! memory (`--max-cpu-loras`) and in GPU slots (`--max-loras`), each least
//! recently used first out. A step that admits a request whose adapter is
//! not in a slot spends the slot copy (`--lora-slot-ms`), and the read from
//! disk first (`--lora-load-ms`) when it is not in host memory either. vLLM
//! has no metric for these; they show only as latency.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

use crate::errors::ApiError;

/// An adapter as the server knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// vLLM's `lora_int_id`.
    pub id: u64,
    /// The name requests use.
    pub name: Arc<str>,
    /// Its path as given (`root` in its model card).
    pub path: String,
    /// The base model it serves under (`parent`).
    pub parent: String,
}

/// One `--lora-modules` item: `name=path`, or a JSON object with `name`,
/// `path` and optionally `base_model_name`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The adapter's name.
    pub name: String,
    /// Where its weights are.
    pub path: String,
    /// The served model it belongs to; another name is ignored, as vLLM does.
    pub base_model_name: Option<String>,
}

/// Parses a `--lora-modules` item as vLLM's `LoRAParserAction` does.
pub fn parse_module(item: &str) -> Result<Module, String> {
    if let Some((name, path)) = item.split_once('=').filter(|_| !item.contains(',')) {
        return Ok(Module { name: name.to_owned(), path: path.to_owned(), base_model_name: None });
    }
    let value: Value = serde_json::from_str(item).map_err(|_| format!("Invalid JSON format for --lora-modules: {item}"))?;
    let field = |k: &str| value.get(k).and_then(Value::as_str).map(str::to_owned);
    match (value.is_object(), field("name"), field("path")) {
        (true, Some(name), Some(path)) => Ok(Module { name, path, base_model_name: field("base_model_name") }),
        _ => Err(format!("Invalid fields for --lora-modules: {item}")),
    }
}

#[derive(Debug, Default)]
struct List {
    adapters: Vec<Adapter>,
    last_id: u64,
}

/// The adapters a server serves, in load order.
#[derive(Debug, Default)]
pub struct Adapters {
    list: Mutex<List>,
}

impl Adapters {
    /// The list with `modules` loaded in order, for a server serving `served`;
    /// an error names the first that cannot be loaded (the server does not start).
    pub fn new(modules: &[Module], served: &[String]) -> anyhow::Result<Self> {
        let adapters = Self::default();
        for m in modules {
            adapters.load(&m.name, &m.path, m.base_model_name.as_deref(), false, served).map_err(|e| anyhow::anyhow!("{}", e.body))?;
        }
        Ok(adapters)
    }

    fn lock(&self) -> MutexGuard<'_, List> {
        self.list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Loads adapter `name` from `path` (`load_inplace` replaces one of that
    /// name, keeping its id and place); the answers are vLLM's.
    pub fn load(&self, name: &str, path: &str, base: Option<&str>, load_inplace: bool, served: &[String]) -> Result<Adapter, ApiError> {
        if name.is_empty() || path.is_empty() {
            return Err(user_error(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."));
        }
        if served.iter().any(|s| s == name) {
            return Err(user_error(400, "InvalidUserInput", &format!("The lora adapter '{name}' conflicts with a served base model.")));
        }
        let mut list = self.lock();
        let existing = list.adapters.iter().position(|a| &*a.name == name);
        if existing.is_some() && !load_inplace {
            let message = format!(
                "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            );
            return Err(user_error(400, "InvalidUserInput", &message));
        }
        // The id is taken before the load is tried, as vLLM's counter is.
        list.last_id += 1;
        let id = existing.map_or(list.last_id, |i| list.adapters[i].id);
        if !Path::new(path).exists() {
            let message = format!("Loading lora {name} failed: No adapter found for {}", sanitize(path));
            return Err(user_error(404, "NotFoundError", &message));
        }
        let parent = base.filter(|b| served.iter().any(|s| s == b)).or(served.first().map(String::as_str)).unwrap_or_default();
        let adapter = Adapter { id, name: name.into(), path: path.to_owned(), parent: parent.to_owned() };
        match existing {
            Some(i) => list.adapters[i] = adapter.clone(),
            None => list.adapters.push(adapter.clone()),
        }
        Ok(adapter)
    }

    /// Forgets adapter `name` (the engine keeps its weights until they are
    /// evicted, as vLLM's does).
    pub fn unload(&self, name: &str) -> Result<(), ApiError> {
        if name.is_empty() {
            return Err(user_error(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."));
        }
        let mut list = self.lock();
        let before = list.adapters.len();
        list.adapters.retain(|a| &*a.name != name);
        if list.adapters.len() == before {
            return Err(user_error(404, "NotFoundError", &format!("The lora adapter '{name}' cannot be found.")));
        }
        Ok(())
    }

    /// Every adapter, in load order.
    pub fn all(&self) -> Vec<Adapter> {
        self.lock().adapters.clone()
    }
}

fn user_error(status: u16, kind: &str, message: &str) -> ApiError {
    ApiError::openai(status, kind, message, None)
}

/// A path in an error message as vLLM's `sanitize_message` shows it: an
/// absolute path (every path here is one, or a name) becomes `<path>`.
fn sanitize(path: &str) -> &str {
    if path.starts_with('/') { "<path>" } else { path }
}

/// The engine's caches of adapter weights.
#[derive(Debug, Clone)]
pub struct Weights {
    /// Adapters in host memory and in GPU slots, least recently used first.
    cpu: Vec<u64>,
    gpu: Vec<u64>,
    /// How many adapters a step may run (`--max-loras`), and host memory holds.
    pub max_loras: usize,
    max_cpu_loras: usize,
    /// Seconds to read an adapter from disk, and to copy it into a slot.
    load_secs: f64,
    slot_secs: f64,
}

impl Weights {
    /// Empty caches for `max_loras` slots and `max_cpu_loras` in host memory
    /// (at least as many), reading in `load_secs` and copying in `slot_secs`.
    pub fn new(max_loras: usize, max_cpu_loras: usize, load_secs: f64, slot_secs: f64) -> Self {
        Self { cpu: Vec::new(), gpu: Vec::new(), max_loras, max_cpu_loras: max_cpu_loras.max(max_loras), load_secs, slot_secs }
    }

    /// Puts adapter `id` in a slot (evicting the least recently used); returns
    /// the seconds that took: none when it was there.
    pub fn activate(&mut self, id: u64) -> f64 {
        let mut secs = 0.0;
        if !touch(&mut self.cpu, id) {
            if self.cpu.len() >= self.max_cpu_loras {
                let gone = self.cpu.remove(0);
                // Leaving host memory deactivates it too.
                self.gpu.retain(|&g| g != gone);
            }
            self.cpu.push(id);
            secs += self.load_secs;
        }
        if !touch(&mut self.gpu, id) {
            if self.gpu.len() >= self.max_loras {
                self.gpu.remove(0);
            }
            self.gpu.push(id);
            secs += self.slot_secs;
        }
        secs
    }
}

/// Moves `id` to the most recent end of `lru`; false when it was not there.
fn touch(lru: &mut Vec<u64>, id: u64) -> bool {
    match lru.iter().position(|&x| x == id) {
        Some(i) => {
            lru.remove(i);
            lru.push(id);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_parse_as_vllm_parses_them() {
        assert_eq!(parse_module("a=/w/a").unwrap(), Module { name: "a".into(), path: "/w/a".into(), base_model_name: None });
        let json = r#"{"name": "b", "path": "/w/b", "base_model_name": "m"}"#;
        assert_eq!(parse_module(json).unwrap().base_model_name.as_deref(), Some("m"));
        assert!(parse_module("[1]").unwrap_err().starts_with("Invalid fields"));
        assert!(parse_module("{nope").unwrap_err().starts_with("Invalid JSON format"));
    }

    #[test]
    fn ids_count_from_one_and_a_failed_load_uses_one() {
        let dir = std::env::temp_dir();
        let path = dir.to_str().unwrap();
        let served = ["m".to_string()];
        let list = Adapters::default();
        assert_eq!(list.load("a", path, None, false, &served).unwrap().id, 1);
        let missing = list.load("b", "/nowhere/at/all", None, false, &served).unwrap_err();
        assert_eq!(missing.status, 404);
        assert!(missing.body.contains("No adapter found for <path>"), "{}", missing.body);
        let b = list.load("b", path, Some("other"), false, &served).unwrap();
        assert_eq!((b.id, b.parent.as_str()), (3, "m"), "a base name not served is ignored");
        assert_eq!(list.load("a", path, None, false, &served).unwrap_err().status, 400);
        assert_eq!(list.load("a", path, None, true, &served).unwrap().id, 1, "in place keeps the id");
        assert_eq!(list.load("m", path, None, false, &served).unwrap_err().status, 400);
        list.unload("a").unwrap();
        assert_eq!(list.unload("a").unwrap_err().status, 404);
        assert_eq!(list.all().iter().map(|a| &*a.name).collect::<Vec<_>>(), ["b"]);
    }

    #[test]
    fn weights_cost_a_read_and_a_copy_only_when_missing() {
        let mut w = Weights::new(2, 3, 0.05, 0.005);
        let mut costs = |id: u64, secs: f64, why: &str| assert!((w.activate(id) - secs).abs() < 1e-12, "{why}");
        costs(1, 0.055, "first use: read and copied");
        costs(1, 0.0, "in a slot");
        costs(2, 0.055, "second slot");
        costs(3, 0.055, "a third adapter: read, and the least recent slot freed");
        costs(1, 0.005, "still in host memory: only the copy");
        costs(4, 0.055, "host memory full: the least recent (2) leaves it");
        costs(2, 0.055, "read again");
        costs(4, 0.0, "4 and 2 hold the slots");
        costs(2, 0.0, "4 and 2 hold the slots");
        costs(1, 0.005, "1 left its slot but not host memory");
    }
}
