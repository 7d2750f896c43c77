//! Mooncake's status codes as OrbitKV reads them: a batch's or a task's
//! state (`TransferStatus`) and the classification of a refused submit by
//! Mooncake's `Status::Code`. The shim passes both through as integers; their
//! values are named here only.

use super::WriteRange;
use crate::error::TransportError;

/// Mooncake's `TransferStatusEnum` (0.3.13.post1, `transfer_engine.h`), as
/// the shim reports a batch's or a task's state (the shim passes the
/// `int32_t` through; its values are named here only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum TransferStatus {
    Waiting = 0,
    Pending = 1,
    Invalid = 2,
    Canceled = 3,
    Completed = 4,
    Timeout = 5,
    Failed = 6,
}

impl TransferStatus {
    /// The status Mooncake reported, or `None` for a value it does not define.
    pub fn from_raw(raw: i32) -> Option<Self> {
        Some(match raw {
            0 => Self::Waiting,
            1 => Self::Pending,
            2 => Self::Invalid,
            3 => Self::Canceled,
            4 => Self::Completed,
            5 => Self::Timeout,
            6 => Self::Failed,
            _ => return None,
        })
    }

    /// Ended without its bytes (an unknown value counts as such).
    pub fn is_failure(self) -> bool {
        !matches!(self, Self::Waiting | Self::Pending | Self::Completed)
    }

    /// Mooncake's name of it (`UNKNOWN` for a value it does not define).
    pub fn name_of(s: Option<Self>) -> &'static str {
        match s {
            Some(Self::Waiting) => "WAITING",
            Some(Self::Pending) => "PENDING",
            Some(Self::Invalid) => "INVALID",
            Some(Self::Canceled) => "CANCELED",
            Some(Self::Completed) => "COMPLETED",
            Some(Self::Timeout) => "TIMEOUT",
            Some(Self::Failed) => "FAILED",
            None => "UNKNOWN",
        }
    }
}

/// Mooncake's `Status::Code` for an address outside every registered
/// region (`kAddressNotRegistered`, the same in every release since 0.3).
pub(crate) const MC_ADDRESS_NOT_REGISTERED: i32 = 3;

/// The error of a refused submit: by Mooncake's status code where the shim
/// passed one (`rc > 0`; the local sources were checked before, so an
/// unregistered address is the peer's), else a failure with the shim's text.
pub(crate) fn submit_failure(peer: &str, ranges: &[WriteRange], rc: i32, reason: String) -> TransportError {
    if rc == MC_ADDRESS_NOT_REGISTERED {
        let r = ranges[0];
        return TransportError::UnregisteredRemote {
            peer: peer.into(),
            addr: r.dst,
            len: r.len,
        };
    }
    TransportError::TransferFailed {
        peer: peer.into(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_submit_is_classified_by_mooncakes_code_not_its_text() {
        let ranges = [WriteRange {
            src: 1,
            dst: 0x2000,
            len: 16,
        }];
        assert_eq!(
            submit_failure(
                "p:1",
                &ranges,
                MC_ADDRESS_NOT_REGISTERED,
                "whatever it says".into()
            ),
            TransportError::UnregisteredRemote {
                peer: "p:1".into(),
                addr: 0x2000,
                len: 16
            }
        );
        // Another code (kInvalidArgument) or none: a failure, whatever the
        // text, even one that mentions registration.
        for rc in [1, -1] {
            assert!(matches!(
                submit_failure("p:1", &ranges, rc, "address not registered".into()),
                TransportError::TransferFailed { .. }
            ));
        }
    }

    #[test]
    fn transfer_status_follows_mooncakes_enum() {
        for (raw, want) in [
            (0, TransferStatus::Waiting),
            (1, TransferStatus::Pending),
            (2, TransferStatus::Invalid),
            (3, TransferStatus::Canceled),
            (4, TransferStatus::Completed),
            (5, TransferStatus::Timeout),
            (6, TransferStatus::Failed),
        ] {
            assert_eq!(TransferStatus::from_raw(raw), Some(want));
            assert_eq!(want as i32, raw);
        }
        assert_eq!(TransferStatus::from_raw(7), None);
        assert_eq!(TransferStatus::name_of(None), "UNKNOWN");
        assert!(TransferStatus::Timeout.is_failure() && !TransferStatus::Pending.is_failure());
    }
}
