//! The engine's statistics and their `/metrics` page in vLLM's names, help
//! text, labels, buckets and `prometheus_client` text format.

use std::fmt::Write;

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with the given bucket upper bounds.
    pub fn new(bounds: Vec<f64>) -> Self {
        Self { counts: vec![0; bounds.len()], bounds, sum: 0.0, count: 0 }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

/// vLLM's 1-2-5 buckets up to `max`.
pub fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1usize;
    'outer: loop {
        for m in [1, 2, 5] {
            let v = m * scale;
            if v > max {
                break 'outer;
            }
            out.push(v as f64);
        }
        scale *= 10;
    }
    out
}

const LATENCY_SECS: [f64; 21] =
    [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];
const TTFT_SECS: [f64; 22] =
    [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
const TOKEN_SECS: [f64; 19] = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITERATION_TOKENS: [f64; 13] = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
const PREEMPTIONS: [f64; 7] = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];
const PARAMS_N: [f64; 5] = [1.0, 2.0, 5.0, 10.0, 20.0];

/// Why a request finished, as `finished_reason` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Stopped as if at an end-of-sequence token.
    Stop,
    /// Reached `max_tokens`.
    Length,
    /// The client went away.
    Abort,
    /// The engine failed the request (a decode leg's KV could not be read).
    Error,
}

impl FinishReason {
    /// The label and response value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

/// Fixed facts about the engine that label its metrics.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The first served model name.
    pub model_name: String,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the KV cache.
    pub num_gpu_blocks: usize,
    /// Context length.
    pub max_model_len: usize,
    /// Unix time the metrics were created.
    pub created: f64,
    /// A KV connector is configured: the NIXL metrics are on the page.
    pub kv_transfer: bool,
    /// `--kv-offloading-size`, GiB, when given.
    pub kv_offloading_size: Option<f64>,
}

/// What `vllm:lora_requests_info` tells, as vLLM 0.32 keeps it: the
/// adapters of the requests that have had output and not finished, in the
/// order first seen, written as both its running and its waiting list
/// (0.32 writes every adapter it tracks into both), and stamped with the
/// time at every step. A list once written stays on the page with its
/// last time.
#[derive(Debug, Clone, Default)]
pub struct LoraInfo {
    /// `--max-loras`.
    pub max_loras: u64,
    /// Adapters with requests that have had output, and how many.
    tracked: Vec<(String, usize)>,
    /// Each list written, and when it was last (seconds since the epoch), in the order first written.
    series: Vec<(String, f64)>,
}

impl LoraInfo {
    /// No adapter tracked yet, for `max_loras` slots.
    pub fn new(max_loras: u64) -> Self {
        Self { max_loras, ..Self::default() }
    }

    /// A request of adapter `name` had its first output.
    pub fn started(&mut self, name: &str) {
        match self.tracked.iter_mut().find(|(n, _)| n == name) {
            Some((_, count)) => *count += 1,
            None => self.tracked.push((name.to_owned(), 1)),
        }
    }

    /// A request of adapter `name` that had output ended.
    pub fn ended(&mut self, name: &str) {
        if let Some(i) = self.tracked.iter().position(|(n, _)| n == name) {
            self.tracked[i].1 -= 1;
            if self.tracked[i].1 == 0 {
                self.tracked.remove(i);
            }
        }
    }

    /// A step ended at `unix` seconds: the current list is written with that time.
    pub fn stamp(&mut self, unix: f64) {
        let list = self.tracked.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(",");
        match self.series.iter_mut().find(|(l, _)| *l == list) {
            Some((_, at)) => *at = unix,
            None => self.series.push((list, unix)),
        }
    }

    fn render(&self, p: &mut Page<'_>) {
        let name = "vllm:lora_requests_info";
        p.header(name, "Running stats on lora requests.", "gauge");
        let max = self.max_loras.to_string();
        for (list, at) in &self.series {
            let labels = [("max_lora", max.as_str()), ("running_lora_adapters", list.as_str()), ("waiting_lora_adapters", list.as_str())];
            p.line(name, &labels, *at);
        }
    }
}

/// Everything `/metrics` reports, updated by the engine.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Sequences running.
    pub running: usize,
    /// Sequences waiting.
    pub waiting: usize,
    /// Of those, the ones a step passed over for want of an adapter slot.
    pub deferred: usize,
    /// The adapters' info gauge, when adapters are on.
    pub lora: Option<LoraInfo>,
    /// Fraction of KV blocks in use.
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: u64,
    /// Sequences preempted.
    pub preemptions: u64,
    /// Prompt tokens prefilled or found cached.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Finished requests: stop, length, abort, error.
    pub finished: [u64; 4],
    /// Prompt tokens a connector supplied: read from a remote prefill or
    /// loaded from the host tier.
    pub external_hits: u64,
    /// Of those, the ones loaded from the host tier.
    pub host_hits: u64,
    /// Prompt tokens looked up through a connector (past the GPU hit).
    pub external_queries: u64,
    /// The NIXL connector's metrics.
    pub nixl: Nixl,
    /// The offloading connector's counters, when it is on.
    pub offload: Option<Offload>,
    /// Per-request prompt tokens.
    pub request_prompt_tokens: Histogram,
    /// Per-request generated tokens.
    pub request_generation_tokens: Histogram,
    /// Tokens per engine step.
    pub iteration_tokens: Histogram,
    /// Per-request maximum tokens to generate.
    pub request_max_generation_tokens: Histogram,
    /// The `n` parameter.
    pub params_n: Histogram,
    /// The `max_tokens` parameter.
    pub params_max_tokens: Histogram,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens.
    pub inter_token: Histogram,
    /// Per-request mean time per output token.
    pub time_per_output_token: Histogram,
    /// End-to-end latency.
    pub e2e: Histogram,
    /// Time waiting.
    pub queue: Histogram,
    /// Time running.
    pub inference: Histogram,
    /// Time prefilling.
    pub prefill: Histogram,
    /// Time decoding.
    pub decode: Histogram,
    /// Preemptions per request.
    pub request_preemptions: Histogram,
    /// Tokens computed (not cached) in prefill, per request.
    pub prefill_computed_tokens: Histogram,
}

impl Stats {
    /// Zeroed statistics with vLLM's buckets for a model of `max_model_len`.
    pub fn new(max_model_len: usize) -> Self {
        let tokens = || Histogram::new(buckets_1_2_5(max_model_len));
        let secs = || Histogram::new(LATENCY_SECS.to_vec());
        Self {
            running: 0,
            waiting: 0,
            deferred: 0,
            lora: None,
            kv_usage: 0.0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            finished: [0; 4],
            external_hits: 0,
            host_hits: 0,
            external_queries: 0,
            nixl: Nixl::default(),
            offload: None,
            request_prompt_tokens: tokens(),
            request_generation_tokens: tokens(),
            iteration_tokens: Histogram::new(ITERATION_TOKENS.to_vec()),
            request_max_generation_tokens: tokens(),
            params_n: Histogram::new(PARAMS_N.to_vec()),
            params_max_tokens: tokens(),
            ttft: Histogram::new(TTFT_SECS.to_vec()),
            inter_token: Histogram::new(TOKEN_SECS.to_vec()),
            time_per_output_token: Histogram::new(TOKEN_SECS.to_vec()),
            e2e: secs(),
            queue: secs(),
            inference: secs(),
            prefill: secs(),
            decode: secs(),
            request_preemptions: Histogram::new(PREEMPTIONS.to_vec()),
            prefill_computed_tokens: tokens(),
        }
    }

    /// Counts a finished request.
    pub fn count_finish(&mut self, reason: FinishReason) {
        self.finished[reason as usize] += 1;
    }

    /// The `/metrics` page.
    pub fn render(&self, info: &EngineInfo) -> String {
        let mut p = Page { out: String::with_capacity(48 * 1024), model: &info.model_name, created: info.created };
        let mfu = "(for Model Flops Utilization calculations).";
        p.counter(
            "vllm:estimated_flops_per_gpu_total",
            &format!("Estimated number of floating point operations per GPU {mfu}"),
            &[(&[], 0.0)],
        );
        p.counter(
            "vllm:estimated_read_bytes_per_gpu_total",
            &format!("Estimated number of bytes read from memory per GPU {mfu}"),
            &[(&[], 0.0)],
        );
        p.counter(
            "vllm:estimated_write_bytes_per_gpu_total",
            &format!("Estimated number of bytes written to memory per GPU {mfu}"),
            &[(&[], 0.0)],
        );
        p.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", &[(&[], self.running as f64)]);
        p.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", &[(&[], self.waiting as f64)]);
        p.gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            &[(&[("reason", "capacity")], self.waiting.saturating_sub(self.deferred) as f64), (&[("reason", "deferred")], self.deferred as f64)],
        );
        if let Some(lora) = &self.lora {
            lora.render(&mut p);
        }
        p.gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            &[(&[("sleep_state", "awake")], 1.0), (&[("sleep_state", "weights_offloaded")], 0.0), (&[("sleep_state", "discard_all")], 0.0)],
        );
        p.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", &[(&[], self.kv_usage)]);
        p.counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            &[(&[], self.prefix_queries as f64)],
        );
        p.counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            &[(&[], self.prefix_hits as f64)],
        );
        let external = "External prefix cache";
        let sharing = "from KV connector cross-instance cache sharing, in terms of number of";
        p.counter(
            "vllm:external_prefix_cache_queries_total",
            &format!("{external} queries {sharing} queried tokens."),
            &[(&[], self.external_queries as f64)],
        );
        p.counter(
            "vllm:external_prefix_cache_hits_total",
            &format!("{external} hits {sharing} cached tokens."),
            &[(&[], self.external_hits as f64)],
        );
        p.counter("vllm:mm_cache_queries_total", "Multi-modal cache queries, in terms of number of queried items.", &[(&[], 0.0)]);
        p.counter("vllm:mm_cache_hits_total", "Multi-modal cache hits, in terms of number of cached items.", &[(&[], 0.0)]);
        p.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", &[(&[], self.preemptions as f64)]);
        p.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", &[(&[], self.prompt_tokens as f64)]);
        let external = self.external_hits as f64;
        let computed = (self.prompt_tokens - self.prefix_hits - self.external_hits) as f64;
        p.counter(
            "vllm:prompt_tokens_by_source_total",
            "Number of prompt tokens by source.",
            &[
                (&[("source", "local_compute")], computed),
                (&[("source", "local_cache_hit")], self.prefix_hits as f64),
                (&[("source", "external_kv_transfer")], external),
            ],
        );
        p.counter(
            "vllm:prompt_tokens_cached_total",
            "Number of cached prompt tokens (local + external).",
            &[(&[], self.prefix_hits as f64 + external)],
        );
        p.counter(
            "vllm:prompt_tokens_cached_by_source_total",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            &[
                (&[("source", "device")], self.prefix_hits as f64),
                (&[("source", "host")], self.host_hits as f64),
                (&[("source", "p2p")], external - self.host_hits as f64),
                (&[("source", "disk")], 0.0),
                (&[("source", "external_unspecified")], 0.0),
            ],
        );
        p.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", &[(&[], self.generation_tokens as f64)]);
        let [stop, length, abort, error] = self.finished.map(|v| v as f64);
        p.counter(
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            &[
                (&[("finished_reason", "stop")], stop),
                (&[("finished_reason", "length")], length),
                (&[("finished_reason", "abort")], abort),
                (&[("finished_reason", "error")], error),
                (&[("finished_reason", "repetition")], 0.0),
            ],
        );
        p.admission_rejections();
        p.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", &self.request_prompt_tokens);
        p.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", &self.request_generation_tokens);
        p.histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", &self.iteration_tokens);
        p.histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            &self.request_max_generation_tokens,
        );
        p.histogram("vllm:request_params_n", "Histogram of the n request parameter.", &self.params_n);
        p.histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", &self.params_max_tokens);
        p.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &self.ttft);
        p.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &self.inter_token);
        p.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &self.time_per_output_token,
        );
        p.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &self.e2e);
        p.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", &self.queue);
        p.histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", &self.inference);
        p.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", &self.prefill);
        p.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", &self.decode);
        p.histogram("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.", &self.request_preemptions);
        p.histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &self.prefill_computed_tokens,
        );
        if info.kv_transfer {
            self.nixl.render(&mut p);
        }
        if let Some(o) = &self.offload {
            o.render(&mut p);
        }
        p.cache_config(info);
        p.out
    }
}

/// The offloading connector's transfer counters (vLLM 0.32's
/// `vllm:kv_offload_*`; its histograms are left out).
#[derive(Debug, Clone, Default)]
pub struct Offload {
    /// Bytes loaded from the host tier.
    pub load_bytes: u64,
    /// Seconds spent loading.
    pub load_secs: f64,
    /// Bytes stored into the host tier.
    pub store_bytes: u64,
    /// Seconds spent storing.
    pub store_secs: f64,
    /// Offers that could not make room.
    pub allocation_failures: u64,
}

impl Offload {
    fn render(&self, p: &mut Page<'_>) {
        p.counter("vllm:kv_offload_load_bytes_total", "Total bytes loaded from offload storage to GPU.", &[(&[], self.load_bytes as f64)]);
        p.counter("vllm:kv_offload_load_time_total", "Total load time from offload storage to GPU, in seconds.", &[(&[], self.load_secs)]);
        p.counter(
            "vllm:kv_offload_store_bytes_total",
            "Total bytes stored from GPU to offload storage.",
            &[(&[], self.store_bytes as f64)],
        );
        p.counter(
            "vllm:kv_offload_store_time_total",
            "Total store time from GPU to offload storage, in seconds.",
            &[(&[], self.store_secs)],
        );
        p.counter(
            "vllm:kv_offload_allocation_failure_total",
            "Number of KV offload store allocation attempts that failed.",
            &[(&[], self.allocation_failures as f64)],
        );
    }
}

const NIXL_XFER_SECS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];
const NIXL_POST_SECS: [f64; 13] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];
const NIXL_DESCRIPTORS: [f64; 14] = [10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0, 20000.0, 50000.0];

/// The NIXL connector's metrics: transfers are recorded by the reader (D),
/// expiries by the holder (P).
#[derive(Debug, Clone)]
pub struct Nixl {
    /// Seconds per transfer.
    pub xfer_time: Histogram,
    /// Seconds to post a transfer.
    pub post_time: Histogram,
    /// Bytes per transfer.
    pub bytes: Histogram,
    /// Descriptors per transfer (one per block).
    pub descriptors: Histogram,
    /// Failed transfers.
    pub failed_transfers: u64,
    /// Leases that ran out before a read.
    pub kv_expired_reqs: u64,
    /// Reads of blocks no longer kept.
    pub notifications_after_expiry: u64,
}

impl Default for Nixl {
    fn default() -> Self {
        Self {
            xfer_time: Histogram::new(NIXL_XFER_SECS.to_vec()),
            post_time: Histogram::new(NIXL_POST_SECS.to_vec()),
            bytes: Histogram::new((1..24).step_by(2).map(|i| 2f64.powi(10 + i)).collect()),
            descriptors: Histogram::new(NIXL_DESCRIPTORS.to_vec()),
            failed_transfers: 0,
            kv_expired_reqs: 0,
            notifications_after_expiry: 0,
        }
    }
}

impl Nixl {
    fn render(&self, p: &mut Page<'_>) {
        let kv = "NIXL KV Cache transfers.";
        p.histogram("vllm:nixl_xfer_time_seconds", &format!("Histogram of transfer duration for {kv}"), &self.xfer_time);
        p.histogram("vllm:nixl_post_time_seconds", &format!("Histogram of transfer post time for {kv}"), &self.post_time);
        p.histogram("vllm:nixl_bytes_transferred", &format!("Histogram of bytes transferred per {kv}"), &self.bytes);
        p.histogram("vllm:nixl_num_descriptors", "Histogram of number of descriptors per NIXL  KV Cache transfers.", &self.descriptors);
        p.counter(
            "vllm:nixl_num_failed_transfers_total",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            &[(&[], self.failed_transfers as f64)],
        );
        p.counter(
            "vllm:nixl_num_failed_notifications_total",
            "Number of failed NIXL KV Cache notifications. Retained for compatibility; these failures are also included in vllm:nixl_num_failed_transfers.",
            &[(&[], 0.0)],
        );
        p.counter(
            "vllm:nixl_num_kv_expired_reqs_total",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            &[(&[], self.kv_expired_reqs as f64)],
        );
        p.counter(
            "vllm:nixl_num_notifications_after_expiry_total",
            "Number of completion notifications for requests that were no longer tracked, usually because their KV lease expired. The KV blocks may have been reused before the transfer finished. Counted per notification (one per remote rank), not per request.",
            &[(&[], self.notifications_after_expiry as f64)],
        );
    }
}

type Labels<'a> = &'a [(&'a str, &'a str)];

struct Page<'a> {
    out: String,
    model: &'a str,
    created: f64,
}

impl Page<'_> {
    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    /// One sample line; labels are sorted by name as `prometheus_client` writes them.
    fn sample(&mut self, name: &str, extra: Labels<'_>, engine: bool, value: f64) {
        let mut labels: Vec<(&str, &str)> = extra.to_vec();
        labels.push(("model_name", self.model));
        if engine {
            labels.push(("engine", "0"));
        }
        labels.sort_by_key(|&(k, _)| k);
        self.line(name, &labels, value);
    }

    /// One sample line with exactly `labels`, in their order.
    fn line(&mut self, name: &str, labels: Labels<'_>, value: f64) {
        self.out.push_str(name);
        self.out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(self.out, "{sep}{k}=\"{}\"", escape(v));
        }
        let _ = writeln!(self.out, "}} {}", go_float(value));
    }

    fn gauge(&mut self, name: &str, help: &str, samples: &[(Labels<'_>, f64)]) {
        self.header(name, help, "gauge");
        for &(labels, v) in samples {
            self.sample(name, labels, true, v);
        }
    }

    fn counter(&mut self, name: &str, help: &str, samples: &[(Labels<'_>, f64)]) {
        self.counter_with(name, help, samples, true);
    }

    fn counter_with(&mut self, name: &str, help: &str, samples: &[(Labels<'_>, f64)], engine: bool) {
        self.header(name, help, "counter");
        for &(labels, v) in samples {
            self.sample(name, labels, engine, v);
        }
        let created = format!("{}_created", name.trim_end_matches("_total"));
        self.header(&created, help, "gauge");
        for &(labels, _) in samples {
            self.sample(&created, labels, engine, self.created);
        }
    }

    fn admission_rejections(&mut self) {
        self.counter_with(
            "vllm:admission_rejections_total",
            "Number of admission attempts rejected by a queue limit, by reason.",
            &[(&[("reason", "max_num_queued_reqs")], 0.0), (&[("reason", "max_num_queued_tokens")], 0.0)],
            false,
        );
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (bound, count) in h.bounds.iter().zip(&h.counts) {
            cumulative += count;
            self.sample(&bucket, &[("le", &go_float(*bound))], true, cumulative as f64);
        }
        self.sample(&bucket, &[("le", "+Inf")], true, h.count as f64);
        self.sample(&format!("{name}_count"), &[], true, h.count as f64);
        self.sample(&format!("{name}_sum"), &[], true, h.sum);
        let created = format!("{name}_created");
        self.header(&created, help, "gauge");
        self.sample(&created, &[], true, self.created);
    }

    fn cache_config(&mut self, info: &EngineInfo) {
        self.header("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge");
        let bs = info.block_size.to_string();
        let offloading = info.kv_offloading_size.map_or_else(|| "None".to_owned(), go_float);
        let blocks = info.num_gpu_blocks.to_string();
        let tokens = (info.block_size * info.num_gpu_blocks).to_string();
        let concurrency = go_float((info.block_size * info.num_gpu_blocks) as f64 / info.max_model_len.max(1) as f64);
        let labels: [(&str, &str); 36] = [
            ("_block_size_resolved", "True"),
            ("block_size", &bs),
            ("cache_dtype", "auto"),
            ("cache_hit_alignment_tokens", "None"),
            ("effective_attention_block_size", &bs),
            ("enable_mamba_shared_prefix_checkpoint", "False"),
            ("enable_prefix_caching", "True"),
            ("gpu_memory_utilization", "0.92"),
            ("hash_block_size", "None"),
            ("is_attention_free", "False"),
            ("kv_cache_dtype_skip_layers", "[]"),
            ("kv_cache_layout", "None"),
            ("kv_cache_max_concurrency", &concurrency),
            ("kv_cache_memory_bytes", "None"),
            ("kv_cache_size_tokens", &tokens),
            ("kv_offloading_backend", "native"),
            ("kv_offloading_size", &offloading),
            ("kv_sharing_fast_prefill", "False"),
            ("mamba_block_size", "None"),
            ("mamba_cache_dtype", "auto"),
            ("mamba_cache_mode", "none"),
            ("mamba_page_size_padded", "None"),
            ("mamba_ssm_cache_dtype", "float32"),
            ("num_cpu_blocks", "None"),
            ("num_gpu_blocks", &blocks),
            ("num_gpu_blocks_override", &blocks),
            ("prefix_cache_retention_interval", "0"),
            ("prefix_caching_hash_algo", "sha256"),
            ("prefix_match_unit", "None"),
            ("replayssm_buffer_len", "16"),
            ("skip_page_size_padded", "None"),
            ("sliding_window", "None"),
            ("swa_bounded_replay", "True"),
            ("use_kda_recoverssm", "False"),
            ("use_replayssm", "False"),
            ("user_specified_block_size", "True"),
        ];
        // cache_config_info carries no model_name label.
        let mut all: Vec<(&str, &str)> = labels.to_vec();
        all.push(("engine", "0"));
        all.sort_by_key(|&(k, _)| k);
        let body: Vec<String> = all.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        let _ = writeln!(self.out, "vllm:cache_config_info{{{}}} 1.0", body.join(","));
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n").replace('"', "\\\"")
}

/// A float as `prometheus_client` prints it: Python's `repr`, switching to an
/// exponent sooner, as Go does, for large positive values.
pub fn go_float(v: f64) -> String {
    if v == f64::INFINITY {
        return "+Inf".into();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    if v.is_nan() {
        return "NaN".into();
    }
    let s = py_repr(v);
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 && !s.contains('e') => {
            let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            let mantissa = digits.trim_end_matches('0').trim_end_matches('.');
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

/// Python's `repr` of a float.
fn py_repr(v: f64) -> String {
    let s = format!("{v:?}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_prometheus_client_prints_them() {
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(21.0), "21.0");
        assert_eq!(go_float(0.6355443000793457), "0.6355443000793457");
        assert_eq!(go_float(1795947561.462891), "1.795947561462891e+09");
        assert_eq!(go_float(1795947561.0), "1.795947561e+09");
        assert_eq!(go_float(1e-5), "1e-05");
        assert_eq!(go_float(2.5e16), "2.5e+16");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
    }

    #[test]
    fn buckets_follow_1_2_5_up_to_the_context() {
        assert_eq!(buckets_1_2_5(2048), [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]);
    }

    #[test]
    fn histogram_buckets_are_cumulative_on_the_page() {
        let mut s = Stats::new(2048);
        s.ttft.observe(0.03);
        s.ttft.observe(0.5);
        let info = EngineInfo {
            model_name: "m".into(),
            block_size: 16,
            num_gpu_blocks: 10,
            max_model_len: 2048,
            created: 1.0,
            kv_transfer: false,
            kv_offloading_size: None,
        };
        let page = s.render(&info);
        assert!(page.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.04\",model_name=\"m\"} 1.0\n"));
        assert!(page.contains("vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.5\",model_name=\"m\"} 2.0\n"));
        assert!(page.contains("vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 2.0\n"));
        assert!(page.contains("num_gpu_blocks=\"10\""));
    }
}
