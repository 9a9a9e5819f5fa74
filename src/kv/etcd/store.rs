//! The store itself: the `KeyValueStore` calls as etcd RPCs, each bounded.
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, DeleteOptions, Identity, PutOptions, TlsOptions,
};
use tokio::sync::{watch, Semaphore};

use super::access::LoadedAccess;
use super::lease::Lease;
use super::runtime::{self, status_of};
use super::watches::{Watches, WriterOf};
use crate::kv::{
    get_by_waiting, GetCallback, KeyValueStore, SetCallback, StoreCapabilities, Unless, WaiterId,
};
use crate::status::{self, Result};

#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// gRPC endpoints, `http://host:port` or `https://host:port` (see
    /// `endpoints::parse`).
    pub endpoints: Vec<String>,
    /// TLS files, RBAC credentials and the key prefix (`access.rs`).
    pub access: LoadedAccess,
    /// The lease's TTL: how long a dead process's keys outlive it.
    pub lease_ttl: Duration,
    /// Bound on every call, and on how long a wait may go without a watch.
    pub call_timeout: Duration,
}

/// Puts and deletes one store has at etcd at once; the rest wait their turn
/// here, under the same call bound. Every write is a raft proposal, and etcd
/// renews a lease only once it has applied every proposal it had committed,
/// waiting 1 s at most ("waiting for the applied index took too long").
/// Unbounded, a 64-process all-to-all put 3,000-4,600 proposals ahead of
/// etcd's apply on a 2-core machine (a few hundred a second there): every
/// renewal was refused for longer than the lease's TTL, every lease lapsed,
/// every process was declared gone, and writes failed past etcd's own 7 s
/// timeout. Bounded, a job's backlog is at most this many per process and a
/// write waits in this queue rather than in etcd's; a job that starves etcd
/// for longer than the lease's TTL still needs a longer `etcd_lease_ttl_s`.
const MUTATIONS_IN_FLIGHT: usize = 4;

pub struct EtcdStore {
    client: Client,
    lease: Arc<Lease>,
    /// MUTATIONS_IN_FLIGHT permits: one per put or delete at etcd.
    mutations: Arc<Semaphore>,
    watches: Arc<Watches>,
    stop: watch::Sender<bool>,
    config: EtcdConfig,
    describe: String,
}

impl EtcdStore {
    /// Connects and takes this process's lease; UNAVAILABLE (naming the
    /// endpoints) when etcd cannot be reached within the call timeout.
    pub fn connect(config: EtcdConfig) -> Result<EtcdStore> {
        let describe = config.endpoints.join(",");
        let ttl_seconds = config.lease_ttl.as_secs().max(1) as i64;
        let timeout = config.call_timeout;
        let endpoints = config.endpoints.clone();
        let options = connect_options(&config.access, timeout, config.lease_ttl);
        let who = match &config.access.credentials {
            Some((user, _)) => format!(" as user {user:?}"),
            None => String::new(),
        };
        let prefix = config.access.key_prefix.clone();
        let (client, lease) = runtime::call("etcd connect", timeout, async move {
            let mut client = Client::connect(endpoints, Some(options))
                .await
                .map_err(|e| status_of("etcd connect", e))?;
            let lease = Lease::grant(&mut client, ttl_seconds).await?;
            if let Err(e) = check_access(&mut client, &prefix, lease.id()).await {
                let _ = client.lease_revoke(lease.id()).await;
                return Err(e);
            }
            Ok((client, lease))
        })
        .map_err(|e| {
            let hint = match e.code {
                status::Code::InvalidArgument | status::Code::Unauthenticated
                    if config.access.credentials.is_some() =>
                {
                    " (check etcd_user and the password in etcd_password_file)"
                }
                status::Code::PermissionDenied => {
                    " (the etcd user's role must grant readwrite on the key prefix \
                     etcd_key_prefix names, with --prefix=true)"
                }
                status::Code::Unavailable if config.access.tls.is_some() => {
                    " (over TLS: check that etcd_ca_file signed etcd's certificate, that the \
                     certificate names the host in kv_store, and, where etcd demands client \
                     certificates, etcd_cert_file and etcd_key_file)"
                }
                _ => "",
            };
            // etcd answers a wrong user or password with INVALID_ARGUMENT.
            let code = match e.code {
                status::Code::InvalidArgument if e.message.contains("authentication failed") => {
                    status::Code::Unauthenticated
                }
                code => code,
            };
            let verb = match code {
                status::Code::Unavailable | status::Code::DeadlineExceeded => "cannot reach",
                _ => "refused by",
            };
            status::Status::new(
                code,
                format!("{verb} etcd at {describe}{who}: {}{hint}", e.message),
            )
        })?;
        let lease = Arc::new(lease);
        let (stop, stopped) = watch::channel(false);
        runtime::handle().spawn(lease.clone().keep_alive(
            client.clone(),
            ttl_seconds,
            stopped.clone(),
        ));
        let watches = Watches::start(
            client.clone(),
            timeout,
            describe.clone(),
            &config.access.key_prefix,
            stopped,
        );
        log::info!(
            "etcd store at {describe}: lease {:x}, TTL {:?}",
            lease.id(),
            lease.ttl()
        );
        Ok(EtcdStore {
            client,
            lease,
            mutations: Arc::new(Semaphore::new(MUTATIONS_IN_FLIGHT)),
            watches,
            stop,
            config,
            describe,
        })
    }

    /// The TTL etcd granted (never below its own minimum).
    pub fn lease_ttl(&self) -> Duration {
        self.lease.ttl()
    }

    pub fn lease_id(&self) -> i64 {
        self.lease.id()
    }

    /// Watches the given processes' liveness keys (their session entries,
    /// all under `prefix`: one watch for them all); a process whose key
    /// disappears fails the waits on keys it writes.
    pub fn track_processes(
        &self,
        prefix: &str,
        entries: Vec<(u32, String)>,
        writer_of: WriterOf,
    ) -> Result<()> {
        let entries = entries
            .into_iter()
            .map(|(process, key)| (process, self.key(&key)))
            .collect();
        let key_prefix = self.config.access.key_prefix.clone();
        self.watches.track_processes(
            &self.key(prefix),
            entries,
            Box::new(move |key| writer_of(key.strip_prefix(key_prefix.as_str())?)),
        )
    }

    /// The key's name in etcd: under the job's key prefix.
    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.config.access.key_prefix)
    }

    /// Waits registered and not yet fired or cancelled.
    pub fn pending_waiters(&self) -> usize {
        self.watches.pending_waiters()
    }

    /// Watches open on the stream for those waits and the liveness keys.
    pub fn active_watches(&self) -> usize {
        self.watches.active_watches()
    }

    /// Waits not settled yet; 0 once every wait registered so far has
    /// either fired or is covered by a confirmed watch (never 0 while etcd
    /// is unreachable and a wait is pending).
    pub fn arms_in_flight(&self) -> usize {
        self.watches.arms_in_flight()
    }

    /// Puts and deletes this store has at etcd now (at most
    /// `MUTATIONS_IN_FLIGHT`; the others wait their turn).
    #[doc(hidden)]
    pub fn mutations_at_etcd(&self) -> usize {
        MUTATIONS_IN_FLIGHT - self.mutations.available_permits()
    }

    /// Whether the watch stream is up.
    pub fn stream_is_up(&self) -> bool {
        self.watches.stream_is_up()
    }

    /// Watch streams opened so far: 1 while the first one lasts, one more
    /// for each time it was lost and made again.
    #[doc(hidden)]
    pub fn watch_streams_opened(&self) -> u64 {
        self.watches.streams_opened()
    }

    /// Test hook: waits on `key` with a watch from `start_revision` and no
    /// Range first (how a test reaches the compaction path).
    #[doc(hidden)]
    pub fn async_get_watching_from(
        &self,
        key: &str,
        start_revision: i64,
        callback: GetCallback,
    ) -> Result<WaiterId> {
        self.watches
            .register_from_revision(&self.key(key), start_revision, callback)
    }

    fn put_op(&self, key: &str, value: &[u8]) -> impl std::future::Future<Output = Result<()>> {
        let client = self.client.clone();
        let (key, value) = (self.key(key), value.to_vec());
        let lease = self.lease.id();
        let what = format!("etcd put {key}");
        let mutations = self.mutations.clone();
        async move {
            let _turn = wait_turn(&mutations, &what).await?;
            runtime::while_overloaded(&what, || {
                let mut client = client.clone();
                let (key, value, what) = (key.clone(), value.clone(), what.clone());
                async move {
                    client
                        .put(key, value, Some(PutOptions::new().with_lease(lease)))
                        .await
                        .map(drop)
                        .map_err(|e| status_of(&what, e))
                }
            })
            .await
        }
    }

    fn delete_op(&self, key: &str) -> impl std::future::Future<Output = Result<()>> {
        let client = self.client.clone();
        let key = self.key(key);
        let what = format!("etcd delete {key}");
        let mutations = self.mutations.clone();
        async move {
            let _turn = wait_turn(&mutations, &what).await?;
            runtime::while_overloaded(&what, || {
                let mut client = client.clone();
                let (key, what) = (key.clone(), what.clone());
                async move {
                    client
                        .delete(key, None::<DeleteOptions>)
                        .await
                        .map(drop)
                        .map_err(|e| status_of(&what, e))
                }
            })
            .await
        }
    }

    /// Runs `op` on the runtime and reports to `done`, bounded.
    fn report(
        &self,
        what: String,
        op: impl std::future::Future<Output = Result<()>> + Send + 'static,
        done: SetCallback,
    ) {
        let timeout = self.config.call_timeout;
        runtime::handle().spawn(async move {
            let outcome = runtime::bounded(&what, timeout, op).await;
            runtime::deliver(move || done(outcome));
        });
    }
}

/// A permit to write to etcd, first come first served; held until the write
/// has its answer (retries of an overloaded etcd included).
async fn wait_turn<'a>(
    mutations: &'a Semaphore,
    what: &str,
) -> Result<tokio::sync::SemaphorePermit<'a>> {
    // Never closed: an error here is a bug, reported, not a panic.
    mutations
        .acquire()
        .await
        .map_err(|e| status::internal(format!("{what}: {e}")))
}

/// Writes, reads and deletes one key under the job's prefix, so that a user
/// whose role does not grant it fails creation, not the job's first transfer.
async fn check_access(client: &mut Client, prefix: &str, lease: i64) -> Result<()> {
    let key = format!("{prefix}crosshost/.access-check/{lease:x}");
    let what = format!("etcd access to the key prefix {prefix:?} ({key})");
    client
        .put(key.as_str(), "", Some(PutOptions::new().with_lease(lease)))
        .await
        .map_err(|e| status_of(&what, e))?;
    client
        .get(key.as_str(), None)
        .await
        .map_err(|e| status_of(&what, e))?;
    client
        .delete(key.as_str(), None::<DeleteOptions>)
        .await
        .map_err(|e| status_of(&what, e))?;
    Ok(())
}

/// How often the connection to etcd pings it while it hears nothing: etcd
/// closes a connection whose pings come more often than its
/// `--grpc-keepalive-min-time` (5 s unless set) with nothing sent back in
/// between (GOAWAY "too_many_pings" at the third), which is just when etcd is
/// too busy to answer. At 1 s a 64-host all-to-all on a 2-core machine had
/// every process's connection closed under it, thousands of times, and every
/// call and watch on it failed.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// How long a ping may go unanswered before the connection is taken for
/// dead: half the lease's TTL, at least 2 s. A starved etcd (or a starved
/// process) answers late, and a connection dropped for that fails every
/// call and wait on it (2 s did that to thousands of puts in the same run).
/// Calls keep their own bound (`kv_call_timeout_ms`).
fn keep_alive_timeout(lease_ttl: Duration) -> Duration {
    (lease_ttl / 2).max(Duration::from_secs(2))
}

/// Keep-alives, bounds, and the access options: TLS and RBAC credentials.
fn connect_options(
    access: &LoadedAccess,
    timeout: Duration,
    lease_ttl: Duration,
) -> ConnectOptions {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(timeout.min(Duration::from_secs(5)))
        .with_keep_alive(KEEP_ALIVE_INTERVAL, keep_alive_timeout(lease_ttl))
        .with_keep_alive_while_idle(true);
    if let Some(tls) = &access.tls {
        let mut config = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(config);
    }
    if let Some((user, password)) = &access.credentials {
        // etcd's simple tokens expire (--auth-token-ttl, 5 minutes by
        // default): a long job renews its token instead of failing.
        options = options
            .with_user(user.clone(), password.expose().to_string())
            .with_auto_token_refresh(true);
    }
    options
}

impl KeyValueStore for EtcdStore {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        get_by_waiting(self, key, timeout, || {
            status::deadline_exceeded(format!("etcd get {key}: not present within {timeout:?}"))
        })
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let mut client = self.client.clone();
        let owned = self.key(key);
        let answer = runtime::call(
            &format!("etcd range {key}"),
            self.config.call_timeout,
            async move {
                client
                    .get(owned.as_str(), None)
                    .await
                    .map_err(|e| status_of(&format!("etcd range {owned}"), e))
            },
        )?;
        answer
            .kvs()
            .first()
            .map(|kv| kv.value().to_vec())
            .ok_or_else(|| status::not_found(format!("etcd: no key {key}")))
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        runtime::call(
            &format!("etcd put {key}"),
            self.config.call_timeout,
            self.put_op(key, value),
        )
    }

    fn set_async(&self, key: &str, value: &[u8], done: SetCallback) {
        self.report(format!("etcd put {key}"), self.put_op(key, value), done);
    }

    fn delete(&self, key: &str) -> Result<()> {
        runtime::call(
            &format!("etcd delete {key}"),
            self.config.call_timeout,
            self.delete_op(key),
        )
    }

    fn delete_async(&self, key: &str, done: SetCallback) {
        self.report(format!("etcd delete {key}"), self.delete_op(key), done);
    }

    fn async_get(&self, key: &str, unless: Unless, callback: GetCallback) -> Result<WaiterId> {
        self.watches.register(&self.key(key), unless, callback)
    }

    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool {
        self.watches.cancel(&self.key(key), id)
    }

    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities {
            can_delete: true,
            can_overwrite: true,
        }
    }
}

impl Drop for EtcdStore {
    /// Revokes the lease (every key this store wrote goes with it) within a
    /// short bound, so destroy returns promptly even with etcd gone.
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.watches.close();
        let mut client = self.client.clone();
        let id = self.lease.id();
        let bound = self.config.call_timeout.min(Duration::from_secs(1));
        if let Err(e) = runtime::call("etcd lease revoke", bound, async move {
            client
                .lease_revoke(id)
                .await
                .map(drop)
                .map_err(|e| status_of("etcd lease revoke", e))
        }) {
            log::warn!(
                "etcd store at {}: {e}; its keys expire with the lease's TTL ({:?})",
                self.describe,
                self.lease.ttl()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unanswered_ping_drops_the_connection_after_half_the_lease_never_before_2_s() {
        assert_eq!(
            keep_alive_timeout(Duration::from_secs(10)),
            Duration::from_secs(5)
        );
        assert_eq!(
            keep_alive_timeout(Duration::from_secs(60)),
            Duration::from_secs(30)
        );
        assert_eq!(
            keep_alive_timeout(Duration::from_secs(2)),
            Duration::from_secs(2)
        );
    }
}
