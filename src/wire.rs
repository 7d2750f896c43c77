//! The wire contract: the handshake a consumer publishes over the P/D HTTP
//! control channel, and the notification a producer sends through Mooncake.
//!
//! Both are versioned JSON. Parsing is strict: an unknown version, a missing
//! or unknown field, block IDs outside the advertised region, overlapping or
//! inconsistent geometry — each is a typed [`ProtocolError`] and nothing is
//! admitted. The handshake carries no rkeys, QP descriptors or RDMA-IMM ids:
//! Mooncake's P2P handshake exchanges those itself.

use serde::{Deserialize, Serialize};

use crate::error::ProtocolError;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::layout::KvLayout;
use crate::transport::parse_endpoint;

/// The wire version this build speaks.
pub const WIRE_VERSION: u32 = 1;

/// Mooncake notification name under which OrbitKV notices travel.
pub const NOTIFY_NAME: &str = "orbitkv";

/// What a consumer (decode) rank authorizes for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handshake {
    pub version: u32,
    pub request_id: RequestId,
    pub generation: Generation,
    /// The consumer rank's Mooncake endpoint (`ip:port`).
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
}

impl Handshake {
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
}

impl Notice {
    pub fn from_json(text: &[u8]) -> Result<Self, ProtocolError> {
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

/// Reads `version` first, so a future version is reported as such and not
/// as an unknown field; then parses strictly.
fn parse_versioned<T: serde::de::DeserializeOwned>(
    text: &str,
    what: &'static str,
) -> Result<T, ProtocolError> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ProtocolError::Malformed {
        what,
        reason: e.to_string(),
    })?;
    match value.get("version").and_then(|v| v.as_u64()) {
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
    serde_json::from_value(value).map_err(|e| ProtocolError::Malformed {
        what,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::tests::layout;

    fn handshake() -> Handshake {
        Handshake {
            version: WIRE_VERSION,
            request_id: RequestId::new("req-1"),
            generation: Generation(7),
            endpoint: "127.0.0.1:15000".into(),
            expected_producers: 1,
            first_block: 0,
            block_ids: vec![3, 1, 2],
            layout: layout(0x10_0000, 2, 8, 256, (0, 1), 2),
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
        };
        assert_eq!(Notice::from_json(&n.to_json()).unwrap(), n);
    }

    #[test]
    fn unknown_version_is_typed() {
        let mut v: serde_json::Value = serde_json::from_str(&handshake().to_json()).unwrap();
        v["version"] = 2.into();
        v["something_new"] = 1.into();
        let err = Handshake::from_json(&v.to_string()).unwrap_err();
        assert_eq!(
            err,
            ProtocolError::Version {
                found: 2,
                supported: 1
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
}
