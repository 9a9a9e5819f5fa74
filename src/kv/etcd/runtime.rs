//! The async runtime under the etcd client, and the two bridges between it
//! and the store's synchronous callers: a bounded call (spawn, then wait on
//! a channel, so it works from any thread, a runtime thread included) and
//! callback delivery on the blocking pool (a store callback may do real
//! work, such as a send's copy, and must never stall the watch stream).
use std::future::Future;
use std::time::Duration;

use once_cell::sync::Lazy;

use crate::status::{self, Code, Result, Status};

/// One runtime per process, shared by every etcd store: it is never torn
/// down, so a store dropped on any thread has nothing to join.
static RUNTIME: Lazy<tokio::runtime::Runtime> = Lazy::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("crosshost-etcd")
        .enable_all()
        .build()
        .expect("building the etcd client's tokio runtime")
});

pub(super) fn handle() -> tokio::runtime::Handle {
    RUNTIME.handle().clone()
}

fn no_answer(what: &str, timeout: Duration) -> Status {
    status::deadline_exceeded(format!("{what}: no answer from etcd within {timeout:?}"))
}

/// `op`, or DEADLINE_EXCEEDED naming `what` once `timeout` has passed.
pub(super) async fn bounded<T>(
    what: &str,
    timeout: Duration,
    op: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(timeout, op)
        .await
        .unwrap_or_else(|_| Err(no_answer(what, timeout)))
}

/// `op`, made again after a short backoff for as long as etcd answers that
/// it is overloaded ("etcdserver: too many requests", RESOURCE_EXHAUSTED:
/// its proposals queue is full, which a start-up storm of a large job
/// reaches); the caller's bound ends the retries. Only for idempotent
/// calls (a put of one value, a delete).
pub(super) async fn while_overloaded<T, F, Fut>(what: &str, mut op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut backoff = Duration::from_millis(10);
    loop {
        match op().await {
            Err(e) if e.code == crate::status::Code::ResourceExhausted => {
                log::debug!(
                    "{what}: etcd is overloaded ({}); again in {backoff:?}",
                    e.message
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            outcome => return outcome,
        }
    }
}

/// Runs `op` on the runtime and waits at most `timeout` for it.
pub(super) fn call<T, F>(what: &str, timeout: Duration, op: F) -> Result<T>
where
    T: Send + 'static,
    F: Future<Output = Result<T>> + Send + 'static,
{
    let (done, result) = crossbeam_channel::bounded(1);
    let owned = what.to_string();
    let task = RUNTIME.spawn(async move {
        let _ = done.send(bounded(&owned, timeout, op).await);
    });
    // The task's own bound answers first; this one covers a runtime that
    // never ran it.
    result
        .recv_timeout(timeout + Duration::from_millis(200))
        .unwrap_or_else(|_| {
            task.abort();
            Err(no_answer(what, timeout))
        })
}

/// Runs a store callback off the runtime's worker threads.
pub(super) fn deliver(callback: impl FnOnce() + Send + 'static) {
    RUNTIME.spawn_blocking(callback);
}

/// An etcd client error as a status: gRPC codes are PJRT's codes; a
/// transport failure means the server could not be reached.
pub(super) fn status_of(what: &str, error: etcd_client::Error) -> Status {
    let code = match &error {
        // The client's own transport failed (the server went away mid-call,
        // or closed the connection in the TLS handshake: tonic says
        // CANCELLED then, though nobody cancelled anything).
        etcd_client::Error::GRpcStatus(s)
            if matches!(
                Code::from_raw(s.code() as i32),
                Code::Unknown | Code::Cancelled
            ) && std::error::Error::source(s).is_some() =>
        {
            Code::Unavailable
        }
        etcd_client::Error::GRpcStatus(s) => code_of(Code::from_raw(s.code() as i32), s.message()),
        etcd_client::Error::InvalidArgs(_) | etcd_client::Error::InvalidUri(_) => {
            Code::InvalidArgument
        }
        _ => Code::Unavailable,
    };
    Status::new(code, format!("{what}: {error}"))
}

/// etcd's answer as PJRT's code. etcd 3.4 sends its "too many requests"
/// (its apply queue more than 5,000 entries behind, which a large job's
/// transfer storm reaches) as UNKNOWN: its error table maps it to the
/// client-side `rpctypes.ErrTooManyRequests`, which is no gRPC status, where
/// every other error gets its `ErrGRPC…` twin. Taken at its code, a put or a
/// delete failed at once instead of being asked again (`while_overloaded`).
fn code_of(code: Code, message: &str) -> Code {
    match code {
        Code::Unknown if message == "etcdserver: too many requests" => Code::ResourceExhausted,
        code => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn etcd_3_4s_too_many_requests_is_overload_whatever_its_code() {
        // As etcd 3.4.23 sends it (a 64-host all-to-all on the bed met it).
        let seen = code_of(Code::Unknown, "etcdserver: too many requests");
        assert_eq!(seen, Code::ResourceExhausted);
        // As etcd 3.5 sends it, and anything else UNKNOWN, unchanged.
        let later = code_of(Code::ResourceExhausted, "etcdserver: too many requests");
        assert_eq!(later, Code::ResourceExhausted);
        assert_eq!(code_of(Code::Unknown, "etcdserver: other"), Code::Unknown);
        assert_eq!(
            code_of(Code::Unavailable, "etcdserver: request timed out"),
            Code::Unavailable
        );
    }

    #[test]
    fn an_overloaded_etcd_is_asked_again_and_other_errors_pass_through() {
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        let outcome = call("put", Duration::from_secs(5), async move {
            while_overloaded("put", || {
                let n = counted.fetch_add(1, Ordering::AcqRel);
                async move {
                    if n < 3 {
                        Err(status::resource_exhausted("etcdserver: too many requests"))
                    } else {
                        Ok(n)
                    }
                }
            })
            .await
        });
        assert_eq!(outcome.unwrap(), 3);
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        let outcome: Result<()> = call("put", Duration::from_secs(5), async move {
            while_overloaded("put", || {
                counted.fetch_add(1, Ordering::AcqRel);
                async { Err(status::unavailable("gone")) }
            })
            .await
        });
        assert_eq!(outcome.unwrap_err().code, Code::Unavailable);
        assert_eq!(tries.load(Ordering::Acquire), 1);
        // Overloaded for longer than the caller's bound: its deadline ends it.
        let outcome: Result<()> = call("put", Duration::from_millis(100), async move {
            while_overloaded("put", || async { Err(status::resource_exhausted("busy")) }).await
        });
        assert_eq!(outcome.unwrap_err().code, Code::DeadlineExceeded);
    }
}
