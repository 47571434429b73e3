//! Every message survives encode → decode unchanged, and bad frames are errors, not panics:
//! the malformed cases below, and a fuzz run over mutations of every message's frame.

use vllm_fixtures::fuzz::{fuzz, Verdict};
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

fn engine_inputs() -> Vec<EngineCoreInput> {
    vec![
        EngineCoreInput::Add(request()),
        EngineCoreInput::Abort(vec!["a".into(), "b".into()]),
        EngineCoreInput::Utility(UtilityCall {
            call_id: 9,
            method: UtilityMethod::GetStats,
        }),
        EngineCoreInput::Utility(UtilityCall {
            call_id: 10,
            method: UtilityMethod::ResetPrefixCache,
        }),
        EngineCoreInput::Shutdown(()),
    ]
}

fn model_info() -> ModelInfo {
    ModelInfo {
        architecture: "Qwen3ForCausalLM".into(),
        vocab_size: 10,
        num_hidden_layers: 2,
        max_model_len: 4096,
        dtype: "bfloat16".into(),
    }
}

fn engine_events() -> Vec<EngineCoreEvent> {
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
    let stats = SchedulerStats {
        num_running_reqs: 3,
        kv_cache_usage: 0.5,
        ..Default::default()
    };
    vec![
        EngineCoreEvent::Outputs(EngineCoreOutputs {
            outputs: vec![
                output,
                EngineCoreOutput::failed("x".into(), "too long".into()),
            ],
            scheduler_stats: Some(stats.clone()),
            timestamp: 12.0,
        }),
        EngineCoreEvent::Register(Register {
            protocol_version: PROTOCOL_VERSION,
            rank: 0,
        }),
        EngineCoreEvent::Dead("worker rank 0 died".into()),
        EngineCoreEvent::StartupFailed("no such model".into()),
        EngineCoreEvent::Utility(UtilityResult {
            call_id: 9,
            output: UtilityOutput::Stats(stats),
        }),
        EngineCoreEvent::Utility(UtilityResult {
            call_id: 10,
            output: UtilityOutput::Failed("busy".into()),
        }),
        EngineCoreEvent::Ready(EngineReady {
            protocol_version: PROTOCOL_VERSION,
            num_gpu_blocks: 100,
            block_size: 16,
            max_model_len: 4096,
            model: model_info(),
            device: "cpu".into(),
        }),
    ]
}

fn worker_inputs() -> Vec<WorkerInput> {
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
            num_output_placeholders: 0,
        }],
        num_scheduled_tokens: vec![("r".into(), 3), ("s".into(), 1)],
        total_num_scheduled_tokens: 4,
        finished_req_ids: vec!["t".into()],
        preempted_req_ids: vec![],
    };
    vec![
        WorkerInput::Execute(out),
        WorkerInput::InitializeKvCache(InitializeKvCache { num_blocks: 8 }),
        WorkerInput::InitDistributed(nccl_id()),
        WorkerInput::InitDistributed(DistributedInit {
            nccl_unique_id: None,
        }),
        WorkerInput::Shutdown(()),
    ]
}

fn nccl_id() -> DistributedInit {
    DistributedInit {
        nccl_unique_id: Some((0..128).collect()),
    }
}

fn worker_events() -> Vec<WorkerEvent> {
    vec![
        WorkerEvent::Register(Register {
            protocol_version: PROTOCOL_VERSION,
            rank: 1,
        }),
        WorkerEvent::DistributedInit(nccl_id()),
        WorkerEvent::Profiled(WorkerProfile {
            rank: 1,
            num_available_blocks: 1000,
            model: model_info(),
            device: "cuda:1".into(),
        }),
        WorkerEvent::KvCacheReady(1),
        WorkerEvent::Output(ModelRunnerOutput {
            step_id: 3,
            sampled: vec![SampledToken {
                req_id: "r".into(),
                token_id: 5,
                logprobs: Some(TokenLogprobs {
                    token_id: 5,
                    logprob: -0.5,
                    rank: 2,
                    top: vec![(4, -0.1), (5, -0.5)],
                }),
            }],
        }),
        WorkerEvent::Failed("out of memory".into()),
    ]
}

#[test]
fn every_message_round_trips() {
    engine_inputs().into_iter().for_each(round_trip);
    engine_events().into_iter().for_each(round_trip);
    worker_inputs().into_iter().for_each(round_trip);
    worker_events().into_iter().for_each(round_trip);
}

/// Mutated frames of every message, each decoded as all four socket types: an error or a
/// message, never a panic. Frames that decode become seeds for further mutation.
#[test]
fn fuzz_frame_decoders() {
    fn frames<M: WireMessage>(msgs: Vec<M>) -> Vec<Vec<u8>> {
        msgs.iter().map(|m| m.encode().expect("encode")).collect()
    }
    let mut seeds = frames(engine_inputs());
    seeds.extend(frames(engine_events()));
    seeds.extend(frames(worker_inputs()));
    seeds.extend(frames(worker_events()));
    let dictionary: &[&[u8]] = &[
        b"request_id",
        b"prompt_token_ids",
        b"sampling_params",
        b"\xc0",
    ];
    let report = fuzz("wire frames", &seeds, dictionary, 3.0, |frame| {
        let decoded = [
            EngineCoreInput::decode(frame).is_ok(),
            EngineCoreEvent::decode(frame).is_ok(),
            WorkerInput::decode(frame).is_ok(),
            WorkerEvent::decode(frame).is_ok(),
        ];
        if decoded.contains(&true) {
            Verdict::Accepted
        } else {
            Verdict::Rejected
        }
    });
    println!("{report}");
    assert!(report.accepted > 0, "no mutated frame decoded: {report}");
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
    // A valid message with bytes behind it.
    let mut frame = EngineCoreInput::Shutdown(()).encode().unwrap();
    frame.push(0xc0);
    assert!(matches!(
        EngineCoreInput::decode(&frame),
        Err(FrameError::TrailingBytes {
            kind: 0x04,
            extra: 1
        })
    ));
    // A frame for another socket is refused by its type byte.
    let frame = WorkerInput::Shutdown(()).encode().unwrap();
    assert!(matches!(
        EngineCoreInput::decode(&frame),
        Err(FrameError::UnknownType(0x23))
    ));
}
