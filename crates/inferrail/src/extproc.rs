//! The ext_proc gRPC service: one stream per HTTP request and filter, each
//! a translator from Envoy's messages into the router's terms.
//!
//! A stream's first message says which filter it comes from:
//! - [`route`]: Envoy's route filter (BUFFERED request body) sends headers,
//!   then the body, and gets the decision; then the response's headers
//!   (status, the replica that really served after retries). Envoy keeps
//!   the stream open until the HTTP request ends, however it ends, so its
//!   closing is the request's end.
//! - [`picker`]: an Inference Extension gateway's full-duplex stream
//!   (`FULL_DUPLEX_STREAMED`), carrying request and response alike.
//! - [`observe`]: an observe filter (observability mode, asynchronous) tells
//!   the first body byte, where no access log is added.
//!
//! [`front`] answers what the router serves itself and asks the router for
//! the decision; [`response`] is the one response phase both the route and
//! the picker stream follow, turning what they see into lifecycle events
//! ([`crate::router::Router::hear`]); [`envoy`] reads Envoy's attributes and
//! metadata. Nothing here decides anything about the lease itself.

use std::pin::Pin;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

pub use self::front::ExtProc;
use self::front::Out;

pub mod envoy;
pub mod front;
mod observe;
mod picker;
pub mod response;
mod route;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn process(&self, request: tonic::Request<Streaming<ProcessingRequest>>) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else { return };
            let full_duplex = |mode: i32| mode == BodySendMode::FullDuplexStreamed as i32;
            if first.observability_mode {
                observe::follow(&this.front.router, first, inbound).await;
            } else if first.protocol_config.as_ref().is_some_and(|c| full_duplex(c.request_body_mode)) {
                picker::serve(&this, first, inbound, tx).await;
            } else {
                route::serve(&this, first, inbound, tx).await;
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests;
