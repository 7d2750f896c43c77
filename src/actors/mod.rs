//! The P/D request runtime: one actor per request and side, layer writers
//! per peer, and a notification router. The rules live in [`state`].

pub mod state;
