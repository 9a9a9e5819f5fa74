//! The plugin's logger: off unless `PJRT_CROSSHOST_LOG` is set (env_logger
//! filter syntax, e.g. `debug` or `pjrt_crosshost::transfer=trace`). A logger
//! already installed by the host process is left alone.
use std::sync::Once;

pub const LOG_ENV: &str = "PJRT_CROSSHOST_LOG";

pub(crate) fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        if let Ok(filter) = std::env::var(LOG_ENV) {
            let _ = env_logger::Builder::new()
                .parse_filters(&filter)
                .format_timestamp_micros()
                .try_init();
        }
    });
}
