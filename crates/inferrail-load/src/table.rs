//! The latest load snapshot of every replica, shared by whoever fills it (the
//! scraper, or the router following the sidecar) and the router's decision core.
//!
//! The table keeps whatever it was given; deciding that a snapshot is too old
//! to use is the reader's job ([`Snapshot::age`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::page::EngineLoad;

/// One replica's load as read at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// When the scrape that read it completed.
    pub at: Instant,
    /// What the engine said.
    pub load: EngineLoad,
}

impl Snapshot {
    /// How old the snapshot is at `now` (zero if `now` is earlier).
    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.at)
    }
}

/// A concurrent map from replica id to its latest snapshot; clones share it.
#[derive(Debug, Clone, Default)]
pub struct LoadTable {
    map: Arc<papaya::HashMap<String, Snapshot>>,
}

impl LoadTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The latest snapshot of `id`, however old.
    pub fn get(&self, id: &str) -> Option<Snapshot> {
        self.map.pin().get(id).cloned()
    }

    /// Records `snapshot` as `id`'s latest, unless the table holds a newer one.
    pub fn insert(&self, id: &str, snapshot: Snapshot) {
        let map = self.map.pin();
        map.update_or_insert_with(
            id.to_string(),
            |old| if old.at > snapshot.at { old.clone() } else { snapshot.clone() },
            || snapshot.clone(),
        );
    }

    /// Forgets `id` (it left the fleet).
    pub fn remove(&self, id: &str) {
        self.map.pin().remove(id);
    }

    /// The ids the table holds, in no order.
    pub fn ids(&self) -> Vec<String> {
        self.map.pin().keys().cloned().collect()
    }
}
