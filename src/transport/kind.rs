//! Which transport Mooncake installs, and what that means for how many
//! ranges a peer may have in flight.
//!
//! Mooncake chooses its transport itself when an engine starts (topology
//! auto-discovery), and says so only in its log. Its rule, as the pinned
//! 0.3.13.post1 applies it (`transfer_engine_impl.cpp`; the device runs log
//! "Using Intra-Node NVLink transport (MC_INTRANODE_NVLINK set)"):
//!
//! * a CUDA build (`mooncake-transfer-engine-cuda13`, ...) with
//!   `MC_INTRANODE_NVLINK` **present** in the environment (any value, even
//!   `0`) installs the intra-node NVLink transport;
//! * otherwise RDMA where it finds an RDMA device (restricted to the
//!   configured NICs) and `MC_FORCE_TCP` is absent, else TCP. A CUDA build
//!   without RDMA devices and without `MC_INTRANODE_NVLINK` may install its
//!   multi-node NVLink transport instead: that is [`TransportKind::Unknown`]
//!   here, as is a wheel whose name does not say whether it was built with
//!   CUDA (the plain `mooncake-transfer-engine`) when `MC_INTRANODE_NVLINK`
//!   is set.
//!
//! [`mooncake_transport`] mirrors that rule; it decides only defaults
//! (never a write's target), so a wrong guess costs speed, not bytes.

/// The transport an engine's writes go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Mooncake's TCP transport: it queues at most 1024 transfers per peer
    /// by default (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`) and fails the rest.
    Tcp,
    /// Mooncake's RDMA transport.
    Rdma,
    /// Mooncake's intra-node NVLink transport (CUDA IPC between the GPUs of
    /// one host).
    NvlinkIntra,
    /// Not known (a test double, a library without wheel metadata, or a
    /// choice this rule does not cover).
    Unknown,
}

/// Ranges in flight per peer where the transport does not allow more.
/// Below Mooncake's TCP limit of 1024 queued per peer, with room for
/// notices and a second batch.
pub const DEFAULT_RANGES_IN_FLIGHT: usize = 768;

/// Ranges in flight per peer on the intra-node NVLink transport. With group
/// commit, a lane that falls behind then merges up to 2048 queued ranges
/// (with four lanes) into one batch: on one H200 under load that cut decode's
/// wait after the prefill answered at 32 in flight from 1.2–1.4 s to
/// 0.24–0.56 s and TTFT p99 at 16 and 32 in flight to 0.73–0.87 × the 768 cap
/// (`docs/qualification.md`, runs 31–33).
pub const NVLINK_RANGES_IN_FLIGHT: usize = 8192;

impl TransportKind {
    /// Every kind.
    pub const ALL: [Self; 4] = [Self::Tcp, Self::Rdma, Self::NvlinkIntra, Self::Unknown];

    /// Its name, as logs and the docs write it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma => "rdma",
            Self::NvlinkIntra => "nvlink_intra",
            Self::Unknown => "unknown",
        }
    }

    /// Ranges in flight per peer when the setting is left out.
    pub fn default_ranges_in_flight(self) -> usize {
        match self {
            Self::NvlinkIntra => NVLINK_RANGES_IN_FLIGHT,
            Self::Tcp | Self::Rdma | Self::Unknown => DEFAULT_RANGES_IN_FLIGHT,
        }
    }

    /// The most transfers per peer the transport queues by default, where it
    /// has such a limit (more fail).
    pub fn queue_limit(self) -> Option<usize> {
        match self {
            Self::Tcp => Some(1024),
            Self::Rdma | Self::NvlinkIntra | Self::Unknown => None,
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`mooncake_transport`] decides from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransportFacts {
    /// The wheel's distribution name (`None`: no wheel metadata).
    pub distribution: Option<String>,
    /// `MC_INTRANODE_NVLINK` is present in the environment.
    pub intranode_nvlink: bool,
    /// `MC_FORCE_TCP` is present in the environment.
    pub force_tcp: bool,
    /// An RDMA device Mooncake would use (one of the configured NICs, or any
    /// when none is configured).
    pub rdma_device: bool,
}

impl TransportFacts {
    /// The facts of this process: its environment and `/sys/class/infiniband`.
    pub fn of_this_host(distribution: Option<&str>, nics: &[String]) -> Self {
        let devices: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        Self {
            distribution: distribution.map(str::to_owned),
            intranode_nvlink: std::env::var_os("MC_INTRANODE_NVLINK").is_some(),
            force_tcp: std::env::var_os("MC_FORCE_TCP").is_some(),
            rdma_device: devices.iter().any(|d| nics.is_empty() || nics.contains(d)),
        }
    }
}

/// The transport Mooncake installs given `facts` (the rule in the module
/// documentation).
pub fn mooncake_transport(facts: &TransportFacts) -> TransportKind {
    let Some(dist) = facts.distribution.as_deref() else {
        return TransportKind::Unknown;
    };
    // The build, from the wheel's name: `-non-cuda` is built without CUDA,
    // a name with `cuda` otherwise (`-cuda13`) with it; another name (the
    // plain `mooncake-transfer-engine`) is not known either way.
    let cuda_build = match (dist.contains("non-cuda"), dist.contains("cuda")) {
        (true, _) => Some(false),
        (false, true) => Some(true),
        (false, false) => None,
    };
    let rdma = facts.rdma_device && !facts.force_tcp;
    match (cuda_build, facts.intranode_nvlink, rdma) {
        (Some(true), true, _) => TransportKind::NvlinkIntra,
        (None, true, _) => TransportKind::Unknown,
        (_, _, true) => TransportKind::Rdma,
        (Some(false), _, false) => TransportKind::Tcp,
        (Some(true) | None, false, false) => TransportKind::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(dist: Option<&str>, nvlink: bool, force_tcp: bool, rdma: bool) -> TransportFacts {
        TransportFacts {
            distribution: dist.map(str::to_owned),
            intranode_nvlink: nvlink,
            force_tcp,
            rdma_device: rdma,
        }
    }

    #[test]
    fn mooncakes_rule_case_by_case() {
        use TransportKind::*;
        let (cpu, gpu) = (
            Some("mooncake-transfer-engine-non-cuda"),
            Some("mooncake-transfer-engine-cuda13"),
        );
        // (wheel, MC_INTRANODE_NVLINK, MC_FORCE_TCP, RDMA device) -> transport
        let cases = [
            // The non-CUDA build: TCP or RDMA whatever MC_INTRANODE_NVLINK says.
            (cpu, true, false, false, Tcp),
            (cpu, false, false, false, Tcp),
            (cpu, true, false, true, Rdma),
            (cpu, false, true, true, Tcp),
            // A CUDA build with MC_INTRANODE_NVLINK present: NVLink.
            (gpu, true, false, false, NvlinkIntra),
            (gpu, true, true, true, NvlinkIntra),
            (gpu, false, false, true, Rdma),
            (gpu, false, false, false, Unknown),
            // A wheel not named for or against CUDA is not taken for one.
            (Some("mooncake-transfer-engine"), true, false, false, Unknown),
            // No wheel metadata.
            (None, true, false, false, Unknown),
        ];
        for (dist, nvlink, force_tcp, rdma, want) in cases {
            assert_eq!(
                mooncake_transport(&facts(dist, nvlink, force_tcp, rdma)),
                want,
                "{dist:?} nvlink={nvlink} force_tcp={force_tcp} rdma={rdma}"
            );
        }
    }

    #[test]
    fn only_nvlink_raises_the_range_cap_and_tcp_stays_below_its_queue() {
        assert_eq!(TransportKind::NvlinkIntra.default_ranges_in_flight(), 8192);
        for k in TransportKind::ALL
            .into_iter()
            .filter(|&k| k != TransportKind::NvlinkIntra)
        {
            assert_eq!(k.default_ranges_in_flight(), 768, "{k}");
        }
        let tcp = TransportKind::Tcp;
        assert!(tcp.default_ranges_in_flight() < tcp.queue_limit().unwrap());
    }
}
