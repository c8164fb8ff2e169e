//! Sealing what gateways tell each other: every sync message and every handover frame is
//! encrypted and authenticated with a key the gateways share (`[sync] key_file`, a mounted
//! Secret), so nobody on the pod network can read a booking or ask for the index.
//!
//! The libzmq this crate builds has no CURVE (that needs libsodium), so sealing is done on the
//! frames: XChaCha20-Poly1305 with a random 24-byte nonce per frame. A sealed frame is
//!
//! | bytes | what |
//! |---|---|
//! | 3 | [`MAGIC`]: `ks` and the format version |
//! | 8 | when it was sealed, Unix ms, big-endian |
//! | 24 | the nonce |
//! | rest | the ciphertext and its 16-byte tag |
//!
//! The tag covers the frame's [`Purpose`] and its header, so a frame sealed as a sync message
//! is refused as a handover request, and one whose time was changed is refused. A frame older
//! than [`MAX_AGE`] (or that far in the future: clocks of a cluster's nodes agree far better)
//! is refused too, which bounds how long a recorded frame can be replayed.
//!
//! Without a key (gateways on one host, or an operator's explicit
//! `allow_unauthenticated`), frames go as they are.
//!
//! Pure: no sockets, and the time is an argument.

use std::fmt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

/// The first bytes of a sealed frame.
pub const MAGIC: [u8; 3] = [b'k', b's', 1];
/// How old (or how far ahead) a sealed frame may be.
pub const MAX_AGE: Duration = Duration::from_secs(60);
const HEADER: usize = MAGIC.len() + 8 + 24;

/// What a frame is for: authenticated with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A batch of bookings on the sync port.
    Sync,
    /// A starting sidecar's request for a handover.
    HandoverRequest,
    /// A frame of a handover answer.
    HandoverAnswer,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Sync => b"kvgate-sync",
            Purpose::HandoverRequest => b"kvgate-handover-request",
            Purpose::HandoverAnswer => b"kvgate-handover-answer",
        }
    }
}

/// The gateways' shared key: 32 bytes, written as 64 hex digits.
#[derive(Clone, PartialEq, Eq)]
pub struct SyncKey([u8; 32]);

impl fmt::Debug for SyncKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SyncKey(..)")
    }
}

/// Why a key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file could not be read.
    #[error("reading the sync key {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The text is not 64 hex digits.
    #[error("a sync key is 64 hex digits (32 bytes, e.g. `openssl rand -hex 32`); this one has {0} characters or other than hex digits")]
    Format(usize),
}

impl SyncKey {
    /// The key written as 64 hex digits (surrounding whitespace ignored).
    pub fn parse(text: &str) -> Result<SyncKey, KeyError> {
        let text = text.trim();
        let bad = || KeyError::Format(text.chars().count());
        if text.len() != 64 {
            return Err(bad());
        }
        let mut key = [0u8; 32];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
        }
        Ok(SyncKey(key))
    }

    /// The key in `path` (a mounted Secret).
    pub fn read(path: &Path) -> Result<SyncKey, KeyError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| KeyError::Read { path: path.display().to_string(), source })?;
        SyncKey::parse(&text)
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Not sealed with our key (or not sealed at all, or altered, or sealed for another
    /// purpose).
    #[error("not sealed with this mesh's key")]
    Unauthenticated,
    /// Sealed with our key, but longer ago (or further ahead) than [`MAX_AGE`].
    #[error("sealed {0} s away from now")]
    Stale(u64),
}

impl OpenError {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            OpenError::Unauthenticated => "unauthenticated",
            OpenError::Stale(_) => "stale",
        }
    }
}

/// Seals and opens frames with the mesh's key, or passes them as they are without one.
#[derive(Clone)]
pub struct Sealer {
    cipher: Option<XChaCha20Poly1305>,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sealer").field("keyed", &self.cipher.is_some()).finish()
    }
}

impl Sealer {
    /// Seals with `key`; with `None`, frames pass as they are.
    pub fn new(key: Option<&SyncKey>) -> Sealer {
        Sealer { cipher: key.map(|k| XChaCha20Poly1305::new(&k.0.into())) }
    }

    /// Whether frames are sealed.
    pub fn keyed(&self) -> bool {
        self.cipher.is_some()
    }

    /// `plain`, sealed for `purpose` at `now`.
    pub fn seal(&self, purpose: Purpose, plain: Vec<u8>, now: SystemTime) -> Vec<u8> {
        let Some(cipher) = &self.cipher else { return plain };
        let mut frame = Vec::with_capacity(HEADER + plain.len() + 16);
        frame.extend_from_slice(&MAGIC);
        frame.extend_from_slice(&unix_ms(now).to_be_bytes());
        frame.extend_from_slice(&rand::random::<[u8; 24]>());
        let aad = aad(purpose, &frame);
        let nonce = XNonce::from_slice(&frame[MAGIC.len() + 8..HEADER]);
        // Encryption cannot fail below the cipher's length limit (256 GiB), far above any frame.
        let sealed = cipher.encrypt(nonce, Payload { msg: &plain, aad: &aad }).unwrap_or_default();
        frame.extend_from_slice(&sealed);
        frame
    }

    /// The plaintext of `frame`, if it was sealed for `purpose` with this key within
    /// [`MAX_AGE`] of `now`.
    pub fn open(&self, purpose: Purpose, frame: Vec<u8>, now: SystemTime) -> Result<Vec<u8>, OpenError> {
        let Some(cipher) = &self.cipher else { return Ok(frame) };
        if frame.len() < HEADER + 16 || frame[..MAGIC.len()] != MAGIC {
            return Err(OpenError::Unauthenticated);
        }
        let (header, sealed) = frame.split_at(HEADER);
        let aad = aad(purpose, header);
        let nonce = XNonce::from_slice(&header[MAGIC.len() + 8..]);
        let plain =
            cipher.decrypt(nonce, Payload { msg: sealed, aad: &aad }).map_err(|_| OpenError::Unauthenticated)?;
        // Only now is the time known to be the sealer's.
        let mut at = [0u8; 8];
        at.copy_from_slice(&header[MAGIC.len()..MAGIC.len() + 8]);
        let away = unix_ms(now).abs_diff(u64::from_be_bytes(at));
        if away > MAX_AGE.as_millis() as u64 {
            return Err(OpenError::Stale(away / 1000));
        }
        Ok(plain)
    }
}

fn aad(purpose: Purpose, header: &[u8]) -> Vec<u8> {
    [purpose.label(), b"/", header].concat()
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn sealer(key: &str) -> Sealer {
        Sealer::new(Some(&SyncKey::parse(key).unwrap()))
    }

    #[test]
    fn a_sealed_frame_opens_with_the_key_it_was_sealed_with_and_hides_its_text() {
        let now = SystemTime::now();
        let frame = sealer(KEY).seal(Purpose::Sync, b"booked r1 for request-42".to_vec(), now);
        assert!(!frame.windows(10).any(|w| w == b"request-42"), "the text is not readable");
        assert_eq!(sealer(KEY).open(Purpose::Sync, frame, now).unwrap(), b"booked r1 for request-42");
    }

    #[test]
    fn another_key_another_purpose_an_altered_frame_or_a_plain_one_is_refused() {
        let now = SystemTime::now();
        let frame = sealer(KEY).seal(Purpose::Sync, b"view".to_vec(), now);
        let other = KEY.replace("1f", "ff");
        assert_eq!(sealer(&other).open(Purpose::Sync, frame.clone(), now), Err(OpenError::Unauthenticated));
        assert_eq!(sealer(KEY).open(Purpose::HandoverRequest, frame.clone(), now), Err(OpenError::Unauthenticated));
        for at in [0, 5, HEADER, frame.len() - 1] {
            let mut altered = frame.clone();
            altered[at] ^= 1;
            assert_eq!(sealer(KEY).open(Purpose::Sync, altered, now), Err(OpenError::Unauthenticated), "byte {at}");
        }
        assert_eq!(sealer(KEY).open(Purpose::Sync, b"plain".to_vec(), now), Err(OpenError::Unauthenticated));
        assert_eq!(sealer(KEY).open(Purpose::Sync, Vec::new(), now), Err(OpenError::Unauthenticated));
    }

    #[test]
    fn a_frame_older_or_newer_than_the_window_is_refused_as_stale() {
        let sealed_at = SystemTime::now();
        let frame = sealer(KEY).seal(Purpose::Sync, b"x".to_vec(), sealed_at);
        let later = sealed_at + MAX_AGE - Duration::from_secs(1);
        assert!(sealer(KEY).open(Purpose::Sync, frame.clone(), later).is_ok());
        let late = sealed_at + MAX_AGE + Duration::from_secs(2);
        assert!(matches!(sealer(KEY).open(Purpose::Sync, frame.clone(), late), Err(OpenError::Stale(_))));
        let early = sealed_at - MAX_AGE - Duration::from_secs(2);
        assert!(matches!(sealer(KEY).open(Purpose::Sync, frame, early), Err(OpenError::Stale(_))));
    }

    #[test]
    fn without_a_key_frames_pass_as_they_are() {
        let plain = Sealer::new(None);
        assert!(!plain.keyed());
        assert_eq!(plain.seal(Purpose::Sync, b"x".to_vec(), SystemTime::now()), b"x");
        assert_eq!(plain.open(Purpose::Sync, b"x".to_vec(), SystemTime::now()).unwrap(), b"x");
    }

    #[test]
    fn a_key_is_64_hex_digits() {
        assert!(SyncKey::parse(&format!("  {KEY}\n")).is_ok());
        assert!(matches!(SyncKey::parse(&KEY[..62]), Err(KeyError::Format(62))));
        assert!(SyncKey::parse(&KEY.replace('0', "g")).is_err());
        assert!(SyncKey::parse(&"é".repeat(32)).is_err(), "multi-byte text is refused, not sliced");
        assert_eq!(format!("{:?}", SyncKey::parse(KEY).unwrap()), "SyncKey(..)", "never logged");
    }
}
