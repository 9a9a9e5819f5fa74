//! The send path into another process's shared memory when that process
//! (the receiver) is gone: the send is UNAVAILABLE naming it, never OK, and
//! no receipt is written for it.
use super::*;
use crate::backend::DeviceMemory;
use crate::kv::MemoryStore;
use crate::transfer::descriptor::{AllocationHandle, Descriptor};
use crate::transfer::session::LocalDevices;
use crate::transfer::Receipt;
use crate::transport::auth_token::AuthToken;
use crate::transport::claim::claim_table_len;
use crate::transport::claim::ClaimRange;
use crate::transport::host_identity::HostIdentity;
use crate::transport::random::random_u64;
use crate::transport::shm::SharedRegion;
use crate::transport::shm_owner::{read_proc_stat, ShmOwner};
use crate::transport::shm_test_object::NamedShmObject;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const LEN: usize = 4096;
const U8: u32 = 6;

/// A stand-in receiver: a child process (`cat`, alive until its stdin
/// closes) and a claim-armed destination in an object named as that process
/// would name it. The object is unlinked and the child ended on drop.
struct Receiver {
    child: Child,
    object: NamedShmObject,
    region: SharedRegion,
    nonce: u64,
}

impl Receiver {
    fn spawn() -> Receiver {
        let child = Command::new("cat")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let owner = ShmOwner {
            pid: child.id(),
            start_time: read_proc_stat(child.id()).unwrap().unwrap().start_time,
            ..ShmOwner::current().unwrap()
        };
        let table = claim_table_len(LEN);
        let object = NamedShmObject::create(&owner, table + LEN);
        let region = SharedRegion::open_whole(object.name()).unwrap();
        let nonce = random_u64().unwrap();
        region
            .claim_slot(table as u64)
            .unwrap()
            .arm(&ClaimRange {
                nonce,
                offset: table as u64,
                len: LEN as u64,
            })
            .unwrap();
        Receiver {
            child,
            object,
            region,
            nonce,
        }
    }

    fn descriptor(&self, key: &str) -> Vec<u8> {
        Descriptor {
            host: HostIdentity::local().unwrap(),
            process_id: self.child.id(),
            allocation: AllocationHandle::SharedMemory {
                name: self.object.name().to_string(),
            },
            offset: claim_table_len(LEN) as u64,
            byte_size: LEN as u64,
            element_type: U8,
            dims: vec![LEN as i64],
            completion_key: key.to_string(),
            nonce: self.nonce,
            auth_token: AuthToken::generate().unwrap(),
        }
        .encode()
        .unwrap()
    }

    fn received(&self) -> Vec<u8> {
        let mut out = vec![0u8; LEN];
        self.region.read_at(claim_table_len(LEN), &mut out).unwrap();
        out
    }
}

/// Ends `child` and reaps it.
fn end(child: &mut Child) {
    drop(child.stdin.take());
    child.wait().unwrap();
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // The object is unlinked when `object` drops.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Host bytes that run `on_read` while the sender copies them (to end the
/// receiver in the middle of a send).
struct Source {
    bytes: Vec<u8>,
    on_read: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl DeviceMemory for Source {
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if let Some(on_read) = self.on_read.lock().take() {
            on_read();
        }
        dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
        Ok(())
    }
    fn write(&self, _offset: usize, _src: &[u8]) -> Result<()> {
        unreachable!("a send only reads its source")
    }
    fn address(&self) -> usize {
        self.bytes.as_ptr() as usize
    }
    fn is_host_memory(&self) -> bool {
        true
    }
}

fn pattern() -> Vec<u8> {
    (0..LEN).map(|i| (i % 251) as u8 + 1).collect()
}

fn source(on_read: Option<Box<dyn FnOnce() + Send>>) -> SendSource {
    SendSource {
        memory: Arc::new(Source {
            bytes: pattern(),
            on_read: Mutex::new(on_read),
        }),
        ready: Future::ready(Ok(())),
        spec: BufferSpec {
            byte_size: LEN,
            element_type: U8,
            dims: vec![LEN as i64],
        },
        global_device_id: 0,
    }
}

fn service() -> (Arc<TransferService>, Arc<MemoryStore>) {
    let store = Arc::new(MemoryStore::new());
    (service_on(store.clone()), store)
}

/// A one-process service whose keys go to `store`.
fn service_on(store: Arc<dyn crate::kv::KeyValueStore>) -> Arc<TransferService> {
    let session = Session::local(LocalDevices::sequential(1, "cpu"), "auto").unwrap();
    TransferService::new(store, session, TransferConfig::default(), None, None)
}

fn send(service: &Arc<TransferService>, source: SendSource, descriptor: &[u8]) -> Outcome {
    let future = service
        .send_to_descriptor(source, descriptor, "test send")
        .unwrap();
    future
        .wait_timeout(Duration::from_secs(20))
        .expect("the send ended")
}

#[test]
fn a_send_to_a_live_receiver_is_ok_and_writes_the_receipt() {
    let (service, store) = service();
    let receiver = Receiver::spawn();
    let key = "crosshost/recv/test-live/1/0";
    send(&service, source(None), &receiver.descriptor(key)).unwrap();
    assert_eq!(receiver.received(), pattern());
    let receipt = Receipt::decode(&store.try_get(key).unwrap()).unwrap();
    assert_eq!(
        receipt,
        Receipt::Ok {
            nonce: receiver.nonce
        }
    );
}

#[test]
fn a_send_to_a_receiver_that_died_before_is_unavailable_and_writes_nothing() {
    let (service, store) = service();
    let mut receiver = Receiver::spawn();
    let pid = receiver.child.id();
    let key = "crosshost/recv/test-dead/1/0";
    let descriptor = receiver.descriptor(key);
    end(&mut receiver.child);
    let error = send(&service, source(None), &descriptor).unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    assert!(error.message.contains(&format!("pid {pid}")), "{error}");
    assert_eq!(
        receiver.received(),
        vec![0u8; LEN],
        "bytes went to a dead receiver"
    );
    assert_eq!(store.try_get(key).unwrap_err().code, Code::NotFound);
}

#[test]
fn a_receiver_that_dies_during_the_copy_fails_the_send_before_any_receipt() {
    let (service, store) = service();
    let mut receiver = Receiver::spawn();
    let pid = receiver.child.id();
    let key = "crosshost/recv/test-dying/1/0";
    let descriptor = receiver.descriptor(key);
    let mut child = std::mem::replace(&mut receiver.child, Command::new("true").spawn().unwrap());
    let die = Box::new(move || end(&mut child));
    let error = send(&service, source(Some(die)), &descriptor).unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    assert!(error.message.contains(&format!("pid {pid}")), "{error}");
    assert!(error.message.contains(receiver.object.name()), "{error}");
    assert_eq!(
        store.try_get(key).unwrap_err().code,
        Code::NotFound,
        "a receipt was written for a dead receiver"
    );
}

/// A store whose asynchronous sets are held, unanswered, until released: a
/// store behind a cut link.
#[derive(Default)]
struct CutStore {
    store: MemoryStore,
    held: Mutex<Vec<(String, crate::kv::SetCallback)>>,
}

impl crate::kv::KeyValueStore for CutStore {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.store.get(key, timeout)
    }
    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.store.try_get(key)
    }
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(key, value)
    }
    fn set_async(&self, key: &str, _value: &[u8], done: crate::kv::SetCallback) {
        self.held.lock().push((key.to_string(), done));
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.store.delete(key)
    }
    fn async_get(
        &self,
        key: &str,
        unless: crate::kv::Unless,
        callback: crate::kv::GetCallback,
    ) -> Result<crate::kv::WaiterId> {
        self.store.async_get(key, unless, callback)
    }
    fn cancel_async_get(&self, key: &str, id: crate::kv::WaiterId) -> bool {
        self.store.cancel_async_get(key, id)
    }
    fn capabilities(&self) -> crate::kv::StoreCapabilities {
        self.store.capabilities()
    }
}

#[test]
fn a_failed_send_reports_its_failure_without_waiting_for_its_error_receipt() {
    let store = Arc::new(CutStore::default());
    let service = service_on(store.clone());
    let receiver = Receiver::spawn();
    let key = "crosshost/recv/test-cut/1/0";
    // A source of another size than the destination: the send fails.
    let mut short = source(None);
    short.spec.byte_size = LEN / 2;
    short.spec.dims = vec![(LEN / 2) as i64];
    let future = service
        .send_to_descriptor(short, &receiver.descriptor(key), "test send")
        .unwrap();
    let error = future
        .wait_timeout(Duration::from_secs(20))
        .expect("the send's failure is its outcome while its receipt is still unanswered")
        .unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument, "{error}");
    // The error receipt was still sent to the receiver, best effort.
    let held: Vec<_> = std::mem::take(&mut *store.held.lock());
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].0, key);
    for (_, done) in held {
        done(Err(crate::status::unavailable("the link was cut")));
    }
}
