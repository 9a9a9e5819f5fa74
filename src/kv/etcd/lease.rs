//! The process's one lease: every key this store writes is attached to it,
//! a keep-alive task renews it every third of its TTL, and revoking it (at
//! destroy) or its expiry (the process died) removes all of them at once.
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;

use super::runtime::status_of;
use crate::status::Result;

pub(super) struct Lease {
    id: AtomicI64,
    /// The TTL etcd granted (it raises requests below its minimum).
    ttl: Duration,
}

impl Lease {
    pub(super) async fn grant(client: &mut Client, ttl_seconds: i64) -> Result<Lease> {
        let granted = client
            .lease_grant(ttl_seconds, None)
            .await
            .map_err(|e| status_of("etcd lease grant", e))?;
        Ok(Lease {
            id: AtomicI64::new(granted.id()),
            ttl: Duration::from_secs(granted.ttl().max(1) as u64),
        })
    }

    pub(super) fn id(&self) -> i64 {
        self.id.load(Ordering::Acquire)
    }

    pub(super) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Renews the lease until `stop` changes. A lease found expired (the
    /// process was cut off from etcd longer than its TTL, so its keys are
    /// already gone and its peers consider it dead) is replaced, loudly.
    pub(super) async fn keep_alive(
        self: Arc<Self>,
        mut client: Client,
        ttl_seconds: i64,
        mut stop: watch::Receiver<bool>,
    ) {
        let period = (self.ttl / 3).max(Duration::from_millis(200));
        loop {
            let id = self.id();
            let renewed = tokio::select! {
                _ = stop.changed() => return,
                r = self.renew_until_broken(&mut client, id, period) => r,
            };
            if renewed == Renewal::Expired {
                log::error!(
                    "etcd lease {id:x} expired: this process was cut off from etcd for more than \
                     {:?}; its keys are gone and its peers treat it as dead; granting a new lease",
                    self.ttl
                );
                match Lease::grant(&mut client, ttl_seconds).await {
                    Ok(fresh) => self.id.store(fresh.id(), Ordering::Release),
                    Err(e) => log::warn!("etcd: {e}"),
                }
            }
            tokio::select! {
                _ = stop.changed() => return,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    async fn renew_until_broken(&self, client: &mut Client, id: i64, period: Duration) -> Renewal {
        let (mut keeper, mut responses) = match client.lease_keep_alive(id).await {
            Ok(pair) => pair,
            Err(e) => {
                log::debug!("etcd lease keep-alive stream: {e}");
                return opening_refused(&e);
            }
        };
        loop {
            if let Err(e) = keeper.keep_alive().await {
                log::debug!("etcd lease keep-alive: {e}");
                return Renewal::Broken;
            }
            match tokio::time::timeout(period.max(Duration::from_secs(1)), responses.message())
                .await
            {
                Ok(Ok(Some(answer))) if answer.ttl() <= 0 => return Renewal::Expired,
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => return Renewal::Broken,
            }
            tokio::time::sleep(period).await;
        }
    }
}

#[derive(PartialEq, Eq, Debug)]
enum Renewal {
    Broken,
    Expired,
}

/// What a keep-alive stream that could not be opened says about the lease.
/// etcd-client opens the stream with a first renewal and answers etcd's "no
/// such lease" to it (TTL 0) with this error, not with a response: taken for
/// a broken stream, a lease that expired while the stream was down (etcd
/// refuses renewals while its apply queue lags, "waiting for the applied
/// index took too long", and each refusal ends the stream) was asked after
/// five times a second for the rest of the process's life, never replaced,
/// and every write under it failed with "requested lease not found".
fn opening_refused(error: &etcd_client::Error) -> Renewal {
    match error {
        etcd_client::Error::LeaseKeepAliveError(why) if why == "lease not found" => {
            Renewal::Expired
        }
        _ => Renewal::Broken,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_refused_for_want_of_the_lease_means_expired_anything_else_broken() {
        // The error etcd-client makes of a first response with TTL 0
        // (rpc/lease.rs, LeaseClient::keep_alive).
        let gone = etcd_client::Error::LeaseKeepAliveError("lease not found".into());
        assert_eq!(opening_refused(&gone), Renewal::Expired);
        // Its sender closing, or the transport failing: the stream, not the lease.
        let closed = etcd_client::Error::LeaseKeepAliveError("channel closed".into());
        assert_eq!(opening_refused(&closed), Renewal::Broken);
        let down = etcd_client::Error::WatchError("failed to create lease keeper".into());
        assert_eq!(opening_refused(&down), Renewal::Broken);
    }
}
