//! The wire contract: the handshake a consumer publishes over the P/D HTTP
//! control channel, and the notification a producer sends through Mooncake.
//!
//! Both are versioned JSON. Parsing is strict: an unknown version, a missing
//! or unknown field, block IDs outside the advertised region, overlapping or
//! inconsistent geometry — each is a typed [`ProtocolError`] and nothing is
//! admitted. The handshake carries no rkeys, QP descriptors or RDMA-IMM ids:
//! Mooncake's P2P handshake exchanges those itself.

use serde::{Deserialize, Serialize};

use crate::error::{GeometryError, ProtocolError};
use crate::ids::{parse_endpoint, Capability, Generation, NoticeKey, ProducerRank, RequestId, Sequence};
use crate::layout::{KvLayout, Target};
use crate::staging::StagingGrant;

/// The wire version this build speaks. Version 2 added the request's
/// capability to the handshake and the cancel message to the wire; version
/// 3 the notice's tag ([`Notice::sign`]) and the cancel's fence
/// ([`Cancel::generation`], [`Fence`]); version 4 the handshake's notice
/// key ([`Handshake::notice_key`]), which keys the notice's tag in place of
/// the capability, and its sequence ([`Handshake::sequence`]), which orders
/// a consumer's authorizations now that generations are random
/// ([`Generation::random`]).
pub const WIRE_VERSION: u32 = 4;

/// Mooncake notification name under which OrbitKV notices travel.
pub const NOTIFY_NAME: &str = "orbitkv";

/// What a consumer (decode) rank authorizes for one request. Its `Debug`
/// shows neither secret (the capability and the notice key print as
/// `<redacted>`); [`Handshake::to_json`], the wire form, carries both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handshake {
    pub version: u32,
    pub request_id: RequestId,
    /// The request's secret, as the router gave it to both halves: the
    /// producer admits the handshake only if it matches its own.
    pub capability: Capability,
    /// This authorization's identity (random, [`Generation::random`]): its
    /// writes, notices and fence name it.
    pub generation: Generation,
    /// Where this authorization stands among the consumer runtime's
    /// (strictly increasing, [`Sequence::next_after`]): a producer takes a
    /// handshake of the same request and consumer rank up in place of the
    /// one it holds only if this is greater ([`Handshake::supersedes`]).
    /// Used for that order only.
    pub sequence: Sequence,
    /// The key of this authorization's notice tags ([`Notice::sign`]),
    /// fresh for each authorization: the producer tags its notice with it,
    /// and the consumer believes no notice without that tag. The client
    /// that sent the request holds the capability, but never sees this key
    /// (it travels only here, to the allowed prefill side channels).
    pub notice_key: NoticeKey,
    /// The consumer rank's Mooncake endpoint (`ip:port`, at most
    /// [`MAX_ENDPOINT`] bytes).
    #[serde(deserialize_with = "bounded_endpoint")]
    pub endpoint: String,
    /// How many producer ranks must report done.
    pub expected_producers: u32,
    /// Index, in the request's block list, of the first authorized block:
    /// blocks before it the consumer already holds (a local prefix-cache
    /// hit) and are not written.
    pub first_block: u32,
    /// Authorized destination blocks for request blocks `first_block..`,
    /// in request order.
    pub block_ids: Vec<u32>,
    /// The consumer rank's KV geometry (TP rank and size included).
    pub layout: KvLayout,
    /// The consumer's deadline, in milliseconds since the Unix epoch on its
    /// clock (0: none). A producer submits no write once its own clock is
    /// past it: the consumer has failed the request by then, and a prefill
    /// that stalled (stopped, swapped) past the consumer's quarantine must
    /// not start writing into blocks that may have been reused. Hosts'
    /// clocks must agree to well within `orbitkv.pd.timeout_s` (NTP).
    #[serde(default)]
    pub expires_unix_ms: u64,
    /// The request's tokens the consumer loads, counted from the request's
    /// start (its prompt): what a producer of another block size writes up
    /// to. 0 (absent): not said; only an equal block size is served then.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub tokens: u32,
    /// Where a producer that stages writes instead of the pages: a region of
    /// the consumer's registered staging memory, authorized for this
    /// request and generation like `block_ids` (`crate::staging`). Absent:
    /// producers write the pages directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<StagingGrant>,
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// Milliseconds since the Unix epoch, on this host's clock.
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Handshake {
    /// Where this authorization lets a producer write (what the planners need).
    pub fn target(&self) -> Target<'_> {
        Target {
            layout: &self.layout,
            block_ids: &self.block_ids,
            first_block: self.first_block,
            tokens: self.tokens,
        }
    }

    /// Whether this authorization replaces `other` (an earlier handshake of
    /// the same request and consumer rank that a producer holds or parked):
    /// its sequence is greater. Generations are random and say nothing of
    /// order; arrival order does not either (the side channel's retries and
    /// connections can reorder two handshakes of one consumer), so an older
    /// handshake arriving late never replaces a newer one.
    pub fn supersedes(&self, other: &Handshake) -> bool {
        self.sequence > other.sequence
    }

    /// Whether the consumer's deadline has passed on this host's clock.
    pub fn expired(&self) -> bool {
        self.expires_unix_ms != 0 && unix_ms_now() > self.expires_unix_ms
    }

    /// Checks everything that can be checked without the producer's layout.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        if self.version != WIRE_VERSION {
            return Err(ProtocolError::Version {
                found: self.version,
                supported: WIRE_VERSION,
            });
        }
        let malformed = |reason: &str| ProtocolError::Malformed {
            what: "handshake",
            reason: reason.into(),
        };
        if self.request_id.as_str().is_empty() {
            return Err(malformed("empty request_id"));
        }
        if self.expected_producers == 0 {
            return Err(malformed("expected_producers is 0"));
        }
        if self.block_ids.is_empty() {
            return Err(malformed("no authorized blocks"));
        }
        parse_endpoint(&self.endpoint).map_err(|e| ProtocolError::Endpoint(e.to_string()))?;
        self.layout.validate()?;
        self.layout.validate_blocks(&self.block_ids)?;
        if self.tokens != 0 {
            // The authorized blocks reach the block holding the last token.
            let size = self.layout.block_size.max(1) as u64;
            let end = self.first_block as u64 + self.layout.request_blocks(self.block_ids.len()) as u64;
            let needed = (self.tokens as u64).div_ceil(size);
            if needed > end {
                return Err(malformed(&format!(
                    "{} tokens take {needed} blocks of {size}, the handshake authorizes blocks up to {end}",
                    self.tokens
                )));
            }
        }
        if self.staging.is_some() && self.layout.groups() > 1 {
            return Err(malformed("staging for a layout of several KV cache groups"));
        }
        if let Some(g) = self.staging {
            let needed = crate::staging::staged_bytes(&self.layout, self.block_ids.len() as u32)
                .ok_or(GeometryError::StagingOverflow)?;
            if g.base.checked_add(g.len).is_none() || g.base == 0 {
                return Err(GeometryError::StagingOverflow.into());
            }
            if !crate::staging::group_fits(&self.layout, g.group) {
                return Err(malformed(&format!(
                    "staging grouped by {} units, which do not divide the {} units of a block",
                    g.group,
                    crate::staging::units(&self.layout)
                )));
            }
            if g.len < needed {
                return Err(GeometryError::StagingTooSmall {
                    granted: g.len,
                    needed,
                }
                .into());
            }
        }
        Ok(())
    }

    /// Parses and validates a handshake.
    pub fn from_json(text: &str) -> Result<Self, ProtocolError> {
        let h: Self = parse_versioned(text, "handshake")?;
        h.validate()?;
        Ok(h)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a handshake always serializes")
    }
}

/// A consumer (decode) rank gives a request up before it authorized anything:
/// no handshake will come, so the producer need not hold its source blocks.
/// Accepted only with the request's capability.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cancel {
    pub version: u32,
    pub request_id: RequestId,
    pub capability: Capability,
    /// Why (informative, at most [`Cancel::MAX_REASON`] bytes).
    #[serde(default, deserialize_with = "bounded_reason")]
    pub reason: String,
    /// The fence: the consumer authorized this generation (and rank
    /// `consumer_rank` of its instance) and wants to know whether anything
    /// can still be written into it ([`Fence`], the producer's answer).
    /// Absent: it authorized nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<Generation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer_rank: Option<u32>,
}

/// A prefill rank's answer to a [`Cancel`] with a generation: what may still
/// be written into that generation's blocks from this rank (the body of the
/// side channel's `200`, `{"ok":true,"fence":"…"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fence {
    /// Nothing: no producer of this rank holds the generation, none has a
    /// write of it in flight, and none will take it up (the request was
    /// aborted here, and the cancel is remembered against a later open).
    /// The consumer counts this rank as ended at once.
    Fenced,
    /// A producer that holds the generation is aborting: its notice follows
    /// once its admitted writes drained (or was sent already).
    NoticeFollows,
    /// Writes of the generation may still be in flight under an
    /// authorization that was superseded, and no notice will name it: the
    /// consumer keeps its deadline and quarantine.
    Held,
}

impl Fence {
    /// The side channel's reply body for this answer.
    pub fn reply(self) -> String {
        serde_json::json!({"ok": true, "fence": self}).to_string()
    }

    /// The answer in a side-channel reply body, if it holds one.
    pub fn from_reply(body: &str) -> Option<Fence> {
        let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
        serde_json::from_value(v.get("fence")?.clone()).ok()
    }
}

impl Cancel {
    pub const MAX_REASON: usize = 1024;

    pub fn new(request_id: RequestId, capability: Capability, reason: &str) -> Self {
        let mut reason = reason.to_string();
        truncate_utf8(&mut reason, Self::MAX_REASON);
        Self {
            version: WIRE_VERSION,
            request_id,
            capability,
            reason,
            generation: None,
            consumer_rank: None,
        }
    }

    /// The cancel of an authorization: `generation` of consumer rank
    /// `consumer_rank`, to be fenced ([`Fence`]).
    pub fn fencing(mut self, generation: Generation, consumer_rank: u32) -> Self {
        self.generation = Some(generation);
        self.consumer_rank = Some(consumer_rank);
        self
    }

    pub fn from_json(text: &str) -> Result<Self, ProtocolError> {
        let c: Self = parse_versioned(text, "cancel")?;
        let malformed = |reason: &str| ProtocolError::Malformed {
            what: "cancel",
            reason: reason.into(),
        };
        if c.request_id.as_str().is_empty() {
            return Err(malformed("empty request_id"));
        }
        if c.generation.is_some() != c.consumer_rank.is_some() {
            return Err(malformed("generation and consumer_rank come together"));
        }
        Ok(c)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a cancel always serializes")
    }
}

/// How a producer's part of a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Done,
    Failed,
    Aborted,
}

/// A producer rank's report on one request, sent through Mooncake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Notice {
    pub version: u32,
    pub request_id: RequestId,
    pub generation: Generation,
    pub producer_rank: ProducerRank,
    pub outcome: Outcome,
    /// Why, for `failed` and `aborted`.
    pub reason: Option<String>,
    /// Bytes this producer wrote for the request.
    pub bytes: u64,
    /// Whether this producer wrote into the handshake's staging grant
    /// instead of the pages (the consumer then scatters its heads).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub staged: bool,
    /// The producer's tag over every other field, keyed by the notice key
    /// of the handshake it wrote under ([`Notice::sign`]): only the
    /// consumer and the producers it sent that handshake to hold the key,
    /// so nobody else — not even the client that sent the request and so
    /// holds its capability — can make one. A consumer believes no notice
    /// without it ([`Notice::authentic`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl Notice {
    /// What the tag covers: every field but the tag, each of variable length
    /// prefixed by its length, after a domain string (no other message of
    /// OrbitKV's is tagged with a notice key).
    fn tagged_fields(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(b"orbitkv-notice-v4\0");
        let id = self.request_id.as_str().as_bytes();
        out.extend_from_slice(&(id.len() as u64).to_le_bytes());
        out.extend_from_slice(id);
        out.extend_from_slice(&self.generation.0.to_le_bytes());
        out.extend_from_slice(&self.producer_rank.0.to_le_bytes());
        out.push(match self.outcome {
            Outcome::Done => 0,
            Outcome::Failed => 1,
            Outcome::Aborted => 2,
        });
        out.extend_from_slice(&self.bytes.to_le_bytes());
        out.push(u8::from(self.staged));
        match &self.reason {
            None => out.extend_from_slice(&u64::MAX.to_le_bytes()),
            Some(r) => {
                out.extend_from_slice(&(r.len() as u64).to_le_bytes());
                out.extend_from_slice(r.as_bytes());
            }
        }
    }

    /// Tags the notice with `key`, the notice key of the handshake the
    /// producer wrote under (its last step before sending it).
    pub fn sign(self, key: &NoticeKey) -> Self {
        self.sign_with_raw_key(key.bytes())
    }

    /// The tag under any key (what [`Self::sign`] does with a notice key;
    /// the tests forge notices under other keys with it).
    pub(crate) fn sign_with_raw_key(mut self, key: &[u8]) -> Self {
        let mut msg = Vec::with_capacity(96 + self.request_id.as_str().len());
        self.tagged_fields(&mut msg);
        self.mac = Some(crate::mac::tag_hex(key, &[&msg]));
        self
    }

    /// Whether the notice carries its tag under `key`, the notice key of
    /// the authorization it names (constant time).
    pub fn authentic(&self, key: &NoticeKey) -> bool {
        let Some(mac) = &self.mac else { return false };
        let mut msg = Vec::with_capacity(96 + self.request_id.as_str().len());
        self.tagged_fields(&mut msg);
        crate::mac::verify_hex(key.bytes(), &[&msg], mac.as_bytes())
    }

    /// The longest notice accepted (bytes of JSON): a request ID of
    /// [`RequestId::MAX_LEN`], a reason of [`Notice::MAX_REASON`] (escaped,
    /// at most 6 bytes a byte) and the fixed fields fit well within it.
    pub const MAX_BYTES: usize = 16 << 10;
    /// The longest reason a producer sends (longer ones are cut).
    pub const MAX_REASON: usize = 1024;

    /// `reason` cut to [`Notice::MAX_REASON`] bytes, so that the notice
    /// carrying it stays within [`Notice::MAX_BYTES`].
    pub fn clip_reason(reason: Option<String>) -> Option<String> {
        reason.map(|mut r| {
            truncate_utf8(&mut r, Self::MAX_REASON);
            r
        })
    }

    /// Parses a notice received through Mooncake; one over
    /// [`Notice::MAX_BYTES`] is refused before it is parsed.
    pub fn from_json(text: &[u8]) -> Result<Self, ProtocolError> {
        if text.len() > Self::MAX_BYTES {
            return Err(ProtocolError::Malformed {
                what: "notice",
                reason: format!(
                    "{} bytes, over the {} a notice may have",
                    text.len(),
                    Self::MAX_BYTES
                ),
            });
        }
        let text = std::str::from_utf8(text).map_err(|_| ProtocolError::Malformed {
            what: "notice",
            reason: "not UTF-8".into(),
        })?;
        let n: Self = parse_versioned(text, "notice")?;
        if n.version != WIRE_VERSION {
            return Err(ProtocolError::Version {
                found: n.version,
                supported: WIRE_VERSION,
            });
        }
        Ok(n)
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a notice always serializes")
    }
}

/// The top-level `version` of a message, read without keeping anything
/// else (other fields are skipped, not allocated).
#[derive(Deserialize)]
struct Peek {
    #[serde(default)]
    version: PeekVersion,
}

/// A `version` that is an unsigned integer, or `None` (any other value,
/// skipped).
#[derive(Default)]
struct PeekVersion(Option<u64>);

impl<'de> Deserialize<'de> for PeekVersion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PeekVersion;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_u64<E>(self, v: u64) -> Result<PeekVersion, E> {
                Ok(PeekVersion(Some(v)))
            }
            fn visit_i64<E>(self, _: i64) -> Result<PeekVersion, E> {
                Ok(PeekVersion(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<PeekVersion, E> {
                Ok(PeekVersion(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<PeekVersion, E> {
                Ok(PeekVersion(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<PeekVersion, E> {
                Ok(PeekVersion(None))
            }
            fn visit_unit<E>(self) -> Result<PeekVersion, E> {
                Ok(PeekVersion(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<PeekVersion, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(PeekVersion(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<PeekVersion, A::Error> {
                while a
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(PeekVersion(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// A parse error as a [`ProtocolError::Malformed`]: serde's message may
/// quote the input (an unknown field's name, a bad value), so it is kept
/// escaped and short ([`crate::error::untrusted`]).
fn malformed(what: &'static str, e: serde_json::Error) -> ProtocolError {
    ProtocolError::Malformed {
        what,
        reason: crate::error::untrusted(&e.to_string(), crate::error::MAX_PARSE_ERROR),
    }
}

/// Reads `version` first, so a future version is reported as such and not
/// as an unknown field; then parses strictly. Neither pass builds a tree of
/// the document: every string is checked where it is read (a request ID
/// by [`RequestId`]'s bounds, a reason by [`Cancel::MAX_REASON`]) before
/// anything is kept of it.
fn parse_versioned<T: serde::de::DeserializeOwned>(
    text: &str,
    what: &'static str,
) -> Result<T, ProtocolError> {
    let peek: Peek = serde_json::from_str(text).map_err(|e| malformed(what, e))?;
    match peek.version.0 {
        Some(v) if v == WIRE_VERSION as u64 => {}
        Some(v) => {
            return Err(ProtocolError::Version {
                found: v as u32,
                supported: WIRE_VERSION,
            })
        }
        None => {
            return Err(ProtocolError::Malformed {
                what,
                reason: "missing field `version`".into(),
            })
        }
    }
    serde_json::from_str(text).map_err(|e| malformed(what, e))
}

/// Cuts `s` to at most `max` bytes, at a character boundary.
fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// A cancel's `reason`, refused beyond [`Cancel::MAX_REASON`] bytes before
/// it is copied.
fn bounded_reason<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_str(crate::ids::BoundedStr {
        what: "a reason",
        check: |s| {
            if s.len() > Cancel::MAX_REASON {
                return Err(format!(
                    "a reason is at most {} bytes, got {}",
                    Cancel::MAX_REASON,
                    s.len()
                ));
            }
            Ok(())
        },
    })
}

/// The longest endpoint (`host:port`) a handshake may name.
pub const MAX_ENDPOINT: usize = 300;

/// A handshake's `endpoint`, refused beyond [`MAX_ENDPOINT`] bytes before
/// it is copied (its form is checked by `validate`).
fn bounded_endpoint<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_str(crate::ids::BoundedStr {
        what: "an endpoint",
        check: |s| {
            if s.len() > MAX_ENDPOINT {
                return Err(format!(
                    "an endpoint is at most {MAX_ENDPOINT} bytes, got {}",
                    s.len()
                ));
            }
            Ok(())
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::MAX_PARSE_ERROR;
    use crate::layout::tests::layout;

    fn cap() -> Capability {
        Capability::parse(&"c".repeat(32)).unwrap()
    }

    /// The notice key of [`handshake`].
    fn key() -> NoticeKey {
        NoticeKey::parse(&"5a".repeat(32)).unwrap()
    }

    fn handshake() -> Handshake {
        Handshake {
            tokens: 0,
            version: WIRE_VERSION,
            request_id: RequestId::new("req-1"),
            capability: cap(),
            generation: Generation(7),
            sequence: Sequence(3),
            notice_key: key(),
            endpoint: "127.0.0.1:15000".into(),
            expected_producers: 1,
            first_block: 0,
            block_ids: vec![3, 1, 2],
            layout: layout(0x10_0000, 2, 8, 256, (0, 1), 2),
            expires_unix_ms: 0,
            staging: None,
        }
    }

    /// `tokens` from the network: said only where it fits the authorized
    /// blocks (3 blocks of 16 from block 0: 33..=48 tokens, or fewer with
    /// blocks to spare); left out of the wire when 0.
    #[test]
    fn a_token_count_past_the_authorized_blocks_is_refused() {
        let mut h = handshake();
        assert!(!h.to_json().contains("tokens"));
        h.tokens = 48;
        let back = Handshake::from_json(&h.to_json()).unwrap();
        assert_eq!(back.tokens, 48);
        h.tokens = 20;
        h.validate().unwrap();
        for bad in [49, u32::MAX] {
            h.tokens = bad;
            let err = Handshake::from_json(&h.to_json()).unwrap_err();
            assert!(err.to_string().contains("tokens take"), "{err}");
        }
        // With a held prefix the blocks start later: 3 blocks from block 1.
        h.first_block = 1;
        h.tokens = 64;
        h.validate().unwrap();
        h.tokens = 65;
        assert!(h.validate().is_err());
    }

    #[test]
    fn the_consumer_deadline_travels_and_expires() {
        let mut h = handshake();
        assert!(!h.expired(), "0 is no deadline");
        h.expires_unix_ms = unix_ms_now() + 60_000;
        assert!(!h.expired());
        let back: Handshake = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(back.expires_unix_ms, h.expires_unix_ms);
        h.expires_unix_ms = unix_ms_now() - 1;
        assert!(h.expired());
        // A handshake without the field (an older consumer) has no deadline.
        let mut v = serde_json::to_value(handshake()).unwrap();
        v.as_object_mut().unwrap().remove("expires_unix_ms");
        let old: Handshake = serde_json::from_value(v).unwrap();
        assert_eq!(old.expires_unix_ms, 0);
        // A malformed deadline is a malformed handshake.
        for bad in [
            serde_json::json!("soon"),
            serde_json::json!(-1),
            serde_json::json!(1.5),
            serde_json::json!(null),
        ] {
            let mut v = serde_json::to_value(handshake()).unwrap();
            v["expires_unix_ms"] = bad.clone();
            assert!(
                matches!(
                    Handshake::from_json(&v.to_string()),
                    Err(ProtocolError::Malformed { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn round_trip() {
        let h = handshake();
        assert_eq!(Handshake::from_json(&h.to_json()).unwrap(), h);
        let n = Notice {
            version: WIRE_VERSION,
            request_id: RequestId::new("r"),
            generation: Generation(1),
            producer_rank: ProducerRank(0),
            outcome: Outcome::Failed,
            reason: Some("x".into()),
            bytes: 5,
            staged: false,
            mac: None,
        };
        assert_eq!(Notice::from_json(&n.to_json()).unwrap(), n);
        // The tag travels, and covers every field (the reason too).
        let signed = n.clone().sign(&key());
        let back = Notice::from_json(&signed.to_json()).unwrap();
        assert_eq!(back, signed);
        assert!(back.authentic(&key()) && !n.authentic(&key()));
        assert!(!Notice {
            reason: Some("y".into()),
            ..signed.clone()
        }
        .authentic(&key()));
        assert!(!Notice {
            reason: None,
            ..signed.clone()
        }
        .authentic(&key()));
        // `staged` is left out when false (what an older producer sends)...
        assert!(!String::from_utf8_lossy(&n.to_json()).contains("staged"));
        let staged = Notice { staged: true, ..n };
        assert_eq!(Notice::from_json(&staged.to_json()).unwrap(), staged);
        // ...and anything but a boolean is malformed
        for bad in [
            serde_json::json!("yes"),
            serde_json::json!(1),
            serde_json::json!(null),
        ] {
            let mut v = serde_json::to_value(&staged).unwrap();
            v["staged"] = bad.clone();
            assert!(
                matches!(
                    Notice::from_json(v.to_string().as_bytes()),
                    Err(ProtocolError::Malformed { .. })
                ),
                "{bad}"
            );
        }
    }

    // Issue 44: the tag is keyed by the authorization's notice key. A
    // notice tagged under the request's capability (which the client that
    // sent the request holds) or under another authorization's key is not
    // authentic; only the notice key's tag is.
    #[test]
    fn a_notice_is_authentic_only_under_its_notice_key() {
        let n = Notice {
            version: WIRE_VERSION,
            request_id: RequestId::new("r"),
            generation: Generation(9),
            producer_rank: ProducerRank(0),
            outcome: Outcome::Done,
            reason: None,
            bytes: 5,
            staged: false,
            mac: None,
        };
        assert!(n.clone().sign(&key()).authentic(&key()));
        let under_capability = n.clone().sign_with_raw_key(cap().as_str().as_bytes());
        assert!(!under_capability.authentic(&key()));
        let other = NoticeKey::random();
        assert!(!n.clone().sign(&other).authentic(&key()));
        assert!(!n.clone().sign(&key()).authentic(&other));
    }

    // The notice key appears on the wire (the handshake's JSON) and nowhere
    // else: not in its `Debug` (which traces and errors print), nor in the
    // `Debug` of anything that holds a handshake.
    #[test]
    fn a_handshakes_notice_key_is_written_only_on_the_wire() {
        let h = handshake();
        let hex = String::from(key());
        let wire: serde_json::Value = serde_json::from_str(&h.to_json()).unwrap();
        assert_eq!(wire["notice_key"], serde_json::json!(hex));
        assert_eq!(wire["sequence"], serde_json::json!(3));
        for shown in [
            format!("{h:?}"),
            format!("{h:#?}"),
            format!("{:?}", std::sync::Arc::new(h.clone())),
            format!("{:?}", Some(&h)),
        ] {
            assert!(shown.contains("NoticeKey(<redacted>)"), "{shown}");
            assert!(!shown.contains(&hex), "the key is shown: {shown}");
            assert!(!shown.to_ascii_uppercase().contains(&hex.to_ascii_uppercase()));
            assert!(
                !shown.contains(cap().as_str()),
                "the capability is shown: {shown}"
            );
        }
        // Nor in the error of a handshake with a bad key.
        let mut v = wire.clone();
        v["notice_key"] = format!("{}zz", &hex[2..]).into();
        let err = Handshake::from_json(&v.to_string()).unwrap_err();
        assert!(matches!(err, ProtocolError::Malformed { .. }), "{err}");
        assert!(!err.to_string().contains(&hex[2..]), "{err}");
    }

    #[test]
    fn a_handshake_without_a_valid_notice_key_or_sequence_is_malformed() {
        let h = handshake();
        for field in ["notice_key", "sequence"] {
            let mut v: serde_json::Value = serde_json::from_str(&h.to_json()).unwrap();
            v.as_object_mut().unwrap().remove(field);
            assert!(
                matches!(
                    Handshake::from_json(&v.to_string()),
                    Err(ProtocolError::Malformed { .. })
                ),
                "{field}"
            );
        }
        for bad in [
            serde_json::json!(""),
            serde_json::json!("5a".repeat(16)),
            serde_json::json!("5a".repeat(33)),
            serde_json::json!(7),
            serde_json::Value::Null,
        ] {
            let mut v: serde_json::Value = serde_json::from_str(&h.to_json()).unwrap();
            v["notice_key"] = bad.clone();
            assert!(
                matches!(
                    Handshake::from_json(&v.to_string()),
                    Err(ProtocolError::Malformed { .. })
                ),
                "{bad}"
            );
        }
        // A version-3 handshake (a consumer that sends no key) is refused
        // as such.
        let mut v: serde_json::Value = serde_json::from_str(&h.to_json()).unwrap();
        v["version"] = 3.into();
        for field in ["notice_key", "sequence"] {
            v.as_object_mut().unwrap().remove(field);
        }
        assert_eq!(
            Handshake::from_json(&v.to_string()),
            Err(ProtocolError::Version {
                found: 3,
                supported: WIRE_VERSION
            })
        );
    }

    #[test]
    fn the_sequence_orders_handshakes_whatever_their_generations() {
        let older = handshake();
        let newer = Handshake {
            sequence: Sequence(older.sequence.0 + 1),
            generation: Generation(older.generation.0 - 1),
            ..handshake()
        };
        assert!(newer.supersedes(&older) && !older.supersedes(&newer));
        assert!(!older.supersedes(&older.clone()));
    }

    #[test]
    fn a_staging_grant_is_checked_like_the_blocks() {
        let n = handshake().block_ids.len() as u32;
        let needed = crate::staging::staged_bytes(&handshake().layout, n).unwrap();
        let mut h = handshake();
        h.staging = Some(StagingGrant {
            base: 0x100_0000,
            len: needed,
            group: 1,
        });
        assert_eq!(Handshake::from_json(&h.to_json()).unwrap(), h);
        // unit-major (group 1) is what an older consumer sends: left out
        assert!(!h.to_json().contains("group"));
        // grouped by the block's two heads: sent and checked
        h.staging = Some(StagingGrant {
            base: 0x100_0000,
            len: needed,
            group: 2,
        });
        assert!(h.to_json().contains(r#""group":2"#));
        assert_eq!(Handshake::from_json(&h.to_json()).unwrap(), h);
        // too small, at 0, overflowing, not a {base, len} object, or a
        // group that does not divide the block's units
        for bad in [
            serde_json::json!({"base": 0x100_0000, "len": needed, "group": 0}),
            serde_json::json!({"base": 0x100_0000, "len": needed, "group": 3}),
            serde_json::json!({"base": 0x100_0000, "len": needed, "group": -1}),
            serde_json::json!({"base": 0x100_0000, "len": needed - 1}),
            serde_json::json!({"base": 0, "len": needed}),
            serde_json::json!({"base": u64::MAX - 8, "len": needed}),
            serde_json::json!({"base": 1, "len": needed, "rkey": 7}),
            serde_json::json!({"base": -1, "len": needed}),
            serde_json::json!([1, 2]),
            serde_json::json!("0x1000"),
        ] {
            let mut v = serde_json::to_value(handshake()).unwrap();
            v["staging"] = bad.clone();
            assert!(Handshake::from_json(&v.to_string()).is_err(), "{bad}");
        }
        // absent or null: no staging
        let mut v = serde_json::to_value(handshake()).unwrap();
        v["staging"] = serde_json::Value::Null;
        assert_eq!(Handshake::from_json(&v.to_string()).unwrap().staging, None);
    }

    #[test]
    fn unknown_version_is_typed() {
        let mut v: serde_json::Value = serde_json::from_str(&handshake().to_json()).unwrap();
        v["version"] = 5.into();
        v["something_new"] = 1.into();
        let err = Handshake::from_json(&v.to_string()).unwrap_err();
        assert_eq!(
            err,
            ProtocolError::Version {
                found: 5,
                supported: WIRE_VERSION
            }
        );
    }

    #[test]
    fn missing_and_unknown_fields_are_malformed() {
        let mut v: serde_json::Value = serde_json::from_str(&handshake().to_json()).unwrap();
        v.as_object_mut().unwrap().remove("endpoint");
        assert!(matches!(
            Handshake::from_json(&v.to_string()),
            Err(ProtocolError::Malformed { .. })
        ));
        let mut v: serde_json::Value = serde_json::from_str(&handshake().to_json()).unwrap();
        v["rkey"] = 42.into();
        assert!(matches!(
            Handshake::from_json(&v.to_string()),
            Err(ProtocolError::Malformed { .. })
        ));
        assert!(matches!(
            Handshake::from_json("{not json"),
            Err(ProtocolError::Malformed { .. })
        ));
        assert!(matches!(
            Notice::from_json(b"\xff"),
            Err(ProtocolError::Malformed { .. })
        ));
    }

    #[test]
    fn blocks_outside_region_are_rejected() {
        let mut h = handshake();
        h.block_ids.push(8);
        assert!(matches!(
            Handshake::from_json(&h.to_json()),
            Err(ProtocolError::Geometry(_))
        ));
        let mut h = handshake();
        h.block_ids.push(3);
        assert!(matches!(
            Handshake::from_json(&h.to_json()),
            Err(ProtocolError::Geometry(_))
        ));
    }

    #[test]
    fn overlapping_geometry_is_rejected() {
        let mut h = handshake();
        h.layout.layers[1].planes[0].base = h.layout.layers[0].planes[0].base + 128;
        assert!(matches!(
            Handshake::from_json(&h.to_json()),
            Err(ProtocolError::Geometry(_))
        ));
    }

    #[test]
    fn bad_endpoint_and_empty_authorization_are_rejected() {
        let mut h = handshake();
        h.endpoint = "nowhere".into();
        assert!(matches!(
            Handshake::from_json(&h.to_json()),
            Err(ProtocolError::Endpoint(_))
        ));
        let mut h = handshake();
        h.block_ids.clear();
        assert!(matches!(
            Handshake::from_json(&h.to_json()),
            Err(ProtocolError::Malformed { .. })
        ));
        let mut h = handshake();
        h.expected_producers = 0;
        assert!(matches!(
            Handshake::from_json(&h.to_json()),
            Err(ProtocolError::Malformed { .. })
        ));
    }

    #[test]
    fn a_handshake_without_a_valid_capability_is_malformed() {
        let mut v: serde_json::Value = serde_json::from_str(&handshake().to_json()).unwrap();
        v.as_object_mut().unwrap().remove("capability");
        assert!(matches!(
            Handshake::from_json(&v.to_string()),
            Err(ProtocolError::Malformed { .. })
        ));
        for bad in ["", "short", &"z".repeat(32), &"a".repeat(129)] {
            v["capability"] = bad.into();
            assert!(matches!(
                Handshake::from_json(&v.to_string()),
                Err(ProtocolError::Malformed { .. })
            ));
        }
    }

    #[test]
    fn a_fence_travels_in_the_cancel_and_its_answer_in_the_reply() {
        let c = Cancel::new(RequestId::new("r"), cap(), "x").fencing(Generation(9), 1);
        let back = Cancel::from_json(&c.to_json()).unwrap();
        assert_eq!(
            (back.generation, back.consumer_rank),
            (Some(Generation(9)), Some(1))
        );
        // A cancel without them (what a consumer that authorized nothing sends).
        assert!(!Cancel::new(RequestId::new("r"), cap(), "x")
            .to_json()
            .contains("generation"));
        for half in [
            r#"{"version":4,"request_id":"r","capability":"cccccccccccccccccccccccccccccccc","generation":9}"#,
            r#"{"version":4,"request_id":"r","capability":"cccccccccccccccccccccccccccccccc","consumer_rank":0}"#,
            r#"{"version":4,"request_id":"r","capability":"cccccccccccccccccccccccccccccccc","generation":-1,"consumer_rank":0}"#,
        ] {
            assert!(
                matches!(Cancel::from_json(half), Err(ProtocolError::Malformed { .. })),
                "{half}"
            );
        }
        for f in [Fence::Fenced, Fence::NoticeFollows, Fence::Held] {
            assert_eq!(Fence::from_reply(&f.reply()), Some(f));
        }
        assert_eq!(Fence::from_reply(r#"{"ok":true}"#), None);
        assert_eq!(Fence::from_reply(r#"{"ok":true,"fence":"maybe"}"#), None);
        assert_eq!(Fence::from_reply("not json"), None);
    }

    /// Issue 44: what a stranger names is bounded where it is read, and a
    /// parse error never carries its text long or unescaped.
    #[test]
    fn identifiers_are_bounded_and_parse_errors_are_short_and_escaped() {
        let capability = "c".repeat(32);
        let cancel = |id: &str, reason: &str| {
            format!(r#"{{"version":4,"request_id":"{id}","capability":"{capability}","reason":"{reason}"}}"#)
        };
        assert!(Cancel::from_json(&cancel(&"r".repeat(RequestId::MAX_LEN), &"x".repeat(1024))).is_ok());
        for (id, reason) in [
            ("r".repeat(RequestId::MAX_LEN + 1), String::new()),
            ("x".repeat(8 << 20), String::new()),
            ("a b".into(), String::new()),
            ("a\\u0000b".into(), String::new()),
            ("r".into(), "x".repeat(1025)),
            ("r".into(), "x".repeat(4 << 20)),
        ] {
            let e = Cancel::from_json(&cancel(&id, &reason)).unwrap_err();
            let ProtocolError::Malformed { reason, .. } = &e else {
                panic!("{e:?}")
            };
            assert!(reason.len() <= MAX_PARSE_ERROR + 3, "{} bytes", reason.len());
        }
        // An unknown field whose name forges a log line, and a huge one.
        let forged = format!(
            r#"{{"version":4,"request_id":"r","capability":"{capability}","x\n2026-01-01T00:00:00Z WARN forged":1}}"#
        );
        let e = Cancel::from_json(&forged).unwrap_err().to_string();
        assert!(!e.contains('\n') && e.contains("\\n"), "{e}");
        let huge = format!(
            r#"{{"version":4,"request_id":"r","capability":"{capability}","{}":1}}"#,
            "y".repeat(4 << 20)
        );
        let e = Cancel::from_json(&huge).unwrap_err().to_string();
        assert!(e.len() < 256, "{} bytes", e.len());
        // A handshake's endpoint is bounded the same way.
        let mut v = serde_json::to_value(handshake()).unwrap();
        v["endpoint"] = format!("{}:1", "h".repeat(MAX_ENDPOINT)).into();
        let e = Handshake::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("endpoint") && e.len() < 256, "{e}");
    }

    #[test]
    fn a_notice_is_bounded_before_it_is_parsed() {
        let n = Notice {
            version: WIRE_VERSION,
            request_id: RequestId::new("r".repeat(RequestId::MAX_LEN)),
            generation: Generation(u64::MAX),
            producer_rank: ProducerRank(u32::MAX),
            outcome: Outcome::Failed,
            // The longest reason a producer sends, all of it escaped.
            reason: Notice::clip_reason(Some("\u{1}".repeat(4096))),
            bytes: u64::MAX,
            staged: true,
            mac: None,
        }
        .sign(&key());
        assert_eq!(n.reason.as_ref().unwrap().len(), Notice::MAX_REASON);
        let json = n.to_json();
        assert!(json.len() <= Notice::MAX_BYTES, "{}", json.len());
        assert_eq!(Notice::from_json(&json).unwrap(), n);
        // One byte over (whitespace a parser would accept): refused unread.
        let mut over = json.clone();
        over.resize(Notice::MAX_BYTES + 1, b' ');
        let e = Notice::from_json(&over).unwrap_err().to_string();
        assert!(e.contains("over the"), "{e}");
    }

    #[test]
    fn cancel_round_trip_and_strict_parsing() {
        let c = Cancel::new(RequestId::new("r"), cap(), &"é".repeat(2000));
        assert!(c.reason.len() <= Cancel::MAX_REASON);
        assert_eq!(Cancel::from_json(&c.to_json()).unwrap(), c);
        for bad in [
            r#"{"version":4,"request_id":"r"}"#.to_string(),
            r#"{"version":4,"request_id":"","capability":"cccccccccccccccccccccccccccccccc"}"#.to_string(),
            r#"{"version":4,"request_id":"r","capability":"cccccccccccccccccccccccccccccccc","x":1}"#
                .to_string(),
            r#"{"version":4,"request_id":7,"capability":"cccccccccccccccccccccccccccccccc"}"#.to_string(),
            format!(
                r#"{{"version":4,"request_id":"r","capability":"{}","reason":"{}"}}"#,
                "c".repeat(32),
                "x".repeat(1025)
            ),
            "[]".to_string(),
        ] {
            assert!(
                matches!(Cancel::from_json(&bad), Err(ProtocolError::Malformed { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            Cancel::from_json(r#"{"version":1,"request_id":"r"}"#),
            Err(ProtocolError::Version { found: 1, .. })
        ));
    }
}
