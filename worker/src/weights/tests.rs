//! Tests of weight loading: narrowing and fusing in every dtype, safetensors pass-through
//! and errors, dummy weights.

use std::borrow::Cow;

use ::safetensors::Dtype;

use super::*;
use crate::backend::{Backend, CpuBackend};
use vllm_fixtures::{write_safetensors, TinyDtype};

fn host(shape: Vec<usize>, seed: u32) -> HostTensor {
    let n = shape.iter().product();
    let data = (0..n)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
        .collect();
    HostTensor::new(shape, data)
}

/// `t` rounded through `dtype`, as the f32 path saw a checkpoint of that dtype.
fn rounded(t: &HostTensor, dtype: DType) -> HostTensor {
    HostTensor::new(
        t.shape.clone(),
        t.data.iter().map(|&v| dtype.round(v)).collect(),
    )
}

#[test]
fn raw_narrow_and_cat_equal_the_f32_path() {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let a = host(vec![12, 10], 1);
        let b = host(vec![5, 10], 2);
        let (ra, rb) = (rounded(&a, dtype), rounded(&b, dtype));
        let wa = WeightTensor::from_host(&a, dtype);
        let wb = WeightTensor::from_host(&b, dtype);
        assert_eq!(wa.to_host(), ra);

        assert_eq!(wa.clone().narrow(0, 3, 4).to_host(), ra.narrow(0, 3, 4));
        assert_eq!(wa.clone().narrow(1, 2, 5).to_host(), ra.narrow(1, 2, 5));
        assert_eq!(wa.clone().narrow(0, 0, 12), wa);
        let bias = host(vec![9], 3);
        assert_eq!(
            WeightTensor::from_host(&bias, dtype)
                .narrow(0, 4, 5)
                .to_host(),
            rounded(&bias, dtype).narrow(0, 4, 5)
        );

        let cat = WeightTensor::cat_rows(vec![wa.clone().narrow(0, 1, 3), wb.clone(), wa.clone()]);
        assert_eq!(cat.dtype, dtype);
        assert_eq!(
            cat.to_host(),
            HostTensor::cat_rows(&[ra.narrow(0, 1, 3), rb.clone(), ra.clone()])
        );
        assert_eq!(WeightTensor::cat_rows(vec![wb.clone()]), wb);
    }
    // Parts over several copy blocks.
    let (a, b) = (host(vec![1000, 700], 7), host(vec![300, 700], 8));
    let cat = WeightTensor::cat_rows(vec![
        WeightTensor::from_host(&a, DType::BF16),
        WeightTensor::from_host(&b, DType::BF16),
    ]);
    assert_eq!(
        cat.to_host(),
        HostTensor::cat_rows(&[rounded(&a, DType::BF16), rounded(&b, DType::BF16)])
    );
    // Parts of different dtypes meet in f32.
    let a = host(vec![2, 3], 4);
    let mixed = WeightTensor::cat_rows(vec![
        WeightTensor::from_host(&a, DType::BF16),
        WeightTensor::from_host(&a, DType::F32),
    ]);
    assert_eq!(mixed.dtype, DType::F32);
    assert_eq!(
        mixed.to_host(),
        HostTensor::cat_rows(&[rounded(&a, DType::BF16), a.clone()])
    );
}

#[test]
fn bf16_checkpoint_bytes_pass_through_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let a = host(vec![8, 6], 5);
    let tensors = vec![("w".to_string(), a.shape.clone(), a.data.clone())];
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &tensors,
        TinyDtype::BF16,
    )
    .unwrap();
    let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let weights = Weights::open(dir.path()).unwrap();
    let w = weights.get("w", &[8, 6]).unwrap();
    assert_eq!(w.dtype, DType::BF16);
    let expected = DType::BF16.encode(&a.data);
    assert_eq!(w.bytes().as_ref(), expected.as_slice());
    // Borrowed from the mmap, not copied: the same bytes end the file.
    assert!(matches!(w.bytes(), Cow::Borrowed(_)));
    assert!(file.ends_with(&expected));
    assert!(matches!(w.bytes_as(DType::BF16), Cow::Borrowed(b) if b == expected.as_slice()));
    let rows = w.clone().narrow(0, 2, 3);
    assert!(matches!(rows.bytes(), Cow::Borrowed(_)));
    assert_eq!(rows.bytes().as_ref(), &expected[2 * 6 * 2..5 * 6 * 2]);
    // Converted only when asked for another dtype; the CPU backend gets f32.
    assert_eq!(
        w.bytes_as(DType::F32).as_ref(),
        DType::F32.encode(&rounded(&a, DType::BF16).data).as_slice()
    );
    let cpu = CpuBackend::new();
    let t = cpu.upload_weight(&w).unwrap();
    assert_eq!(cpu.to_host(&t).unwrap(), rounded(&a, DType::BF16));
}

#[test]
fn loader_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let err = format!("{:#}", Weights::open(dir.path()).err().unwrap());
    assert!(err.contains("no *.safetensors weights"), "{err}");
    // Dummy weights read no file.
    let dummy = Weights::load(dir.path(), LoadFormat::Dummy, DType::BF16).unwrap();
    assert!(dummy.contains("anything"));
    assert_eq!(dummy.get("x.weight", &[3, 4]).unwrap().shape, [3, 4]);
    assert!(Weights::load(dir.path(), LoadFormat::Auto, DType::BF16).is_err());

    let a = host(vec![4, 2], 6);
    let tensors = vec![("w".to_string(), a.shape.clone(), a.data.clone())];
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &tensors,
        TinyDtype::F16,
    )
    .unwrap();
    let weights = Weights::load(dir.path(), LoadFormat::Safetensors, DType::F32).unwrap();
    let err = weights.get("v", &[4, 2]).err().unwrap().to_string();
    assert!(err.contains("checkpoint has no tensor `v`"), "{err}");
    let err = weights.get("w", &[2, 4]).err().unwrap().to_string();
    assert!(err.contains("has shape [4, 2], expected [2, 4]"), "{err}");
    assert_eq!(weights.get("w", &[4, 2]).unwrap().dtype, DType::F16);

    let ints: Vec<u8> = (0..8i32).flat_map(|i| i.to_le_bytes()).collect();
    let view = ::safetensors::tensor::TensorView::new(Dtype::I32, vec![8], &ints).unwrap();
    ::safetensors::serialize_to_file(
        vec![("i".to_string(), view)],
        None,
        &dir.path().join("model.safetensors"),
    )
    .unwrap();
    let weights = Weights::open(dir.path()).unwrap();
    let err = weights.get("i", &[8]).err().unwrap().to_string();
    assert!(err.contains("unsupported dtype I32"), "{err}");
}

#[test]
fn a_model_loads_from_dummy_weights_and_runs() {
    use crate::layers::TensorParallel;
    use crate::models::{variant_for, LlamaForCausalLM};
    use vllm_fixtures::{write_tiny_model, ModelType, TinyModelSpec};
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), &TinyModelSpec::tiny(ModelType::Qwen2)).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let cfg = crate::config::ModelConfig::from_model_dir(dir.path()).unwrap();
    let b = CpuBackend::new();
    let weights = Weights::load(dir.path(), LoadFormat::Dummy, b.weight_dtype()).unwrap();
    let load = || {
        LlamaForCausalLM::load(
            &b,
            &weights,
            &cfg,
            variant_for(&cfg),
            TensorParallel::SINGLE,
            16,
            |_| {},
        )
    };
    assert!(load().is_ok());
    let err = match Weights::load(dir.path(), LoadFormat::Auto, b.weight_dtype()) {
        Ok(_) => panic!("loaded weights from a folder without any"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("no *.safetensors weights"), "{err}");
}
