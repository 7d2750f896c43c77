//! OrbitKV: the core of a vLLM prefill/decode KV-transfer connector.
//!
//! The prefill worker streams each completed layer into the decode worker's KV
//! pages with Mooncake Transfer Engine batch WRITEs. OrbitKV owns the KV
//! layout and the per-request state machine; Mooncake moves the bytes.
//!
//! * [`transport`]: the native boundary over Mooncake (`MooncakeTransferEngine`).
//! * [`layout`]: KV geometry and the producer → consumer block mapping.
//! * [`wire`]: the versioned handshake and notification.
//! * [`fsm`]: the pure state machines of a request, one rule of the safety contract per transition.
//! * [`actors`]: the request runtime (actix) that carries out their effects.
//! * [`side_channel`]: the HTTP server decode ranks POST handshakes and cancels to (actix-web).
//! * [`side_channel_client`]: the side channel as a sender sees it (paths, signature, HTTP client).
//! * [`error`]: typed errors.
//! * [`mac`]: HMAC-SHA256 tags (the deployment key's signature, a notice's tag).
//! * [`trace`]: Chrome trace (Perfetto) export of the actors' spans (`ORBITKV_TRACE=path`).

//!
//! Feature `runtime` (default) builds [`actors`], [`side_channel`],
//! [`transport`] and [`trace`]; without it the crate is the protocol core
//! alone ([`ids`], [`layout`], [`wire`], [`fsm`], [`staging`], [`mac`],
//! [`error`]), which is what the fuzz target builds.

#[cfg(feature = "runtime")]
pub mod actors;
pub mod error;
pub mod fsm;
pub mod ids;
pub mod layout;
pub mod mac;
#[cfg(feature = "runtime")]
pub mod side_channel;
#[cfg(feature = "runtime")]
pub mod side_channel_client;
pub mod staging;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "runtime")]
pub mod trace;
#[cfg(feature = "runtime")]
pub mod transport;
pub mod wire;

#[cfg(feature = "runtime")]
pub use actors::stats::Timing;
#[cfg(feature = "runtime")]
pub use actors::{
    GatherCopy, PagesBack, Runtime, RuntimeConfig, RuntimeEvent, RuntimeSettings, StatsSnapshot,
};
pub use error::{
    GeometryError, ProtocolError, RuntimeError, SideChannelError, TransportError, TransportResult,
};
pub use ids::{Capability, Generation, NoticeKey, ProducerRank, RequestId, Sequence};
pub use layout::{KvLayout, LayerGeometry, Plane, WriteRange, HOLE};
#[cfg(feature = "runtime")]
pub use side_channel::{MooncakeBootstrap, Refused, SideChannel, SideChannelConfig};
#[cfg(feature = "runtime")]
pub use transport::{BatchHandle, BatchState, EngineConfig, MooncakeTransferEngine, Notification, Transport};
pub use wire::{Cancel, Handshake, Notice, Outcome};

/// The side channel's HTTP client ([`side_channel_client`]) as the
/// publisher's [`actors::decode::publisher::SideChannelPost`]: what
/// [`Runtime::start`] gives a runtime, whose actors know no HTTP.
#[cfg(feature = "runtime")]
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpPost;

#[cfg(feature = "runtime")]
impl actors::decode::publisher::SideChannelPost for HttpPost {
    fn handshake(
        &self,
        addr: &str,
        body: &str,
        key: Option<&[u8]>,
        timeout: std::time::Duration,
        until: std::time::Instant,
    ) -> std::io::Result<(u16, String)> {
        side_channel_client::post_while_busy(
            addr,
            side_channel_client::HANDSHAKE_PATH,
            body,
            key,
            timeout,
            until,
        )
    }

    fn cancel(
        &self,
        addr: &str,
        body: &str,
        key: Option<&[u8]>,
        timeout: std::time::Duration,
    ) -> std::io::Result<(u16, String)> {
        side_channel_client::post(addr, side_channel_client::CANCEL_PATH, body, key, timeout)
    }
}

#[cfg(feature = "runtime")]
impl Runtime {
    /// [`Runtime::start_with`] over the side channel's HTTP client
    /// ([`HttpPost`]): how every rank starts its runtime.
    pub fn start(
        transport: std::sync::Arc<dyn Transport>,
        local: KvLayout,
        cfg: RuntimeConfig,
    ) -> Result<Self, RuntimeError> {
        Self::start_with(transport, local, cfg, std::sync::Arc::new(HttpPost))
    }
}
