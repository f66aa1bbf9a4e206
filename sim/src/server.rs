//! The accept loop: HTTP/1.1 connections served by hyper, with the listening
//! socket closed while the `refuse` fault is in force.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use crate::api::App;
use crate::fault::Action;

/// Serves `app` on `listener` until `shutdown` completes.
pub async fn serve(app: Arc<App>, listener: TcpListener, shutdown: impl Future<Output = ()>) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let mut listener = Some(listener);
    tokio::pin!(shutdown);
    loop {
        let refuse = app.faults.action() == Action::Refuse;
        if refuse {
            // Closing the socket makes new connections fail with "refused".
            listener = None;
        } else if listener.is_none() {
            listener = Some(rebind(addr).await?);
        }
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            () = app.faults.changed() => {}
            accepted = accept(listener.as_ref()) => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(connection(app.clone(), stream));
                }
                Err(e) => {
                    // Out of descriptors, say: back off rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Binds the address again after a `refuse` fault, retrying while the
/// kernel still holds the port.
async fn rebind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if tries < 50 => {
                tracing::debug!(error = %e, "rebind failed, retrying");
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn connection(app: Arc<App>, stream: TcpStream) {
    // Latency matters more than packet count here.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "set_nodelay failed");
    }
    let service = service_fn(move |req| app.clone().handle(req));
    if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
        tracing::debug!(error = %e, "connection ended");
    }
}
