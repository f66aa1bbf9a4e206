//! API keys, known only by their SHA-256 digests: the configuration holds
//! each key's digest in hex, never the key; a presented key is hashed and
//! looked up by its digest, so no key is kept, compared or logged in plain
//! text.

use std::collections::HashMap;

/// A SHA-256 digest.
pub type Digest = [u8; 32];

/// The digest of `key`.
pub fn digest(key: &str) -> Digest {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref());
    out
}

/// `digest` as 64 lowercase hex digits, as the configuration writes it.
pub fn hex(digest: &Digest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// A digest written as 64 hex digits (either case), if it is one.
pub fn parse_hex(s: &str) -> Option<Digest> {
    let s = s.as_bytes();
    if s.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, pair) in s.chunks(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

/// The key in an `Authorization` header's value: `Bearer <key>`.
pub fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, key) = authorization.trim().split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

/// Whatever each key grants, by the key's digest.
#[derive(Debug, Clone)]
pub struct Keys<T> {
    by_digest: HashMap<Digest, T>,
}

impl<T> Keys<T> {
    /// The keys given by digest.
    pub fn new(entries: impl IntoIterator<Item = (Digest, T)>) -> Self {
        Self { by_digest: entries.into_iter().collect() }
    }

    /// What the presented key grants, if it is one of them.
    pub fn find(&self, presented: &str) -> Option<&T> {
        self.by_digest.get(&digest(presented))
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_sha256() {
        // FIPS 180-2's example: SHA-256("abc").
        assert_eq!(hex(&digest("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn hex_round_trips_and_rejects_what_is_not_a_digest() {
        let d = digest("sk-test");
        assert_eq!(parse_hex(&hex(&d)), Some(d));
        assert_eq!(parse_hex(&hex(&d).to_uppercase()), Some(d));
        assert_eq!(parse_hex("abc"), None);
        assert_eq!(parse_hex(&"g".repeat(64)), None);
        assert_eq!(parse_hex("sk-test"), None);
    }

    #[test]
    fn keys_are_found_by_their_digest_only() {
        let keys = Keys::new([(digest("sk-alpha"), "alpha"), (digest("sk-beta"), "beta")]);
        assert_eq!(keys.find("sk-alpha"), Some(&"alpha"));
        assert_eq!(keys.find("sk-beta"), Some(&"beta"));
        assert_eq!(keys.find("sk-gamma"), None);
        // The digest itself is not a key.
        assert_eq!(keys.find(&hex(&digest("sk-alpha"))), None);
    }

    #[test]
    fn bearer_reads_the_authorization_header() {
        assert_eq!(bearer("Bearer sk-1"), Some("sk-1"));
        assert_eq!(bearer("bearer  sk-1 "), Some("sk-1"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("sk-1"), None);
    }
}
