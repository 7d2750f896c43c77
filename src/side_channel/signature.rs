//! The deployment key's signature: `X-OrbitKV-Signature: sha256=<hex
//! HMAC-SHA256(key, body)>` on every handshake and cancel, checked in
//! constant time before the body is parsed.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The header that carries the signature.
pub const SIGNATURE_HEADER: &str = "X-OrbitKV-Signature";

const PREFIX: &[u8] = b"sha256=";

fn mac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length (longer ones are hashed first).
    <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key"))
}

/// The header value for `body` under `key` (what a sender puts in
/// [`SIGNATURE_HEADER`]).
pub fn sign(key: &[u8], body: &[u8]) -> String {
    let mut m = mac(key);
    m.update(body);
    let tag = m.finalize().into_bytes();
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256=");
    for b in tag {
        out.push(char::from(b"0123456789abcdef"[(b >> 4) as usize]));
        out.push(char::from(b"0123456789abcdef"[(b & 15) as usize]));
    }
    out
}

/// Whether `header` (the raw value of [`SIGNATURE_HEADER`], if any) is
/// `body`'s signature under `key`. The tag is compared in constant time.
pub fn verify(key: &[u8], header: Option<&[u8]>, body: &[u8]) -> bool {
    let Some(hex) = header.and_then(|h| h.strip_prefix(PREFIX)) else {
        return false;
    };
    let Some(tag) = decode_hex32(hex) else {
        return false;
    };
    let mut m = mac(key);
    m.update(body);
    m.verify_slice(&tag).is_ok()
}

fn decode_hex32(hex: &[u8]) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_for_its_key_and_body() {
        let (key, body) = (
            b"deployment-key-0123456789".as_slice(),
            b"{\"version\":2}".as_slice(),
        );
        let s = sign(key, body);
        assert!(s.starts_with("sha256=") && s.len() == 71);
        assert!(verify(key, Some(s.as_bytes()), body));
        assert!(verify(
            key,
            Some(s.to_uppercase().replace("SHA256=", "sha256=").as_bytes()),
            body
        ));
        assert!(!verify(b"another-key-0123456789", Some(s.as_bytes()), body));
        assert!(!verify(key, Some(s.as_bytes()), b"{\"version\":3}"));
        for bad in [
            "",
            "sha256=",
            "sha1=00",
            &s[..70],
            &format!("{s}0"),
            &s.replace("sha256=", "sha512="),
            &format!("sha256={}", "zz".repeat(32)),
        ] {
            assert!(!verify(key, Some(bad.as_bytes()), body), "{bad:?}");
        }
        assert!(!verify(key, None, body));
    }

    #[test]
    fn known_answer() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        assert_eq!(
            sign(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
