//! `noop-extproc`: an ext_proc processor that decides nothing. Put in
//! place of inferrail behind the same filter (`envoy/local.yaml`: headers
//! sent, the body buffered), it measures what the ext_proc architecture
//! itself costs: every phase is answered CONTINUE with no mutation, so
//! Envoy's replica cluster falls back to its round robin. It sets no
//! metadata, so the access log sends it nothing; a stream in observability
//! mode (an observe filter) is read to its end unanswered.

use std::net::SocketAddr;
use std::pin::Pin;

use clap::Args;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};

/// Flags of `noop-extproc`.
#[derive(Debug, Clone, Args)]
pub struct NoopArgs {
    /// Address the gRPC server listens on.
    #[arg(long, default_value = "127.0.0.1:9002")]
    pub listen: SocketAddr,
}

/// The answer to one message: CONTINUE for its phase, nothing changed.
fn answer(request: Request) -> ProcessingResponse {
    let common = || HeadersResponse { response: Some(CommonResponse::default()) };
    let body = || BodyResponse { response: Some(CommonResponse::default()) };
    let response = match request {
        Request::RequestHeaders(_) => Response::RequestHeaders(common()),
        Request::RequestBody(_) => Response::RequestBody(body()),
        Request::RequestTrailers(_) => Response::RequestTrailers(TrailersResponse::default()),
        Request::ResponseHeaders(_) => Response::ResponseHeaders(common()),
        Request::ResponseBody(_) => Response::ResponseBody(body()),
        Request::ResponseTrailers(_) => Response::ResponseTrailers(TrailersResponse::default()),
    };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// The processor.
#[derive(Debug, Clone, Copy, Default)]
pub struct Noop;

type Out = Result<ProcessingResponse, Status>;

#[tonic::async_trait]
impl ExternalProcessor for Noop {
    type ProcessStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn process(&self, request: tonic::Request<Streaming<ProcessingRequest>>) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                // Envoy reads no answer in observability mode.
                let Some(request) = message.request.filter(|_| !message.observability_mode) else { continue };
                if tx.send(Ok(answer(request))).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Serves the processor on `listener` until the process ends (Nagle off, as inferrail's).
pub async fn serve(listener: TcpListener) -> anyhow::Result<()> {
    let incoming = TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok::<_, std::io::Error>(stream)
    });
    let service = ExternalProcessorServer::new(Noop).max_decoding_message_size(64 << 20);
    tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await?;
    Ok(())
}

/// `noop-extproc`: binds and serves.
pub async fn noop_extproc(args: NoopArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen).await?;
    eprintln!("no-op ext_proc processor on {}", listener.local_addr()?);
    serve(listener).await
}

#[cfg(test)]
mod tests;
