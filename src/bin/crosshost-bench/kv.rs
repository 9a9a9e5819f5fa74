//! The benchmark owns the job's key-value store, as a PJRT framework does:
//! the parent keeps it in memory and serves the child over a Unix socket;
//! both processes hand it to the plugin through the PJRT KV callbacks (plus
//! the plugin's delete extension, so receipts are really retired).
use std::collections::HashMap;
use std::ffi::c_void;
use std::io::{Read, Write};
use std::os::raw::c_char;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use pjrt_crosshost::pjrt::bindings::*;

use crate::ffi_client::KvCallbacks;

/// What the plugin's callbacks talk to.
pub trait KvBackend: Send + Sync {
    /// `Ok(None)`: absent after waiting `timeout`.
    fn get(&self, key: &str, timeout: Duration) -> std::io::Result<Option<Vec<u8>>>;
    fn put(&self, key: &str, value: &[u8]) -> std::io::Result<()>;
    fn delete(&self, key: &str) -> std::io::Result<()>;
}

/// The parent's store. A get waits on its own key's condition variable, so a
/// set wakes only the waiters of that key (not every blocked get).
#[derive(Default)]
pub struct LocalStore {
    map: Mutex<Entries>,
    /// Requests served for the child, and the time spent on them (not
    /// counting time blocked waiting for a key).
    pub served: AtomicU64,
    pub serving_ns: AtomicU64,
}

#[derive(Default)]
struct Entries {
    values: HashMap<String, Vec<u8>>,
    waiters: HashMap<String, Arc<Condvar>>,
}

impl LocalStore {
    pub fn keys(&self) -> Vec<String> {
        self.map.lock().values.keys().cloned().collect()
    }
}

impl KvBackend for LocalStore {
    fn get(&self, key: &str, timeout: Duration) -> std::io::Result<Option<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock();
        let waiter = map.waiters.entry(key.to_string()).or_default().clone();
        let found = loop {
            if let Some(v) = map.values.get(key) {
                break Some(v.clone());
            }
            if waiter.wait_until(&mut map, deadline).timed_out() {
                break map.values.get(key).cloned();
            }
        };
        // The last waiter of a key removes its condition variable.
        if Arc::strong_count(&waiter) == 2 {
            map.waiters.remove(key);
        }
        Ok(found)
    }

    fn put(&self, key: &str, value: &[u8]) -> std::io::Result<()> {
        let mut map = self.map.lock();
        map.values.insert(key.to_string(), value.to_vec());
        if let Some(waiter) = map.waiters.get(key) {
            waiter.notify_all();
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> std::io::Result<()> {
        self.map.lock().values.remove(key);
        Ok(())
    }
}

// Wire: request = op u8 (0 get, 1 put, 2 delete), timeout_ms u32, key len
// u32 + key, value len u32 + value. Response = found u8, value len u32 + value.
fn write_frame(
    stream: &mut UnixStream,
    op: u8,
    timeout_ms: u32,
    key: &str,
    value: &[u8],
) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(13 + key.len() + value.len());
    frame.push(op);
    frame.extend_from_slice(&timeout_ms.to_le_bytes());
    frame.extend_from_slice(&(key.len() as u32).to_le_bytes());
    frame.extend_from_slice(key.as_bytes());
    frame.extend_from_slice(&(value.len() as u32).to_le_bytes());
    frame.extend_from_slice(value);
    stream.write_all(&frame)
}

fn read_u32(stream: &mut UnixStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    stream.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_bytes(stream: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let n = read_u32(stream)? as usize;
    let mut v = vec![0u8; n];
    stream.read_exact(&mut v)?;
    Ok(v)
}

/// Serves `store` to other processes until the process exits.
pub fn serve(store: Arc<LocalStore>, path: &Path) -> std::io::Result<()> {
    let listener = UnixListener::bind(path)?;
    std::thread::Builder::new()
        .name("bench-kv-accept".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let store = store.clone();
                let _ = std::thread::Builder::new()
                    .name("bench-kv-conn".into())
                    .spawn(move || serve_connection(store, stream));
            }
        })?;
    Ok(())
}

fn serve_connection(store: Arc<LocalStore>, mut stream: UnixStream) {
    loop {
        let mut op = [0u8; 1];
        if stream.read_exact(&mut op).is_err() {
            return;
        }
        let request = (|| -> std::io::Result<(u32, String, Vec<u8>)> {
            let timeout = read_u32(&mut stream)?;
            let key = String::from_utf8_lossy(&read_bytes(&mut stream)?).into_owned();
            Ok((timeout, key, read_bytes(&mut stream)?))
        })();
        let Ok((timeout_ms, key, value)) = request else {
            return;
        };
        let started = Instant::now();
        let mut waited = Duration::ZERO;
        let answer = match op[0] {
            0 => {
                let r = store.get(&key, Duration::from_millis(timeout_ms as u64));
                waited = started.elapsed();
                r
            }
            1 => store.put(&key, &value).map(|()| None),
            _ => store.delete(&key).map(|()| None),
        };
        store.served.fetch_add(1, Ordering::Relaxed);
        let mut response = Vec::new();
        match answer {
            Ok(Some(v)) => {
                response.push(1);
                response.extend_from_slice(&(v.len() as u32).to_le_bytes());
                response.extend_from_slice(&v);
            }
            _ => {
                response.push(0);
                response.extend_from_slice(&0u32.to_le_bytes());
            }
        }
        let ok = stream.write_all(&response).is_ok();
        // Waiting for a key to appear is not serving cost; only the rest is.
        let spent =
            started
                .elapsed()
                .saturating_sub(if op[0] == 0 { waited } else { Duration::ZERO });
        store
            .serving_ns
            .fetch_add(spent.as_nanos() as u64, Ordering::Relaxed);
        if !ok {
            return;
        }
    }
}

/// The child's handle on the parent's store: a small pool of connections
/// (a blocked get holds one; others take another).
pub struct RemoteStore {
    path: PathBuf,
    idle: Mutex<Vec<UnixStream>>,
}

impl RemoteStore {
    pub fn new(path: &Path) -> RemoteStore {
        RemoteStore {
            path: path.to_path_buf(),
            idle: Mutex::new(Vec::new()),
        }
    }

    fn call(
        &self,
        op: u8,
        timeout: Duration,
        key: &str,
        value: &[u8],
    ) -> std::io::Result<Option<Vec<u8>>> {
        let mut stream = match self.idle.lock().pop() {
            Some(s) => s,
            None => UnixStream::connect(&self.path)?,
        };
        write_frame(
            &mut stream,
            op,
            timeout.as_millis().min(u32::MAX as u128) as u32,
            key,
            value,
        )?;
        let mut found = [0u8; 1];
        stream.read_exact(&mut found)?;
        let v = read_bytes(&mut stream)?;
        self.idle.lock().push(stream);
        Ok((found[0] == 1).then_some(v))
    }
}

impl KvBackend for RemoteStore {
    fn get(&self, key: &str, timeout: Duration) -> std::io::Result<Option<Vec<u8>>> {
        self.call(0, timeout, key, &[])
    }
    fn put(&self, key: &str, value: &[u8]) -> std::io::Result<()> {
        self.call(1, Duration::ZERO, key, value).map(|_| ())
    }
    fn delete(&self, key: &str) -> std::io::Result<()> {
        self.call(2, Duration::ZERO, key, &[]).map(|_| ())
    }
}

// ------------------------------ C callbacks ---------------------------------

/// The object behind the callbacks' `user_arg`.
pub struct CallbackTarget(pub Arc<dyn KvBackend>);

/// Builds the callback set for `target` (which must outlive the client).
pub fn callbacks(target: &CallbackTarget) -> KvCallbacks {
    KvCallbacks {
        get: Some(kv_get),
        try_get: Some(kv_try_get),
        put: Some(kv_put),
        delete: Some(kv_delete),
        user_arg: target as *const CallbackTarget as *mut c_void,
    }
}

unsafe extern "C" fn free_value(value: *mut c_char) {
    // SAFETY: allocated with libc::malloc in `found`.
    unsafe { libc::free(value as *mut c_void) };
}

/// # Safety
/// `callback_error` is the plugin's PJRT_CallbackError pointer.
unsafe fn error(
    callback_error: *mut PJRT_CallbackError,
    code: PJRT_Error_Code,
    message: &str,
) -> *mut PJRT_Error {
    // SAFETY: the header: callback_error points at the plugin's function.
    match unsafe { callback_error.as_ref().and_then(|f| *f) } {
        Some(f) => unsafe { f(code, message.as_ptr() as *const c_char, message.len()) },
        None => std::ptr::null_mut(),
    }
}

/// # Safety
/// `ptr` must point to `len` bytes.
unsafe fn key_of(ptr: *const c_char, len: usize) -> String {
    // SAFETY: forwarded contract.
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
        .into_owned()
}

/// Copies `v` into malloc'd memory the plugin frees with `free_value`.
fn found(v: &[u8]) -> (*mut c_char, usize) {
    // SAFETY: malloc of at least one byte; we copy v.len() bytes into it.
    unsafe {
        let p = libc::malloc(v.len().max(1)) as *mut u8;
        std::ptr::copy_nonoverlapping(v.as_ptr(), p, v.len());
        (p as *mut c_char, v.len())
    }
}

unsafe extern "C" fn kv_get(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error {
    // SAFETY: the plugin passes valid args and our user_arg.
    unsafe {
        let a = &mut *args;
        let target = &*(a.user_arg as *const CallbackTarget);
        let key = key_of(a.key, a.key_size);
        match target
            .0
            .get(&key, Duration::from_millis(a.timeout_in_ms.max(0) as u64))
        {
            Ok(Some(v)) => {
                (a.value, a.value_size) = found(&v);
                a.value_deleter_callback = Some(free_value);
                std::ptr::null_mut()
            }
            Ok(None) => error(
                a.callback_error,
                PJRT_Error_Code_DEADLINE_EXCEEDED,
                "key not set in time",
            ),
            Err(e) => error(
                a.callback_error,
                PJRT_Error_Code_UNAVAILABLE,
                &e.to_string(),
            ),
        }
    }
}

unsafe extern "C" fn kv_try_get(args: *mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error {
    // SAFETY: the plugin passes valid args and our user_arg.
    unsafe {
        let a = &mut *args;
        let target = &*(a.user_arg as *const CallbackTarget);
        let key = key_of(a.key, a.key_size);
        match target.0.get(&key, Duration::ZERO) {
            Ok(Some(v)) => {
                (a.value, a.value_size) = found(&v);
                a.value_deleter_callback = Some(free_value);
                std::ptr::null_mut()
            }
            Ok(None) => error(a.callback_error, PJRT_Error_Code_NOT_FOUND, "key not found"),
            Err(e) => error(
                a.callback_error,
                PJRT_Error_Code_UNAVAILABLE,
                &e.to_string(),
            ),
        }
    }
}

unsafe extern "C" fn kv_put(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error {
    // SAFETY: the plugin passes valid args and our user_arg.
    unsafe {
        let a = &*args;
        let target = &*(a.user_arg as *const CallbackTarget);
        let key = key_of(a.key, a.key_size);
        let value = std::slice::from_raw_parts(a.value as *const u8, a.value_size);
        match target.0.put(&key, value) {
            Ok(()) => std::ptr::null_mut(),
            Err(e) => error(
                a.callback_error,
                PJRT_Error_Code_UNAVAILABLE,
                &e.to_string(),
            ),
        }
    }
}

unsafe extern "C" fn kv_delete(
    args: *mut PJRT_CrossHost_KeyValueDeleteCallback_Args,
) -> *mut PJRT_Error {
    // SAFETY: the plugin passes valid args and our user_arg.
    unsafe {
        let a = &*args;
        let target = &*(a.user_arg as *const CallbackTarget);
        match target.0.delete(&key_of(a.key, a.key_size)) {
            Ok(()) => std::ptr::null_mut(),
            Err(e) => error(
                a.callback_error,
                PJRT_Error_Code_UNAVAILABLE,
                &e.to_string(),
            ),
        }
    }
}
