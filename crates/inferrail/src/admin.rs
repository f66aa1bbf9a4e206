//! The admin HTTP listener: `/metrics` in Prometheus text, `/healthz`
//! (the process is up) and `/readyz` (some model has a healthy replica).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use crate::router::Router;

/// Serves the admin endpoints on `listener` forever.
pub async fn serve(listener: TcpListener, router: Arc<Router>, metrics: PrometheusHandle) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, say: back off rather than spin.
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let (router, metrics) = (router.clone(), metrics.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let answer = answer(req.uri().path(), &router, &metrics);
                async move { Ok::<_, Infallible>(answer) }
            });
            if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(error = %e, "admin connection ended");
            }
        });
    }
}

fn answer(path: &str, router: &Router, metrics: &PrometheusHandle) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match path {
        "/metrics" => (StatusCode::OK, "text/plain; version=0.0.4", crate::telemetry::gauges::page(router, metrics)),
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        "/readyz" => {
            if router.ready() {
                (StatusCode::OK, "text/plain", "ready\n".to_string())
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "text/plain", "no healthy replica\n".to_string())
            }
        }
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".to_string()),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    r
}
