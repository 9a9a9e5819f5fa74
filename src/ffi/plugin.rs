//! PJRT_Plugin_*: initialization and plugin attributes.
use once_cell::sync::Lazy;

use super::handles::{NamedValue, NamedValues};

static PLUGIN_ATTRIBUTES: Lazy<NamedValues> = Lazy::new(|| {
    NamedValues::new(vec![
        (
            "supports_cross_host_transfers".into(),
            NamedValue::Bool(true),
        ),
        (
            "pjrt_crosshost_version".into(),
            NamedValue::Str(env!("CARGO_PKG_VERSION").into()),
        ),
    ])
});

crate::pjrt_entry!(plugin_initialize = "PJRT_Plugin_Initialize", PJRT_Plugin_Initialize_Args through struct_size, |_args| {
    super::logging::init();
    Ok(())
});

crate::pjrt_entry!(plugin_attributes = "PJRT_Plugin_Attributes", PJRT_Plugin_Attributes_Args through num_attributes, |args| {
    args.attributes = PLUGIN_ATTRIBUTES.values.as_ptr();
    args.num_attributes = PLUGIN_ATTRIBUTES.values.len();
    Ok(())
});
