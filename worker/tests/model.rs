//! The model stack end to end on tiny random models: round trips for every architecture,
//! sharded checkpoints, chunked prefill, paged decode in shuffled blocks, and the served
//! path against `greedy_reference`.

use std::path::Path;

use vllm_fixtures::{
    special_token_ids, tiny_model_tensors, write_safetensors, write_tiny_model, ModelType,
    TinyDtype, TinyModelSpec,
};
use vllm_protocol::{CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput};
use vllm_worker::model_runner::{ModelRunner, WorkerConfig};
use vllm_worker::reference::{greedy_reference, reference_logits};
use vllm_worker::sampler::argmax;

const BLOCK_SIZE: u32 = 4;

fn worker_config(dir: &Path) -> WorkerConfig {
    WorkerConfig {
        model_dir: dir.to_path_buf(),
        rank: 0,
        world_size: 1,
        device: "cpu".into(),
        // The reference forward (`greedy_reference`) computes in f32.
        dtype: Some("float32".into()),
        block_size: BLOCK_SIZE,
        max_model_len: Some(256),
        max_num_batched_tokens: 256,
        max_num_seqs: 8,
        kv_cache_memory_bytes: 1 << 20,
        gpu_memory_utilization: 0.9,
        num_gpu_blocks_override: Some(64),
        seed: 0,
        load_format: Default::default(),
        attention_backend: Default::default(),
        execute_model_timeout_s: 300.0,
        enforce_eager: false,
        disable_custom_all_reduce: false,
    }
}

fn runner(dir: &Path) -> ModelRunner {
    let mut r = ModelRunner::load(&worker_config(dir)).unwrap();
    let p = r.profile().unwrap();
    r.initialize_kv_cache(p.num_available_blocks).unwrap();
    r
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: 64,
        ..Default::default()
    }
}

fn new_req(id: &str, prompt: &[u32], blocks: &[u32], scheduled: u32) -> SchedulerOutput {
    SchedulerOutput {
        scheduled_new_reqs: vec![NewRequestData {
            req_id: id.into(),
            prompt_token_ids: prompt.to_vec(),
            output_token_ids: vec![],
            sampling_params: greedy(),
            block_ids: blocks.to_vec(),
            num_computed_tokens: 0,
        }],
        num_scheduled_tokens: vec![(id.into(), scheduled)],
        total_num_scheduled_tokens: scheduled,
        ..Default::default()
    }
}

fn cached(
    id: &str,
    new_tokens: &[u32],
    new_blocks: &[u32],
    computed: u32,
    scheduled: u32,
) -> SchedulerOutput {
    SchedulerOutput {
        scheduled_cached_reqs: vec![CachedRequestData {
            req_id: id.into(),
            new_token_ids: new_tokens.to_vec(),
            new_block_ids: new_blocks.to_vec(),
            num_computed_tokens: computed,
            num_output_placeholders: 0,
        }],
        num_scheduled_tokens: vec![(id.into(), scheduled)],
        total_num_scheduled_tokens: scheduled,
        ..Default::default()
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 256)
        .collect()
}

fn tiny(dir: &Path, arch: ModelType, tied: bool) {
    let spec = TinyModelSpec {
        tie_word_embeddings: tied,
        seed: 3,
        ..TinyModelSpec::tiny(arch)
    };
    write_tiny_model(dir, &spec).unwrap();
}

#[test]
fn tiny_model_round_trip_every_architecture_tied_and_untied() {
    for arch in [ModelType::Qwen3, ModelType::Qwen2, ModelType::Llama] {
        for tied in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            tiny(dir.path(), arch, tied);
            let has_head = vllm_worker::weights::Weights::open(dir.path())
                .unwrap()
                .contains("lm_head.weight");
            assert_eq!(has_head, !tied);
            let mut r = runner(dir.path());
            assert_eq!(
                r.model_config().architecture.hf_name(),
                arch.hf_architecture()
            );
            let p = prompt(9, 1);
            let logits = r.execute_logits(&new_req("a", &p, &[0, 1, 2], 9)).unwrap();
            assert_eq!(logits.len(), 1);
            let row = &logits[0].1;
            assert_eq!(row.len(), 512);
            assert!(
                row.iter().all(|v| v.is_finite()),
                "{arch:?} tied={tied}: non-finite logits"
            );
            let mean = row.iter().sum::<f32>() / row.len() as f32;
            let std = (row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / row.len() as f32)
                .sqrt();
            assert!(
                std >= 2.0,
                "{arch:?} tied={tied}: logit std {std} too small for well-defined greedy"
            );
            // The served greedy path on a fresh runner samples this row's argmax.
            let mut r2 = runner(dir.path());
            let out = r2.execute_model(&new_req("a", &p, &[0, 1, 2], 9)).unwrap();
            assert_eq!(out.sampled.len(), 1);
            assert_eq!(out.sampled[0].token_id, argmax(row));
        }
    }
}

#[test]
fn tokenizer_decodes_every_id_and_files_are_complete() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), ModelType::Qwen3, true);
    let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    for id in 0..512u32 {
        tok.decode(&[id], false)
            .unwrap_or_else(|e| panic!("id {id} does not decode: {e}"));
    }
    let (eot, im_start, im_end) = special_token_ids();
    let enc = tok
        .encode("<|im_start|>user\nHello the world<|im_end|>", false)
        .unwrap();
    assert_eq!(enc.get_ids()[0], im_start);
    assert_eq!(*enc.get_ids().last().unwrap(), im_end);
    assert_eq!(
        tok.decode(enc.get_ids(), false).unwrap(),
        "<|im_start|>user\nHello the world<|im_end|>"
    );
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert!(cfg["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    assert_eq!(cfg["eos_token"], "<|im_end|>");
    assert!(cfg["bos_token"].is_null());
    let gen: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("generation_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(gen["eos_token_id"], serde_json::json!([im_end, eot]));
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let spec = TinyModelSpec {
        dtype: TinyDtype::F32,
        seed: 9,
        ..TinyModelSpec::tiny(ModelType::Qwen2)
    };
    let single = tempfile::tempdir().unwrap();
    write_tiny_model(single.path(), &spec).unwrap();
    let sharded = tempfile::tempdir().unwrap();
    write_tiny_model(sharded.path(), &spec).unwrap();
    std::fs::remove_file(sharded.path().join("model.safetensors")).unwrap();
    let tensors = tiny_model_tensors(&spec);
    let (a, b) = tensors.split_at(tensors.len() / 2);
    write_safetensors(
        &sharded.path().join("model-00001-of-00002.safetensors"),
        a,
        TinyDtype::F32,
    )
    .unwrap();
    write_safetensors(
        &sharded.path().join("model-00002-of-00002.safetensors"),
        b,
        TinyDtype::F32,
    )
    .unwrap();
    let mut map = serde_json::Map::new();
    for (name, _, _) in a {
        map.insert(name.clone(), "model-00001-of-00002.safetensors".into());
    }
    for (name, _, _) in b {
        map.insert(name.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let p = prompt(6, 2);
    let x = runner(single.path())
        .execute_logits(&new_req("a", &p, &[0, 1], 6))
        .unwrap();
    let y = runner(sharded.path())
        .execute_logits(&new_req("a", &p, &[0, 1], 6))
        .unwrap();
    assert_eq!(x, y);

    // Dropping a shard's tensor gives an error naming it.
    write_safetensors(
        &sharded.path().join("model-00002-of-00002.safetensors"),
        &b[1..],
        TinyDtype::F32,
    )
    .unwrap();
    let err = format!(
        "{:#}",
        ModelRunner::load(&worker_config(sharded.path()))
            .err()
            .unwrap()
    );
    assert!(err.contains(&b[0].0), "{err}");
}

#[test]
fn shape_mismatch_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinyModelSpec::tiny(ModelType::Llama);
    write_tiny_model(dir.path(), &spec).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    cfg["intermediate_size"] = 96.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let err = format!(
        "{:#}",
        ModelRunner::load(&worker_config(dir.path())).err().unwrap()
    );
    assert!(
        err.contains("mlp.gate_proj.weight")
            && err.contains("[128, 64]")
            && err.contains("[96, 64]"),
        "{err}"
    );
}

#[test]
fn chunked_prefill_matches_one_shot_prefill() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), ModelType::Qwen3, true);
    let p = prompt(20, 3);
    let blocks: Vec<u32> = (0..5).collect();
    let one_shot = runner(dir.path())
        .execute_logits(&new_req("a", &p, &blocks, 20))
        .unwrap();

    let mut r = runner(dir.path());
    // Chunks of 7, 6 and 7 tokens; block ids arrive as the chunks need them.
    assert!(r
        .execute_logits(&new_req("a", &p, &blocks[..2], 7))
        .unwrap()
        .is_empty());
    assert!(r
        .execute_logits(&cached("a", &[], &blocks[2..4], 7, 6))
        .unwrap()
        .is_empty());
    let chunked = r
        .execute_logits(&cached("a", &[], &blocks[4..], 13, 7))
        .unwrap();
    assert_eq!(chunked, one_shot);
    assert_eq!(chunked[0].1, reference_logits(dir.path(), &p).unwrap());
}

#[test]
fn decode_through_shuffled_blocks_matches_contiguous_blocks() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), ModelType::Llama, false);
    let p = prompt(10, 4);
    let run = |blocks: &[u32]| -> Vec<Vec<f32>> {
        let mut r = runner(dir.path());
        let mut rows = vec![
            r.execute_logits(&new_req("a", &p, &blocks[..3], 10))
                .unwrap()
                .remove(0)
                .1,
        ];
        for len in 10u32..15 {
            let next = argmax(rows.last().unwrap());
            let need = (len as usize + 1).div_ceil(BLOCK_SIZE as usize);
            let have = (len as usize).div_ceil(BLOCK_SIZE as usize);
            let so = cached("a", &[next], &blocks[have..need], len, 1);
            rows.push(r.execute_logits(&so).unwrap().remove(0).1);
        }
        rows
    };
    let contiguous = run(&[0, 1, 2, 3, 4, 5]);
    let shuffled = run(&[41, 7, 63, 0, 22, 13]);
    assert_eq!(contiguous, shuffled);
}

#[test]
fn served_greedy_matches_reference_with_batching_and_chunking() {
    for arch in [ModelType::Qwen3, ModelType::Qwen2, ModelType::Llama] {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path(), arch, arch != ModelType::Llama);
        let (pa, pb) = (prompt(13, 5), prompt(6, 6));
        let max_tokens = 8;
        let want_a = greedy_reference(dir.path(), &pa, max_tokens).unwrap();
        let want_b = greedy_reference(dir.path(), &pb, max_tokens).unwrap();

        let mut r = runner(dir.path());
        // Step 1: a's first chunk (5 tokens) and all of b (6 tokens), b samples.
        let mut so = new_req("a", &pa, &[10, 3], 5);
        so.scheduled_new_reqs
            .extend(new_req("b", &pb, &[30, 8], 6).scheduled_new_reqs);
        so.num_scheduled_tokens.push(("b".into(), 6));
        so.total_num_scheduled_tokens = 11;
        let out = r.execute_model(&so).unwrap();
        assert_eq!(out.sampled.len(), 1);
        assert_eq!(out.sampled[0].req_id, "b");
        let mut got_b = vec![out.sampled[0].token_id];
        // Step 2: the rest of a's prompt (8 tokens) and b's first decode.
        let step2 = SchedulerOutput {
            scheduled_cached_reqs: vec![
                CachedRequestData {
                    req_id: "a".into(),
                    new_token_ids: vec![],
                    new_block_ids: vec![17, 5],
                    num_computed_tokens: 5,
                    num_output_placeholders: 0,
                },
                CachedRequestData {
                    req_id: "b".into(),
                    new_token_ids: got_b.clone(),
                    new_block_ids: vec![],
                    num_computed_tokens: 6,
                    num_output_placeholders: 0,
                },
            ],
            num_scheduled_tokens: vec![("a".into(), 8), ("b".into(), 1)],
            total_num_scheduled_tokens: 9,
            ..Default::default()
        };
        let out = r.execute_model(&step2).unwrap();
        let ids: Vec<&str> = out.sampled.iter().map(|s| s.req_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        let mut got_a = vec![out.sampled[0].token_id];
        got_b.push(out.sampled[1].token_id);
        // Decode both until max_tokens, growing block tables as needed.
        let mut next_block = 40u32;
        let (mut len_a, mut len_b) = (13u32, 7u32);
        while got_a.len() < max_tokens {
            let mut deltas = Vec::new();
            let mut sched = Vec::new();
            for (id, len, got) in [("a", &mut len_a, &got_a), ("b", &mut len_b, &got_b)] {
                if got.len() >= max_tokens {
                    continue;
                }
                let grow = *len % BLOCK_SIZE == 0;
                let new_blocks = if grow {
                    next_block += 1;
                    vec![next_block]
                } else {
                    vec![]
                };
                deltas.push(CachedRequestData {
                    req_id: id.into(),
                    new_token_ids: vec![*got.last().unwrap()],
                    new_block_ids: new_blocks,
                    num_computed_tokens: *len,
                    num_output_placeholders: 0,
                });
                sched.push((id.to_string(), 1));
                *len += 1;
            }
            let n = sched.len() as u32;
            let so = SchedulerOutput {
                scheduled_cached_reqs: deltas,
                num_scheduled_tokens: sched,
                total_num_scheduled_tokens: n,
                finished_req_ids: if got_b.len() >= max_tokens {
                    vec!["b".into()]
                } else {
                    vec![]
                },
                ..Default::default()
            };
            for s in r.execute_model(&so).unwrap().sampled {
                if s.req_id == "a" {
                    got_a.push(s.token_id)
                } else {
                    got_b.push(s.token_id)
                }
            }
        }
        assert_eq!(got_a, want_a, "{arch:?}: request a");
        assert_eq!(got_b, want_b, "{arch:?}: request b");
    }
}
