//! The unsafe half of `kv::CallbackStore`: calls the `kv_get` / `kv_try_get`
//! / `kv_put` function pointers that `PJRT_Client_Create` received, and the
//! `kv_delete` callback of `PJRT_CrossHost_KvDeleteExtension` when the caller
//! attached one (`include/pjrt_crosshost.h`), else the process's registered
//! delete (`kv_delete_route.rs`).
//!
//! Errors. Each call hands the callback `callback_error`, a pointer to our
//! `PJRT_CallbackError` implementation, which makes one of the plugin's own
//! error objects and notes its address. An error pointer a callback returns
//! is read only if `callback_error` made it and it was not taken yet;
//! anything else becomes an `UNKNOWN` error naming the callback and is never
//! dereferenced: a Python callback that raises through ctypes returns
//! whatever the return register held, and reading that crashed the process.
//! Values are copied, then freed with the callback's
//! `value_deleter_callback`.
use std::collections::HashSet;
use std::ffi::c_void;
use std::mem::{offset_of, size_of};
use std::os::raw::c_char;
use std::ptr;
use std::time::Duration;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use crate::ffi::errors::error_into_raw;
use crate::ffi::kv_delete_route;
use crate::kv::RawKvCallbacks;
use crate::pjrt::bindings::*;
use crate::status::{self, Code, Result, Status};

// ---------------------------------------------------------------------------
// The PJRT_CallbackError implementation and its error object.
// ---------------------------------------------------------------------------

static CALLBACK_ERROR: PJRT_CallbackError = Some(callback_error);

fn callback_error_ptr() -> *mut PJRT_CallbackError {
    // The C side only reads through this pointer (it calls the function).
    ptr::addr_of!(CALLBACK_ERROR) as *mut PJRT_CallbackError
}

/// The `PJRT_CallbackError` we hand to each KV callback: a new error of ours
/// with `code` and a copy of the message, owned by whoever the callback
/// returns it to (us).
unsafe extern "C" fn callback_error(
    code: PJRT_Error_Code,
    message: *const c_char,
    message_size: usize,
) -> *mut PJRT_Error {
    // SAFETY: the PJRT contract: `message` points to `message_size` readable
    // bytes for the duration of this call; we copy them.
    let message = unsafe { crate::ffi::args::lossy_str(message, message_size) };
    // The plugin's own error object (ffi/errors.rs): a well-formed
    // PJRT_Error whose vtable any reader can use.
    let error = error_into_raw(Status::new(Code::from_raw(code as i32), message));
    ISSUED.lock().insert(error as usize);
    error
}

/// Errors `callback_error` made that no callback has returned yet.
static ISSUED: Lazy<Mutex<HashSet<usize>>> = Lazy::new(Default::default);

/// Turns an error a callback returned into a Status naming the call, and
/// frees it, if `callback_error` made it; any other pointer is not read.
///
/// # Safety
/// None beyond the callback contract: `error` is compared, not read, unless
/// it is one of ours.
unsafe fn take_error(error: *mut PJRT_Error, what: &str) -> Status {
    if !ISSUED.lock().remove(&(error as usize)) {
        return status::unknown(format!(
            "{what}: the callback returned an error that its callback_error did not make              ({error:p}; a Python callback that raised through ctypes returns an undefined              pointer); it was not read"
        ));
    }
    // SAFETY: made by callback_error (error_into_raw), not freed since: it
    // left ISSUED only now, and only here.
    let status = unsafe { crate::ffi::errors::take_error(error) }
        .unwrap_or_else(|| status::unknown("null error"));
    Status::new(status.code, format!("{what}: {}", status.message))
}

/// Copies a returned value and hands it back to its deleter.
///
/// # Safety
/// `value` points to `size` readable bytes (or is null), allocated by the
/// callback that also returned `deleter`.
unsafe fn take_value(
    value: *mut c_char,
    size: usize,
    deleter: Option<unsafe extern "C" fn(*mut c_char)>,
    what: &str,
) -> Result<Vec<u8>> {
    let copied = if value.is_null() {
        if size != 0 {
            return Err(status::internal(format!(
                "{what}: callback returned a null value of size {size}"
            )));
        }
        Vec::new()
    } else {
        // SAFETY: caller guarantees `size` readable bytes at `value`.
        unsafe { std::slice::from_raw_parts(value as *const u8, size) }.to_vec()
    };
    if let (Some(deleter), false) = (deleter, value.is_null()) {
        // SAFETY: the deleter the callback gave for this value, called once.
        unsafe { deleter(value) };
    }
    Ok(copied)
}

// ---------------------------------------------------------------------------
// The callbacks.
// ---------------------------------------------------------------------------

type GetFn = unsafe extern "C" fn(*mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error;
type TryGetFn = unsafe extern "C" fn(*mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error;
type PutFn = unsafe extern "C" fn(*mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error;
type DeleteFn =
    unsafe extern "C" fn(*mut PJRT_CrossHost_KeyValueDeleteCallback_Args) -> *mut PJRT_Error;

/// The KV callbacks of one client.
pub struct PjrtKvCallbacks {
    get: (GetFn, *mut c_void),
    put: (PutFn, *mut c_void),
    try_get: Option<(TryGetFn, *mut c_void)>,
    delete: Option<(DeleteFn, *mut c_void)>,
}

// SAFETY: the PJRT contract requires the KV callbacks to be thread-safe; the
// user args are opaque pointers we only pass back to those callbacks.
unsafe impl Send for PjrtKvCallbacks {}
// SAFETY: as above.
unsafe impl Sync for PjrtKvCallbacks {}

/// Longest extension chain we walk (guards against a cyclic list).
const MAX_EXTENSIONS: usize = 64;

impl PjrtKvCallbacks {
    /// The callbacks of `args`, or `None` when get or put is missing. Reads
    /// only the fields that `args.struct_size` covers.
    ///
    /// # Safety
    /// `args` points to a readable `PJRT_Client_Create_Args` of at least
    /// `args.struct_size` bytes, whose `extension_start` chain (if any) is a
    /// valid list of `PJRT_Extension_Base` nodes, and whose callbacks stay
    /// valid for the client's lifetime.
    pub unsafe fn from_create_args(args: *const PJRT_Client_Create_Args) -> Option<Self> {
        // SAFETY: caller guarantees `args` is readable up to its struct_size.
        let args = unsafe { &*args };
        let has = |end: usize| args.struct_size >= end;
        let end_of_put = offset_of!(PJRT_Client_Create_Args, kv_put_user_arg) + size_of::<usize>();
        if !has(end_of_put) {
            return None;
        }
        let get = (args.kv_get_callback?, args.kv_get_user_arg);
        let put = (args.kv_put_callback?, args.kv_put_user_arg);
        let end_of_try_get =
            offset_of!(PJRT_Client_Create_Args, kv_try_get_user_arg) + size_of::<usize>();
        let try_get = if has(end_of_try_get) {
            args.kv_try_get_callback
                .map(|f| (f, args.kv_try_get_user_arg))
        } else {
            None
        };
        // SAFETY: caller guarantees the extension chain is valid.
        let delete = unsafe { find_delete_extension(args.extension_start) };
        Some(PjrtKvCallbacks {
            get,
            put,
            try_get,
            delete,
        })
    }
}

/// # Safety
/// `ext` is null or the head of a valid `PJRT_Extension_Base` list.
unsafe fn find_delete_extension(
    mut ext: *mut PJRT_Extension_Base,
) -> Option<(DeleteFn, *mut c_void)> {
    for _ in 0..MAX_EXTENSIONS {
        if ext.is_null() {
            return None;
        }
        // SAFETY: a non-null node of a valid list.
        let base = unsafe { &*ext };
        if base.type_ == PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE
            && base.struct_size >= size_of::<PJRT_CrossHost_KvDeleteExtension>()
        {
            // SAFETY: type and size identify our extension struct.
            let delete = unsafe { &*(ext as *const PJRT_CrossHost_KvDeleteExtension) };
            return delete
                .kv_delete_callback
                .map(|f| (f, delete.kv_delete_user_arg));
        }
        ext = base.next;
    }
    log::warn!("PJRT_Client_Create: extension chain longer than {MAX_EXTENSIONS}; stopped looking for the KV delete extension");
    None
}

fn timeout_ms(timeout: Duration) -> i32 {
    i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX)
}

impl RawKvCallbacks for PjrtKvCallbacks {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let (get, user_arg) = self.get;
        let mut args = PJRT_KeyValueGetCallback_Args {
            struct_size: size_of::<PJRT_KeyValueGetCallback_Args>(),
            extension_start: ptr::null_mut(),
            key: key.as_ptr() as *const c_char,
            key_size: key.len(),
            timeout_in_ms: timeout_ms(timeout),
            callback_error: callback_error_ptr(),
            user_arg,
            value: ptr::null_mut(),
            value_size: 0,
            value_deleter_callback: None,
        };
        crate::timeline!("kv get {key} (up to {timeout:?})");
        // SAFETY: a thread-safe callback given at client creation, called with
        // a fully initialised args struct that outlives the call.
        let error = unsafe { get(&mut args) };
        crate::timeline!("kv get {key} returned (error: {})", !error.is_null());
        let what = format!("kv_get_callback({key:?})");
        if !error.is_null() {
            // SAFETY: a non-null error returned by the callback, ours to free.
            return Err(unsafe { take_error(error, &what) });
        }
        // SAFETY: on success the callback filled value/size/deleter.
        unsafe {
            take_value(
                args.value,
                args.value_size,
                args.value_deleter_callback,
                &what,
            )
        }
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let Some((try_get, user_arg)) = self.try_get else {
            // No try-get callback (older callers): a get that does not wait.
            return self.get(key, Duration::ZERO).map_err(|e| match e.code {
                Code::DeadlineExceeded => status::not_found(e.message),
                _ => e,
            });
        };
        let mut args = PJRT_KeyValueTryGetCallback_Args {
            struct_size: size_of::<PJRT_KeyValueTryGetCallback_Args>(),
            extension_start: ptr::null_mut(),
            key: key.as_ptr() as *const c_char,
            key_size: key.len(),
            callback_error: callback_error_ptr(),
            user_arg,
            value: ptr::null_mut(),
            value_size: 0,
            value_deleter_callback: None,
        };
        // SAFETY: as in `get`.
        let error = unsafe { try_get(&mut args) };
        crate::timeline!("kv try_get {key} (found: {})", error.is_null());
        let what = format!("kv_try_get_callback({key:?})");
        if !error.is_null() {
            // SAFETY: a non-null error returned by the callback, ours to free.
            return Err(unsafe { take_error(error, &what) });
        }
        // SAFETY: on success the callback filled value/size/deleter.
        unsafe {
            take_value(
                args.value,
                args.value_size,
                args.value_deleter_callback,
                &what,
            )
        }
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let (put, user_arg) = self.put;
        let mut args = PJRT_KeyValuePutCallback_Args {
            struct_size: size_of::<PJRT_KeyValuePutCallback_Args>(),
            extension_start: ptr::null_mut(),
            key: key.as_ptr() as *const c_char,
            key_size: key.len(),
            value: value.as_ptr() as *const c_char,
            value_size: value.len(),
            callback_error: callback_error_ptr(),
            user_arg,
        };
        crate::timeline!("kv put {key} ({} bytes)", value.len());
        // SAFETY: as in `get`; key and value outlive the call.
        let error = unsafe { put(&mut args) };
        crate::timeline!("kv put {key} done");
        if error.is_null() {
            Ok(())
        } else {
            // SAFETY: a non-null error returned by the callback, ours to free.
            Err(unsafe { take_error(error, &format!("kv_put_callback({key:?})")) })
        }
    }

    fn delete(&self, key: &str) -> Option<Result<()>> {
        let mut args = PJRT_CrossHost_KeyValueDeleteCallback_Args {
            struct_size: size_of::<PJRT_CrossHost_KeyValueDeleteCallback_Args>(),
            extension_start: ptr::null_mut(),
            key: key.as_ptr() as *const c_char,
            key_size: key.len(),
            callback_error: callback_error_ptr(),
            user_arg: ptr::null_mut(),
        };
        crate::timeline!("kv delete {key}");
        let error = match self.delete {
            Some((delete, user_arg)) => {
                args.user_arg = user_arg;
                // SAFETY: the extension's callback, thread-safe like the others.
                unsafe { delete(&mut args) }
            }
            // SAFETY: valid args that live for the call.
            None => unsafe { kv_delete_route::call(&mut args) }?,
        };
        crate::timeline!("kv delete {key} done");
        Some(if error.is_null() {
            Ok(())
        } else {
            // SAFETY: a non-null error returned by the callback, ours to free.
            Err(unsafe { take_error(error, &format!("kv_delete_callback({key:?})")) })
        })
    }

    /// The extension's delete, else the process's registered one (which
    /// can come and go: the store asks at every retirement).
    fn has_delete(&self) -> bool {
        self.delete.is_some() || kv_delete_route::registered()
    }
}

#[cfg(test)]
mod tests {
    //! Fake C callbacks over a `MemoryStore` (passed as `user_arg`), the way
    //! a framework would implement them.
    use super::*;
    use crate::kv::{KeyValueStore, MemoryStore};

    unsafe fn store<'a>(user_arg: *mut c_void) -> &'a MemoryStore {
        // SAFETY: the tests pass a `&MemoryStore` that outlives the calls.
        unsafe { &*(user_arg as *const MemoryStore) }
    }

    unsafe fn key<'a>(key: *const c_char, size: usize) -> &'a str {
        // SAFETY: our own calls pass a valid UTF-8 key of `size` bytes.
        unsafe { std::str::from_utf8(std::slice::from_raw_parts(key as *const u8, size)).unwrap() }
    }

    unsafe fn fail(callback_error: *mut PJRT_CallbackError, e: Status) -> *mut PJRT_Error {
        // SAFETY: the plugin passes a pointer to a valid PJRT_CallbackError.
        unsafe {
            let make = (*callback_error).unwrap();
            make(
                e.code as PJRT_Error_Code,
                e.message.as_ptr() as *const c_char,
                e.message.len(),
            )
        }
    }

    unsafe fn malloc_copy(value: &[u8]) -> *mut c_char {
        // SAFETY: a fresh allocation of the right size, freed by `free_value`.
        unsafe {
            let p = libc::malloc(value.len().max(1)) as *mut u8;
            ptr::copy_nonoverlapping(value.as_ptr(), p, value.len());
            p as *mut c_char
        }
    }

    unsafe extern "C" fn free_value(value: *mut c_char) {
        // SAFETY: allocated by `malloc_copy`.
        unsafe { libc::free(value as *mut c_void) }
    }

    unsafe extern "C" fn fake_get(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error {
        // SAFETY: the plugin passes a valid args struct.
        unsafe {
            let args = &mut *args;
            let timeout = Duration::from_millis(args.timeout_in_ms as u64);
            match store(args.user_arg).get(key(args.key, args.key_size), timeout) {
                Ok(v) => {
                    args.value = malloc_copy(&v);
                    args.value_size = v.len();
                    args.value_deleter_callback = Some(free_value);
                    ptr::null_mut()
                }
                Err(e) => fail(args.callback_error, e),
            }
        }
    }

    unsafe extern "C" fn fake_put(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error {
        // SAFETY: the plugin passes a valid args struct.
        unsafe {
            let args = &*args;
            let value = std::slice::from_raw_parts(args.value as *const u8, args.value_size);
            match store(args.user_arg).set(key(args.key, args.key_size), value) {
                Ok(()) => ptr::null_mut(),
                Err(e) => fail(args.callback_error, e),
            }
        }
    }

    unsafe extern "C" fn fake_delete(
        args: *mut PJRT_CrossHost_KeyValueDeleteCallback_Args,
    ) -> *mut PJRT_Error {
        // SAFETY: the plugin passes a valid args struct.
        unsafe {
            let args = &*args;
            match store(args.user_arg).delete(key(args.key, args.key_size)) {
                Ok(()) => ptr::null_mut(),
                Err(e) => fail(args.callback_error, e),
            }
        }
    }

    fn create_args(store: &MemoryStore, ext: *mut PJRT_Extension_Base) -> PJRT_Client_Create_Args {
        let arg = store as *const MemoryStore as *mut c_void;
        PJRT_Client_Create_Args {
            struct_size: size_of::<PJRT_Client_Create_Args>(),
            extension_start: ext,
            kv_get_callback: Some(fake_get),
            kv_get_user_arg: arg,
            kv_put_callback: Some(fake_put),
            kv_put_user_arg: arg,
            ..Default::default()
        }
    }

    #[test]
    fn values_round_trip_and_callback_errors_keep_code_and_message() {
        let _serial = crate::ffi::kv_delete_route::tests::REGISTRATION.lock();
        let backing = MemoryStore::new();
        let args = create_args(&backing, ptr::null_mut());
        // SAFETY: `args` is a valid struct whose callbacks outlive `kv`.
        let kv = unsafe { PjrtKvCallbacks::from_create_args(&args) }.unwrap();
        assert!(!kv.has_delete());
        assert!(kv.delete("k").is_none());
        kv.put("k", b"value").unwrap();
        assert_eq!(kv.get("k", Duration::from_millis(1)).unwrap(), b"value");
        kv.put("empty", b"").unwrap();
        assert_eq!(kv.get("empty", Duration::ZERO).unwrap(), b"");
        let err = kv.get("absent", Duration::from_millis(1)).unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded);
        assert!(err.message.contains("absent"), "{err}");
        // No try-get callback: falls back to a non-waiting get, NOT_FOUND.
        assert_eq!(kv.try_get("absent").unwrap_err().code, Code::NotFound);
    }

    #[test]
    fn without_the_extension_the_registered_delete_is_used_while_registered() {
        let _serial = crate::ffi::kv_delete_route::tests::REGISTRATION.lock();
        let backing = MemoryStore::new();
        let args = create_args(&backing, ptr::null_mut());
        // SAFETY: valid args whose callbacks outlive `kv`.
        let kv = unsafe { PjrtKvCallbacks::from_create_args(&args) }.unwrap();
        let user_arg = &backing as *const MemoryStore as *mut c_void;
        assert_eq!(
            kv_delete_route::pjrt_crosshost_set_kv_delete(Some(fake_delete), user_arg),
            0
        );
        assert!(kv.has_delete());
        kv.put("k", b"v").unwrap();
        kv.delete("k").unwrap().unwrap();
        assert!(backing.is_empty());
        assert_eq!(
            kv_delete_route::pjrt_crosshost_set_kv_delete(None, ptr::null_mut()),
            0
        );
        assert!(!kv.has_delete());
        assert!(kv.delete("k").is_none());
    }

    #[test]
    fn the_delete_extension_is_found_in_the_chain_and_used() {
        let backing = MemoryStore::new();
        let mut other = PJRT_Extension_Base {
            struct_size: size_of::<PJRT_Extension_Base>(),
            type_: 7,
            next: ptr::null_mut(),
        };
        let mut delete_ext = PJRT_CrossHost_KvDeleteExtension {
            base: PJRT_Extension_Base {
                struct_size: size_of::<PJRT_CrossHost_KvDeleteExtension>(),
                type_: PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE,
                next: ptr::null_mut(),
            },
            kv_delete_callback: Some(fake_delete),
            kv_delete_user_arg: &backing as *const MemoryStore as *mut c_void,
        };
        other.next = &mut delete_ext.base;
        let args = create_args(&backing, &mut other);
        // SAFETY: valid args and chain, outliving `kv`.
        let kv = unsafe { PjrtKvCallbacks::from_create_args(&args) }.unwrap();
        assert!(kv.has_delete());
        kv.put("k", b"v").unwrap();
        kv.delete("k").unwrap().unwrap();
        assert!(backing.is_empty());
    }

    /// A put that returns a pointer `callback_error` never made: an
    /// unmapped address, which reading would fault on.
    unsafe extern "C" fn foreign_error_put(
        _args: *mut PJRT_KeyValuePutCallback_Args,
    ) -> *mut PJRT_Error {
        0xdead_0000usize as *mut PJRT_Error
    }

    #[test]
    fn an_error_pointer_callback_error_did_not_make_is_unknown_and_never_read() {
        let backing = MemoryStore::new();
        let mut args = create_args(&backing, ptr::null_mut());
        args.kv_put_callback = Some(foreign_error_put);
        // SAFETY: valid args whose callbacks outlive `kv`.
        let kv = unsafe { PjrtKvCallbacks::from_create_args(&args) }.unwrap();
        let err = kv.put("k", b"v").unwrap_err();
        assert_eq!(err.code, Code::Unknown);
        assert!(err.message.contains("kv_put_callback"), "{err}");
        assert!(err.message.contains("did not make"), "{err}");
        // An error of ours is read once; the same pointer again is foreign.
        let error = {
            let message = "taken";
            // SAFETY: our own callback_error with a valid message.
            unsafe {
                callback_error(
                    Code::Aborted as PJRT_Error_Code,
                    message.as_ptr() as *const c_char,
                    message.len(),
                )
            }
        };
        // SAFETY: made by callback_error just now.
        let first = unsafe { take_error(error, "x") };
        assert_eq!(
            (first.code, first.message.as_str()),
            (Code::Aborted, "x: taken")
        );
        // SAFETY: compared only (taken and freed above).
        assert_eq!(unsafe { take_error(error, "x") }.code, Code::Unknown);
    }

    #[test]
    fn missing_get_or_put_or_short_struct_means_no_callbacks() {
        let backing = MemoryStore::new();
        let mut args = create_args(&backing, ptr::null_mut());
        args.kv_put_callback = None;
        // SAFETY: valid args.
        assert!(unsafe { PjrtKvCallbacks::from_create_args(&args) }.is_none());
        let mut args = create_args(&backing, ptr::null_mut());
        args.struct_size = offset_of!(PJRT_Client_Create_Args, kv_get_callback);
        // SAFETY: valid args (we only shrink the declared size).
        assert!(unsafe { PjrtKvCallbacks::from_create_args(&args) }.is_none());
    }
}
