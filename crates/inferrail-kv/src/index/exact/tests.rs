//! Exact mode: the index fed by engine events, against the router's own hashes of the same tokens and a naive model.

use super::super::tests::wait;
use super::super::{Event, EventError, KvIndex, Pace, Recorded, Slot, Stored, Tier, Wait};
use crate::hash::{BlockHash, block_hashes, salt};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

const BS: usize = 4;

fn tokens(blocks: usize, variant: u32) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| t * 7 + variant * 1000).collect()
}

/// An engine hash for a router hash: any stable renaming will do.
fn engine(h: BlockHash) -> u64 {
    (h as u64) ^ ((h >> 64) as u64).rotate_left(17) ^ 0x5555
}

fn stored<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u32], seed: BlockHash, tier: Tier<'a>) -> Event<'a> {
    Event::Stored(Stored { hashes, parent, tokens, block_size: BS, seed, tier })
}

/// An exact index with one replica at slot 0 and another, approximate, at slot 1.
fn index() -> KvIndex {
    sized(64)
}

/// The same, with caches of `blocks` blocks.
fn sized(blocks: usize) -> KvIndex {
    let index = KvIndex::new();
    index.add_replica(0, blocks);
    index.add_replica(1, blocks);
    assert!(index.enter_exact(0, BS));
    index
}

/// A request for `blocks` blocks of `variant` that the engine ran and stored, now over.
fn ran(index: &KvIndex, seed: BlockHash, variant: u32, blocks: usize) {
    let rec = index.record(0, &block_hashes(seed, &tokens(blocks, variant), BS), blocks, 0, 1, false, None);
    store(index, seed, variant, 0, blocks, Tier::ROUTING).unwrap();
    index.complete(&rec, Duration::ZERO);
}

/// Stores `blocks` blocks of `variant`'s tokens at slot 0, starting after `from` blocks already stored.
fn store(index: &KvIndex, seed: BlockHash, variant: u32, from: usize, blocks: usize, tier: Tier<'_>) -> Result<(), EventError> {
    let t = tokens(blocks, variant);
    let router = block_hashes(seed, &t, BS);
    let hashes: Vec<u64> = router[from..].iter().map(|&h| engine(h)).collect();
    let parent = from.checked_sub(1).map(|p| engine(router[p]));
    index.apply(0, &stored(&hashes, parent, &t[from * BS..], seed, tier))
}

/// The engine stored `keys` in host memory at slot 0, one placeholder event each.
fn to_host(index: &KvIndex, seed: BlockHash, keys: &[BlockHash]) {
    for &h in keys {
        let placeholder = Stored { hashes: &[engine(h)], parent: None, tokens: &[], block_size: 0, seed, tier: Tier::HOST };
        index.apply(0, &Event::Stored(placeholder)).unwrap();
    }
}

fn matched(index: &KvIndex, seed: BlockHash, variant: u32, blocks: usize) -> usize {
    index.matched(&block_hashes(seed, &tokens(blocks, variant), BS), &[0])[0]
}

#[test]
fn stored_blocks_are_found_by_the_routers_own_hashes_and_removals_apply_at_once() {
    let index = index();
    let seed = salt(&["m", ""]);
    store(&index, seed, 0, 0, 3, Tier::ROUTING).unwrap();
    store(&index, seed, 0, 3, 5, Tier::ROUTING).unwrap();
    assert_eq!(matched(&index, seed, 0, 8), 5, "the second event continues the chain from its parent");
    assert_eq!(index.matched(&block_hashes(seed, &tokens(8, 0), BS), &[1]), [0], "another replica holds nothing");
    let tail = [engine(block_hashes(seed, &tokens(5, 0), BS)[4])];
    index.apply(0, &Event::Removed { hashes: &tail, tier: Tier::ROUTING }).unwrap();
    assert_eq!(matched(&index, seed, 0, 8), 4);
    index.apply(0, &Event::Cleared).unwrap();
    assert_eq!(matched(&index, seed, 0, 8), 0);
    assert!(index.is_exact(0), "a cleared cache is still known exactly");
    store(&index, seed, 0, 0, 2, Tier::ROUTING).unwrap();
    assert_eq!(matched(&index, seed, 0, 8), 2);
}

#[test]
fn adapters_and_media_are_kept_apart() {
    let index = index();
    let (base, lora) = (salt(&["m", ""]), salt(&["adapter", ""]));
    store(&index, lora, 0, 0, 3, Tier::ROUTING).unwrap();
    assert_eq!(matched(&index, base, 0, 3), 0, "an adapter's blocks are not the base model's");
    assert_eq!(matched(&index, lora, 0, 3), 3);
    let cpu = Tier { medium: "CPU", group: 0 };
    store(&index, base, 1, 0, 4, cpu).unwrap();
    assert_eq!(matched(&index, base, 1, 4), 0, "offloaded blocks do not count as GPU blocks");
    assert_eq!(index.exact_tiers(0), [("GPU".to_owned(), 0, 3), ("CPU".to_owned(), 0, 4)]);
    // An offload tier may continue a chain whose parent is on the GPU; the GPU tier may not continue one offloaded.
    store(&index, lora, 0, 3, 4, cpu).unwrap();
    assert_eq!(
        store(&index, base, 1, 4, 5, Tier::ROUTING),
        Err(EventError::UnknownParent(engine(block_hashes(base, &tokens(4, 1), BS)[3])))
    );
}

#[test]
fn offloaded_blocks_continue_the_gpu_prefix_from_placeholders_or_their_tokens() {
    let index = index();
    let seed = salt(&["m", ""]);
    let cpu = Tier { medium: "CPU", group: 0 };
    let router = block_hashes(seed, &tokens(6, 0), BS);
    let keys = |from: usize| index.offloaded(&router, &[(0, from), (1, from)]);
    // The GPU stored six blocks; placeholders (a hash, nothing else) say four reached the host.
    store(&index, seed, 0, 0, 6, Tier::ROUTING).unwrap();
    for &h in &router[..4] {
        let hash = [engine(h)];
        index.apply(0, &Event::Stored(Stored { hashes: &hash, parent: None, tokens: &[], block_size: 0, seed, tier: cpu })).unwrap();
    }
    // The GPU evicts from the tail: the last four go, the host still has the first four.
    for k in (2..6).rev() {
        index.apply(0, &Event::Removed { hashes: &[engine(router[k])], tier: Tier::ROUTING }).unwrap();
    }
    assert_eq!(matched(&index, seed, 0, 6), 2);
    assert_eq!(keys(2), [(2, 0), (0, 0)], "past the GPU's two, the host's next two; an approximate replica knows none");
    assert_eq!(keys(0), [(4, 0), (0, 0)]);
    // A block the host evicts before its parent ends the run there, and is no error.
    index.apply(0, &Event::Removed { hashes: &[engine(router[1])], tier: cpu }).unwrap();
    assert_eq!(keys(0), [(1, 0), (0, 0)]);
    assert_eq!(keys(2), [(2, 0), (0, 0)]);
    // Self-describing events name blocks by their tokens when the GPU never held them;
    // a storage tier counts apart, after the host.
    let disk = Tier { medium: "STORAGE", group: 0 };
    let t = tokens(6, 0);
    let tail: Vec<u64> = router[4..].iter().map(|&h| engine(h)).collect();
    index.apply(0, &stored(&tail, Some(engine(router[3])), &t[4 * BS..], seed, disk)).unwrap();
    assert_eq!(keys(2), [(2, 2), (0, 0)]);
    // A placeholder for a block no tier knows, and its removal, change nothing.
    index.apply(0, &Event::Stored(Stored { hashes: &[77], parent: None, tokens: &[], block_size: 0, seed, tier: cpu })).unwrap();
    index.apply(0, &Event::Removed { hashes: &[77, 78], tier: cpu }).unwrap();
    // Clearing the GPU leaves the host's blocks.
    index.apply(0, &Event::Cleared).unwrap();
    assert_eq!(keys(0), [(1, 0), (0, 0)]);
    assert!(index.is_exact(0));
}

#[test]
fn requests_sent_and_not_yet_admitted_will_evict_the_least_recent_host_blocks() {
    let index = index();
    index.set_host(0, Some(4));
    let seed = salt(&["m", ""]);
    let cpu = Tier::HOST;
    let (a, b) = (block_hashes(seed, &tokens(4, 0), BS), block_hashes(seed, &tokens(4, 1), BS));
    store(&index, seed, 0, 0, 4, Tier::ROUTING).unwrap();
    to_host(&index, seed, &a);
    index.apply(0, &Event::Cleared).unwrap();
    assert_eq!(index.offloaded(&a, &[(0, 0)]), [(4, 0)]);
    // A request for b is sent: when admitted it stores b's four blocks, evicting a's.
    let rec = index.record(0, &b, 4, 0, 1, false, None);
    assert_eq!(index.offloaded(&a, &[(0, 0)]), [(0, 0)], "a's blocks are as good as gone");
    // The engine admits it: b stored, a evicted, as foretold.
    store(&index, seed, 1, 0, 4, Tier::ROUTING).unwrap();
    to_host(&index, seed, &b);
    let gone: Vec<u64> = a.iter().rev().map(|&h| engine(h)).collect();
    index.apply(0, &Event::Removed { hashes: &gone, tier: cpu }).unwrap();
    assert_eq!(index.offloaded(&a, &[(0, 0)]), [(0, 0)]);
    assert_eq!(index.offloaded(&b, &[(0, 0)]), [(4, 0)]);
    index.complete(&rec, Duration::ZERO);
    assert_eq!(index.offloaded(&b, &[(0, 2)]), [(2, 0)]);
}

/// A request's blocks are to come in host memory until the engine admits
/// it, which its blocks stored on the GPU tell, or, when the GPU held its
/// prompt whole, its stores in host memory: the engine offers them then,
/// once. Evicted while it runs, they are not counted to come again, unless
/// another request not yet admitted expects them.
#[test]
fn a_running_requests_blocks_evicted_from_host_memory_are_not_to_come_again() {
    for gpu_held in [false, true] {
        let index = index();
        index.set_host(0, Some(4));
        let seed = salt(&["m", ""]);
        let (x, b, e) =
            (block_hashes(seed, &tokens(2, 0), BS), block_hashes(seed, &tokens(2, 1), BS), block_hashes(seed, &tokens(2, 2), BS));
        store(&index, seed, 0, 0, 2, Tier::ROUTING).unwrap();
        to_host(&index, seed, &x);
        if gpu_held {
            store(&index, seed, 1, 0, 2, Tier::ROUTING).unwrap();
        }
        let rec = index.record(0, &b, 1, 0, 1, false, None);
        // Admitted: b is stored on the GPU (unless held), then in host memory.
        if !gpu_held {
            store(&index, seed, 1, 0, 2, Tier::ROUTING).unwrap();
        }
        to_host(&index, seed, &b);
        // While it runs, host memory evicts b and stores e: full again.
        let gone: Vec<u64> = b.iter().map(|&h| engine(h)).collect();
        index.apply(0, &Event::Removed { hashes: &gone, tier: Tier::HOST }).unwrap();
        store(&index, seed, 2, 0, 2, Tier::ROUTING).unwrap();
        to_host(&index, seed, &e);
        assert_eq!(index.offloaded(&x, &[(0, 0)]), [(2, 0)], "nothing is to come: x stays ({gpu_held})");
        // A request for b not yet admitted will store it again, evicting x.
        let again = index.record(0, &b, 1, 0, 1, false, None);
        assert_eq!(index.offloaded(&x, &[(0, 0)]), [(0, 0)]);
        index.complete(&again, Duration::ZERO);
        index.complete(&rec, Duration::ZERO);
        assert_eq!(index.offloaded(&x, &[(0, 0)]), [(2, 0)]);
    }
}

/// A request whose GPU prefix loses its tail before the engine admits it
/// loads the tail from host memory, and when it ends the engine refreshes
/// there only what it loaded (ADR 0062): the index learns its GPU hit from
/// the blocks stored since it was sent, not from what it foresaw then.
#[test]
fn a_request_that_loaded_its_tail_refreshes_only_that_in_host_memory() {
    let index = index();
    index.set_host(0, Some(6));
    let seed = salt(&["m", ""]);
    let (a, b, c) = (block_hashes(seed, &tokens(4, 0), BS), block_hashes(seed, &tokens(2, 1), BS), block_hashes(seed, &tokens(2, 2), BS));
    // a in the GPU and in host memory, then b there too: a least recent.
    store(&index, seed, 0, 0, 4, Tier::ROUTING).unwrap();
    to_host(&index, seed, &a);
    store(&index, seed, 1, 0, 2, Tier::ROUTING).unwrap();
    to_host(&index, seed, &b);
    // Sent for a, all of it in the GPU; before it is admitted the GPU evicts
    // a's last two blocks, and the engine loads them back from host memory.
    let rec = index.record(0, &a, 3, 0, 1, false, None);
    let tail: Vec<u64> = a[2..].iter().rev().map(|&h| engine(h)).collect();
    index.apply(0, &Event::Removed { hashes: &tail, tier: Tier::ROUTING }).unwrap();
    store(&index, seed, 0, 2, 4, Tier::ROUTING).unwrap();
    index.complete(&rec, Duration::ZERO);
    // a's last two are now the most recent in host memory, its first two the
    // least: a request storing two blocks there evicts a's head, not b.
    let _coming = index.record(0, &c, 2, 0, 1, false, None);
    assert_eq!(index.offloaded(&a, &[(0, 0)]), [(0, 0)], "a's first block goes first");
    assert_eq!(index.offloaded(&b, &[(0, 0)]), [(2, 0)], "b was used after a's head");
}

#[test]
fn an_approximate_replica_with_a_host_tier_keeps_the_prompts_sent_there() {
    let index = index();
    let seed = salt(&["m", ""]);
    let (a, b) = (block_hashes(seed, &tokens(4, 0), BS), block_hashes(seed, &tokens(4, 1), BS));
    let pace = Pace { lead: 0.0, span: 1.0 };
    let rec = index.record(1, &a, 4, 0, 1, false, None);
    index.complete(&rec, Duration::ZERO);
    assert_eq!(index.offloaded(&a, &[(1, 0)]), [(0, 0)], "no host tier configured");
    index.set_host(1, Some(6));
    let rec = index.record(1, &a, 4, 0, 1, false, None);
    assert_eq!(index.offloaded(&a, &[(1, 0), (1, 3)]), [(4, 0), (1, 0)], "stored once the shadow admits it");
    index.decoding(&rec, Duration::from_secs(1), pace);
    assert_eq!(index.offloaded(&a, &[(1, 0), (1, 3)]), [(4, 0), (1, 0)]);
    // Six blocks: b's four push out a's first two (stored first, the least
    // recent while a runs, ADR 0062).
    let rec_b = index.record(1, &b, 4, 0, 1, false, None);
    assert_eq!(index.offloaded(&a, &[(1, 0), (1, 2)]), [(0, 0), (2, 0)]);
    index.decoding(&rec_b, Duration::from_secs(1), pace);
    assert_eq!(index.offloaded(&a, &[(1, 0), (1, 2)]), [(0, 0), (2, 0)]);
    assert_eq!(index.offloaded(&b, &[(1, 0)]), [(4, 0)]);
    // c's four push out a's last two and b's first two; taken back (it
    // never reached the engine), it stored nothing and evicted nothing.
    let c = block_hashes(seed, &tokens(4, 2), BS);
    let rec_c = index.record(1, &c, 4, 0, 1, false, None);
    assert_eq!((index.offloaded(&c, &[(1, 0)]), index.offloaded(&b, &[(1, 0), (1, 2)])), (vec![(4, 0)], vec![(0, 0), (2, 0)]));
    index.take_back(&rec_c);
    assert_eq!((index.offloaded(&c, &[(1, 0)]), index.offloaded(&b, &[(1, 0)])), (vec![(0, 0)], vec![(4, 0)]));
    assert_eq!(index.offloaded(&a, &[(1, 2)]), [(2, 0)]);
    index.complete(&rec, Duration::from_secs(2));
}

/// A host tier resized while requests are in flight starts empty: a request
/// not yet started stores there when it starts, and one that stored in the
/// old tier, taken back, changes nothing in the new one.
#[test]
fn a_resized_host_tier_takes_the_stores_to_come_and_no_take_back() {
    let index = index();
    let seed = salt(&["m", ""]);
    let prompt = |n: u32| block_hashes(seed, &tokens(4, n), BS);
    let (x, a, b, c) = (prompt(3), prompt(0), prompt(1), prompt(2));
    index.set_host(1, Some(4));
    let rec_x = index.record(1, &x, 4, 0, 1, false, None);
    index.complete(&rec_x, Duration::ZERO);
    // a's store evicts x's four blocks.
    let rec_a = index.record(1, &a, 4, 0, 1, false, None);
    assert_eq!((index.offloaded(&a, &[(1, 0)]), index.offloaded(&x, &[(1, 0)])), (vec![(4, 0)], vec![(0, 0)]));
    index.set_host(1, Some(6));
    assert_eq!(index.offloaded(&a, &[(1, 0)]), [(0, 0)], "the new tier starts empty");
    let rec_b = index.record(1, &b, 4, 0, 1, false, None);
    // Taken back, a brings nothing back into the new tier.
    index.take_back(&rec_a);
    assert_eq!((index.offloaded(&b, &[(1, 0)]), index.offloaded(&x, &[(1, 0)])), (vec![(4, 0)], vec![(0, 0)]));
    // Two more blocks than the tier holds: c evicts b's first two.
    let rec_c = index.record(1, &c, 4, 0, 1, false, None);
    assert_eq!((index.offloaded(&b, &[(1, 2)]), index.offloaded(&c, &[(1, 0)])), (vec![(2, 0)], vec![(4, 0)]));
    index.complete(&rec_b, Duration::from_secs(1));
    index.complete(&rec_c, Duration::from_secs(1));
}

#[test]
fn bad_events_are_errors() {
    let index = index();
    let seed = salt(&["m", ""]);
    assert_eq!(
        store(&index, seed, 0, 2, 3, Tier::ROUTING),
        Err(EventError::UnknownParent(engine(block_hashes(seed, &tokens(2, 0), BS)[1])))
    );
    let t = tokens(2, 0);
    let wrong_size = Event::Stored(Stored { hashes: &[1], parent: None, tokens: &t, block_size: 8, seed, tier: Tier::ROUTING });
    assert_eq!(index.apply(0, &wrong_size), Err(EventError::BlockSizeMismatch { event: 8, replica: BS }));
    assert!(matches!(index.apply(0, &stored(&[1, 2, 3], None, &t, seed, Tier::ROUTING)), Err(EventError::Malformed { .. })));
    assert_eq!(index.apply(0, &Event::Removed { hashes: &[9], tier: Tier::ROUTING }), Err(EventError::UnknownBlock(9)));
    store(&index, seed, 0, 0, 2, Tier::ROUTING).unwrap();
    let first = engine(block_hashes(seed, &t, BS)[0]);
    assert_eq!(index.apply(0, &Event::Removed { hashes: &[first], tier: Tier::ROUTING }), Err(EventError::BrokenPrefix(first)));
    assert_eq!(index.apply(1, &Event::Cleared), Err(EventError::NotExact(1)));
    assert_eq!(index.apply(7, &Event::Cleared), Err(EventError::UnknownReplica(7)));
}

#[test]
fn a_block_stored_twice_stays_until_both_copies_are_removed() {
    let index = index();
    let seed = salt(&["m", ""]);
    store(&index, seed, 0, 0, 1, Tier::ROUTING).unwrap();
    store(&index, seed, 0, 0, 1, Tier::ROUTING).unwrap();
    let h = [engine(block_hashes(seed, &tokens(1, 0), BS)[0])];
    index.apply(0, &Event::Removed { hashes: &h, tier: Tier::ROUTING }).unwrap();
    assert_eq!(matched(&index, seed, 0, 1), 1);
    index.apply(0, &Event::Removed { hashes: &h, tier: Tier::ROUTING }).unwrap();
    assert_eq!(matched(&index, seed, 0, 1), 0);
}

#[test]
fn a_request_sent_claims_its_blocks_until_it_completes() {
    let index = index();
    let seed = salt(&["m", ""]);
    let prompt = block_hashes(seed, &tokens(4, 0), BS);
    let rec = index.record(0, &prompt, 4, 0, 1, false, None);
    assert_eq!(matched(&index, seed, 0, 4), 4, "predicted before the engine says anything");
    assert_eq!(index.held(&prompt, &[(0, 4), (1, 0)]), [4, 0], "and held by the request");
    store(&index, seed, 0, 0, 2, Tier::ROUTING).unwrap();
    index.apply(0, &Event::Cleared).unwrap();
    assert_eq!(matched(&index, seed, 0, 4), 4, "still claimed while the request runs");
    store(&index, seed, 0, 0, 3, Tier::ROUTING).unwrap();
    index.complete(&rec, Duration::ZERO);
    assert_eq!(matched(&index, seed, 0, 4), 3, "once it completes, only what the engine holds");
    assert_eq!(index.held(&prompt, &[(0, 3)]), [0], "held by no request in flight");
    let refused = index.record(0, &prompt, 4, 0, 1, false, None);
    index.take_back(&refused);
    assert_eq!(matched(&index, seed, 0, 4), 3);
    let shorter = index.record(0, &prompt[..2], 2, 0, 1, false, None);
    assert_eq!(index.held(&prompt, &[(0, 3)]), [2], "the claimed prefix is held, the block after it is not");
    index.complete(&shorter, Duration::ZERO);
    assert_eq!(index.held(&prompt, &[(0, 3)]), [0]);
}

#[test]
fn a_claim_ends_with_the_request_even_when_its_status_never_comes() {
    // Two routers: the response's status went to the other one. The request
    // is over, the engine evicted the tail of its prompt; the claim must not
    // keep predicting it.
    let index = index();
    let seed = salt(&["m", ""]);
    let prompt = block_hashes(seed, &tokens(4, 0), BS);
    let rec = index.record(0, &prompt, 4, 0, 1, false, None);
    store(&index, seed, 0, 0, 4, Tier::ROUTING).unwrap();
    let tail: Vec<u64> = prompt[2..].iter().rev().map(|&h| engine(h)).collect();
    index.apply(0, &Event::Removed { hashes: &tail, tier: Tier::ROUTING }).unwrap();
    assert_eq!(matched(&index, seed, 0, 4), 4, "claimed while the request runs");
    assert!(index.end_claim(&rec));
    assert_eq!(matched(&index, seed, 0, 4), 2, "over: what the engine holds");
    assert!(!index.end_claim(&rec), "once");
    index.complete(&rec, Duration::ZERO);
    assert_eq!(matched(&index, seed, 0, 4), 2);
    // An approximate replica's record waits for its status.
    let prompt1 = block_hashes(seed, &tokens(3, 1), BS);
    let approximate = index.record(1, &prompt1, 3, 0, 1, false, None);
    assert!(!index.end_claim(&approximate));
    assert_eq!(index.matched(&prompt1, &[1]), [3]);
}

#[test]
fn requests_sent_make_the_least_recently_freed_blocks_absent() {
    // Ten blocks: A then B ran (8 held), so two are empty.
    let index = sized(10);
    let seed = salt(&["m", ""]);
    let (a, b) = (0, 1);
    ran(&index, seed, a, 4);
    ran(&index, seed, b, 4);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (4, 4), "room for what nobody sent yet");
    // C needs its 4 blocks and one to generate into: 3 past the empty ones, taken from A's tail.
    let c = index.record(0, &block_hashes(seed, &tokens(4, 2), BS), 4, 0, 1, false, None);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (1, 4), "A was freed first, its last block first");
    assert_eq!(matched(&index, seed, 2, 4), 4, "C's own blocks are claimed");
    // D reuses A's first three blocks: they are in use again, and B's tail goes instead.
    let d = index.record(0, &block_hashes(seed, &tokens(3, a), BS), 3, 0, 1, false, None);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (3, 1));
    index.take_back(&d);
    index.complete(&c, Duration::ZERO);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (4, 4), "nothing is coming: everything held is there");
}

#[test]
fn what_a_request_generated_is_evicted_with_it_just_before_its_prompt() {
    let index = sized(12);
    let seed = salt(&["m", ""]);
    // R's prompt is 3 blocks; the engine stores 2 more it generated while Q runs and ends.
    let r = index.record(0, &block_hashes(seed, &tokens(3, 0), BS), 3, 0, 1, false, None);
    store(&index, seed, 0, 0, 5, Tier::ROUTING).unwrap();
    ran(&index, seed, 1, 3);
    index.complete(&r, Duration::ZERO);
    // 8 held, 4 empty; S needs 6 + 1: 3 evicted, all of Q, freed before R ended.
    let s = index.record(0, &block_hashes(seed, &tokens(6, 2), BS), 6, 0, 1, false, None);
    assert_eq!((matched(&index, seed, 1, 3), matched(&index, seed, 0, 5)), (0, 5));
    index.take_back(&s);
    // S needs 8 + 1: 5 evicted, Q's and then what R generated.
    let s = index.record(0, &block_hashes(seed, &tokens(8, 2), BS), 8, 0, 1, false, None);
    assert_eq!((matched(&index, seed, 1, 3), matched(&index, seed, 0, 5)), (0, 3));
    // The engine evicts Q and stores S's blocks: what it will still evict is 2 of R's.
    let q: Vec<u64> = block_hashes(seed, &tokens(3, 1), BS).iter().rev().map(|&h| engine(h)).collect();
    index.apply(0, &Event::Removed { hashes: &q, tier: Tier::ROUTING }).unwrap();
    assert_eq!(matched(&index, seed, 0, 5), 3);
    index.take_back(&s);
    assert_eq!(matched(&index, seed, 0, 5), 5);
}

#[test]
fn what_a_request_in_flight_generated_stays_out_of_the_eviction_order_until_it_ends() {
    let index = sized(12);
    let seed = salt(&["m", ""]);
    let (r, q) = (0, 1);
    // R runs: its prompt is 3 blocks, and the engine stores 2 more it generates.
    let running = index.record(0, &block_hashes(seed, &tokens(3, r), BS), 3, 0, 1, false, None);
    store(&index, seed, r, 0, 5, Tier::ROUTING).unwrap();
    // Q runs and ends after them: its 3 blocks are free, the least recently freed.
    ran(&index, seed, q, 3);
    // 8 named blocks, 4 empty. S needs 6 and R and S a block each to come:
    // 4 evictions, and only Q's 3 blocks can go, since R still holds what it generated.
    let s = index.record(0, &block_hashes(seed, &tokens(6, 2), BS), 6, 0, 1, false, None);
    assert_eq!((matched(&index, seed, q, 3), matched(&index, seed, r, 5)), (0, 5));
    index.take_back(&s);
    // R ends: what it generated is freed just before its prompt. S needing
    // 8 and a block to come takes Q's 3 blocks, then R's 2 generated ones.
    index.complete(&running, Duration::ZERO);
    let s = index.record(0, &block_hashes(seed, &tokens(8, 2), BS), 8, 0, 1, false, None);
    assert_eq!((matched(&index, seed, q, 3), matched(&index, seed, r, 5)), (0, 3));
    index.take_back(&s);
    assert_eq!((matched(&index, seed, q, 3), matched(&index, seed, r, 5)), (3, 5));
}

#[test]
fn a_partial_last_block_is_freed_as_room_reused_before_any_cached_block() {
    // Ten blocks: A and B each ran 4 full blocks and ended inside a fifth,
    // which the engine freed unnamed to the head of its free queue (vLLM
    // 0.32's BlockPool.free_blocks): 8 named blocks held, 2 blocks of room.
    let index = sized(10);
    let seed = salt(&["m", ""]);
    let (a, b) = (0, 1);
    for v in [a, b] {
        let rec = index.record(0, &block_hashes(seed, &tokens(4, v), BS), 4, 0, 1, true, None);
        store(&index, seed, v, 0, 4, Tier::ROUTING).unwrap();
        index.complete(&rec, Duration::ZERO);
    }
    // C needs one block and one to generate into: the room holds both.
    let c = index.record(0, &block_hashes(seed, &tokens(1, 2), BS), 1, 0, 1, true, None);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (4, 4));
    store(&index, seed, 2, 0, 1, Tier::ROUTING).unwrap();
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (4, 4));
    // C ends inside its second block, freed as room: 9 named blocks and 1
    // block of room. D needs two: the room, then A's last block, the least
    // recently freed.
    index.complete(&c, Duration::ZERO);
    let d = index.record(0, &block_hashes(seed, &tokens(1, 4), BS), 1, 0, 1, false, None);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (3, 4));
    index.take_back(&d);
    assert_eq!((matched(&index, seed, a, 4), matched(&index, seed, b, 4)), (4, 4));
}

#[test]
fn leaving_exact_mode_keeps_what_was_known_or_nothing() {
    let index = index();
    let seed = salt(&["m", ""]);
    store(&index, seed, 0, 0, 5, Tier::ROUTING).unwrap();
    let rec = index.record(0, &block_hashes(seed, &tokens(6, 1), BS), 6, 0, 1, false, None);
    index.leave_exact(0, true);
    assert!(!index.is_exact(0));
    assert_eq!(matched(&index, seed, 0, 5), 5, "the shadow starts from the engine's blocks");
    assert_eq!(matched(&index, seed, 1, 6), 0, "claims end with exact mode");
    index.complete(&rec, Duration::ZERO);
    assert_eq!(index.entries(), 5);
    assert!(index.enter_exact(0, BS));
    assert_eq!(matched(&index, seed, 0, 5), 0, "exact mode starts from an empty cache");
    store(&index, seed, 0, 0, 5, Tier::ROUTING).unwrap();
    index.leave_exact(0, false);
    assert_eq!(matched(&index, seed, 0, 5), 0, "a restarted engine holds nothing");
    index.remove_replica(0);
    assert_eq!(index.entries(), 0);
}

#[derive(Debug, Clone)]
enum Op {
    /// The engine stores the next blocks of prompt `p`, up to `n` blocks in all.
    Store(usize, usize),
    /// The engine evicts the last block of prompt `p`'s stored chain.
    Evict(usize),
    Clear,
    /// The router sends prompt `p`'s first `n` blocks.
    Send(usize, usize),
    /// The oldest request sent completes.
    Complete,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4usize, 1..7usize).prop_map(|(p, n)| Op::Store(p, n)),
        3 => (0..4usize).prop_map(Op::Evict),
        1 => Just(Op::Clear),
        2 => (0..4usize, 1..7usize).prop_map(|(p, n)| Op::Send(p, n)),
        2 => Just(Op::Complete),
    ]
}

proptest! {
    /// Four prompts share leading blocks (prompt `p` is prompt 0 with its
    /// blocks from `p` on changed); the engine stores and evicts from chain
    /// tails, as it does. After every step each prompt's match is the count
    /// of its leading blocks present; every claimed block is present and
    /// every present block held or claimed; and of the held blocks nobody
    /// claims, as many are absent as the requests sent will evict: their
    /// blocks not held and one more each, past the cache's empty room. A
    /// block stored after a claimed block (or after one such), while it is
    /// claimed, is generated by the request in flight, which holds it: it
    /// is never absent until that claim ends (or a request claims it, and
    /// with it what was stored after it for the same claim).
    #[test]
    fn exact_mode_matches_a_naive_model(ops in proptest::collection::vec(op(), 1..80), blocks in prop_oneof![Just(8usize), Just(12), Just(64)]) {
        let index = sized(blocks);
        let seed = salt(&["m", ""]);
        let prompts: Vec<Vec<u32>> = (0..4usize).map(|p| {
            let mut t = tokens(6, 0);
            for x in &mut t[p * BS..] { *x += 1 + p as u32; }
            t
        }).collect();
        let hashes: Vec<Vec<BlockHash>> = prompts.iter().map(|t| block_hashes(seed, t, BS)).collect();
        // The engine: router hashes held, with how many children each has.
        let mut held: HashMap<BlockHash, usize> = HashMap::new();
        let mut sent: Vec<(super::super::Recorded, Vec<BlockHash>)> = Vec::new();
        // Blocks held by the requests in flight that generated them, in the order stored, with the claimed block each follows.
        let mut trail: Vec<(BlockHash, BlockHash)> = Vec::new();
        for op in ops {
            let claimed_now: HashSet<BlockHash> = sent.iter().flat_map(|(_, k)| k.iter().copied()).collect();
            match op {
                Op::Store(p, n) => {
                    let have = hashes[p].iter().take_while(|h| held.contains_key(h)).count();
                    if have < n {
                        let engine_hashes: Vec<u64> = hashes[p][have..n].iter().map(|&h| engine(h)).collect();
                        let parent = have.checked_sub(1).map(|i| engine(hashes[p][i]));
                        index.apply(0, &stored(&engine_hashes, parent, &prompts[p][have * BS..n * BS], seed, Tier::ROUTING)).unwrap();
                        for i in have..n {
                            held.insert(hashes[p][i], 0);
                            if i > 0 { *held.entry(hashes[p][i - 1]).or_default() += 1; }
                            let (b, parent) = (hashes[p][i], i.checked_sub(1).map(|j| hashes[p][j]));
                            let anchor = parent.and_then(|q| if claimed_now.contains(&q) { Some(q) } else { trail.iter().find(|t| t.0 == q).map(|t| t.1) });
                            if let (false, Some(a)) = (claimed_now.contains(&b), anchor) {
                                trail.push((b, a));
                            }
                        }
                    }
                }
                Op::Evict(p) => {
                    let have = hashes[p].iter().take_while(|h| held.contains_key(h)).count();
                    if have > 0 && held[&hashes[p][have - 1]] == 0 {
                        let h = hashes[p][have - 1];
                        index.apply(0, &Event::Removed { hashes: &[engine(h)], tier: Tier::ROUTING }).unwrap();
                        held.remove(&h);
                        trail.retain(|t| t.0 != h);
                        if have > 1 { *held.entry(hashes[p][have - 2]).or_default() -= 1; }
                    }
                }
                Op::Clear => {
                    index.apply(0, &Event::Cleared).unwrap();
                    held.clear();
                    trail.clear();
                }
                Op::Send(p, n) => {
                    // A block claimed anew stops trailing, and takes over what was stored after it for the same claim.
                    for &k in &hashes[p][..n] {
                        if claimed_now.contains(&k) || !held.contains_key(&k) { continue; }
                        if let Some(at) = trail.iter().position(|t| t.0 == k) {
                            let a = trail.remove(at).1;
                            for t in &mut trail[at..] {
                                if t.1 == a { t.1 = k; }
                            }
                        }
                    }
                    sent.push((index.record(0, &hashes[p][..n], n, 0, 1, false, None), hashes[p][..n].to_vec()));
                }
                Op::Complete => if !sent.is_empty() {
                    index.complete(&sent.remove(0).0, Duration::ZERO);
                    let still: HashSet<BlockHash> = sent.iter().flat_map(|(_, k)| k.iter().copied()).collect();
                    trail.retain(|t| still.contains(&t.1));
                },
            }
            let claimed: HashSet<BlockHash> = sent.iter().flat_map(|(_, k)| k.iter().copied()).collect();
            let present = |h: &BlockHash| index.holders.word(*h, 0) & 1 != 0;
            for h in &hashes {
                let want = h.iter().take_while(|x| present(x)).count();
                prop_assert_eq!(index.matched(h, &[0 as Slot])[0], want);
            }
            let every: HashSet<BlockHash> = hashes.iter().flatten().copied().collect();
            for h in &every {
                prop_assert!(!claimed.contains(h) || present(h), "claimed blocks are present");
                prop_assert!(!present(h) || claimed.contains(h) || held.contains_key(h), "present blocks are held or claimed");
            }
            let free = held.keys().filter(|h| !claimed.contains(*h) && !trail.iter().any(|t| t.0 == **h)).count();
            let unheld = claimed.iter().filter(|h| !held.contains_key(*h)).count();
            let evicted = (unheld + sent.len()).saturating_sub(blocks.saturating_sub(held.len())).min(free);
            let absent = held.keys().filter(|h| !present(h)).count();
            prop_assert_eq!(absent, evicted);
        }
    }
}

/// A request for `blocks` blocks of `variant`, stored, decoding from
/// `first` with `output` blocks of output, one a block time.
fn running(index: &KvIndex, seed: BlockHash, variant: u32, blocks: usize, output: usize, first: Duration) -> Recorded {
    let rec = index.record(0, &block_hashes(seed, &tokens(blocks, variant), BS), blocks, 0, output, false, None);
    store(index, seed, variant, 0, blocks, Tier::ROUTING).unwrap();
    index.decoding(&rec, first, Pace { lead: 0.0, span: output as f64 });
    rec
}

/// Runs a one-block request of `variant` 9 that teaches the replica's
/// block time (one block of output in 100 ms); its block is free after it.
fn teach_block_time(index: &KvIndex, seed: BlockHash) {
    let learn = index.record(0, &block_hashes(seed, &tokens(1, 9), BS), 1, 0, 1, false, None);
    store(index, seed, 9, 0, 1, Tier::ROUTING).unwrap();
    index.decoding(&learn, Duration::ZERO, Pace { lead: 0.0, span: 1.0 });
    index.complete(&learn, Duration::from_millis(100));
}

/// A cache of `blocks` blocks holding, free, a 4-block prefix of variant 0
/// and then the block that taught the block time (100 ms), and a request
/// of 4 prompt blocks of variant 1 decoding from 1,000 ms, owing 4 output
/// blocks: by its pace it takes them from 1,000 to 1,300 ms and ends at
/// 1,400.
fn prefix_beside_a_running_request(blocks: usize) -> (KvIndex, BlockHash, Recorded) {
    let index = sized(blocks);
    let seed = salt(&["m", ""]);
    ran(&index, seed, 0, 4);
    teach_block_time(&index, seed);
    let running = running(&index, seed, 1, 4, 4, Duration::from_millis(1_000));
    (index, seed, running)
}

/// Exact mode forecasts a wait as approximate mode does (ADR 0055): a
/// request sent now that does not fit waits for a request in flight to
/// end, and meanwhile that request's output takes blocks, evicting the
/// least recently freed: here the tail of the prefix the new prompt would
/// reuse.
#[test]
fn a_prompt_that_must_wait_for_room_or_a_slot_loses_what_the_outputs_in_flight_grow_into() {
    let ms = Duration::from_millis;
    let (index, seed, running) = prefix_beside_a_running_request(10);
    // The prefix and 4 fresh blocks need 8 of the 5 free: the prompt waits
    // until 1,400 ms, and the 3 output blocks taken meanwhile evict the
    // prefix from its tail.
    let prompt = block_hashes(seed, &tokens(8, 0), BS);
    assert_eq!(matched(&index, seed, 0, 8), 4);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 4)], ms(1_000)), [1]);
    // The prefix alone fits at once and keeps it all.
    assert_eq!(index.kept_through_wait(&prompt[..4], &[wait(0, 4, 0)], ms(1_000)), [4]);
    // Unless its LoRA adapter must wait for the running request's slot
    // (vLLM defers it until that adapter has no request left): then it
    // starts at 1,400 ms too, and keeps as little.
    let slot_wait = |ahead| [Wait { adapter_ahead: ahead, ..wait(0, 4, 0) }];
    assert_eq!(index.kept_through_wait(&prompt[..4], &slot_wait(Some(0)), ms(1_000)), [4], "whose adapter it is, unknown");
    index.adapter(&running, 7);
    assert_eq!(index.kept_through_wait(&prompt[..4], &slot_wait(Some(0)), ms(1_000)), [1]);
    assert_eq!(index.kept_through_wait(&prompt[..4], &slot_wait(Some(1)), ms(1_000)), [4], "fewer adapters in flight than foreseen");
    index.complete(&running, ms(1_400));
}

/// The engine stores a request's output block once it is full, as it
/// takes the next: the wait forecast paces the request from there, not
/// from a first token that put it ahead of the engine.
#[test]
fn a_waiting_prompt_paces_a_request_in_flight_by_the_output_blocks_it_stored() {
    let ms = Duration::from_millis;
    let (index, seed, running) = prefix_beside_a_running_request(12);
    // The engine is slower: it stores the first output block at 1,300 ms,
    // taking the second. The third and fourth come at 1,400 and 1,500 ms,
    // and it ends at 1,600.
    index.advance(&[0], ms(1_300));
    store(&index, seed, 1, 4, 5, Tier::ROUTING).unwrap();
    // The prefix and 4 fresh blocks wait for it to end. Of its 2 output
    // blocks still to come, the first takes the last empty block and the
    // second the prefix's tail.
    let prompt = block_hashes(seed, &tokens(8, 0), BS);
    assert_eq!(matched(&index, seed, 0, 8), 4);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 4)], ms(1_300)), [3]);
    index.complete(&running, ms(1_600));
}

/// An output block a request in flight took by its pace, of which no event
/// has told yet, has evicted a free block or will before a prompt sent now
/// starts: a prompt that fits at once loses what that block takes.
#[test]
fn a_prompt_that_fits_loses_what_an_output_block_not_yet_heard_of_took() {
    let ms = Duration::from_millis;
    // The running request takes its first output block at 1,000 ms (the
    // last empty one), and its second at 1,100 ms.
    let (index, seed, running) = prefix_beside_a_running_request(10);
    let prompt = block_hashes(seed, &tokens(4, 0), BS);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 0)], ms(1_050)), [4]);
    // At 1,110 ms no event has told of the second: it took the prefix's
    // tail, the head of the free blocks.
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 0)], ms(1_110)), [3]);
    // The step's events, heard at 1,150 ms: the first output block stored, the
    // tail evicted. The view holds 3 blocks of the prefix, and nothing is
    // still to be taken.
    index.advance(&[0], ms(1_150));
    store(&index, seed, 1, 4, 5, Tier::ROUTING).unwrap();
    let tail = [engine(prompt[3])];
    index.apply(0, &Event::Removed { hashes: &tail, tier: Tier::ROUTING }).unwrap();
    assert_eq!((matched(&index, seed, 0, 4), index.kept_through_wait(&prompt[..3], &[wait(0, 3, 1)], ms(1_150))), (3, vec![3]));
    index.complete(&running, ms(1_400));
}

/// A running request's output is held until it ends (ADR 0066), and the
/// wait forecast frees it then, once: what it stored so far is among the
/// blocks it frees, not counted again with its output.
#[test]
fn a_waiting_prompt_counts_what_a_request_in_flight_generated_once_when_it_ends() {
    let ms = Duration::from_millis;
    let index = sized(14);
    let seed = salt(&["m", ""]);
    // A prefix of 4 blocks, free, then the block time learned (its block free after it).
    ran(&index, seed, 0, 4);
    teach_block_time(&index, seed);
    // Two requests decoding from 1,000 ms, a block each 100 ms: one of 2
    // prompt blocks and 4 output blocks (ending at 1,400 ms), one of 1 and
    // 8 (ending at 1,800 ms). Each stored its second output block at
    // 1,200 ms, taking its third, as its pace has it.
    let first = running(&index, seed, 1, 2, 4, ms(1_000));
    let second = running(&index, seed, 2, 1, 8, ms(1_000));
    index.advance(&[0], ms(1_200));
    store(&index, seed, 1, 2, 4, Tier::ROUTING).unwrap();
    store(&index, seed, 2, 1, 3, Tier::ROUTING).unwrap();
    // The prefix and 5 fresh blocks need 9 of the 5 free. When the first
    // ends, it frees 6 (2 prompt and 4 output blocks) and the outputs have
    // taken 3 more: 8, too few. When the second ends, the outputs' 6 blocks
    // have taken all 5 free blocks, the prefix first.
    let prompt = block_hashes(seed, &tokens(9, 0), BS);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 5)], ms(1_250)), [0]);
    // With 4 fresh blocks it starts when the first ends, the prefix's last 3 blocks gone.
    assert_eq!(index.kept_through_wait(&prompt[..8], &[wait(0, 4, 4)], ms(1_250)), [1]);
    index.complete(&first, ms(1_400));
    index.complete(&second, ms(1_800));
}

/// What was generated after a prefix two requests in flight claim is held
/// until the last of them ends, as the prefix is: the wait forecast frees
/// it then, not when the first ends.
#[test]
fn a_waiting_prompt_keeps_what_was_generated_after_a_prefix_still_claimed() {
    let ms = Duration::from_millis;
    let index = sized(7);
    let seed = salt(&["m", ""]);
    teach_block_time(&index, seed);
    // Two requests for one 2-block prompt, decoding from 1,000 ms: 4 output
    // blocks (ending at 1,400 ms) and 8 (1,800 ms). The first has stored 2.
    let prompt = block_hashes(seed, &tokens(4, 1), BS);
    let first = running(&index, seed, 1, 2, 4, ms(1_000));
    let second = index.record(0, &prompt[..2], 2, 0, 8, false, None);
    index.decoding(&second, ms(1_000), Pace { lead: 0.0, span: 8.0 });
    store(&index, seed, 1, 2, 4, Tier::ROUTING).unwrap();
    // The next turn resends the prompt and what was generated: it needs
    // the 2 generated blocks out of the free pool, which holds 1, and
    // starts when the first request ends. The 3 blocks allocated by then
    // take the free one and the first's output still owed, never what was
    // generated, which the second's claim still holds.
    assert_eq!(index.matched(&prompt, &[0]), [4]);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 0)], ms(1_250)), [4]);
    index.complete(&first, ms(1_400));
    index.complete(&second, ms(1_800));
}

/// A prefix a request in flight claims is kept only while it runs: once it
/// ends, the engine frees its blocks behind those free already, and a
/// prompt still waiting for room loses them, from the tail, to the outputs
/// that grow meanwhile.
#[test]
fn a_waiting_prompt_loses_a_claimed_prefix_once_its_claim_ends() {
    let ms = Duration::from_millis;
    let index = sized(12);
    let seed = salt(&["m", ""]);
    // A request that teaches the block time, its block free after it.
    teach_block_time(&index, seed);
    // A claims the 3-block prefix and ends at 1,100 ms; B runs another 4
    // blocks and takes an output block every 100 ms until 1,600.
    let a = running(&index, seed, 0, 3, 1, ms(1_000));
    let b = running(&index, seed, 1, 4, 6, ms(1_000));
    // The prefix and 9 fresh blocks do not fit until B ends. A's end frees
    // the prefix behind the learning block; B's four output blocks from
    // 1,200 to 1,500 take the two blocks of room, then the learning block
    // and the prefix's last block.
    let prompt = block_hashes(seed, &tokens(12, 0), BS);
    assert_eq!(matched(&index, seed, 0, 12), 3, "claimed: present");
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 3, 9)], ms(1_000)), [2]);
    // With 3 fresh blocks it fits once A ends, before any eviction.
    assert_eq!(index.kept_through_wait(&prompt[..6], &[wait(0, 3, 3)], ms(1_000)), [3]);
    index.complete(&a, ms(1_100));
    index.complete(&b, ms(1_600));
}

/// A request taken to have ended before now (its estimated end passed
/// unheard) counts what the others' outputs take from now on, not from
/// its end: before now they took nothing more that the events did not say.
#[test]
fn an_end_estimated_before_now_takes_no_output_from_before_now() {
    let ms = Duration::from_millis;
    let index = sized(20);
    let seed = salt(&["m", ""]);
    teach_block_time(&index, seed);
    ran(&index, seed, 0, 4);
    // A, 3 blocks, was to end at 100 ms; B, 4 blocks, decodes from 900 ms
    // to 2,900. By 1,000 ms B has taken two output blocks, and the engine
    // has stored the first.
    let a = running(&index, seed, 2, 3, 1, ms(0));
    let b = running(&index, seed, 1, 4, 20, ms(900));
    index.advance(&[0], ms(1_000));
    store(&index, seed, 1, 4, 5, Tier::ROUTING).unwrap();
    // The prefix and 8 fresh blocks wait for A's end, which frees room at once.
    let prompt = block_hashes(seed, &tokens(12, 0), BS);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 4, 8)], ms(1_000)), [4]);
    index.complete(&a, ms(1_000));
    index.complete(&b, ms(2_900));
}
