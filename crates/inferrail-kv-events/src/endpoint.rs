//! Which side of a ZMQ endpoint binds, by vLLM's rule, and how an endpoint
//! written for libzmq is spelled for zmq.rs.
//!
//! vLLM's publisher binds only when the endpoint has a wildcard (`*`), an
//! IPv6 any-address (`::`), or is `ipc://` or `inproc://`; for any other
//! endpoint, such as `tcp://127.0.0.1:5557`, the engine connects and the
//! subscriber must bind. libzmq reads `*` as "every interface" or "any
//! port"; zmq.rs needs `0.0.0.0` and `0`. `inproc://` needs one process-wide
//! libzmq context, which zmq.rs does not have, so it is refused.

use std::time::Duration;

use zeromq::{Socket, ZmqError};

/// Why an endpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// `inproc://` endpoints exist only inside one libzmq context.
    #[error("{0}: inproc:// endpoints are not supported (use ipc:// or tcp://)")]
    Inproc(String),
    /// Neither `tcp://` nor `ipc://`.
    #[error("{0}: not a tcp:// or ipc:// endpoint")]
    Transport(String),
    /// The socket could not bind or connect there.
    #[error("{endpoint}: {source}")]
    Socket {
        /// The endpoint.
        endpoint: String,
        /// What ZMQ said.
        source: ZmqError,
    },
}

/// Whether vLLM's publisher binds `endpoint` (otherwise it connects to it).
pub fn engine_binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::") || endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://")
}

/// `endpoint` as zmq.rs reads it: `*` as a host is every interface, as a
/// port any free port.
pub fn for_zmq_rs(endpoint: &str) -> Result<String, EndpointError> {
    if endpoint.starts_with("inproc://") {
        return Err(EndpointError::Inproc(endpoint.to_owned()));
    }
    if endpoint.starts_with("ipc://") {
        return Ok(endpoint.to_owned());
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else { return Err(EndpointError::Transport(endpoint.to_owned())) };
    let (host, port) = rest.rsplit_once(':').unwrap_or((rest, ""));
    let host = if host == "*" { "0.0.0.0" } else { host };
    let port = if port == "*" { "0" } else { port };
    Ok(format!("tcp://{host}:{port}"))
}

/// Binds `socket` to `endpoint`; returns the endpoint bound (a port `*` or
/// `0` resolved).
pub(crate) async fn bind(socket: &mut impl Socket, endpoint: &str) -> Result<String, EndpointError> {
    let target = for_zmq_rs(endpoint)?;
    let bound = socket.bind(&target).await.map_err(|source| EndpointError::Socket { endpoint: endpoint.to_owned(), source })?;
    Ok(bound.to_string())
}

/// How long one connection attempt may take before it is begun again, so a
/// peer that comes back is reached within about this long.
pub(crate) const CONNECT_ATTEMPT: Duration = Duration::from_millis(250);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_binds_only_wildcards_and_local_transports() {
        for e in ["tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv", "tcp://127.0.0.1:*"] {
            assert!(engine_binds(e), "{e}");
        }
        for e in ["tcp://127.0.0.1:5557", "tcp://router.local:5557", "tcp://10.0.0.2:1"] {
            assert!(!engine_binds(e), "{e}");
        }
    }

    #[test]
    fn libzmq_wildcards_become_zmq_rs_addresses() {
        assert_eq!(for_zmq_rs("tcp://*:5557").ok().as_deref(), Some("tcp://0.0.0.0:5557"));
        assert_eq!(for_zmq_rs("tcp://127.0.0.1:*").ok().as_deref(), Some("tcp://127.0.0.1:0"));
        assert_eq!(for_zmq_rs("tcp://[::]:5557").ok().as_deref(), Some("tcp://[::]:5557"));
        assert_eq!(for_zmq_rs("ipc:///tmp/kv").ok().as_deref(), Some("ipc:///tmp/kv"));
        assert!(matches!(for_zmq_rs("inproc://kv"), Err(EndpointError::Inproc(_))));
        assert!(matches!(for_zmq_rs("udp://1.2.3.4:5"), Err(EndpointError::Transport(_))));
    }
}
