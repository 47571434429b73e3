//! `AsyncLLM`: the engine as the frontend's callers see it (vLLM's name). It owns the
//! engine-core client, the tokenizer and the model's generation facts, turns a tokenized
//! prompt plus `SamplingParams` into an `EngineCoreRequest`, and hands back a stream of
//! detokenized [`RequestOutput`]s. The HTTP server, `generate` and the benchmarks all use it.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use vllm_protocol::{EngineCoreRequest, SamplingParams};
use vllm_worker::model_path::ModelPath;
use vllm_worker::weights::gguf::GgufFile;

use crate::args::EngineArgs;
use crate::engine_client::{vllm_rs_exe, EngineCoreClient};
use crate::metrics::Metrics;
use crate::output_processor::{OutputStream, TextOptions};
use crate::tokenizer::Tokenizer;

pub struct AsyncLLM {
    pub client: EngineCoreClient,
    pub tokenizer: Tokenizer,
    /// Every token id that ends generation by default: the tokenizer's eos plus those of
    /// config.json and generation_config.json.
    pub eos_token_ids: Vec<u32>,
    pub metrics: Arc<Metrics>,
    /// `--max-num-seqs`: the most sequences one step runs, and so the most one API request
    /// may ask for (prompts × n).
    pub max_num_seqs: u32,
}

impl AsyncLLM {
    /// Loads the tokenizer, then starts the engine-core and its workers.
    pub async fn start(args: &EngineArgs) -> anyhow::Result<Self> {
        args.validate()?;
        let tokenizer = Tokenizer::from_model_dir(args.tokenizer_path())?;
        let eos_token_ids = eos_token_ids(&args.model, &tokenizer);
        let client = EngineCoreClient::start(args.engine_core_config(vllm_rs_exe()?)?).await?;
        let metrics = Arc::new(Metrics::new(args.served_model_names()[0].clone()));
        Ok(Self {
            client,
            tokenizer,
            eos_token_ids,
            metrics,
            max_num_seqs: args.max_num_seqs()?,
        })
    }

    pub fn max_model_len(&self) -> u32 {
        self.client.ready.max_model_len
    }

    /// Submits one tokenized prompt. The stream aborts the request if dropped early.
    /// `parent_request_id` names the API request it is a part of (one of its prompts or
    /// samples), so the scheduler shares slots fairly among API requests.
    pub fn generate(
        &self,
        request_id: String,
        prompt_token_ids: Vec<u32>,
        sampling_params: SamplingParams,
        text: TextOptions,
        priority: i32,
        parent_request_id: Option<String>,
    ) -> anyhow::Result<OutputStream> {
        let request = EngineCoreRequest {
            request_id,
            prompt_token_ids: prompt_token_ids.clone(),
            sampling_params,
            eos_token_ids: self.eos_token_ids.clone(),
            arrival_time: vllm_engine_core::engine_core::now(),
            priority,
            parent_request_id,
        };
        let stream = self.client.add_request(request)?;
        OutputStream::new(
            stream,
            self.tokenizer.clone(),
            &prompt_token_ids,
            text,
            self.metrics.clone(),
        )
    }

    pub async fn shutdown(&self) {
        self.client.shutdown().await;
    }
}

/// Collects eos ids from the tokenizer, config.json and generation_config.json (either may
/// hold one id or a list), or a GGUF model's eos and eot ids.
fn eos_token_ids(model_dir: &Path, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = tokenizer.eos_token_id().into_iter().collect();
    if let Ok(ModelPath::Gguf(path)) = ModelPath::resolve(model_dir) {
        if let Ok(file) = GgufFile::open(&path) {
            for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
                ids.extend(file.get_u64(key).map(|v| v as u32));
            }
        }
    }
    for file in ["config.json", "generation_config.json"] {
        let Ok(text) = std::fs::read_to_string(model_dir.join(file)) else {
            continue;
        };
        let Ok(json) = serde_json::from_str::<serde_json::Value>(&text).context(file) else {
            continue;
        };
        match &json["eos_token_id"] {
            serde_json::Value::Number(n) => ids.extend(n.as_u64().map(|v| v as u32)),
            serde_json::Value::Array(list) => {
                ids.extend(list.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
            }
            _ => {}
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}
