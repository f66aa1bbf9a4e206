//! When each response's first body byte came, from Envoy's access log
//! instead of a second ext_proc stream per request (ADR 0035).
//!
//! Envoy's OpenTelemetry access logger (`envoy/local.yaml`) sends one record
//! per routed request, batched, to `LogsService/Export` on the ext_proc
//! port: the request's id and deciding router, and how long after the
//! request began (the record's time) the first response body byte came.
//! Each record becomes the request's first byte, heard as the moment it
//! happened however late the batch arrives, and sent to the router that
//! decided. The status and the end come on the route stream, before the
//! record: the log tells nothing else, so a late record of a request whose
//! id a newer one took cannot end or move the newer one (and its first
//! byte, before the newer decision, is ignored).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inferrail_route::lifecycle::Event;
use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsService;
use opentelemetry_proto::tonic::collector::logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::logs::v1::LogRecord;
use tonic::{Request, Response, Status};

use crate::decision::decider_id;
use crate::router::Router;

/// The attribute names `envoy/local.yaml`'s access log gives each record.
pub mod attribute {
    /// `%DYNAMIC_METADATA(inferrail:request_id)%`: the id the decision is known by.
    pub const REQUEST_ID: &str = "inferrail.request_id";
    /// `%DYNAMIC_METADATA(inferrail:router)%`: the router that decided.
    pub const ROUTER: &str = "inferrail.router";
    /// `%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%`: from the request's
    /// start (the record's time) to the first response body byte.
    pub const FIRST_BODY_US: &str = "first_body_us";
}

/// What one record says of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    request_id: String,
    decider: Option<u64>,
    /// When the first response body byte came.
    first_byte: Option<SystemTime>,
}

impl Entry {
    /// The record's request, or `None` for one no router decided (Envoy's
    /// `-` for a missing value counts as missing).
    fn read(record: &LogRecord) -> Option<Self> {
        let text = |key: &str| {
            record.attributes.iter().find(|kv| kv.key == key).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) if !s.is_empty() && s != "-" => Some(s.clone()),
                Value::IntValue(n) => Some(n.to_string()),
                _ => None,
            })
        };
        let started = UNIX_EPOCH + Duration::from_nanos(record.time_unix_nano);
        Some(Self {
            request_id: text(attribute::REQUEST_ID)?,
            decider: text(attribute::ROUTER).and_then(|r| decider_id(&r)),
            first_byte: text(attribute::FIRST_BODY_US).and_then(|us| us.parse().ok()).map(|us| started + Duration::from_micros(us)),
        })
    }

    /// Tells the request's life its first byte, at `now` (wall clock).
    fn tell(&self, router: &Router, now: SystemTime) {
        if let Some(at) = self.first_byte {
            // Envoy's and this clock may disagree a little: never in the future.
            router.hear_for(self.decider, &self.request_id, Event::FirstByte, now.duration_since(at).unwrap_or_default());
        }
    }
}

/// The OpenTelemetry logs service Envoy's access logger exports to.
#[derive(Clone)]
pub struct AccessLog {
    router: Arc<Router>,
}

impl AccessLog {
    /// Feeds what the records say to `router`.
    pub fn new(router: Arc<Router>) -> Self {
        Self { router }
    }
}

#[tonic::async_trait]
impl LogsService for AccessLog {
    async fn export(&self, request: Request<ExportLogsServiceRequest>) -> Result<Response<ExportLogsServiceResponse>, Status> {
        let now = SystemTime::now();
        let records = request.into_inner().resource_logs.into_iter().flat_map(|r| r.scope_logs).flat_map(|s| s.log_records);
        let mut heard = 0u64;
        for entry in records.filter_map(|r| Entry::read(&r)) {
            entry.tell(&self.router, now);
            heard += 1;
        }
        metrics::counter!("inferrail_access_log_records_total").increment(heard);
        Ok(Response::new(ExportLogsServiceResponse { partial_success: None }))
    }
}

#[cfg(test)]
mod tests;
