//! Synchronisation primitives shared by every layer.
pub mod kill_points;
pub mod metrics;
pub mod promise;
pub mod runner;
pub mod threads;
pub mod timeline;
pub mod timer;

pub use metrics::{ByteRoute, Metrics, MetricsSnapshot};
pub use promise::{Future, PromiseOnce};
pub use runner::AsyncWorkRunner;
pub use timer::{DeadlineTimer, TimerId};
