//! `DestinationRegistry`: the receive destinations a network transport (the
//! TCP server, UCX) may write, by the descriptor's auth token. A token is
//! single-use: the first sender accepted claims (removes) it, so a second or
//! replayed sender is refused instead of writing a destination that may
//! already be published. Memory stays valid while a write is in flight
//! because the writer holds its own `Arc` clone.
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::status::{self, Result};
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::WritableDestination;

#[derive(Default)]
pub struct DestinationRegistry {
    destinations: Mutex<HashMap<AuthToken, Arc<dyn WritableDestination>>>,
}

impl DestinationRegistry {
    pub fn new() -> Arc<DestinationRegistry> {
        Arc::new(DestinationRegistry::default())
    }

    /// Lets senders presenting `token` write into `destination`.
    /// `ALREADY_EXISTS` if the token is registered already.
    pub fn register(
        &self,
        token: AuthToken,
        destination: Arc<dyn WritableDestination>,
    ) -> Result<()> {
        let mut destinations = self.destinations.lock();
        if destinations.contains_key(&token) {
            return Err(status::already_exists(
                "a destination is already registered under this auth token",
            ));
        }
        destinations.insert(token, destination);
        Ok(())
    }

    /// Stops accepting writes for `token` and returns its destination;
    /// `None` when a sender already claimed it (a write may be in progress
    /// and finishes into the still valid memory) or it was never registered.
    pub fn unregister(&self, token: &AuthToken) -> Option<Arc<dyn WritableDestination>> {
        self.destinations.lock().remove(token)
    }

    /// Takes the destination for the sender presenting `token`.
    pub fn claim(&self, token: &AuthToken) -> Option<Arc<dyn WritableDestination>> {
        // `AuthToken`'s equality is the constant-time compare, and the map's
        // hasher is randomly keyed, so lookup timing reveals nothing useful
        // about registered tokens.
        self.destinations.lock().remove(token)
    }

    /// Puts back a destination claimed by a request that wrote nothing.
    pub fn restore(&self, token: AuthToken, destination: Arc<dyn WritableDestination>) {
        self.destinations.lock().insert(token, destination);
    }

    pub fn len(&self) -> usize {
        self.destinations.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
