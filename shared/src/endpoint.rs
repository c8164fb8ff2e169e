//! ZMQ endpoints of data-parallel engines: vLLM's `offset_endpoint_port`, which the engine
//! applies to publish each rank's KV events apart and kvgate applies to subscribe to them.

/// Why an endpoint cannot be offset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// A `tcp://` endpoint without a numeric port.
    #[error("no port in {0}")]
    NoPort(String),
    /// Only `tcp://` and `inproc://` endpoints can be offset (vLLM refuses `ipc://`).
    #[error("cannot offset {0} for a data-parallel rank: only tcp:// and inproc:// can be")]
    NotOffsettable(String),
}

/// The endpoint of data-parallel rank `rank`: `port + rank` for `tcp`, `name_dp{rank}` for
/// `inproc`. Rank 0 and port 0 (ephemeral) are unchanged.
///
/// ```
/// use kvgate_shared::endpoint::for_rank;
/// assert_eq!(for_rank("tcp://*:5557", 2).unwrap(), "tcp://*:5559");
/// assert_eq!(for_rank("tcp://10.0.0.7:5557", 0).unwrap(), "tcp://10.0.0.7:5557");
/// assert!(for_rank("ipc:///tmp/kv", 1).is_err());
/// ```
pub fn for_rank(endpoint: &str, rank: u32) -> Result<String, EndpointError> {
    if rank == 0 {
        return Ok(endpoint.to_owned());
    }
    if endpoint.starts_with("inproc://") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(EndpointError::NotOffsettable(endpoint.to_owned()));
    };
    let no_port = || EndpointError::NoPort(endpoint.to_owned());
    let (host, port) = rest.rsplit_once(':').ok_or_else(no_port)?;
    let port: u32 = port.parse().map_err(|_| no_port())?;
    if port == 0 {
        return Ok(endpoint.to_owned());
    }
    Ok(format!("tcp://{host}:{}", port + rank))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_offsets() {
        assert_eq!(for_rank("tcp://*:5557", 0).unwrap(), "tcp://*:5557");
        assert_eq!(for_rank("tcp://*:5557", 2).unwrap(), "tcp://*:5559");
        assert_eq!(for_rank("tcp://[::]:5557", 1).unwrap(), "tcp://[::]:5558");
        assert_eq!(for_rank("tcp://*:0", 3).unwrap(), "tcp://*:0");
        assert_eq!(for_rank("inproc://kv", 1).unwrap(), "inproc://kv_dp1");
        assert!(for_rank("ipc:///tmp/kv", 1).is_err());
        assert!(for_rank("tcp://host", 1).is_err());
    }
}
