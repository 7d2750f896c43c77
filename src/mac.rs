//! HMAC-SHA256 tags, written and checked one way for the whole crate: the
//! deployment key's signature of a side-channel body
//! ([`crate::side_channel::sign`]) and a completion notice's tag under its
//! request's capability ([`crate::wire::Notice::sign`]). Tags travel as 64
//! lowercase hex digits and are compared in constant time.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The HMAC-SHA256 of the concatenation of `parts` under `key`.
pub fn tag(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = hmac(key);
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// `tag` as 64 lowercase hex digits.
pub fn tag_hex(key: &[u8], parts: &[&[u8]]) -> String {
    let mut out = String::with_capacity(64);
    for b in tag(key, parts) {
        out.push(char::from(HEX[(b >> 4) as usize]));
        out.push(char::from(HEX[(b & 15) as usize]));
    }
    out
}

/// Whether `hex` (64 hex digits, either case) is the tag of `parts` under
/// `key`; compared in constant time. Anything else is `false`.
pub fn verify_hex(key: &[u8], parts: &[&[u8]], hex: &[u8]) -> bool {
    let Some(want) = decode_hex32(hex) else {
        return false;
    };
    let mut m = hmac(key);
    for p in parts {
        m.update(p);
    }
    m.verify_slice(&want).is_ok()
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hmac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length (longer ones are hashed first).
    <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key"))
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
    fn known_answer_and_parts() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        assert_eq!(tag_hex(b"Jefe", &[b"what do ya want for nothing?"]), want);
        // The parts are concatenated.
        assert_eq!(tag_hex(b"Jefe", &[b"what do ya ", b"want for nothing?"]), want);
        assert!(verify_hex(
            b"Jefe",
            &[b"what do ya want for nothing?"],
            want.as_bytes()
        ));
        assert!(verify_hex(
            b"Jefe",
            &[b"what do ya want for nothing?"],
            want.to_uppercase().as_bytes()
        ));
        for bad in ["", &want[..63], &format!("{want}0"), &"zz".repeat(32)] {
            assert!(!verify_hex(
                b"Jefe",
                &[b"what do ya want for nothing?"],
                bad.as_bytes()
            ));
        }
        assert!(!verify_hex(
            b"Jeff",
            &[b"what do ya want for nothing?"],
            want.as_bytes()
        ));
    }
}
