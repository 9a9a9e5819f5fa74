//! C handles ↔ Rust objects, and the one handle rule.
//!
//! # The one handle rule
//!
//! Every handle a caller gets from this plugin comes back to it and is
//! understood, because each handle type has one owner:
//!
//! | handle | whose |
//! |---|---|
//! | `PJRT_Client`, `PJRT_Device`, `PJRT_Memory` | always ours; a delegating client wraps the compute plugin's client, devices and memories and unwraps them on the way in |
//! | `PJRT_DeviceDescription` | ours for our devices; a topology's descriptions are the compute plugin's |
//! | `PJRT_Buffer`, `PJRT_Event` | ours for an embedded backend's buffers and for events we make (`PJRT_Event_Create`, send events); the compute plugin's for a delegating client's buffers (receive buffers included: its alias buffers) and their events |
//! | executables, topologies, execute contexts, async transfer managers, copy streams, tracking events, layouts, memory descriptions | always the compute plugin's (we make none) |
//! | `PJRT_Error` | always ours: the compute plugin's errors are converted as they cross |
//!
//! Every handle we make begins with a tag word (`#[repr(C)]`, tag first;
//! a memory's tag follows its vtable pointer, an error is known by its
//! vtable). `route` reads that word: one of our tags of the expected type is
//! ours; another of our tags, or `DEAD` (a destroyed handle), is an error;
//! any other word is the compute plugin's handle when one is loaded (no
//! pointer the inner plugin makes can begin with our tags: they are not
//! canonical addresses), and an error otherwise.
//!
//! Ownership follows rustls-ffi's `Castable`: a handle type says whether C
//! holds a `Box` (made by `into_raw`, destroyed by a `_Destroy` entry through
//! `try_take`) or borrows an object that lives in its client's tables
//! (`try_borrow` only).
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::{Mutex, RwLock};

use crate::api::buffer::Buffer;
use crate::api::client::Client;
use crate::api::device::{Device, Memory};
use crate::compute_plugin::{self, ComputePlugin, InnerPtr};
use crate::pjrt::bindings::*;
use crate::pjrt::named_values::{NamedValue, NamedValues};
use crate::status::{invalid_argument, Result};
use crate::sync::{Future, PromiseOnce};

const DEAD: u64 = 0xdead_dead_dead_dead;
const CLIENT_TAG: u64 = 0x4348_434c_4945_4e54;
const DEVICE_TAG: u64 = 0x4348_4445_5649_4345;
const DESCRIPTION_TAG: u64 = 0x4348_4445_5343_5200;
const MEMORY_TAG: u64 = 0x4348_4d45_4d4f_5259;
const BUFFER_TAG: u64 = 0x4348_4255_4646_4552;
const EVENT_TAG: u64 = 0x4348_4556_454e_5400;
const OUR_TAGS: [u64; 6] = [
    CLIENT_TAG,
    DEVICE_TAG,
    DESCRIPTION_TAG,
    MEMORY_TAG,
    BUFFER_TAG,
    EVENT_TAG,
];

/// C holds a `Box` of the handle and destroys it.
pub(crate) struct OwnedBox;
/// C borrows the handle from its client's tables.
pub(crate) struct Borrowed;

/// Implemented by every handle type.
pub(crate) trait Castable: Sized {
    /// The C type callers see.
    type C;
    /// `OwnedBox` or `Borrowed`.
    type Ownership;
    const TAG: u64;
    /// Byte offset of the tag word.
    const TAG_OFFSET: usize = 0;
    const WHAT: &'static str;
    fn set_dead(&mut self);
}

/// Reads the tag word of a handle-shaped pointer.
///
/// # Safety
/// `ptr` must be non-null and point to at least `offset + 8` readable bytes.
unsafe fn tag_word(ptr: *const c_void, offset: usize) -> u64 {
    // SAFETY: forwarded contract; unaligned read, the word's alignment is
    // not ours to promise for a foreign handle.
    unsafe {
        (ptr as *const u8)
            .add(offset)
            .cast::<u64>()
            .read_unaligned()
    }
}

fn not_live<H: Castable>(function: &str, field: &str) -> crate::status::Status {
    invalid_argument(format!(
        "{function}: {field} is not a live {} handle",
        H::WHAT
    ))
}

/// Borrows the Rust object behind one of our handles.
///
/// # Safety
/// `ptr` must be null or a pointer to a handle-shaped object at least
/// `TAG_OFFSET + 8` bytes long that has not been freed (the tag check
/// catches type confusion and destroyed handles whose memory was not reused,
/// but cannot make a freed pointer readable).
pub(crate) unsafe fn try_borrow<'a, H: Castable>(
    ptr: *const H::C,
    function: &str,
    field: &str,
) -> Result<&'a H> {
    if ptr.is_null() {
        return Err(invalid_argument(format!("{function}: {field} is null")));
    }
    // SAFETY: forwarded contract.
    if unsafe { tag_word(ptr.cast(), H::TAG_OFFSET) } != H::TAG {
        return Err(not_live::<H>(function, field));
    }
    // SAFETY: our tag at our offset: the pointer is an `H` we made.
    Ok(unsafe { &*(ptr as *const H) })
}

/// Gives C an owned handle.
pub(crate) fn into_raw<H: Castable<Ownership = OwnedBox>>(handle: H) -> *mut H::C {
    Box::into_raw(Box::new(handle)) as *mut H::C
}

/// Takes back an owned handle for destruction; its tag is poisoned so a
/// second destroy (or a later use) is caught while the allocator has not
/// reused the memory.
///
/// # Safety
/// Same as `try_borrow`, and the handle must not be used again.
pub(crate) unsafe fn try_take<H: Castable<Ownership = OwnedBox>>(
    ptr: *mut H::C,
    function: &str,
    field: &str,
) -> Result<Box<H>> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<H>(ptr, function, field) }?;
    // SAFETY: made by `into_raw` as a Box<H>; the tag was checked.
    let mut boxed = unsafe { Box::from_raw(ptr as *mut H) };
    boxed.set_dead();
    Ok(boxed)
}

/// Whose a routable handle is.
pub(crate) enum Route<'a, H> {
    Ours(&'a H),
    /// The compute plugin's handle: forward it.
    Compute(Arc<ComputePlugin>),
}

/// Decides whose handle `ptr` is (see the module doc).
///
/// # Safety
/// As `try_borrow`.
pub(crate) unsafe fn route<'a, H: Castable>(
    ptr: *const H::C,
    function: &str,
    field: &str,
) -> Result<Route<'a, H>> {
    if ptr.is_null() {
        return Err(invalid_argument(format!("{function}: {field} is null")));
    }
    // SAFETY: forwarded contract (routable handles keep their tag at 0).
    let word = unsafe { tag_word(ptr.cast(), 0) };
    if word == H::TAG {
        // SAFETY: our tag: an `H` we made.
        return Ok(Route::Ours(unsafe { &*(ptr as *const H) }));
    }
    if word == DEAD || OUR_TAGS.contains(&word) {
        return Err(not_live::<H>(function, field));
    }
    match compute_plugin::loaded() {
        Some(plugin) => Ok(Route::Compute(plugin)),
        None => Err(not_live::<H>(function, field)),
    }
}

/// Whether `ptr` is one of our handles of any type (a forwarded call must
/// not hand the compute plugin one of ours).
///
/// # Safety
/// `ptr` must be null or a readable handle-shaped object.
pub(crate) unsafe fn is_ours(ptr: *const c_void) -> bool {
    // SAFETY: forwarded contract.
    !ptr.is_null() && {
        let word = unsafe { tag_word(ptr, 0) };
        word == DEAD || OUR_TAGS.contains(&word)
    }
}

macro_rules! castable {
    ($ty:ident, $c:ident, $ownership:ident, $tag:expr, $what:literal) => {
        castable!($ty, $c, $ownership, $tag, $what, 0);
    };
    ($ty:ident, $c:ident, $ownership:ident, $tag:expr, $what:literal, $offset:expr) => {
        impl Castable for $ty {
            type C = $c;
            type Ownership = $ownership;
            const TAG: u64 = $tag;
            const TAG_OFFSET: usize = $offset;
            const WHAT: &'static str = $what;
            fn set_dead(&mut self) {
                self.tag = DEAD;
            }
        }
    };
}

/// A raw pointer table that is immutable after construction.
pub(crate) struct PtrList<T>(pub Vec<*mut T>);
// SAFETY: the pointees are handles owned by the same ClientTables, immutable
// after construction and themselves Sync.
unsafe impl<T> Send for PtrList<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for PtrList<T> {}

mod buffer;
mod client;
mod compute_handles;
mod device;
mod event;
mod memory;

pub(crate) use buffer::*;
pub(crate) use client::*;
pub(crate) use compute_handles::*;
pub(crate) use device::*;
pub(crate) use event::*;
pub(crate) use memory::*;
