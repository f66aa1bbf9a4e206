//! `inferrail-sim`: a CPU mock of a vLLM 0.32.0 OpenAI-compatible server.
//!
//! Everything else in the project is developed and tested against it, so it
//! answers with vLLM's bytes (`wire`, `errors`), keeps a real prefix cache
//! (`cache`), schedules like a continuously batching engine on a virtual
//! timeline (`engine`, `cost`), exports vLLM's metrics (`metrics`) and can
//! misbehave on demand (`fault`). With `--kv-events-config` it publishes
//! vLLM's KV cache events over ZMQ (`events`); with `--kv-transfer-config`
//! it serves either leg of a disaggregated request (`nixl`); with
//! `--enable-lora`, LoRA adapters (`lora`); with `--kv-offloading-size`, a
//! host tier for KV blocks (`offload`). `api` routes HTTP requests;
//! `server` accepts connections. [`Sim::start`] runs one inside any tokio
//! program or test.

pub use inferrail_engine::{cache, cost};

pub mod api;
pub mod args;
pub mod engine;
pub mod errors;
pub mod events;
pub mod fault;
pub mod lora;
pub mod metrics;
pub mod nixl;
pub mod offload;
pub mod server;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use inferrail_kv_events::publish::Publisher;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::api::{ApiConfig, App};
use crate::args::Args;
use crate::engine::{Engine, EngineConfig};
use crate::fault::Faults;
use crate::metrics::EngineInfo;
use crate::nixl::{Connector, FailurePolicy, SideChannel, TransferConfig};

/// Tokens of repeated prompt pieces the tokenizer keeps encoded.
const TOKENIZER_CACHE_TOKENS: usize = 1 << 20;

/// A running simulator.
pub struct Sim {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state, for tests that reach in.
    pub app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Sim {
    /// Checks the flags, binds the port and starts serving.
    pub async fn start(args: Args) -> anyhow::Result<Self> {
        check(&args)?;
        let names = args.served_names();
        let tokenizer = Arc::new(
            inferrail_tokenize::Tokenizer::load(&args.tokenizer, TOKENIZER_CACHE_TOKENS)
                .with_context(|| format!("loading tokenizer {}", args.tokenizer))?,
        );
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let kv_events = match args.kv_events()? {
            Some(config) => {
                let publisher = Publisher::start(config).await.context("starting the KV event publisher")?;
                tracing::info!(endpoint = publisher.endpoint(), replay = ?publisher.replay_endpoint(), "publishing KV events");
                Some(Arc::new(publisher))
            }
            None => None,
        };
        let listener = TcpListener::bind((args.host, args.port)).await.with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(args.seed);
        let offload = args.offload()?;
        // A transfer config that names the offloading connector is not a NIXL one.
        let nixl = args.kv_transfer_config.as_deref().filter(|_| offload.is_none());
        let transfer = nixl.map(|json| TransferConfig::parse(json, &mut rng)).transpose()?;
        let engine = Engine::start(EngineConfig {
            block_size: args.block_size,
            num_blocks: args.num_gpu_blocks_override,
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            latency: args.latency(),
            seed: args.seed,
            generation_ids: tokenizer.generation_ids(),
            info: EngineInfo {
                model_name: names[0].clone(),
                block_size: args.block_size,
                num_gpu_blocks: args.num_gpu_blocks_override,
                max_model_len: args.max_model_len,
                created,
                kv_transfer: transfer.is_some(),
                kv_offloading_size: args.kv_offloading_size,
            },
            kv_events,
            lease: transfer.as_ref().map_or(std::time::Duration::from_secs(30), |t| t.lease),
            failure: transfer.as_ref().map_or(FailurePolicy::Fail, |t| t.failure),
            lora: args.lora()?,
            offload,
        });
        let connector = transfer.map(|cfg| Connector::new(cfg, side_channel(&args, addr), args.latency(), args.block_size));
        let app = Arc::new(App::new(
            ApiConfig {
                names,
                tokenizer,
                root: args.model.clone(),
                max_model_len: args.max_model_len,
                details: args.enable_prompt_tokens_details,
                default_output_tokens: args.default_output_tokens,
                seed: args.seed,
                connector,
                api_key: args.api_key.clone(),
                lora: args.enable_lora.then(|| args.lora_modules.clone()),
                runtime_lora: args.allow_runtime_lora_updating,
            },
            engine,
            Faults::new(args.fault()),
        )?);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(app.clone(), listener, async {
            // A dropped sender stops the server as well.
            let _ = stopped.await;
        }));
        Ok(Self { addr, app, stop: Some(stop), task })
    }

    /// The base URL, `http://ip:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections and waits for the accept loop to end.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await??;
        Ok(())
    }
}

/// Where decoders reach this engine's kept blocks: its HTTP port, on
/// `VLLM_NIXL_SIDE_CHANNEL_HOST` if set, else the address it listens on
/// (`localhost` when that is every address).
fn side_channel(args: &Args, addr: SocketAddr) -> SideChannel {
    let host = match std::env::var("VLLM_NIXL_SIDE_CHANNEL_HOST") {
        Ok(h) if !h.is_empty() => h,
        _ if args.host.is_unspecified() => "localhost".to_owned(),
        _ => args.host.to_string(),
    };
    SideChannel { host, port: addr.port() }
}

/// Refuses flag combinations a real engine would refuse to start with.
fn check(args: &Args) -> anyhow::Result<()> {
    if args.block_size == 0 || args.num_gpu_blocks_override == 0 || args.max_num_seqs == 0 || args.max_model_len < 2 {
        bail!("--block-size, --num-gpu-blocks-override and --max-num-seqs must be at least 1, --max-model-len at least 2");
    }
    let capacity = args.block_size * args.num_gpu_blocks_override;
    if args.max_model_len > capacity {
        bail!(
            "the model's max seq len ({}) is larger than the maximum number of tokens that can be stored in KV cache ({capacity}); raise --num-gpu-blocks-override or lower --max-model-len",
            args.max_model_len
        );
    }
    Ok(())
}
