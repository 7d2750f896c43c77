//! Newtypes for the identities the safety contract is written in.

use serde::{Deserialize, Serialize};

/// A P/D request's identity, shared by its prefill and decode halves.
///
/// Deserialized (from a handshake, a cancel or a notice: input from the
/// network) only when it is 1 to [`RequestId::MAX_LEN`] bytes of printable
/// ASCII without spaces (0x21..=0x7e, the rule of the vLLM connector's
/// `params.py`), checked on the borrowed text before any `String` is made:
/// an 8 MiB ID is refused without being copied.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct RequestId(pub String);

impl RequestId {
    /// The longest request ID accepted from the network (bytes).
    pub const MAX_LEN: usize = 256;

    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Why `s` is not a request ID the wire accepts, if it is not: the
    /// reason names the rule and the length, never the text.
    pub fn check(s: &str) -> Result<(), String> {
        let ok = (1..=Self::MAX_LEN).contains(&s.len()) && s.bytes().all(|b| (0x21..=0x7e).contains(&b));
        if ok {
            return Ok(());
        }
        Err(format!(
            "a request_id is 1 to {} printable ASCII characters without spaces, got {} bytes",
            Self::MAX_LEN,
            s.len()
        ))
    }
}

impl<'de> Deserialize<'de> for RequestId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(BoundedStr {
            what: "a request_id",
            check: RequestId::check,
        })
        .map(RequestId)
    }
}

/// A string deserialized only when `check` accepts the borrowed text (so
/// nothing is allocated for one it refuses).
pub(crate) struct BoundedStr {
    pub(crate) what: &'static str,
    pub(crate) check: fn(&str) -> Result<(), String>,
}

impl serde::de::Visitor<'_> for BoundedStr {
    type Value = String;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.what)
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<String, E> {
        (self.check)(s).map_err(E::custom)?;
        Ok(s.to_string())
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

/// Which authorization of a request ID a message belongs to: the consumer
/// draws a fresh generation each time it authorizes a request ID
/// ([`Generation::random`]), and everything that carries another one is
/// stale. A generation is an identity, never an order: it is compared for
/// equality only (no `Ord`), and which of two authorizations is the newer
/// one is said by their handshakes' [`Sequence`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u64);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// The order of one consumer runtime's authorizations: each handshake
/// carries the next one ([`Sequence::next_after`]), and a producer (or a
/// handshake parked before its request opened) takes a handshake of the
/// same request and consumer rank up only if its sequence is greater than
/// the one it holds ([`crate::wire::Handshake::supersedes`]).
///
/// It exists because generations are random: it is used for that ordering
/// only, never to route, authenticate or fence anything, so it need not be
/// secret. It is a microsecond clock that never repeats or goes back within
/// a runtime (the last one plus one when the clock has not moved on or went
/// back), so a runtime that replaced another (a restart of decode) starts
/// above every sequence of the old one unless that one authorized more than
/// a request a microsecond on end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Sequence(pub u64);

impl Sequence {
    /// The sequence of a consumer's next authorization, after `prev` (its
    /// last one; `Sequence(0)` for none): strictly greater than `prev`.
    pub fn next_after(prev: Sequence) -> Sequence {
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Sequence(now_us.max(prev.0.saturating_add(1)))
    }
}

/// The number of a layer mark (a recorded GPU event, `actors::prefill::gate`) that a
/// write waits for before it is submitted; 0: none (the data is written).
pub type MarkSeq = u64;

/// A producer's tensor-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ProducerRank(pub u32);

/// A per-request secret shared by a request's prefill and decode halves
/// (the router hands it to both in `kv_transfer_params`). A handshake or a
/// cancel is accepted only with the capability the producer was opened with,
/// so nobody who merely reaches a side channel can steer a write or cancel a
/// request. Compared in constant time; never printed.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Capability(String);

impl TryFrom<String> for Capability {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Self::parse(&s)
    }
}

impl From<Capability> for String {
    fn from(c: Capability) -> String {
        c.0
    }
}

impl Capability {
    /// Shortest accepted capability: 32 hex digits (128 bits).
    pub const MIN_HEX: usize = 32;
    /// Longest accepted capability.
    pub const MAX_HEX: usize = 128;

    /// A capability of 32 to 128 lowercase or uppercase hex digits.
    pub fn parse(s: &str) -> Result<Self, String> {
        let n = s.len();
        if !(Self::MIN_HEX..=Self::MAX_HEX).contains(&n) || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "a capability is {} to {} hex digits, got {} characters",
                Self::MIN_HEX,
                Self::MAX_HEX,
                n
            ));
        }
        Ok(Self(s.to_ascii_lowercase()))
    }

    /// A fresh capability of 256 bits from the operating system's
    /// cryptographic random source (two v4 UUIDs, 244 random bits).
    pub fn random() -> Self {
        let (a, b) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
        Self(format!("{}{}", a.simple(), b.simple()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Constant-time comparison (in the length of the longer value).
    pub fn matches(&self, other: &Capability) -> bool {
        let (a, b) = (self.0.as_bytes(), other.0.as_bytes());
        let mut diff = (a.len() ^ b.len()) as u8 | ((a.len() ^ b.len()) >> 8) as u8;
        for i in 0..a.len().max(b.len()) {
            diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
        }
        std::hint::black_box(diff) == 0
    }
}

impl std::fmt::Debug for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Capability(<redacted>)")
    }
}

impl Generation {
    /// A fresh generation: 64 bits from the operating system's
    /// cryptographic random source (the one [`Capability::random`] and
    /// [`NoticeKey::random`] draw from), never 0 (the placeholder of a
    /// handshake the request directory has not given one yet). Nothing of
    /// it can be read off an earlier one: no clock, no counter. That alone
    /// authenticates nothing (a notice is believed only with its tag under
    /// the authorization's [`NoticeKey`]); it keeps a guess of the
    /// generation worth no more than a guess of 64 bits.
    pub fn random() -> Generation {
        loop {
            // A v4 UUID holds 122 random bits: its two halves' fixed bits
            // (version, variant) lie at different positions, so their XOR
            // is 64 uniformly random bits.
            let (a, b) = uuid::Uuid::new_v4().as_u64_pair();
            if a ^ b != 0 {
                return Generation(a ^ b);
            }
        }
    }
}

/// The key of the tags on one authorization's completion notices
/// ([`crate::wire::Notice::sign`]): 256 bits the consumer draws for each
/// authorization (request, generation, consumer rank), sends only in its
/// handshake (which goes only to the prefill side channels it allows) and
/// keeps with the authorization. Unlike the [`Capability`], which the
/// client that sent the request also holds, only the consumer and the
/// producers it sent the handshake to know it, so only they can make a
/// notice the consumer believes.
///
/// On the wire: 64 lowercase hex digits (the handshake's `notice_key`).
/// Compared in constant time; never printed (`Debug` says `<redacted>`, and
/// there is no `Display`).
#[derive(Clone, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NoticeKey([u8; 32]);

impl NoticeKey {
    /// Hex digits of a key on the wire.
    pub const HEX: usize = 64;

    /// A fresh key of 256 bits from the operating system's cryptographic
    /// random source (the one [`Capability::random`] draws from): three v4
    /// UUIDs (366 random bits) through SHA-256.
    pub fn random() -> Self {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"orbitkv-notice-key\0");
        for _ in 0..3 {
            h.update(uuid::Uuid::new_v4().as_bytes());
        }
        Self(h.finalize().into())
    }

    /// A key of exactly [`Self::HEX`] hex digits (either case).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "a notice key is {} hex digits, got {} characters",
                Self::HEX,
                s.len()
            )
        };
        let b = s.as_bytes();
        if b.len() != Self::HEX {
            return Err(bad());
        }
        let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut out = [0u8; 32];
        for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
            *o = (nibble(pair[0]).ok_or_else(bad)? << 4) | nibble(pair[1]).ok_or_else(bad)?;
        }
        Ok(Self(out))
    }

    /// The key's bytes, for the tag (`crate::mac`) only.
    pub(crate) fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Constant-time comparison.
    pub fn matches(&self, other: &NoticeKey) -> bool {
        let diff = self.0.iter().zip(&other.0).fold(0u8, |d, (a, b)| d | (a ^ b));
        std::hint::black_box(diff) == 0
    }
}

impl PartialEq for NoticeKey {
    /// [`NoticeKey::matches`] (constant time).
    fn eq(&self, other: &Self) -> bool {
        self.matches(other)
    }
}

impl Eq for NoticeKey {}

impl TryFrom<String> for NoticeKey {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Self::parse(&s)
    }
}

impl From<NoticeKey> for String {
    /// The wire form (the handshake's JSON): the only place a key is written.
    fn from(k: NoticeKey) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(NoticeKey::HEX);
        for b in k.0 {
            out.push(char::from(HEX[(b >> 4) as usize]));
            out.push(char::from(HEX[(b & 15) as usize]));
        }
        out
    }
}

impl std::fmt::Debug for NoticeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NoticeKey(<redacted>)")
    }
}

/// Splits and checks a peer's endpoint, `host:port` (`[v6]:port`): the
/// Mooncake endpoints and side channels that handshakes name.
pub fn parse_endpoint(endpoint: &str) -> crate::error::TransportResult<(String, u16)> {
    let bad = |reason: &str| crate::error::TransportError::BadEndpoint {
        endpoint: endpoint.to_string(),
        reason: reason.into(),
    };
    let (host, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| bad("expected host:port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    if host.chars().any(|c| c.is_whitespace() || c == '/' || c == '\0') {
        return Err(bad("host contains whitespace, '/' or NUL"));
    }
    let port: u16 = port
        .parse()
        .map_err(|_| bad("port is not a number in 1..=65535"))?;
    if port == 0 {
        return Err(bad("port 0"));
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::{Capability, Generation, NoticeKey, RequestId, Sequence};

    #[test]
    fn a_request_id_from_the_wire_is_bounded_printable_ascii() {
        let parse = |json: &str| serde_json::from_str::<RequestId>(json);
        assert_eq!(parse(r#""cmpl-1~x""#).unwrap(), RequestId::new("cmpl-1~x"));
        let longest = format!("\"{}\"", "r".repeat(RequestId::MAX_LEN));
        assert_eq!(parse(&longest).unwrap().as_str().len(), RequestId::MAX_LEN);
        for bad in [
            "\"\"".to_string(),
            format!("\"{}\"", "r".repeat(RequestId::MAX_LEN + 1)),
            r#""a b""#.into(),
            r#""a\nb""#.into(),
            r#""\u007f""#.into(),
            r#""é""#.into(),
            "7".into(),
        ] {
            let e = parse(&bad).unwrap_err().to_string();
            assert!(e.contains("request_id"), "{bad}: {e}");
            // The refusal never repeats the text.
            assert!(e.len() < 200, "{e}");
        }
        let huge = format!("\"{}\"", "x".repeat(8 << 20));
        let e = parse(&huge).unwrap_err().to_string();
        assert!(
            e.contains(&format!("got {} bytes", 8 << 20)) && e.len() < 200,
            "{e}"
        );
    }

    #[test]
    fn generations_are_random_and_carry_no_clock() {
        let gens: Vec<u64> = (0..2000).map(|_| Generation::random().0).collect();
        assert!(gens.iter().all(|&g| g != 0), "0 is the placeholder");
        let distinct: std::collections::HashSet<u64> = gens.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            gens.len(),
            "64 random bits do not collide in 2000 draws"
        );
        // The clock-based generations of before shared their high 40 bits
        // (milliseconds) with the next one and always increased. Random
        // ones: two consecutive ones share their top 16 bits about once in
        // 65,536 pairs, and increase about half the time.
        let pairs = || gens.windows(2);
        let same_top = pairs().filter(|w| w[0] >> 48 == w[1] >> 48).count();
        assert!(
            same_top < 5,
            "{same_top} consecutive pairs share their top 16 bits"
        );
        let increasing = pairs().filter(|w| w[1] > w[0]).count();
        assert!(
            (800..1200).contains(&increasing),
            "{increasing} of 1999 consecutive pairs increase: ordered"
        );
        // Every bit varies (no fixed version or variant bits left).
        let (ones, zeros) = gens.iter().fold((0u64, 0u64), |(o, z), &g| (o | g, z | !g));
        assert_eq!((ones, zeros), (u64::MAX, u64::MAX));
    }

    #[test]
    fn sequences_increase_strictly_even_ahead_of_the_clock() {
        let mut prev = Sequence(0);
        for _ in 0..1000 {
            let s = Sequence::next_after(prev);
            assert!(s > prev, "{s:?} not after {prev:?}");
            prev = s;
        }
        // A runtime whose last sequence ran ahead of the clock still counts up.
        let ahead = Sequence(u64::MAX - 1);
        assert_eq!(Sequence::next_after(ahead), Sequence(u64::MAX));
    }

    #[test]
    fn a_notice_key_is_256_random_bits_never_printed() {
        let (a, b) = (NoticeKey::random(), NoticeKey::random());
        assert!(a.matches(&a.clone()) && !a.matches(&b) && a != b);
        assert_eq!(format!("{a:?}"), "NoticeKey(<redacted>)");
        // The wire form is the only place it is written, and parses back.
        let hex = String::from(a.clone());
        assert_eq!(hex.len(), NoticeKey::HEX);
        assert!(hex
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(NoticeKey::parse(&hex).unwrap(), a);
        assert_eq!(NoticeKey::parse(&hex.to_ascii_uppercase()).unwrap(), a);
        for bad in ["", &hex[1..], &format!("{hex}0"), &format!("{}g", &hex[1..])] {
            let err = NoticeKey::parse(bad).unwrap_err();
            assert!(!err.contains(&hex[..16]), "the error echoes the key: {err}");
        }
    }

    #[test]
    fn capability_parses_hex_of_128_bits_or_more() {
        let ok = "0123456789abcdefABCDEF0123456789";
        assert_eq!(Capability::parse(ok).unwrap().as_str(), ok.to_ascii_lowercase());
        assert!(Capability::parse(&ok[1..]).is_err());
        assert!(Capability::parse(&"a".repeat(129)).is_err());
        assert!(Capability::parse(&format!("{}g", &ok[1..])).is_err());
        assert!(Capability::parse("").is_err());
    }

    #[test]
    fn capability_compares_whole_values() {
        let a = Capability::parse(&"a".repeat(32)).unwrap();
        let b = Capability::parse(&"a".repeat(33)).unwrap();
        let c = Capability::parse(&format!("{}b", "a".repeat(31))).unwrap();
        assert!(a.matches(&a.clone()));
        assert!(!a.matches(&b) && !b.matches(&a));
        assert!(!a.matches(&c));
        assert_eq!(format!("{a:?}"), "Capability(<redacted>)");
    }
}
