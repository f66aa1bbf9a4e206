//! OpenTelemetry traces: one span per decision, exported over OTLP/HTTP
//! (protobuf) when `observability.otlp_endpoint` is set; without it nothing
//! is built and a decision costs nothing more.
//!
//! The span (`inferrail.route`) continues the client's W3C `traceparent`
//! (a new trace when there is none or it is malformed) and carries the
//! policy, the model, how many replicas were weighed, the winner, its
//! estimated time to first token, the predicted cached and the prompt
//! tokens, and what steered the pick. Its own context goes on to the engine
//! as the request's `traceparent`, so the engine's spans are its children.
//! New traces are kept at `trace_sample_ratio`; a client's trace keeps its
//! own sampled flag.
//!
//! Spans leave through the SDK's batch processor: a bounded queue (2048
//! spans; `OTEL_BSP_*` variables tune it) drained by its own thread, so a
//! slow or dead collector drops spans instead of slowing decisions. Export
//! failures are logged once when they start and once when export works
//! again, and counted (`inferrail_trace_export_errors_total`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use inferrail_config::Observability;
use opentelemetry::KeyValue;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span, SpanContext, SpanKind, Status, Tracer, TracerProvider};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter};

use crate::decision::{Decision, RouteError};

/// The decision span's name.
pub const SPAN_NAME: &str = "inferrail.route";

/// How long one export may take before it counts as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where decision spans go.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    failing: Arc<AtomicBool>,
}

impl Traces {
    /// Starts the exporter and its batch thread; `None` when no endpoint is configured.
    pub fn start(config: &Observability) -> anyhow::Result<Option<Self>> {
        let Some(endpoint) = &config.otlp_endpoint else { return Ok(None) };
        let url = traces_url(endpoint);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()?;
        let failing = Arc::new(AtomicBool::new(false));
        let watched = Watched { inner: exporter, url: url.clone(), failing: failing.clone() };
        let ratio = config.trace_sample_ratio.clamp(0.0, 1.0);
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(watched).build())
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))))
            .with_resource(Resource::builder().with_service_name("inferrail").build())
            .build();
        let tracer = provider.tracer("inferrail");
        tracing::info!(url, sample_ratio = ratio, "exporting decision traces over OTLP/HTTP");
        Ok(Some(Self { provider, tracer, failing }))
    }

    /// Records a decision's span, begun at `started`, under the client's
    /// `traceparent` if it sent one; returns the span's own `traceparent`
    /// for the engine.
    pub fn decision(&self, traceparent: Option<&str>, started: SystemTime, d: &Decision) -> String {
        let winner = &d.targets[0];
        let mut attributes = vec![
            KeyValue::new("inferrail.policy", d.policy),
            KeyValue::new("inferrail.model", d.model.clone()),
            KeyValue::new("inferrail.request_id", d.request_id.clone()),
            KeyValue::new("inferrail.candidates", d.candidates as i64),
            KeyValue::new("inferrail.winner", winner.id.clone()),
            KeyValue::new("inferrail.winner.address", winner.addr.to_string()),
            KeyValue::new("inferrail.fallbacks", d.targets.len().saturating_sub(1) as i64),
        ];
        if let Some(estimate) = d.estimate {
            attributes.push(KeyValue::new("inferrail.estimated_ttft_ms", estimate.as_secs_f64() * 1e3));
        }
        if let (Some(prompt), Some(&cached)) = (d.prompt_tokens, d.cached_tokens.first()) {
            attributes.push(KeyValue::new("inferrail.prompt_tokens", prompt as i64));
            attributes.push(KeyValue::new("inferrail.predicted_cached_tokens", cached as i64));
        }
        if let Some(steer) = d.steer {
            attributes.push(KeyValue::new("inferrail.steer", steer));
        }
        let mut span = self.span(traceparent, started, attributes);
        let context = span.span_context().clone();
        span.end();
        format_traceparent(&context)
    }

    /// Records a decision the router answered itself (unknown model, bad
    /// body, no replica) as a failed span.
    pub fn refused(&self, traceparent: Option<&str>, started: SystemTime, e: &RouteError) {
        let attributes = vec![KeyValue::new("inferrail.error", e.reason())];
        let mut span = self.span(traceparent, started, attributes);
        span.set_status(Status::error(e.to_string()));
        span.end();
    }

    fn span(&self, traceparent: Option<&str>, started: SystemTime, attributes: Vec<KeyValue>) -> impl Span + use<> {
        let parent = traceparent.map(|tp| TraceContextPropagator::new().extract(&Traceparent(tp))).unwrap_or_default();
        self.tracer
            .span_builder(SPAN_NAME)
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent)
    }

    /// Whether the last export failed.
    pub fn failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// Exports what is queued now, waiting for it.
    pub fn flush(&self) -> OTelSdkResult {
        self.provider.force_flush()
    }

    /// Exports what is queued and stops the batch thread.
    pub fn shutdown(&self) -> OTelSdkResult {
        self.provider.shutdown()
    }
}

/// The traces URL for a configured endpoint: a bare `http://host:port` (or
/// `http://host:port/`) gets the OTLP path `/v1/traces`; any URL with a path is kept.
pub fn traces_url(endpoint: &str) -> String {
    let after_scheme = endpoint.split_once("://").map_or(endpoint, |(_, rest)| rest);
    match after_scheme.find('/') {
        Some(at) if after_scheme[at..] != *"/" => endpoint.to_string(),
        _ => format!("{}/v1/traces", endpoint.trim_end_matches('/')),
    }
}

/// A span context as a W3C `traceparent` value.
pub fn format_traceparent(c: &SpanContext) -> String {
    format!("00-{}-{}-{:02x}", c.trace_id(), c.span_id(), c.trace_flags().to_u8())
}

/// A request's only header the propagator reads.
struct Traceparent<'a>(&'a str);

impl Extractor for Traceparent<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == "traceparent").then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent"]
    }
}

/// The OTLP exporter, watched: a failing collector is reported when it
/// starts failing and when it recovers, not on every batch.
#[derive(Debug)]
struct Watched<E> {
    inner: E,
    url: String,
    failing: Arc<AtomicBool>,
}

impl<E: SpanExporter> SpanExporter for Watched<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => {
                metrics::counter!("inferrail_trace_spans_exported_total").increment(spans);
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(url = %self.url, "exporting traces works again");
                }
            }
            Err(e) => {
                metrics::counter!("inferrail_trace_export_errors_total").increment(1);
                metrics::counter!("inferrail_trace_spans_lost_total").increment(spans);
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(url = %self.url, error = %e, "exporting traces failed; spans are lost until the collector answers");
                }
            }
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests;
