//! The transfer timeline: one trace line per step of a transfer (every KV
//! call, every hop between threads, every wait), with the thread it ran on.
//! Off unless `PJRT_CROSSHOST_LOG` enables the `crosshost::timeline` target,
//! e.g. `PJRT_CROSSHOST_LOG=crosshost::timeline=trace`; the logger stamps
//! each line with microseconds. This is how a transfer is profiled end to end
//! inside a framework (README, "Profiling a transfer").
#[macro_export]
#[doc(hidden)]
macro_rules! timeline {
    ($($arg:tt)+) => {
        if log::log_enabled!(target: "crosshost::timeline", log::Level::Trace) {
            log::trace!(
                target: "crosshost::timeline",
                "[{}] {}",
                std::thread::current().name().unwrap_or("caller"),
                format_args!($($arg)+)
            );
        }
    };
}
