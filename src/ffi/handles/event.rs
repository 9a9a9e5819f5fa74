//! Event handles.
use super::*;

#[repr(C)]
pub(crate) struct EventHandle {
    tag: u64,
    pub future: Future,
    /// Set only for events made by `PJRT_Event_Create`, which the caller
    /// completes with `PJRT_Event_Set`.
    pub promise: Option<PromiseOnce>,
}
castable!(EventHandle, PJRT_Event, OwnedBox, EVENT_TAG, "PJRT_Event");

impl EventHandle {
    pub fn from_future(future: Future) -> EventHandle {
        EventHandle {
            tag: Self::TAG,
            future,
            promise: None,
        }
    }

    pub fn settable() -> EventHandle {
        let (promise, future) = PromiseOnce::new();
        EventHandle {
            tag: Self::TAG,
            future,
            promise: Some(promise),
        }
    }
}
