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

/// Which incarnation of a request ID an authorization belongs to. The
/// consumer picks a fresh generation each time it authorizes a request ID;
/// everything that carries an older one is stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u64);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// The number of a layer mark (a recorded GPU event, `actors::gate`) that a
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
    /// Random low bits of every generation.
    pub const RANDOM_BITS: u32 = 24;
    /// Where the clock part of a generation counts from: 2024-01-01 UTC, in
    /// milliseconds since the Unix epoch (40 bits of milliseconds last until
    /// 2058).
    const EPOCH_MS: u64 = 1_704_067_200_000;

    /// The generation a consumer gives its next authorization, after `prev`
    /// (its last one; `Generation(0)` for none). Its high 40 bits are a
    /// millisecond clock, strictly increasing (`prev`'s plus one when the
    /// clock has not moved on), so a generation is newer than every earlier
    /// one of this runtime and, unless that runtime authorized more than one
    /// request a millisecond, of a runtime it replaced; its low
    /// [`Self::RANDOM_BITS`] bits are fresh from the operating system's
    /// random source, so the next request's generation cannot be read off
    /// an earlier one (defence in depth: a notice is believed only with its
    /// request's tag, `crate::wire::Notice::authentic`).
    pub fn next_after(prev: Generation) -> Generation {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let ticks = now_ms
            .saturating_sub(Self::EPOCH_MS)
            .max((prev.0 >> Self::RANDOM_BITS) + 1);
        let random = uuid::Uuid::new_v4().as_u64_pair().0 & ((1 << Self::RANDOM_BITS) - 1);
        Generation((ticks << Self::RANDOM_BITS) | random)
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
    use super::{Capability, Generation, RequestId};

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
    fn generations_increase_and_their_low_bits_are_random() {
        let mut prev = Generation(0);
        let mut lows = std::collections::BTreeSet::new();
        for _ in 0..1000 {
            let g = Generation::next_after(prev);
            assert!(g > prev, "{g} not after {prev}");
            lows.insert(g.0 & ((1 << Generation::RANDOM_BITS) - 1));
            prev = g;
        }
        // 1000 draws of 24 random bits: a counter would give 1000 values in
        // a row, a constant one; collisions among random ones are rare.
        assert!(lows.len() > 990, "{} distinct low parts", lows.len());
        let sorted: Vec<u64> = lows.iter().copied().collect();
        assert!(sorted.windows(2).filter(|w| w[1] == w[0] + 1).count() < 10);
        // A runtime that starts later starts above an earlier one's (the
        // clock part), and a runtime that ran ahead of the clock still
        // counts up.
        let ahead = Generation(u64::MAX >> 1);
        assert!(Generation::next_after(ahead) > ahead);
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
