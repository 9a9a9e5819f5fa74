//! Every `PJRT_Api` slot, and whose it is: ours (answered by this plugin),
//! routed (the handle argument decides, `routed.rs` and `translated.rs`) or
//! delegated (our client or device decides, `delegated.rs`). A test checks
//! that the lists cover every slot of the header exactly once, and
//! `tests/forwarding_table.rs` calls every routed and delegated slot against
//! a recording compute plugin.
use crate::ffi::{client, device, error_entries, events, memory, plugin, process_infos};
use crate::pjrt::bindings::*;

/// Whose a slot is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Answered by this plugin.
    Ours,
    /// The handle at this offset of the args decides (`None`: no handle;
    /// forwarded whenever a compute plugin is loaded).
    Routed(Option<usize>),
    /// Our client or device at this offset decides.
    Delegated(usize),
}

macro_rules! ours_table {
    ($( $slot:ident => $entry:path ),* $(,)?) => {
        /// Slots only this plugin answers.
        pub(crate) const OURS: &[&str] = &[$( stringify!($slot) ),*];

        fn install_ours(api: &mut PJRT_Api) {
            $( api.$slot = Some($entry); )*
        }
    };
}

ours_table! {
    PJRT_Error_Destroy => error_entries::error_destroy,
    PJRT_Error_Message => error_entries::error_message,
    PJRT_Error_GetCode => error_entries::error_get_code,
    PJRT_Error_ForEachPayload => error_entries::error_for_each_payload,
    PJRT_Plugin_Initialize => plugin::plugin_initialize,
    PJRT_Plugin_Attributes => plugin::plugin_attributes,
    PJRT_Event_Create => events::event_create,
    PJRT_Client_Create => client::client_create,
    PJRT_Client_Destroy => client::client_destroy,
    PJRT_Client_PlatformName => client::client_platform_name,
    PJRT_Client_ProcessIndex => client::client_process_index,
    PJRT_Client_PlatformVersion => client::client_platform_version,
    PJRT_Client_Devices => client::client_devices,
    PJRT_Client_AddressableDevices => client::client_addressable_devices,
    PJRT_Client_LookupDevice => client::client_lookup_device,
    PJRT_Client_LookupAddressableDevice => client::client_lookup_addressable_device,
    PJRT_Client_AddressableMemories => client::client_addressable_memories,
    PJRT_Client_UpdateGlobalProcessInfo => process_infos::client_update_global_process_info,
    PJRT_Device_GetDescription => device::device_get_description,
    PJRT_Device_IsAddressable => device::device_is_addressable,
    PJRT_Device_LocalHardwareId => device::device_local_hardware_id,
    PJRT_Device_AddressableMemories => device::device_addressable_memories,
    PJRT_Device_DefaultMemory => device::device_default_memory,
    PJRT_Device_GetAttributes => device::device_get_attributes,
    PJRT_Memory_Id => memory::memory_id,
    PJRT_Memory_Kind => memory::memory_kind,
    PJRT_Memory_Kind_Id => memory::memory_kind_id,
    PJRT_Memory_DebugString => memory::memory_debug_string,
    PJRT_Memory_ToString => memory::memory_to_string,
    PJRT_Memory_AddressableByDevices => memory::memory_addressable_by_devices,
}

/// Fills every slot: ours, routed, delegated.
pub(crate) fn install(api: &mut PJRT_Api) {
    install_ours(api);
    super::routed::install(api);
    super::translated::install(api);
    super::delegated::install(api);
}

/// Every slot this plugin fills, with its role.
pub fn roles() -> Vec<(&'static str, Role)> {
    let mut roles: Vec<(&'static str, Role)> = OURS.iter().map(|&s| (s, Role::Ours)).collect();
    roles.extend(
        super::routed::ROUTED
            .iter()
            .map(|&(s, o)| (s, Role::Routed(o))),
    );
    roles.extend(
        super::translated::TRANSLATED
            .iter()
            .map(|&(s, o)| (s, Role::Routed(Some(o)))),
    );
    roles.extend(
        super::delegated::DELEGATED
            .iter()
            .map(|&(s, o)| (s, Role::Delegated(o))),
    );
    roles
}

/// Every `PJRT_Api` slot of the header, in table order.
pub fn header_slots() -> &'static [&'static str] {
    crate::ffi::unimplemented::PJRT_API_SLOTS
}

/// `size_of` the args struct of `slot` (for tests that call every slot);
/// `None` for the two error functions, which take no args struct.
pub fn args_struct_size(slot: &str) -> Option<usize> {
    macro_rules! size_of_args {
        ($name:ident, $args:ident) => {
            if slot == stringify!($name) {
                return Some(std::mem::size_of::<$args>());
            }
        };
    }
    crate::ffi::unimplemented::for_each_pjrt_api_slot!(size_of_args);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_of_the_header_is_ours_routed_or_delegated_exactly_once() {
        let roles = roles();
        for slot in header_slots() {
            let found: Vec<_> = roles.iter().filter(|(name, _)| name == slot).collect();
            assert_eq!(found.len(), 1, "{slot}: {found:?}");
        }
        for (name, _) in &roles {
            assert!(
                header_slots().contains(name),
                "{name} is not a slot of the header"
            );
        }
        assert_eq!(roles.len(), header_slots().len());
    }

    #[test]
    fn no_slot_is_left_on_its_generated_unimplemented_entry() {
        let mut api = PJRT_Api::default();
        crate::ffi::unimplemented::fill(&mut api);
        install(&mut api);
        macro_rules! not_generic {
            ($name:ident, $args:ident) => {
                assert!(
                    api.$name.map(|f| f as *const () as usize)
                        != Some(crate::ffi::unimplemented::$name as *const () as usize),
                    "{} is still the generic UNIMPLEMENTED entry",
                    stringify!($name)
                );
            };
        }
        crate::ffi::unimplemented::for_each_pjrt_api_slot!(not_generic);
    }
}
