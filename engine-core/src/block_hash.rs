//! Prefix-cache block hashes.
//!
//! Every *full* block of a request's token ids gets a hash chained from its parent block's
//! hash and its own token ids, so equal hashes mean equal whole prefixes, not just equal
//! blocks. The KV-cache manager uses these hashes to find blocks it can reuse.

use sha2::{Digest, Sha256};

/// 128 bits of SHA-256 over (parent hash, token ids).
///
/// Why this is safe to trust without comparing token ids on a hit: a cache hit on a
/// collision would serve another prompt's KV, so collisions must be out of reach both by
/// chance and on purpose. By chance, with `n` distinct blocks ever hashed the probability of
/// any collision is about `n² / 2^129`; even 2^40 blocks (a trillion) give ~2^-49. On
/// purpose, SHA-256 truncated to 128 bits has no known attack better than the generic
/// 2^64 birthday search, so a client cannot craft two prompts that share a block hash.
/// (std's 64-bit `DefaultHasher` fails both: 2^32 blocks reach even odds of a collision,
/// and SipHash with its fixed public key is not collision resistant.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// Domain separator so a first block (no parent) can never equal a child block's input.
const ROOT_MARKER: u8 = 0;
const CHILD_MARKER: u8 = 1;

/// Hashes one full block given its parent's hash (`None` for the first block).
pub fn hash_block_tokens(parent: Option<BlockHash>, token_ids: &[u32]) -> BlockHash {
    let mut hasher = Sha256::new();
    match parent {
        None => hasher.update([ROOT_MARKER]),
        Some(p) => {
            hasher.update([CHILD_MARKER]);
            hasher.update(p.0.to_le_bytes());
        }
    }
    // The block size is fixed per engine, but hashing the length keeps the encoding
    // unambiguous whatever the caller passes.
    hasher.update((token_ids.len() as u64).to_le_bytes());
    for t in token_ids {
        hasher.update(t.to_le_bytes());
    }
    let digest = hasher.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    BlockHash(u128::from_le_bytes(first))
}

/// Extends `hashes` with the hash of every full block of `token_ids` not yet hashed.
/// Called whenever tokens are appended, so each block is hashed exactly once.
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, token_ids: &[u32], block_size: usize) {
    let num_full_blocks = token_ids.len() / block_size;
    while hashes.len() < num_full_blocks {
        let i = hashes.len();
        let parent = hashes.last().copied();
        let block = &token_ids[i * block_size..(i + 1) * block_size];
        hashes.push(hash_block_tokens(parent, block));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hash_depends_on_the_whole_prefix() {
        let a = hash_block_tokens(None, &[1, 2]);
        let b = hash_block_tokens(None, &[1, 3]);
        assert_ne!(a, b);
        // Same block content, different parents: different hashes.
        assert_ne!(
            hash_block_tokens(Some(a), &[5, 6]),
            hash_block_tokens(Some(b), &[5, 6])
        );
        assert_eq!(
            hash_block_tokens(Some(a), &[5, 6]),
            hash_block_tokens(Some(a), &[5, 6])
        );
    }

    #[test]
    fn extend_hashes_only_full_blocks() {
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, &[1, 2, 3, 4, 5], 2);
        assert_eq!(hashes.len(), 2);
        let again = hashes.clone();
        extend_block_hashes(&mut hashes, &[1, 2, 3, 4, 5, 6], 2);
        assert_eq!(hashes.len(), 3);
        assert_eq!(&hashes[..2], &again[..]);
        assert_eq!(hashes[1], hash_block_tokens(Some(hashes[0]), &[3, 4]));
    }
}
