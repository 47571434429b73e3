//! The LRU queue of free KV blocks.
//!
//! A doubly linked list threaded through arrays indexed by block id: O(1) pop from the
//! front (the least recently freed block is evicted first), push to the back, and removal
//! from the middle (a cache hit revives a free block that still holds its hash).

use crate::block_id::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct FreeBlockQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    in_queue: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeBlockQueue {
    /// A queue holding every block `0..num_blocks`, in id order.
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        let mut q = Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            in_queue: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..num_blocks {
            q.push_back(id);
        }
        q
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, id: BlockId) -> bool {
        self.in_queue.get(id as usize).copied().unwrap_or(false)
    }

    /// Takes the least recently freed block.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.remove(id);
        Some(id)
    }

    /// Appends a block that just became free (most recently freed goes last).
    pub fn push_back(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(!self.in_queue[i], "block {id} freed twice");
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.in_queue[i] = true;
        self.len += 1;
    }

    /// Unlinks a block wherever it is; a no-op for a block not in the queue.
    pub fn remove(&mut self, id: BlockId) {
        let i = id as usize;
        if !self.in_queue[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_queue[i] = false;
        self.len -= 1;
    }

    /// The free blocks from the front (next evicted) to the back.
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.next[id as usize];
            Some(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_order_and_middle_removal() {
        let mut q = FreeBlockQueue::new(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        q.remove(1);
        assert_eq!(q.pop_front(), Some(0));
        q.push_back(1);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![2, 3, 1]);
        q.remove(1);
        q.remove(1);
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop_front(), Some(2));
        assert_eq!(q.pop_front(), Some(3));
        assert_eq!(q.pop_front(), None);
        assert!(q.is_empty());
    }
}
