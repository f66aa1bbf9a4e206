//! Exact mode: putting a replica in it (its engine's KV events say what it
//! holds) and back in approximate mode, and applying those events.

use super::exact::Exact;
use super::{Event, EventError, KvIndex, Replica, Slot};
use crate::hash::BlockHash;
use crate::host::{HostHolders, HostOrder};

impl KvIndex {
    /// Puts a replica in exact mode, empty: its engine's cache is known to
    /// hold nothing (it just started, or cleared it), and its events from
    /// now on, of blocks of `block_size` tokens, say what it holds. Requests
    /// recorded before are forgotten. False when the slot is unknown.
    pub fn enter_exact(&self, slot: Slot, block_size: usize) -> bool {
        let mut replicas = self.lock();
        let Some(entry) = replicas.get_mut(&slot) else { return false };
        let mut fresh = self.new_replica(entry.shadow.cap(), entry.host_blocks);
        fresh.exact = Some(Exact::new(block_size, entry.shadow.cap(), entry.host_blocks, &self.host));
        let old = std::mem::replace(entry, fresh);
        self.drop_all(slot, old);
        true
    }

    /// Puts a replica in approximate mode. With `keep`, its shadow starts
    /// from what the engine was last known to hold (deepest blocks oldest,
    /// as the engine would evict them); without, from nothing (its engine
    /// restarted). Requests recorded before are forgotten. A replica
    /// already approximate is left alone.
    pub fn leave_exact(&self, slot: Slot, keep: bool) {
        let mut replicas = self.lock();
        let Some(entry) = replicas.get_mut(&slot) else { return };
        let Some(exact) = &entry.exact else { return };
        let mut fresh = self.new_replica(entry.shadow.cap(), entry.host_blocks);
        if keep {
            for h in exact.deepest_first() {
                if !fresh.shadow.contains(h) && fresh.shadow.push(h).is_err() {
                    break;
                }
            }
        }
        let old = std::mem::replace(entry, fresh);
        self.drop_all(slot, old);
        for h in replicas.get(&slot).into_iter().flat_map(|r| r.shadow.blocks()) {
            self.holders.add(h, slot);
        }
    }

    /// Applies one of the engine's KV events to a replica in exact mode.
    /// An error leaves the replica's view untrustworthy: the caller puts it
    /// in approximate mode.
    pub fn apply(&self, slot: Slot, event: &Event<'_>) -> Result<(), EventError> {
        let mut replicas = self.lock();
        let rep = replicas.get_mut(&slot).ok_or(EventError::UnknownReplica(slot))?;
        let exact = rep.exact.as_mut().ok_or(EventError::NotExact(slot))?;
        let mut changes = Vec::new();
        let applied = exact.apply(event, &mut changes);
        let (admitted, grown) = (exact.take_admitted(), exact.take_grown());
        if !admitted.is_empty() {
            rep.host_admitted_by_events(admitted);
        }
        if !grown.is_empty() {
            rep.filled_by_events(&grown);
        }
        self.present(slot, &changes);
        applied
    }

    /// Whether a replica is in exact mode.
    pub fn is_exact(&self, slot: Slot) -> bool {
        self.lock().get(&slot).is_some_and(|r| r.exact.is_some())
    }

    /// For each of `at` (a slot, and its GPU prefix of `keys` in blocks), the
    /// blocks after that prefix its engine holds in offload tiers,
    /// consecutive: (in host memory, elsewhere). Replicas in exact mode know
    /// them from their events; in approximate mode, a replica whose host
    /// tier is configured from the requests sent there; others hold none.
    pub fn offloaded(&self, keys: &[BlockHash], at: &[(Slot, usize)]) -> Vec<(usize, usize)> {
        let replicas = self.lock();
        let found: Vec<Option<&Replica>> = at.iter().map(|(slot, _)| replicas.get(slot)).collect();
        fn tier(r: &Replica) -> Option<&HostOrder> {
            match r {
                Replica { exact: Some(exact), .. } => Some(exact.host()),
                Replica { host, .. } => host.as_ref(),
            }
        }
        // Every tier's run at once, one probe a block (crate::host).
        let (of, wanted): (Vec<usize>, Vec<_>) =
            found.iter().zip(at).enumerate().filter_map(|(c, (r, (_, from)))| Some((c, (tier((*r)?)?, *from)))).unzip();
        let runs = HostHolders::lock(&self.host).runs(keys, &wanted);
        let mut out = vec![(0, 0); at.len()];
        for (c, run) in of.into_iter().zip(runs) {
            out[c].0 = run;
        }
        for ((r, (_, from)), (host, elsewhere)) in found.iter().zip(at).zip(&mut out) {
            if let Some(Replica { exact: Some(exact), .. }) = r
                && *from < keys.len()
            {
                *elsewhere = exact.elsewhere(&keys[from + *host..]);
            }
        }
        out
    }

    /// Blocks an exact replica's engine holds in each tier: medium, group, blocks.
    pub fn exact_tiers(&self, slot: Slot) -> Vec<(String, u32, usize)> {
        self.lock().get(&slot).and_then(|r| r.exact.as_ref()).map(Exact::tiers).unwrap_or_default()
    }
}
