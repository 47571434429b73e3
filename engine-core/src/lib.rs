//! The engine-core.

pub mod block_hash;
pub mod block_id;
pub mod block_pool;
pub mod config;
pub mod engine_core;
pub mod executor;
pub mod free_block_queue;
pub mod kv_cache_manager;
pub mod process;
pub mod request;
pub mod scheduler;
pub mod transport;
