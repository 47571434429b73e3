//! The frontend of vllm-rs and the `vllm-rs` binary's roles: the CLI, the OpenAI server,
//! tokenization and detokenization, the engine-core client and output processing.

pub mod args;
pub mod async_llm;
pub mod bench;
pub mod chat_template;
pub mod cli;
pub mod compile_kernels;
pub mod detokenizer;
pub mod engine_client;
pub mod generate;
mod gguf_tokenizer;
pub mod hub;
pub mod metrics;
pub mod output_processor;
pub mod server;
pub mod stop_strings;
pub mod tokenizer;

#[cfg(test)]
mod fuzz_tests;
