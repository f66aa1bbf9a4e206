//! Command-line flags of `inferrail-sim`, named after vLLM's where vLLM has one.

use std::net::IpAddr;

use clap::Parser;

use anyhow::Context;
use inferrail_kv_events::publish::{PublisherConfig, Skip};

use crate::cost::{self, LatencyModel};
use crate::events::KvEventsConfig;
use crate::fault::Fault;
use crate::lora::{self, Module};
use crate::offload::OffloadConfig;

/// A CPU mock of a vLLM 0.32.0 OpenAI-compatible server.
#[derive(Debug, Clone, Parser)]
#[command(name = "inferrail-sim", version)]
pub struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model path the engine pretends to serve (`root` in the model card).
    #[arg(long, default_value = "inferrail/sim-8b")]
    pub model: String,
    /// Names clients may request; the first one labels the metrics. Defaults to `--model`.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// The tokenizer: `builtin:sim`, a directory with `tokenizer.json` and
    /// `tokenizer_config.json`, or `hf:<org>/<name>` from the local Hugging Face cache.
    #[arg(long, default_value = "builtin:sim")]
    pub tokenizer: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    pub num_gpu_blocks_override: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Most prompt tokens prefilled in one engine step (a single longer prompt still runs alone).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Context length: prompt plus output tokens.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: usize,
    /// Requests to `/v1` paths must carry `Authorization: Bearer <key>`, as with vLLM's flag.
    #[arg(long, env = "VLLM_API_KEY")]
    pub api_key: Option<String>,
    /// Report `usage.prompt_tokens_details.cached_tokens`.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Tokens a chat request without `max_tokens` generates before it stops as if at end of sequence.
    #[arg(long, default_value_t = 256)]
    pub default_output_tokens: usize,
    /// Prefill cost per uncached token, microseconds (`a`).
    #[arg(long, default_value_t = cost::DEFAULT.prefill_token_us)]
    pub prefill_token_us: f64,
    /// Prefill cost per attended token pair, nanoseconds (`b`).
    #[arg(long, default_value_t = cost::DEFAULT.prefill_pair_ns)]
    pub prefill_pair_ns: f64,
    /// Fixed cost of a prefill, milliseconds (`d`).
    #[arg(long, default_value_t = cost::DEFAULT.prefill_fixed_ms)]
    pub prefill_fixed_ms: f64,
    /// Time of one decode step with one running sequence, milliseconds.
    #[arg(long, default_value_t = cost::DEFAULT.decode_token_ms)]
    pub decode_token_ms: f64,
    /// Extra decode step time for each further running sequence, microseconds.
    #[arg(long, default_value_t = cost::DEFAULT.decode_seq_us)]
    pub decode_seq_us: f64,
    /// Time to move one KV block to a decoder that reads it, microseconds.
    #[arg(long, default_value_t = cost::DEFAULT.transfer_block_us)]
    pub kv_transfer_block_us: f64,
    /// Disaggregated prefill and decode as vLLM's NixlConnector does it:
    /// vLLM's JSON, e.g. `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`.
    /// Optional keys: `engine_id`, `kv_load_failure_policy` (`fail` or
    /// `recompute`) and `kv_connector_extra_config.kv_lease_duration` (seconds).
    #[arg(long)]
    pub kv_transfer_config: Option<String>,
    /// Offload KV blocks to a host tier of this many GiB, as vLLM's native
    /// `OffloadingConnector` does (also through `--kv-transfer-config` with
    /// `"kv_connector":"OffloadingConnector"` and `cpu_bytes_to_use`).
    #[arg(long)]
    pub kv_offloading_size: Option<f64>,
    /// The offloading backend; only `native` is simulated.
    #[arg(long, default_value = "native")]
    pub kv_offloading_backend: String,
    /// Bytes of KV one token takes, over all layers (the default is an 8B
    /// model's in 16 bits: 32 layers, 8 KV heads of 128, keys and values).
    /// Sizes the host tier in blocks.
    #[arg(long, default_value_t = cost::KV_BYTES_PER_TOKEN)]
    pub kv_cache_bytes_per_token: usize,
    /// Speed of copies between the GPU and the host tier, GB/s (an
    /// assumption: about what PCIe 4.0 x16 sustains).
    #[arg(long, default_value_t = cost::OFFLOAD_GBS)]
    pub kv_offload_bandwidth_gbs: f64,
    /// Serve LoRA adapters (`--lora-modules`, and at run time with
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`).
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters served from the start, space separated: `name=path`, or a
    /// JSON object with `name`, `path` and `base_model_name`. Each path must exist.
    #[arg(long, num_args = 1.., value_parser = lora::parse_module)]
    pub lora_modules: Vec<Module>,
    /// Adapters load and unload at run time (`POST /v1/load_lora_adapter`,
    /// `/v1/unload_lora_adapter`), as vLLM's environment variable allows.
    #[arg(long, env = "VLLM_ALLOW_RUNTIME_LORA_UPDATING")]
    pub allow_runtime_lora_updating: bool,
    /// Adapters one engine step may run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_loras: u64,
    /// Adapters kept in host memory (default: `--max-loras`; no fewer).
    #[arg(long)]
    pub max_cpu_loras: Option<u64>,
    /// Highest adapter rank taken (vLLM's choices).
    #[arg(long, default_value_t = 16, value_parser = lora_rank)]
    pub max_lora_rank: u32,
    /// Time to read an adapter from disk into host memory, milliseconds (an
    /// assumption, not a measurement: tens of megabytes from local disk).
    #[arg(long, default_value_t = cost::LORA_LOAD_MS)]
    pub lora_load_ms: f64,
    /// Time to copy an adapter from host memory into a GPU slot, milliseconds
    /// (an assumption: tens of megabytes over PCIe).
    #[arg(long, default_value_t = cost::LORA_SLOT_MS)]
    pub lora_slot_ms: f64,
    /// Answer as fast as possible: every engine step takes no time.
    #[arg(long)]
    pub zero_latency: bool,
    /// Seed for response ids and generated tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Start with a fault injected: refuse, close, hang, delay, error or flap.
    #[arg(long, value_enum, default_value = "none")]
    pub fault: FaultMode,
    /// Status answered by `--fault error` and by `--fault flap` while down.
    #[arg(long, default_value_t = 503)]
    pub fault_status: u16,
    /// Delay added by `--fault delay`, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub fault_delay_ms: u64,
    /// Length of each up and each down phase of `--fault flap`, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub fault_period_ms: u64,
    /// Publish KV cache events as vLLM does: vLLM's JSON, e.g.
    /// `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":"kv-events"}`.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// A fault: KV event batches to number and keep for replay but never send,
    /// `rate:P` (each with probability P, by `--seed`) or `seq:N,N,...`.
    #[arg(long)]
    pub kv_events_skip: Option<String>,
}

/// A `--max-lora-rank`: one of vLLM's choices.
fn lora_rank(s: &str) -> Result<u32, String> {
    const RANKS: [u32; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];
    s.parse().ok().filter(|r| RANKS.contains(r)).ok_or_else(|| format!("{s:?} is not one of {RANKS:?}"))
}

/// The fault named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FaultMode {
    /// No fault.
    None,
    /// Refuse connections.
    Refuse,
    /// Accept, then close the connection without answering.
    Close,
    /// Never answer.
    Hang,
    /// Answer after `--fault-delay-ms`.
    Delay,
    /// Answer `--fault-status` in the OpenAI error shape.
    Error,
    /// Alternate between healthy and `--fault-status` every `--fault-period-ms`.
    Flap,
}

impl Args {
    /// The names clients may request.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() { vec![self.model.clone()] } else { self.served_model_name.clone() }
    }

    /// The latency model the flags describe.
    pub fn latency(&self) -> LatencyModel {
        LatencyModel {
            prefill_token_us: self.prefill_token_us,
            prefill_pair_ns: self.prefill_pair_ns,
            prefill_fixed_ms: self.prefill_fixed_ms,
            decode_token_ms: self.decode_token_ms,
            decode_seq_us: self.decode_seq_us,
            transfer_block_us: self.kv_transfer_block_us,
            zero: self.zero_latency,
        }
    }

    /// The fault the flags inject at start.
    pub fn fault(&self) -> Fault {
        match self.fault {
            FaultMode::None => Fault::None,
            FaultMode::Refuse => Fault::Refuse,
            FaultMode::Close => Fault::Close,
            FaultMode::Hang => Fault::Hang,
            FaultMode::Delay => Fault::Delay { ms: self.fault_delay_ms },
            FaultMode::Error => Fault::Error { status: self.fault_status },
            FaultMode::Flap => Fault::Flap { period_ms: self.fault_period_ms, status: self.fault_status },
        }
    }

    /// The KV event publisher the flags ask for, if any.
    pub fn kv_events(&self) -> anyhow::Result<Option<PublisherConfig>> {
        let config = match &self.kv_events_config {
            Some(json) => KvEventsConfig::parse(json)?,
            None => KvEventsConfig::default(),
        };
        let skip = match &self.kv_events_skip {
            Some(text) => Skip::parse(text, self.seed).context("--kv-events-skip")?,
            None => Skip::Never,
        };
        if !config.enabled() {
            if self.kv_events_skip.is_some() {
                anyhow::bail!("--kv-events-skip needs KV events on (--kv-events-config with enable_kv_cache_events)");
            }
            return Ok(None);
        }
        Ok(Some(config.publisher(skip)))
    }

    /// The host tier the flags ask for, if any.
    pub fn offload(&self) -> anyhow::Result<Option<OffloadConfig>> {
        let bytes = self.block_size * self.kv_cache_bytes_per_token;
        let config = OffloadConfig::from_flags(
            self.kv_offloading_size,
            &self.kv_offloading_backend,
            self.kv_transfer_config.as_deref(),
            self.block_size,
            bytes,
            self.kv_offload_bandwidth_gbs,
        )?;
        Ok(config.map(|c| if self.zero_latency { OffloadConfig { block_secs: 0.0, ..c } } else { c }))
    }

    /// The engine's adapter weights the flags ask for, if adapters are on.
    pub fn lora(&self) -> anyhow::Result<Option<lora::Weights>> {
        if !self.enable_lora {
            anyhow::ensure!(self.lora_modules.is_empty(), "--lora-modules needs --enable-lora");
            return Ok(None);
        }
        let max_cpu = self.max_cpu_loras.unwrap_or(self.max_loras);
        anyhow::ensure!(max_cpu >= self.max_loras, "max_cpu_loras ({max_cpu}) must be >= max_loras ({}).", self.max_loras);
        let (load, slot) = if self.zero_latency { (0.0, 0.0) } else { (self.lora_load_ms * 1e-3, self.lora_slot_ms * 1e-3) };
        Ok(Some(lora::Weights::new(self.max_loras as usize, max_cpu as usize, load, slot)))
    }

    /// Flags for an in-process simulator: defaults, a free port, and the given extra flags.
    pub fn for_test(extra: &[&str]) -> Self {
        let base = ["inferrail-sim", "--port", "0"];
        Self::parse_from(base.iter().chain(extra))
    }
}
