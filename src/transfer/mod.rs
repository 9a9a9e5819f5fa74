//! Cross-host protocol: descriptors, receive state machine, send path.
pub mod descriptor;
