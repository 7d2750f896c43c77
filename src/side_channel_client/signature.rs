//! The deployment key's signature: `X-OrbitKV-Signature: sha256=<hex
//! HMAC-SHA256(key, body)>` on every handshake and cancel, checked in
//! constant time before the body is parsed.

/// The header that carries the signature.
pub const SIGNATURE_HEADER: &str = "X-OrbitKV-Signature";

const PREFIX: &[u8] = b"sha256=";

/// The header value for `body` under `key` (what a sender puts in
/// [`SIGNATURE_HEADER`]).
pub fn sign(key: &[u8], body: &[u8]) -> String {
    format!("sha256={}", crate::mac::tag_hex(key, &[body]))
}

/// Whether `header` (the raw value of [`SIGNATURE_HEADER`], if any) is
/// `body`'s signature under `key`. The tag is compared in constant time.
pub fn verify(key: &[u8], header: Option<&[u8]>, body: &[u8]) -> bool {
    header
        .and_then(|h| h.strip_prefix(PREFIX))
        .is_some_and(|hex| crate::mac::verify_hex(key, &[body], hex))
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
