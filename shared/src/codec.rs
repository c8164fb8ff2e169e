//! The one encoding of filter ↔ sidecar bodies: bincode 2 (standard config) over serde.
//!
//! Everything goes through [`encode`] and [`decode`], so the codec can be swapped here alone.
//!
//! ```
//! use kvgate_shared::{codec, wire::LifecycleBatch};
//! let bytes = codec::encode(&LifecycleBatch::default()).unwrap();
//! let back: LifecycleBatch = codec::decode(&bytes).unwrap();
//! assert_eq!(back, LifecycleBatch::default());
//! ```

use serde::{Deserialize, Serialize};

/// The largest body [`decode`] accepts (a tokenizer bundle is ~12 MB).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Why a body could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The value could not be encoded.
    #[error("encode: {0}")]
    Encode(#[from] bincode::error::EncodeError),
    /// The bytes are not a valid encoding of the expected type.
    #[error("decode: {0}")]
    Decode(#[from] bincode::error::DecodeError),
    /// The body decoded, but bytes were left over.
    #[error("decode: {0} trailing bytes")]
    Trailing(usize),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_BODY_BYTES>()
}

/// Encodes a wire value into a buffer of exactly its size: measured first, then written, so
/// a big body (an offloaded 16 MiB prompt, in a wasm VM whose memory never shrinks) is not
/// copied through a growing buffer.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    let mut size = bincode::enc::write::SizeWriter::default();
    bincode::serde::encode_into_writer(value, &mut size, config())?;
    let mut bytes = vec![0; size.bytes_written];
    let written = bincode::serde::encode_into_slice(value, &mut bytes, config())?;
    bytes.truncate(written);
    Ok(bytes)
}

/// Decodes a wire value; the whole input must be consumed. A value that borrows (an offloaded
/// body) borrows from `bytes` instead of copying.
pub fn decode<'de, T: Deserialize<'de>>(bytes: &'de [u8]) -> Result<T, CodecError> {
    let (value, used) = bincode::serde::borrow_decode_from_slice(bytes, config())?;
    if used != bytes.len() {
        return Err(CodecError::Trailing(bytes.len() - used));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::SequenceHash;
    use crate::wire::{RouteRequest, RouteResponse};

    #[test]
    fn a_hash_is_a_bare_u64_on_the_wire() {
        let hashes = [u64::MAX, 0, 7];
        assert_eq!(encode(&hashes.map(SequenceHash).to_vec()).unwrap(), encode(&hashes.to_vec()).unwrap());
    }

    #[test]
    fn an_offloaded_body_is_encoded_as_its_sequence_of_u8_was() {
        // Bytes and a sequence of `u8` are the same on the wire: filters and sidecars of the
        // releases before and after the body became bytes read each other.
        let body: Vec<u8> = (0..=255).chain(0..=255).collect();
        assert_eq!(encode(&serde_bytes::Bytes::new(&body)).unwrap(), encode(&body).unwrap());
        let request =
            crate::wire::RouteBodyRequest::of("r1", crate::prompt::openai::Endpoint::ChatCompletions, body.clone(), 50);
        let call = encode(&request).unwrap();
        let back: crate::wire::RouteBodyRequest<'_> = decode(&call).unwrap();
        assert_eq!(back.body.as_ref(), &body[..]);
        assert!(matches!(back.body, std::borrow::Cow::Borrowed(_)), "the body is read in place, not copied");
    }

    #[test]
    fn round_trips_route_messages() {
        let req = RouteRequest {
            session: Some("s".into()),
            overrides: Some(crate::wire::ScoringOverrides { temperature: Some(0.5), ..Default::default() }),
            ..RouteRequest::exact("r1", "m", 42, 16, [u64::MAX, 0, 7].map(SequenceHash).to_vec())
        };
        assert_eq!(decode::<RouteRequest>(&encode(&req).unwrap()).unwrap(), req);
        let resp = RouteResponse {
            endpoint: Some("127.0.0.1:1".into()),
            replica: None,
            overlap_blocks: 3,
            dp_rank: Some(1),
            prefill: None,
        };
        assert_eq!(decode::<RouteResponse>(&encode(&resp).unwrap()).unwrap(), resp);
    }

    #[test]
    fn rejects_garbage_and_trailing_bytes() {
        assert!(decode::<RouteRequest>(&[0xff; 3]).is_err());
        let mut bytes =
            encode(&RouteResponse { endpoint: None, replica: None, overlap_blocks: 0, dp_rank: None, prefill: None })
                .unwrap();
        bytes.push(0);
        assert!(matches!(decode::<RouteResponse>(&bytes), Err(CodecError::Trailing(1))));
    }

    #[test]
    fn huge_declared_lengths_fail_instead_of_allocating() {
        // A Vec<u64> claiming 2^60 elements.
        let bytes = [0u8, 0, 0, 0, 0, 0xff, 0, 0, 0, 0, 0, 0, 0, 0x10];
        assert!(decode::<RouteRequest>(&bytes).is_err());
    }
}
