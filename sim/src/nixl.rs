//! Disaggregated prefill and decode, as vLLM 0.32's `NixlConnector` speaks
//! it in pull mode.
//!
//! With `--kv-transfer-config` the simulator plays either leg of a request:
//! - **Prefill (P):** a request whose `kv_transfer_params` has
//!   `do_remote_decode: true` is prefilled like any other. When it finishes,
//!   its blocks stay in use under an id, and the response carries the
//!   top-level `kv_transfer_params` a decoder needs (`prefill_params`). The
//!   blocks are freed when a decoder has read them, or when the lease
//!   (`kv_lease_duration`, 30 s) runs out, which counts an expired request.
//! - **Decode (D):** a request whose `kv_transfer_params` has
//!   `do_remote_prefill: true` gets blocks for its whole prompt; the ones its
//!   own cache lacks are read from P (`read`), and they are cached on D (with
//!   `BlockStored` events). D then recomputes the last prompt token and
//!   generates every output token itself. It reports P's
//!   `remote_prefill_cached_tokens` as its cached tokens. A read that fails
//!   ends the request with vLLM's internal error (`kv_load_failure_policy`
//!   `fail`, the default) or prefills it on D (`recompute`).
//!
//! The side channel is the simulator's own HTTP port: `remote_host` and
//! `remote_port` name it, and D reads with `POST /_sim/nixl/read`. P answers
//! after the transfer's time (`--kv-transfer-block-us` per block, on the
//! latency model's scale) and frees the blocks then. Heartbeats are not
//! modelled: a lease outlives any read, which takes milliseconds.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::Rng;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::cost::{LatencyModel, secs};
use crate::errors::ApiError;

/// Bytes of KV per token of an 8B model in 16-bit (32 layers, 8 KV heads of
/// 128, keys and values), for `vllm:nixl_bytes_transferred`.
pub const KV_BYTES_PER_TOKEN: u64 = 32 * 8 * 128 * 2 * 2;

/// Path of the side channel on P.
pub const READ_PATH: &str = "/_sim/nixl/read";

/// `kv_role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefills for remote decoders.
    KvProducer,
    /// Decodes from remote prefills.
    KvConsumer,
    /// Either.
    KvBoth,
}

/// `kv_load_failure_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// The request ends with an internal error.
    #[default]
    Fail,
    /// The request is prefilled on the decoder.
    Recompute,
}

/// The keys read; vLLM's others (`kv_port`, `kv_buffer_device`, ...) change nothing here.
#[derive(Debug, Deserialize)]
struct RawConfig {
    kv_connector: Option<String>,
    kv_role: Option<Role>,
    engine_id: Option<String>,
    #[serde(default)]
    kv_load_failure_policy: FailurePolicy,
    #[serde(default)]
    kv_connector_extra_config: Map<String, Value>,
}

/// The connector the flags configure.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferConfig {
    /// `kv_role`.
    pub role: Role,
    /// `engine_id`, a fresh UUID unless given.
    pub engine_id: String,
    /// `kv_load_failure_policy`.
    pub failure: FailurePolicy,
    /// `kv_connector_extra_config.kv_lease_duration`.
    pub lease: Duration,
}

impl TransferConfig {
    /// Parses vLLM's `--kv-transfer-config` JSON; `rng` draws the engine id.
    pub fn parse(text: &str, rng: &mut impl Rng) -> anyhow::Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).context("--kv-transfer-config is not vLLM's KVTransferConfig JSON")?;
        match raw.kv_connector.as_deref() {
            Some("NixlConnector" | "NixlPullConnector") => {}
            Some(other) => bail!("--kv-transfer-config: kv_connector {other:?} is not simulated (NixlConnector is)"),
            None => bail!("--kv-transfer-config: kv_connector is required (NixlConnector)"),
        }
        let Some(role) = raw.kv_role else {
            bail!("Please specify kv_role when kv_connector is set, supported roles are kv_producer, kv_consumer and kv_both")
        };
        let lease = match raw.kv_connector_extra_config.get("kv_lease_duration") {
            None => 30.0,
            Some(v) => match v.as_f64() {
                Some(s) if s > 0.0 && s.is_finite() => s,
                _ => bail!("--kv-transfer-config: kv_lease_duration must be a positive number of seconds"),
            },
        };
        let engine_id = raw.engine_id.unwrap_or_else(|| uuid4(rng));
        Ok(Self { role, engine_id, failure: raw.kv_load_failure_policy, lease: Duration::from_secs_f64(lease) })
    }
}

fn uuid4(rng: &mut impl Rng) -> String {
    let b: u128 = rng.random();
    let b = (b & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let h = format!("{b:032x}");
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// Where P's blocks are and what P found cached: the `kv_transfer_params`
/// a decode leg carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    /// P's block ids for the prompt (the first KV cache group's).
    pub block_ids: Vec<u32>,
    /// P's internal request id.
    pub request_id: String,
    /// P's side channel.
    pub host: String,
    /// P's side channel port.
    pub port: u16,
    /// `remote_prefill_cached_tokens`, reported as D's cached tokens.
    pub cached_tokens: Option<usize>,
}

/// What a request's `kv_transfer_params` ask of this engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// An ordinary request.
    Whole,
    /// Prefill for a remote decoder and keep the blocks.
    Prefill,
    /// Read the prompt's KV from a remote prefill, then decode.
    Decode(Remote),
}

/// Reads a request's `kv_transfer_params` (an object or null).
pub fn leg(params: Option<&Value>) -> Result<Leg, ApiError> {
    let Some(p) = params.filter(|v| !v.is_null()) else { return Ok(Leg::Whole) };
    let Some(p) = p.as_object() else {
        return Err(ApiError::bad_request("kv_transfer_params must be an object.", Some("kv_transfer_params")));
    };
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("do_remote_decode") {
        return Ok(Leg::Prefill);
    }
    if !flag("do_remote_prefill") {
        return Ok(Leg::Whole);
    }
    let missing = |k: &str| {
        ApiError::bad_request(&format!("kv_transfer_params.{k} is missing or malformed for a remote prefill."), Some("kv_transfer_params"))
    };
    let block_ids = p
        .get("remote_block_ids")
        .and_then(Value::as_array)
        .and_then(|groups| groups.first())
        .and_then(Value::as_array)
        .and_then(|ids| ids.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect::<Option<Vec<u32>>>())
        .ok_or_else(|| missing("remote_block_ids"))?;
    let text = |k: &str| p.get(k).and_then(Value::as_str).map(str::to_owned).ok_or_else(|| missing(k));
    let port = p.get("remote_port").and_then(Value::as_u64).and_then(|n| u16::try_from(n).ok()).ok_or_else(|| missing("remote_port"))?;
    Ok(Leg::Decode(Remote {
        block_ids,
        request_id: text("remote_request_id")?,
        host: text("remote_host")?,
        port,
        cached_tokens: p.get("remote_prefill_cached_tokens").and_then(Value::as_u64).map(|n| n as usize),
    }))
}

/// The internal id vLLM gives a request (`remote_request_id`): the
/// response id, `-0` for a completion's one prompt, and eight random hex digits.
pub fn internal_id(response_id: &str, completion: bool, rng: &mut impl Rng) -> String {
    let suffix: u32 = rng.random();
    if completion { format!("{response_id}-0-{suffix:08x}") } else { format!("{response_id}-{suffix:08x}") }
}

/// What P's side channel is, as its responses name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideChannel {
    /// `remote_host`.
    pub host: String,
    /// `remote_port`.
    pub port: u16,
}

/// The `kv_transfer_params` P answers with, keys in vLLM 0.32's order.
pub fn prefill_params(
    cfg: &TransferConfig,
    side: &SideChannel,
    request_id: &str,
    block_ids: &[u32],
    prompt: usize,
    cached: usize,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [block_ids],
        "remote_engine_id": cfg.engine_id,
        "remote_request_id": request_id,
        "remote_host": side.host,
        "remote_port": side.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt,
        "remote_blocks_expiry_time": null,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached,
    })
}

/// The connector of a running simulator.
#[derive(Debug, Clone)]
pub struct Connector {
    /// Its configuration.
    pub cfg: TransferConfig,
    /// Its side channel, as responses name it.
    pub side: SideChannel,
    /// Times a transfer.
    pub latency: LatencyModel,
    /// Tokens per block.
    pub block_size: usize,
    client: reqwest::Client,
}

impl Connector {
    /// A connector reading over HTTP.
    pub fn new(cfg: TransferConfig, side: SideChannel, latency: LatencyModel, block_size: usize) -> Self {
        Self { cfg, side, latency, block_size, client: reqwest::Client::new() }
    }

    /// Reads the last `blocks` of P's blocks, the ones this engine lacks.
    pub async fn read_tail(&self, remote: &Remote, blocks: usize) -> Result<Transferred, String> {
        let from = remote
            .block_ids
            .len()
            .checked_sub(blocks)
            .ok_or_else(|| format!("{blocks} blocks asked of {} kept", remote.block_ids.len()))?;
        read(&self.client, remote, remote.block_ids[from..].to_vec(), secs(self.latency.transfer_secs(blocks))).await
    }

    /// KV bytes in `blocks` blocks.
    pub fn bytes(&self, blocks: usize) -> u64 {
        KV_BYTES_PER_TOKEN * (self.block_size * blocks) as u64
    }
}

/// D's request on P's side channel.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct ReadRequest {
    /// P's internal request id.
    pub remote_request_id: String,
    /// The blocks read (the tail of P's list that D lacks).
    pub block_ids: Vec<u32>,
    /// How long the transfer takes, seconds.
    pub transfer_s: f64,
}

/// A finished read, for the reader's metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transferred {
    /// Seconds it took.
    pub secs: f64,
    /// Blocks read.
    pub blocks: usize,
}

/// Reads `block_ids` of `remote` from P over its side channel. An error says
/// why the read failed (P gone, lease expired, blocks unknown).
pub async fn read(client: &reqwest::Client, remote: &Remote, block_ids: Vec<u32>, transfer: Duration) -> Result<Transferred, String> {
    let started = Instant::now();
    let blocks = block_ids.len();
    let body = ReadRequest { remote_request_id: remote.request_id.clone(), block_ids, transfer_s: transfer.as_secs_f64() };
    let url = format!("http://{}:{}{READ_PATH}", remote.host, remote.port);
    // vLLM's handshake gives up after 5 s; the transfer itself may take longer.
    let response =
        client.post(&url).timeout(transfer + Duration::from_secs(5)).json(&body).send().await.map_err(|e| format!("{url}: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(format!("{url}: {status}: {text}"));
    }
    Ok(Transferred { secs: started.elapsed().as_secs_f64(), blocks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn the_config_takes_vllms_keys_and_refuses_other_connectors() {
        let mut rng = StdRng::seed_from_u64(1);
        let c = TransferConfig::parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"kv_lease_duration":5}}"#,
            &mut rng,
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!((c.role, c.failure, c.lease), (Role::KvBoth, FailurePolicy::Recompute, Duration::from_secs(5)));
        assert_eq!(c.engine_id.len(), 36);
        assert_eq!(&c.engine_id[14..15], "4");
        for bad in [
            r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#,
            r#"{"kv_connector":"NixlConnector"}"#,
            r#"{"kv_role":"kv_both"}"#,
        ] {
            assert!(TransferConfig::parse(bad, &mut rng).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn the_leg_follows_the_params_and_names_what_is_missing() {
        assert_eq!(leg(None).ok(), Some(Leg::Whole));
        assert_eq!(leg(Some(&Value::Null)).ok(), Some(Leg::Whole));
        let p = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        assert_eq!(leg(Some(&p)).ok(), Some(Leg::Prefill));
        let d = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[3, 4]], "remote_request_id": "cmpl-x-0-1", "remote_host": "localhost", "remote_port": 5600, "remote_prefill_cached_tokens": 16});
        let Ok(Leg::Decode(r)) = leg(Some(&d)) else { panic!("not a decode leg") };
        assert_eq!((r.block_ids, r.port, r.cached_tokens), (vec![3, 4], 5600, Some(16)));
        let mut bad = d.clone();
        bad["remote_block_ids"] = Value::Null;
        let e = leg(Some(&bad)).err().map(|e| e.body).unwrap_or_default();
        assert!(e.contains("remote_block_ids"), "{e}");
    }
}
