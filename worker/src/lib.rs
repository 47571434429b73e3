//! The worker: model runner, model definitions, layers, weight loading, KV cache, sampler
//! and backends (DESIGN §2).
pub mod backend;
pub mod communicator;
pub mod config;
pub mod cuda_graphs;
pub mod exponential_race;
pub mod input_batch;
pub mod kv_cache;
pub mod layers;
pub mod model_path;
pub mod model_runner;
pub mod models;
pub mod overlap;
pub mod reference;
pub mod sampler;
pub mod watchdog;
pub mod weights;
pub mod worker_proc;
