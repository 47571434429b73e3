//! Every message survives encode → decode unchanged, and bad frames are errors, not panics.

use vllm_protocol::*;

fn round_trip<M: WireMessage + PartialEq + std::fmt::Debug>(msg: M) {
    let frame = msg.encode().expect("encode");
    assert_eq!(M::decode(&frame).expect("decode"), msg);
}

fn request() -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: "cmpl-1".into(),
        prompt_token_ids: vec![1, 2, 3, 151_645],
        sampling_params: SamplingParams {
            temperature: 0.6,
            seed: Some(7),
            logit_bias: vec![(5, -1.5)],
            logprobs: Some(3),
            ..Default::default()
        },
        eos_token_ids: vec![151_645, 151_643],
        arrival_time: 1.5e9,
        priority: -2,
        parent_request_id: Some("cmpl-1".into()),
    }
}

#[test]
fn engine_inputs_round_trip() {
    round_trip(EngineCoreInput::Add(request()));
    round_trip(EngineCoreInput::Abort(vec!["a".into(), "b".into()]));
    round_trip(EngineCoreInput::Utility(UtilityCall {
        call_id: 9,
        method: UtilityMethod::GetStats,
    }));
    round_trip(EngineCoreInput::Shutdown(()));
}

#[test]
fn engine_events_round_trip() {
    let output = EngineCoreOutput {
        request_id: "cmpl-1".into(),
        new_token_ids: vec![42],
        new_logprobs: Some(vec![TokenLogprobs {
            token_id: 42,
            logprob: -0.25,
            rank: 1,
            top: vec![(42, -0.25), (7, -2.0)],
        }]),
        finish_reason: Some(FinishReason::Length),
        stop_reason: None,
        num_cached_tokens: 16,
        error: None,
    };
    round_trip(EngineCoreEvent::Outputs(EngineCoreOutputs {
        outputs: vec![
            output,
            EngineCoreOutput::failed("x".into(), "too long".into()),
        ],
        scheduler_stats: Some(SchedulerStats {
            num_running_reqs: 3,
            kv_cache_usage: 0.5,
            ..Default::default()
        }),
        timestamp: 12.0,
    }));
    round_trip(EngineCoreEvent::Register(Register {
        protocol_version: PROTOCOL_VERSION,
        rank: 0,
    }));
    round_trip(EngineCoreEvent::Dead("worker rank 0 died".into()));
    round_trip(EngineCoreEvent::Ready(EngineReady {
        protocol_version: PROTOCOL_VERSION,
        num_gpu_blocks: 100,
        block_size: 16,
        max_model_len: 4096,
        model: ModelInfo {
            architecture: "Qwen3ForCausalLM".into(),
            vocab_size: 10,
            num_hidden_layers: 2,
            max_model_len: 4096,
            dtype: "bfloat16".into(),
        },
        device: "cpu".into(),
    }));
}

#[test]
fn worker_messages_round_trip() {
    let out = SchedulerOutput {
        step_id: 3,
        scheduled_new_reqs: vec![NewRequestData {
            req_id: "r".into(),
            prompt_token_ids: vec![1, 2],
            output_token_ids: vec![3],
            sampling_params: SamplingParams::default(),
            block_ids: vec![4, 5],
            num_computed_tokens: 0,
        }],
        scheduled_cached_reqs: vec![CachedRequestData {
            req_id: "s".into(),
            new_token_ids: vec![9],
            new_block_ids: vec![],
            num_computed_tokens: 17,
        }],
        num_scheduled_tokens: vec![("r".into(), 3), ("s".into(), 1)],
        total_num_scheduled_tokens: 4,
        finished_req_ids: vec!["t".into()],
        preempted_req_ids: vec![],
    };
    round_trip(WorkerInput::Execute(out));
    round_trip(WorkerInput::InitializeKvCache(InitializeKvCache {
        num_blocks: 8,
    }));
    round_trip(WorkerEvent::Output(ModelRunnerOutput {
        step_id: 3,
        sampled: vec![SampledToken {
            req_id: "r".into(),
            token_id: 5,
            logprobs: None,
        }],
    }));
    round_trip(WorkerEvent::Failed("out of memory".into()));
    let init = DistributedInit {
        nccl_unique_id: Some((0..128).collect()),
    };
    round_trip(WorkerEvent::DistributedInit(init.clone()));
    round_trip(WorkerInput::InitDistributed(init));
    round_trip(WorkerInput::InitDistributed(DistributedInit {
        nccl_unique_id: None,
    }));
}

#[test]
fn malformed_frames_are_errors() {
    assert!(matches!(
        EngineCoreInput::decode(&[]),
        Err(FrameError::Empty)
    ));
    assert!(matches!(
        EngineCoreInput::decode(&[0x7f, 1, 2]),
        Err(FrameError::UnknownType(0x7f))
    ));
    // A valid type byte with garbage behind it.
    assert!(matches!(
        EngineCoreInput::decode(&[0x01, 0xc1, 0xff]),
        Err(FrameError::Payload { .. })
    ));
    // A frame for another socket is refused by its type byte.
    let frame = WorkerInput::Shutdown(()).encode().unwrap();
    assert!(matches!(
        EngineCoreInput::decode(&frame),
        Err(FrameError::UnknownType(0x23))
    ));
}
