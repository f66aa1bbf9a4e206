//! Chained XXH3-128 block hashes.
//!
//! Block `i`'s hash is its parent's hash times an odd 128-bit constant plus
//! XXH3-128 of its own token ids (their bytes in place, in the machine's
//! byte order), so one hash names the whole prefix up to the end of its
//! block. Blocks' XXH3 hashes do not wait for one another, so the processor
//! computes several at once; only the multiply-add is chained (ADR 0008).
//! Multiplying by an odd constant is invertible modulo 2^128, so a changed
//! block changes every later hash, never only some. The chain starts from a
//! salt (model, adapter, `cache_salt`), so equal tokens under a different
//! salt never share blocks. A trailing partial block is not hashed: engines
//! only cache full blocks.

use xxhash_rust::xxh3::xxh3_128;

/// The name of a block together with its whole prefix.
pub type BlockHash = u128;

/// The start of a chain for the given salt parts; each part is hashed with
/// its length so `["ab", "c"]` and `["a", "bc"]` differ.
pub fn salt(parts: &[&str]) -> BlockHash {
    let mut buf = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for p in parts {
        buf.extend_from_slice(&(p.len() as u64).to_le_bytes());
        buf.extend_from_slice(p.as_bytes());
    }
    xxh3_128(&buf)
}

/// Hashes of every full block of `tokens`, chained from `seed`.
pub fn block_hashes(seed: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_hashes(&mut out, seed, tokens, block_size);
    out
}

/// Appends the hashes of the full blocks of `tokens` beyond those already in
/// `hashes`, continuing its chain (or starting from `seed` when empty).
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, seed: BlockHash, tokens: &[u32], block_size: usize) {
    if block_size == 0 {
        return;
    }
    let mut parent = hashes.last().copied().unwrap_or(seed);
    for block in tokens.chunks_exact(block_size).skip(hashes.len()) {
        parent = next(parent, block);
        hashes.push(parent);
    }
}

/// The hash of `block` following `parent` (a block's hash, or a chain's seed).
pub fn next(parent: BlockHash, block: &[u32]) -> BlockHash {
    parent.wrapping_mul(CHAIN).wrapping_add(xxh3_128(bytemuck::cast_slice(block)))
}

/// The chain's multiplier: the golden ratio's first 128 fractional bits
/// with the last one set, so it is odd (invertible modulo 2^128) and its
/// bits spread over both halves.
const CHAIN: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn partial_blocks_are_not_hashed() {
        assert_eq!(block_hashes(0, &[1, 2, 3], 4).len(), 0);
        assert_eq!(block_hashes(0, &[1, 2, 3, 4, 5], 4).len(), 1);
    }

    #[test]
    fn reordered_or_repeated_blocks_hash_apart() {
        let (a, b) = ([1u32, 2, 3, 4], [3u32, 4, 1, 2]);
        assert_ne!(block_hashes(0, &a, 2)[1], block_hashes(0, &b, 2)[1]);
        let twice = block_hashes(0, &[5, 6, 5, 6], 2);
        assert_ne!(twice[0], twice[1]);
    }

    #[test]
    fn salt_separates_chains_and_parts() {
        let t = [7u32; 8];
        assert_ne!(block_hashes(salt(&["m"]), &t, 4), block_hashes(salt(&["n"]), &t, 4));
        assert_ne!(salt(&["ab", "c"]), salt(&["a", "bc"]));
    }

    proptest! {
        #[test]
        fn changing_a_token_changes_its_block_and_every_later_one(
            tokens in proptest::collection::vec(0u32..50_000, 1..200),
            bs in 1usize..33,
            pos in any::<prop::sample::Index>(),
        ) {
            let i = pos.index(tokens.len());
            let mut changed = tokens.clone();
            changed[i] ^= 1;
            let a = block_hashes(5, &tokens, bs);
            let b = block_hashes(5, &changed, bs);
            let block = i / bs;
            for k in 0..a.len() {
                if k < block { prop_assert_eq!(a[k], b[k]); } else { prop_assert_ne!(a[k], b[k]); }
            }
        }

        #[test]
        fn a_prefix_hashes_the_same_alone_or_inside_a_longer_prompt(
            tokens in proptest::collection::vec(any::<u32>(), 0..200),
            cut in any::<prop::sample::Index>(),
            bs in 1usize..33,
        ) {
            let n = cut.index(tokens.len() + 1);
            let whole = block_hashes(9, &tokens, bs);
            let part = block_hashes(9, &tokens[..n], bs);
            prop_assert_eq!(&whole[..part.len()], &part[..]);
            let mut grown = part.clone();
            extend_block_hashes(&mut grown, 9, &tokens, bs);
            prop_assert_eq!(grown, whole);
        }
    }
}
