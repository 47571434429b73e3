//! `vllm-rs generate` (one prompt, printed as it streams) and `vllm-rs make-tiny-model`.

use std::io::Write;

use anyhow::bail;
use vllm_protocol::SamplingParams;

use crate::async_llm::AsyncLLM;
use crate::cli::{GenerateArgs, MakeTinyModelArgs};
use crate::output_processor::TextOptions;

/// Prints the completion of `--prompt` to stdout as it is generated. Returns the exit code.
pub async fn generate(args: GenerateArgs) -> anyhow::Result<i32> {
    let llm = AsyncLLM::start(&args.engine).await?;
    let result = run_one(&llm, &args).await;
    llm.shutdown().await;
    result.map(|()| 0)
}

async fn run_one(llm: &AsyncLLM, args: &GenerateArgs) -> anyhow::Result<()> {
    let prompt = llm.tokenizer.encode(&args.prompt, true)?;
    if prompt.len() as u32 >= llm.max_model_len() {
        bail!(
            "the prompt has {} tokens, which does not fit the model's context length of {}",
            prompt.len(),
            llm.max_model_len()
        );
    }
    let params = SamplingParams {
        seed: args.sampling_seed,
        max_tokens: args
            .max_tokens
            .min(llm.max_model_len() - prompt.len() as u32),
        ..args.sampling.params()
    };
    params.validate(llm.client.ready.model.vocab_size)?;
    let text = TextOptions {
        skip_special_tokens: true,
        ..Default::default()
    };
    let mut stream = llm.generate("generate-0".into(), prompt, params, text, 0, None)?;
    let mut stdout = std::io::stdout();
    while let Some(out) = stream.next().await {
        if let Some(err) = out.error {
            bail!("{err}");
        }
        write!(stdout, "{}", out.text)?;
        stdout.flush()?;
    }
    writeln!(stdout)?;
    Ok(())
}

pub fn make_tiny_model(args: &MakeTinyModelArgs) -> anyhow::Result<()> {
    use vllm_fixtures::{write_tiny_model, TinyModelSpec};
    let Some(mut spec) = TinyModelSpec::preset(&args.preset) else {
        bail!("unknown preset {:?}", args.preset);
    };
    spec.seed = args.seed;
    write_tiny_model(&args.out, &spec)?;
    println!("wrote {} to {}", args.preset, args.out.display());
    Ok(())
}
