//! Routed slots: the named handle argument decides (`handles/`). Ours →
//! our entry; the compute plugin's → its function with the caller's args
//! unchanged. `foreign` handles are always the compute plugin's (we make
//! none: without a compute plugin the slot is UNIMPLEMENTED); `none` slots
//! take no handle and forward whenever a compute plugin is loaded.
#![allow(non_snake_case)]

use super::{foreign_only, run_dispatch, Dispatch};
use crate::compute_plugin;
use crate::ffi::boundary::checked_args;
use crate::ffi::handles::{route, BufferHandle, Castable, DescriptionHandle, EventHandle, Route};
use crate::ffi::{buffer, device, events, unimplemented};
use crate::pjrt::bindings::*;

macro_rules! routed_entry {
    ($slot:ident, $args:ident, $field:ident, ours $H:ty => $ours:path) => {
        /// Routed by its handle argument (see the module doc): our handle →
        /// our entry's contract; the compute plugin's → its function's, its
        /// error converted to ours. INVALID_ARGUMENT for a null, destroyed or
        /// mistyped handle (null is allowed for `_Destroy`).
        pub(crate) unsafe extern "C" fn $slot(raw: *mut $args) -> *mut PJRT_Error {
            const NAME: &str = stringify!($slot);
            run_dispatch(NAME, || {
                let required = crate::struct_size_through!($args, $field);
                // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
                let handle = unsafe { checked_args(raw, NAME, required) }?.$field;
                if handle.is_null() && NAME.ends_with("_Destroy") {
                    return Ok(Dispatch::Forwarded); // destroying nullptr is allowed
                }
                // SAFETY: the caller passes a live handle (ours or the compute plugin's).
                let whose = unsafe {
                    route::<$H>(
                        handle as *const <$H as Castable>::C,
                        NAME,
                        stringify!($field),
                    )
                }?;
                match whose {
                    // SAFETY: our entry, with the caller's args.
                    Route::Ours(_) => Ok(Dispatch::Ours(unsafe { $ours(raw) })),
                    Route::Compute(plugin) => {
                        crate::inner_call!(plugin.as_ref(), $slot, raw)?;
                        Ok(Dispatch::Forwarded)
                    }
                }
            })
        }
    };
    ($slot:ident, $args:ident, $field:ident, foreign) => {
        /// The compute plugin's handle type (see the module doc): its
        /// function's contract, its error converted to ours; UNIMPLEMENTED
        /// without a compute plugin, INVALID_ARGUMENT for a null handle (but
        /// `_Destroy`) or one of ours.
        pub(crate) unsafe extern "C" fn $slot(raw: *mut $args) -> *mut PJRT_Error {
            const NAME: &str = stringify!($slot);
            run_dispatch(NAME, || {
                let required = crate::struct_size_through!($args, $field);
                // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
                let handle = unsafe { checked_args(raw, NAME, required) }?.$field;
                if handle.is_null() && NAME.ends_with("_Destroy") {
                    return Ok(Dispatch::Forwarded); // destroying nullptr is allowed
                }
                // SAFETY: the caller passes a live handle of the compute plugin.
                match unsafe { foreign_only(handle as *const _, NAME, stringify!($field)) }? {
                    // SAFETY: the UNIMPLEMENTED entry, with the caller's args.
                    None => Ok(Dispatch::Ours(unsafe { unimplemented::$slot(raw) })),
                    Some(plugin) => {
                        crate::inner_call!(plugin.as_ref(), $slot, raw)?;
                        Ok(Dispatch::Forwarded)
                    }
                }
            })
        }
    };
    ($slot:ident, $args:ident, none) => {
        /// Takes no handle: the compute plugin's function (its contract, its
        /// error converted to ours) when one is loaded, else UNIMPLEMENTED.
        pub(crate) unsafe extern "C" fn $slot(raw: *mut $args) -> *mut PJRT_Error {
            const NAME: &str = stringify!($slot);
            run_dispatch(NAME, || {
                // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
                unsafe { checked_args(raw, NAME, std::mem::size_of::<usize>()) }?;
                match compute_plugin::loaded() {
                    // SAFETY: the UNIMPLEMENTED entry, with the caller's args.
                    None => Ok(Dispatch::Ours(unsafe { unimplemented::$slot(raw) })),
                    Some(plugin) => {
                        crate::inner_call!(plugin.as_ref(), $slot, raw)?;
                        Ok(Dispatch::Forwarded)
                    }
                }
            })
        }
    };
}

macro_rules! field_offset {
    ($args:ident, none) => {
        None
    };
    ($args:ident, $field:ident) => {
        Some(std::mem::offset_of!($args, $field))
    };
}

macro_rules! routed_entries {
    ($( $slot:ident ( $args:ident $(. $field:ident)? ) => $kind:ident $(( $H:ty, $ours:path ))? );* $(;)?) => {
        $( routed_entries!(@entry $slot, $args, $($field,)? $kind $(, $H, $ours)?); )*

        /// `(slot, offset of the routing handle)` of every routed slot.
        pub(crate) const ROUTED: &[(&str, Option<usize>)] = &[
            $( (stringify!($slot), routed_entries!(@offset $args $(, $field)?)) ),*
        ];

        pub(crate) fn install(api: &mut PJRT_Api) {
            $( api.$slot = Some($slot); )*
        }
    };
    (@entry $slot:ident, $args:ident, $field:ident, ours, $H:ty, $ours:path) => {
        routed_entry!($slot, $args, $field, ours $H => $ours);
    };
    (@entry $slot:ident, $args:ident, $field:ident, foreign) => {
        routed_entry!($slot, $args, $field, foreign);
    };
    (@entry $slot:ident, $args:ident, none) => {
        routed_entry!($slot, $args, none);
    };
    (@offset $args:ident, $field:ident) => { field_offset!($args, $field) };
    (@offset $args:ident) => { field_offset!($args, none) };
}

routed_entries! {
    // Events: ours (made by Event_Create, sends) or the compute plugin's.
    PJRT_Event_Destroy(PJRT_Event_Destroy_Args.event) => ours(EventHandle, events::event_destroy);
    PJRT_Event_IsReady(PJRT_Event_IsReady_Args.event) => ours(EventHandle, events::event_is_ready);
    PJRT_Event_Error(PJRT_Event_Error_Args.event) => ours(EventHandle, events::event_error);
    PJRT_Event_Await(PJRT_Event_Await_Args.event) => ours(EventHandle, events::event_await);
    PJRT_Event_Set(PJRT_Event_Set_Args.event) => ours(EventHandle, events::event_set);

    // Descriptions: ours for our devices, the compute plugin's from a topology.
    PJRT_DeviceDescription_Id(PJRT_DeviceDescription_Id_Args.device_description) => ours(DescriptionHandle, device::device_description_id);
    PJRT_DeviceDescription_ProcessIndex(PJRT_DeviceDescription_ProcessIndex_Args.device_description) => ours(DescriptionHandle, device::device_description_process_index);
    PJRT_DeviceDescription_Attributes(PJRT_DeviceDescription_Attributes_Args.device_description) => ours(DescriptionHandle, device::device_description_attributes);
    PJRT_DeviceDescription_Kind(PJRT_DeviceDescription_Kind_Args.device_description) => ours(DescriptionHandle, device::device_description_kind);
    PJRT_DeviceDescription_DebugString(PJRT_DeviceDescription_DebugString_Args.device_description) => ours(DescriptionHandle, device::device_description_debug_string);
    PJRT_DeviceDescription_ToString(PJRT_DeviceDescription_ToString_Args.device_description) => ours(DescriptionHandle, device::device_description_to_string);

    // Executables: always the compute plugin's.
    PJRT_Executable_Destroy(PJRT_Executable_Destroy_Args.executable) => foreign;
    PJRT_Executable_Name(PJRT_Executable_Name_Args.executable) => foreign;
    PJRT_Executable_NumReplicas(PJRT_Executable_NumReplicas_Args.executable) => foreign;
    PJRT_Executable_NumPartitions(PJRT_Executable_NumPartitions_Args.executable) => foreign;
    PJRT_Executable_NumOutputs(PJRT_Executable_NumOutputs_Args.executable) => foreign;
    PJRT_Executable_SizeOfGeneratedCodeInBytes(PJRT_Executable_SizeOfGeneratedCodeInBytes_Args.executable) => foreign;
    PJRT_Executable_GetCostAnalysis(PJRT_Executable_GetCostAnalysis_Args.executable) => foreign;
    PJRT_Executable_OutputMemoryKinds(PJRT_Executable_OutputMemoryKinds_Args.executable) => foreign;
    PJRT_Executable_OptimizedProgram(PJRT_Executable_OptimizedProgram_Args.executable) => foreign;
    PJRT_Executable_Serialize(PJRT_Executable_Serialize_Args.executable) => foreign;
    PJRT_Executable_OutputElementTypes(PJRT_Executable_OutputElementTypes_Args.executable) => foreign;
    PJRT_Executable_OutputDimensions(PJRT_Executable_OutputDimensions_Args.executable) => foreign;
    PJRT_Executable_Fingerprint(PJRT_Executable_Fingerprint_Args.executable) => foreign;
    PJRT_Executable_GetCompiledMemoryStats(PJRT_Executable_GetCompiledMemoryStats_Args.executable) => foreign;
    PJRT_Executable_ParameterMemoryKinds(PJRT_Executable_ParameterMemoryKinds_Args.executable) => foreign;
    PJRT_LoadedExecutable_GetExecutable(PJRT_LoadedExecutable_GetExecutable_Args.loaded_executable) => foreign;
    PJRT_LoadedExecutable_Delete(PJRT_LoadedExecutable_Delete_Args.executable) => foreign;
    PJRT_LoadedExecutable_IsDeleted(PJRT_LoadedExecutable_IsDeleted_Args.executable) => foreign;
    PJRT_LoadedExecutable_Fingerprint(PJRT_LoadedExecutable_Fingerprint_Args.executable) => foreign;
    PJRT_LoadedExecutable_AddressableDeviceLogicalIds(PJRT_LoadedExecutable_AddressableDeviceLogicalIds_Args.executable) => foreign;

    // Buffers: ours (embedded clients) or the compute plugin's.
    PJRT_Buffer_ElementType(PJRT_Buffer_ElementType_Args.buffer) => ours(BufferHandle, buffer::buffer_element_type);
    PJRT_Buffer_Dimensions(PJRT_Buffer_Dimensions_Args.buffer) => ours(BufferHandle, buffer::buffer_dimensions);
    PJRT_Buffer_UnpaddedDimensions(PJRT_Buffer_UnpaddedDimensions_Args.buffer) => ours(BufferHandle, buffer::buffer_unpadded_dimensions);
    PJRT_Buffer_DynamicDimensionIndices(PJRT_Buffer_DynamicDimensionIndices_Args.buffer) => ours(BufferHandle, buffer::buffer_dynamic_dimension_indices);
    PJRT_Buffer_GetMemoryLayout(PJRT_Buffer_GetMemoryLayout_Args.buffer) => ours(BufferHandle, buffer::buffer_get_memory_layout);
    PJRT_Buffer_OnDeviceSizeInBytes(PJRT_Buffer_OnDeviceSizeInBytes_Args.buffer) => ours(BufferHandle, buffer::buffer_on_device_size_in_bytes);
    PJRT_Buffer_IsOnCpu(PJRT_Buffer_IsOnCpu_Args.buffer) => ours(BufferHandle, buffer::buffer_is_on_cpu);
    PJRT_Buffer_ReadyEvent(PJRT_Buffer_ReadyEvent_Args.buffer) => ours(BufferHandle, buffer::buffer_ready_event);
    PJRT_Buffer_DecreaseExternalReferenceCount(PJRT_Buffer_DecreaseExternalReferenceCount_Args.buffer) => ours(BufferHandle, buffer::buffer_decrease_external_reference_count);
    PJRT_Buffer_CopyRawToHostFuture(PJRT_Buffer_CopyRawToHostFuture_Args.buffer) => ours(BufferHandle, unimplemented::PJRT_Buffer_CopyRawToHostFuture);
    PJRT_Buffer_DonateWithControlDependency(PJRT_Buffer_DonateWithControlDependency_Args.buffer) => ours(BufferHandle, unimplemented::PJRT_Buffer_DonateWithControlDependency);
    PJRT_Buffer_Bitcast(PJRT_Buffer_Bitcast_Args.buffer) => ours(BufferHandle, unimplemented::PJRT_Buffer_Bitcast);

    // Streams, topologies, contexts, transfer managers: the compute plugin's.
    PJRT_CopyToDeviceStream_Destroy(PJRT_CopyToDeviceStream_Destroy_Args.stream) => foreign;
    PJRT_CopyToDeviceStream_AddChunk(PJRT_CopyToDeviceStream_AddChunk_Args.stream) => foreign;
    PJRT_CopyToDeviceStream_TotalBytes(PJRT_CopyToDeviceStream_TotalBytes_Args.stream) => foreign;
    PJRT_CopyToDeviceStream_GranuleSize(PJRT_CopyToDeviceStream_GranuleSize_Args.stream) => foreign;
    PJRT_CopyToDeviceStream_CurrentBytes(PJRT_CopyToDeviceStream_CurrentBytes_Args.stream) => foreign;
    PJRT_TopologyDescription_Create(PJRT_TopologyDescription_Create_Args) => none;
    PJRT_TopologyDescription_Deserialize(PJRT_TopologyDescription_Deserialize_Args) => none;
    PJRT_TopologyDescription_Destroy(PJRT_TopologyDescription_Destroy_Args.topology) => foreign;
    PJRT_TopologyDescription_PlatformName(PJRT_TopologyDescription_PlatformName_Args.topology) => foreign;
    PJRT_TopologyDescription_PlatformVersion(PJRT_TopologyDescription_PlatformVersion_Args.topology) => foreign;
    PJRT_TopologyDescription_GetDeviceDescriptions(PJRT_TopologyDescription_GetDeviceDescriptions_Args.topology) => foreign;
    PJRT_TopologyDescription_Serialize(PJRT_TopologyDescription_Serialize_Args.topology) => foreign;
    PJRT_TopologyDescription_Attributes(PJRT_TopologyDescription_Attributes_Args.topology) => foreign;
    PJRT_TopologyDescription_Fingerprint(PJRT_TopologyDescription_Fingerprint_Args.topology) => foreign;
    PJRT_TopologyDescription_MakeCanonicalShapeForMemorySpace(PJRT_TopologyDescription_MakeCanonicalShapeForMemorySpace_Args.topology) => foreign;
    PJRT_TopologyDescription_GetMemorySpaceKindIds(PJRT_TopologyDescription_GetMemorySpaceKindIds_Args.topology) => foreign;
    PJRT_ExecuteContext_Create(PJRT_ExecuteContext_Create_Args) => none;
    PJRT_ExecuteContext_Destroy(PJRT_ExecuteContext_Destroy_Args.context) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_Destroy(PJRT_AsyncHostToDeviceTransferManager_Destroy_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_TransferData(PJRT_AsyncHostToDeviceTransferManager_TransferData_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer(PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_BufferCount(PJRT_AsyncHostToDeviceTransferManager_BufferCount_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_BufferSize(PJRT_AsyncHostToDeviceTransferManager_BufferSize_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_SetBufferError(PJRT_AsyncHostToDeviceTransferManager_SetBufferError_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_AddMetadata(PJRT_AsyncHostToDeviceTransferManager_AddMetadata_Args.transfer_manager) => foreign;
    PJRT_AsyncHostToDeviceTransferManager_TransferLiteral(PJRT_AsyncHostToDeviceTransferManager_TransferLiteral_Args.transfer_manager) => foreign;
    PJRT_AsyncTrackingEvent_Destroy(PJRT_AsyncTrackingEvent_Destroy_Args.event) => foreign;
}
