//! `meshnet-peer`: the peer's command line.
//!
//! - Without a subcommand it joins (or, with `--tracker`, starts) a mesh: it serves the span
//!   of layers the tracker assigns, and the tracker answers an OpenAI-style API.
//! - `generate` runs the whole model in this process — the reference for everything
//!   distributed — optionally split into spans at `--boundaries` with hidden states cast to
//!   bfloat16 between them, exactly as the wire does.
//! - `fetch-model [NAME]` puts a known model on disk: the default SmolLM2-135M-Instruct (Q4_1
//!   GGUF), or `gemma3-270m` (Gemma 3 270M, Q4_K_M) with its license notices.
//! - `model-info` sizes `--memory` budgets; `health URL` is a container healthcheck (exit 0 only
//!   on a 200).
//! - `status` prints a member's view of the mesh (coverage map, peers) as a table; `chat`
//!   talks to the mesh in the terminal, streaming answers (both in `terminal`).
//! - `tokenize` prints the ids of JSON strings read from standard input, one per line, with
//!   a model's tokenizer (in `tokenize`).
//! - `api-key hash` prints the `sha256:` form of a key read from standard input, for an
//!   `--api-keys` file without plaintext keys.

mod fetch;
mod run_config;
mod terminal;
mod tokenize;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use libp2p::Multiaddr;
use meshnet_model::{
    BoundaryPolicy, ChatMessage, DEFAULT_KV_BUDGET_BYTES, GenerationRequest, Model, SamplingConfig,
    SplitModel, StopConditions, TextSide, generate, split_specs,
};
use meshnet_peer::PeerConfig;
use meshnet_peer::mesh_model::MeshModel;
use meshnet_types::{PeerId, Quantization};

#[derive(Parser)]
#[command(
    name = "meshnet-peer",
    version,
    about = "A meshnet peer: serve a span of a model's layers in a mesh, or take the tracker role \
             and answer an OpenAI-style API",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Commands>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum Commands {
    /// Generate a continuation of a prompt with the model in this process.
    Generate(GenerateArgs),
    /// Download a known model (smollm2-135m, the default, or gemma3-270m) into
    /// $MESHNET_MODELS (default ~/.cache/meshnet), its license notices beside it, and print
    /// its path.
    FetchModel(FetchModelArgs),
    /// Print what a mesh needs to know about a model as JSON: its id, layers, and the memory
    /// a layer, the tracker's extra parts and the KV cache take (for sizing --memory).
    ModelInfo(ModelInfoArgs),
    /// Ask a member's `GET /health` (or any URL) and exit 0 only if it answers 200: a
    /// container healthcheck that needs no shell or curl.
    Health(HealthArgs),
    /// Print a member's view of the mesh as a table: the model, the tracker and its term, the
    /// coverage map and every peer with its span, state and path.
    Status(terminal::StatusArgs),
    /// Chat with the mesh in the terminal: each line of input is a question, answers stream
    /// as they are generated, followed by tokens/s. `/reset` forgets the conversation. A member
    /// started with --api-keys needs a key: set MESHNET_API_KEY.
    Chat(terminal::ChatArgs),
    /// Print an `X-Meshnet-Grant` header value signed with the tracker's identity (run it on
    /// the tracker's machine, with its --data-dir): members serve a hand-made `/forward` only
    /// with one.
    Grant(GrantArgs),
    /// Tools for the `--api-keys` file.
    ApiKey(ApiKeyArgs),
    /// Read one JSON string per line of standard input and print its token ids as one JSON
    /// array per line (no BOS, special tokens as plain text unless asked otherwise).
    Tokenize(tokenize::TokenizeArgs),
    /// Swarm keys of private meshes (`swarm-key new`).
    #[command(subcommand)]
    SwarmKey(SwarmKeyCommand),
}

/// What `swarm-key` does.
#[derive(Subcommand)]
enum SwarmKeyCommand {
    /// Write a new random swarm key (libp2p's swarm.key format, mode 0600) for a private
    /// mesh: give the file to every member with --swarm-key. An existing file is never
    /// overwritten.
    New {
        /// Where to write it.
        #[arg(long, value_name = "FILE", default_value = "swarm.key")]
        out: PathBuf,
    },
}

/// What `api-key` does.
#[derive(clap::Args)]
struct ApiKeyArgs {
    #[command(subcommand)]
    action: ApiKeyAction,
}

#[derive(Subcommand)]
enum ApiKeyAction {
    /// Read a key from the first line of standard input and print the `sha256:HEX` form an
    /// `--api-keys` file may hold instead of the key.
    Hash,
}

/// Which model `fetch-model` downloads.
#[derive(clap::Args)]
struct FetchModelArgs {
    /// The model's name.
    #[arg(default_value = meshnet_model::DEFAULT_MODEL_NAME)]
    name: String,
}

/// What `grant` signs.
#[derive(clap::Args)]
struct GrantArgs {
    /// The tracker's data directory (holding its identity key); default: the tracker's
    /// default data directory.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The session the grant is for (a UUID; the frame's X-Meshnet-Session).
    #[arg(long)]
    session: uuid::Uuid,
    /// Every hop of the route after the tracker, first first, in X-Meshnet-Route syntax:
    /// `start-end@endpoint,...` (a frame to the first hop names its layers in
    /// X-Meshnet-Layers and the rest in X-Meshnet-Route).
    #[arg(long)]
    route: String,
    /// Seconds the grant stays valid.
    #[arg(long, default_value_t = 900)]
    ttl: u64,
}

/// What `health` asks.
#[derive(clap::Args)]
struct HealthArgs {
    /// The URL to ask, e.g. http://127.0.0.1:8080/health.
    url: String,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
}

/// What `model-info` is asked.
#[derive(clap::Args)]
struct ModelInfoArgs {
    /// The GGUF file or GPT-2 directory (default: the fetched SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<PathBuf>,
    /// KV-cache tokens reserved per held layer, as for --kv-tokens.
    #[arg(long, default_value_t = 2048)]
    kv_tokens: u64,
    /// Also print `memory_for_layers`: the --memory that holds exactly this many layers
    /// (with --tracker, plus the embedding and head), with half a layer of slack.
    #[arg(long, value_name = "N")]
    layers: Option<u32>,
    /// With --layers: size the tracker's budget.
    #[arg(long, requires = "layers")]
    tracker: bool,
    /// With --layers: the format the layers are held in (default: the model's own).
    #[arg(long, requires = "layers", value_parser = parse_format)]
    quantization: Option<Quantization>,
}

/// Joining or starting a mesh.
/// A member that lies on purpose (feature `faulty-member`, debug builds only).
#[cfg(feature = "faulty-member")]
#[derive(clap::Args)]
struct FaultArgs {
    /// Corrupt this fraction (0 to 1) of the frames this member's layers answer with.
    #[arg(long, value_name = "FRACTION")]
    corrupt_frames: Option<f64>,
    /// How a corrupted frame is changed: noise (a few values move a few percent) or sign (a
    /// few values change sign).
    #[arg(long, value_name = "MODE", default_value = "noise")]
    corrupt_mode: String,
    /// The seed that picks which frames are corrupted.
    #[arg(long, value_name = "N", default_value_t = 1)]
    corrupt_seed: u64,
}

#[cfg(feature = "faulty-member")]
impl FaultArgs {
    /// The corruption asked for, if any.
    fn frames(&self) -> anyhow::Result<Option<std::sync::Arc<meshnet_peer::faulty::FaultyFrames>>> {
        let Some(fraction) = self.corrupt_frames else {
            return Ok(None);
        };
        let mode = self.corrupt_mode.parse()?;
        let frames = meshnet_peer::faulty::FaultyFrames::new(fraction, mode, self.corrupt_seed)?;
        tracing::warn!(fraction, mode = ?mode, "this member corrupts frames on purpose");
        Ok(Some(std::sync::Arc::new(frames)))
    }
}

#[derive(clap::Args)]
struct RunArgs {
    /// The GGUF model every member of the mesh runs (default: the fetched
    /// SmolLM2-135M-Instruct).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Take the tracker role: hold the first layers, plan the mesh, answer the OpenAI API.
    #[arg(long)]
    tracker: bool,
    /// HTTP listen address (default: 127.0.0.1:8080 for the tracker, 127.0.0.1 on a free
    /// port for a peer).
    #[arg(long, value_name = "ADDR:PORT")]
    http: Option<SocketAddr>,
    /// The base URL other peers reach this one at (default: http:// and the bound address).
    #[arg(long, value_name = "URL")]
    advertise_http: Option<String>,
    /// libp2p listen address, repeatable (default: TCP and QUIC on all interfaces, port 4001
    /// for the tracker, a free port for a peer; TCP only with --swarm-key).
    #[arg(long = "p2p", value_name = "MULTIADDR")]
    p2p: Vec<Multiaddr>,
    /// The libp2p address other peers reach this one at, repeatable, when it is not where it
    /// listens (a port forward, a relay in front of it): announced instead of the listen
    /// addresses (with --reachable).
    #[arg(long, value_name = "MULTIADDR")]
    advertise_p2p: Vec<Multiaddr>,
    /// libp2p address of any member of the mesh, repeatable.
    #[arg(long, value_name = "MULTIADDR")]
    bootstrap: Vec<Multiaddr>,
    /// Run a private mesh: the swarm key file (made by `swarm-key new`) every member holds.
    /// Only members with the same key can connect over libp2p; QUIC is off.
    #[arg(long, value_name = "FILE")]
    swarm_key: Option<PathBuf>,
    /// A Jinja chat template file to render chat prompts with instead of the model's own
    /// (used when this member is or becomes the tracker).
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    #[cfg(feature = "faulty-member")]
    #[command(flatten)]
    faults: FaultArgs,
    /// Memory given to the mesh: weights plus KV cache (e.g. 512MiB, 2GB, or bytes).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    memory: u64,
    /// Formats this peer may hold layers in, repeatable: the model's own (e.g. q4_1) or q8_0
    /// (default: the model's own).
    #[arg(long, value_parser = parse_format)]
    quantization: Vec<Quantization>,
    /// Where the peer keeps its identity key (default: $MESHNET_DATA or
    /// ~/.local/share/meshnet/<tracker|peer>).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Seconds between announcements; a peer silent for three is dropped from the map. In a
    /// large mesh the tracker asks for a longer interval (at most 20 announcements heard a
    /// second) and members follow it.
    #[arg(long, default_value_t = 2.0)]
    announce_interval: f64,
    /// KV-cache tokens reserved per held layer.
    #[arg(long, default_value_t = 2048)]
    kv_tokens: u64,
    /// Generations the tracker runs at once; more wait in line.
    #[arg(long, default_value_t = 8)]
    max_sessions: usize,
    /// The most rows (tokens over all sessions) one pass over this peer's layers takes:
    /// concurrent sessions' decode steps and prefill chunks share each pass. 1 runs every
    /// chunk alone.
    #[arg(long, default_value_t = meshnet_peer::batcher::DEFAULT_MAX_BATCH_TOKENS)]
    max_batch_tokens: usize,
    /// Chunks of one prompt the tracker keeps travelling through the other peers at once: the
    /// next chunk is computed while the hops work on the last (pipelined prefill). 1 waits for
    /// each chunk's answer.
    #[arg(long, default_value_t = meshnet_peer::remote::DEFAULT_PREFILL_IN_FLIGHT)]
    prefill_chunks_in_flight: usize,
    /// Send every route's output back along the route instead of straight from its last hop
    /// to the tracker (which saves one link's delay per hop after the first on every token).
    #[arg(long)]
    no_direct_return: bool,
    /// The most tokens the tracker drafts from the context (prompt lookup) and verifies in
    /// one trip through the route (speculative decoding); the length adapts to how many are
    /// accepted, and drafts whose measured cost outweighs their expected saving are not sent.
    /// 0 turns it off.
    #[arg(long, default_value_t = meshnet_model::DEFAULT_MAX_DRAFT)]
    max_draft: usize,
    /// Decode one token per trip through the route (the same as `--max-draft 0`).
    #[arg(long)]
    no_speculation: bool,
    /// Requests the tracker keeps waiting for a generation slot (0: none); one more is
    /// answered 429.
    #[arg(long, default_value_t = 32)]
    max_queued_sessions: usize,
    /// Seconds a request waits in line for a generation slot before it is answered 429.
    #[arg(long, default_value_t = 60.0)]
    queue_timeout: f64,
    /// Treat the listen addresses as reachable by other peers (LAN, loopback, public host)
    /// instead of waiting for AutoNAT to confirm it.
    #[arg(long)]
    reachable: bool,
    /// Ask the router for a port mapping with UPnP.
    #[arg(long)]
    upnp: bool,
    /// Circuits the relay (run by the tracker and by `--reachable` members for members behind
    /// NAT) carries at once.
    #[arg(long, default_value_t = 64)]
    relay_max_circuits: usize,
    /// Circuits the relay carries at once for one peer.
    #[arg(long, default_value_t = 16)]
    relay_circuits_per_peer: usize,
    /// Hours one relayed circuit may stay open (circuits carry any number of bytes).
    #[arg(long, default_value_t = 24.0)]
    relay_circuit_hours: f64,
    /// Accept coverage maps and directives only from this tracker peer id.
    #[arg(long, value_name = "PEER_ID", value_parser = parse_peer_id)]
    tracker_id: Option<PeerId>,
    /// New routes a generation tries after a hop fails, before the client gets a 503.
    #[arg(long, default_value_t = 3)]
    failover_attempts: u32,
    /// Seconds a failing generation waits for some peer to serve layers nobody serves.
    #[arg(long, default_value_t = 60.0)]
    recover_timeout: f64,
    /// The share of the tracker's sessions checked against a second holder of every hop
    /// (0 to 1; ADR-0026).
    #[arg(long, default_value_t = meshnet_peer::verify::DEFAULT_SAMPLE_RATE, value_name = "RATE")]
    verify_sample: f64,
    /// Checked sessions a new member must pass before its sessions are only sampled (0: no
    /// probation).
    #[arg(long, default_value_t = meshnet_peer::verify::DEFAULT_PROBATION_SESSIONS, value_name = "N")]
    probation_sessions: u32,
    /// Hours a member caught returning wrong activations stays banned.
    #[arg(long, default_value_t = 24.0, value_name = "HOURS")]
    ban_hours: f64,
    /// Whether this peer may take over the tracker role when the tracker goes silent (only
    /// a peer the tracker names in its succession list does).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    tracker_capable: bool,
    /// A file of the keys the OpenAI-style API accepts, one a line with optional limits:
    /// `<key | sha256:HEX> [id=NAME] [rpm=N] [tpm=N]` (docs/openai-api.md). Without it the
    /// API is open to anyone who can reach the HTTP address.
    #[arg(long, value_name = "FILE")]
    api_keys: Option<PathBuf>,
    /// Seconds a stopping peer (SIGTERM, Ctrl-C) waits for its sessions to finish and its
    /// layers to be served by others before it exits anyway.
    #[arg(long, default_value_t = 30.0)]
    leave_timeout: f64,
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
    /// With --chat: a Jinja chat template file to use instead of the model's own.
    #[arg(long, value_name = "FILE", requires = "chat")]
    chat_template: Option<PathBuf>,
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
        Some(Commands::Generate(args)) => run_generate(&args),
        Some(Commands::FetchModel(args)) => fetch::fetch_model(&args.name),
        Some(Commands::ModelInfo(args)) => model_info(&args),
        Some(Commands::Health(args)) => health(&args),
        Some(Commands::Status(args)) => terminal::status(&args),
        Some(Commands::Chat(args)) => terminal::chat(&args),
        Some(Commands::Grant(args)) => grant(&args),
        Some(Commands::Tokenize(args)) => tokenize::tokenize(&args),
        Some(Commands::SwarmKey(SwarmKeyCommand::New { out })) => new_swarm_key(&out),
        Some(Commands::ApiKey(args)) => match args.action {
            ApiKeyAction::Hash => hash_api_key(),
        },
        None => run_peer(cli.run),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Parses a byte count: plain bytes, or a number with KB, MB, GB (powers of 1000) or KiB,
/// MiB, GiB (powers of 1024).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count such as 512MiB or 2GB"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (use KB, MB, GB, KiB, MiB or GiB)"
            ));
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{text:?} is not a usable memory size"));
    }
    Ok(bytes as u64)
}

fn parse_format(text: &str) -> Result<Quantization, String> {
    text.parse().map_err(|_| {
        format!("unknown quantization {text:?} (a mesh serves the model's own format or q8_0)")
    })
}

fn parse_peer_id(text: &str) -> Result<PeerId, String> {
    meshnet_p2p::parse_peer_id(text).map_err(|error| error.to_string())
}

/// `generate --quantization`: a format, or `as-shipped` (also `none`) for the file's own.
fn parse_generate_format(text: &str) -> anyhow::Result<Option<Quantization>> {
    match text.to_ascii_lowercase().as_str() {
        "as-shipped" | "asshipped" | "none" => Ok(None),
        _ => Ok(Some(parse_format(text).map_err(anyhow::Error::msg)?)),
    }
}

/// `meshnet-peer grant`: prints a grant signed with the identity in the data directory.
fn grant(args: &GrantArgs) -> anyhow::Result<()> {
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| default_data_dir(true));
    if !data_dir.join(meshnet_p2p::IDENTITY_FILE_NAME).exists() {
        anyhow::bail!(
            "no identity key in {}: give the tracker's --data-dir",
            data_dir.display()
        );
    }
    let keypair = meshnet_p2p::load_or_create_identity(&data_dir)?;
    let route = meshnet_wire::Route::parse(&args.route)
        .map_err(|error| anyhow::anyhow!("--route: {error}"))?;
    if route.is_empty() {
        anyhow::bail!("--route names no hop");
    }
    let signer = meshnet_peer::grants::GrantSigner::new(keypair);
    let (value, _) = signer
        .issue(args.session, route, Duration::from_secs(args.ttl))
        .map_err(|reason| anyhow::anyhow!(reason))?;
    println!("{value}");
    Ok(())
}

/// `meshnet-peer swarm-key new`: writes a new key and says where, with its fingerprint.
fn new_swarm_key(out: &Path) -> anyhow::Result<()> {
    let key = meshnet_p2p::SwarmKey::generate();
    meshnet_p2p::write_swarm_key(out, &key)?;
    println!(
        "wrote a new swarm key to {} (fingerprint {}); start every member with --swarm-key {}",
        out.display(),
        meshnet_p2p::swarm_key_fingerprint(&key),
        out.display()
    );
    Ok(())
}

fn default_data_dir(tracker: bool) -> PathBuf {
    if let Some(dir) = std::env::var_os("MESHNET_DATA").filter(|d| !d.is_empty()) {
        return dir.into();
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    Path::new(&home)
        .join(".local/share/meshnet")
        .join(if tracker { "tracker" } else { "peer" })
}

/// Takes an exclusive lock on the data directory so two peers never share an identity.
fn lock_data_dir(dir: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the data directory {}", dir.display()))?;
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "the data directory {} is in use by another meshnet-peer; give each peer its own \
             --data-dir",
            dir.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking {}", path.display()))
        }
    }
}

/// The model path given, or the default model, which must exist.
fn model_path_or_default(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let path = model
        .clone()
        .unwrap_or_else(meshnet_model::default_model_path);
    if !path.exists() {
        if model.is_none() {
            bail!(
                "the default model is not at {}: run `meshnet-peer fetch-model` or \
                 `bash scripts/fetch-model.sh` first, or pass --model",
                path.display()
            );
        }
        bail!("model file {} does not exist", path.display());
    }
    Ok(path)
}

/// The most of a health answer's body `health` reads and prints.
const HEALTH_BODY_LIMIT: usize = 64 * 1024;

/// `health URL`: prints the answer's body; fails unless the answer is 200.
fn health(args: &HealthArgs) -> anyhow::Result<()> {
    let url = reqwest::Url::parse(&args.url).with_context(|| {
        format!(
            "{:?} is not a URL such as http://127.0.0.1:8080/health",
            args.url
        )
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        bail!("{url} is not an http:// URL");
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= 86_400.0) {
        bail!(
            "--timeout must be a number of seconds above 0 and at most 86400, got {}",
            args.timeout
        );
    }
    let timeout = Duration::from_secs_f64(args.timeout);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (status, body) = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .context("building the HTTP client")?;
        let response = client
            .get(url.clone())
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        let status = response.status();
        let mut response = response;
        // A health answer is a line; whatever else a URL sends is not kept.
        let mut body = Vec::new();
        while body.len() < HEALTH_BODY_LIMIT
            && let Some(chunk) = response
                .chunk()
                .await
                .with_context(|| format!("reading the answer of {url}"))?
        {
            let room = HEALTH_BODY_LIMIT - body.len();
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        }
        anyhow::Ok((status, String::from_utf8_lossy(&body).into_owned()))
    })?;
    println!("{}", body.trim_end());
    if status != reqwest::StatusCode::OK {
        bail!("{url} answered {status}");
    }
    Ok(())
}

fn model_info(args: &ModelInfoArgs) -> anyhow::Result<()> {
    let path = model_path_or_default(args.model.clone())?;
    let model = MeshModel::open(&path)?;
    let shape = model.shape();
    let kv_tokens = args.kv_tokens;
    let layer_bytes: serde_json::Map<String, serde_json::Value> = shape
        .layer_bytes
        .iter()
        .map(|(format, bytes)| (format.name().to_owned(), (*bytes).into()))
        .collect();
    let layer_cost: serde_json::Map<String, serde_json::Value> = shape
        .layer_bytes
        .keys()
        .filter_map(|format| {
            let cost = shape.layer_cost(*format, kv_tokens)?;
            Some((format.name().to_owned(), cost.into()))
        })
        .collect();
    let mut info = serde_json::json!({
        "id": model.id(),
        "path": path,
        "architecture": model.description().architecture,
        "layers": model.num_layers(),
        "hidden": model.description().hidden,
        "context_length": model.description().context_length,
        "shipped_format": model.shipped_format().name(),
        "tensor_types": model.description().tensor_types,
        "bytes_per_layer_as_shipped": model.description().bytes_as_shipped.layers,
        "layer_bytes": layer_bytes,
        "kv_bytes_per_token_per_layer": shape.kv_bytes_per_token_per_layer,
        "kv_tokens": kv_tokens,
        "layer_cost_with_kv": layer_cost,
        "tracker_extra_bytes": shape.tracker_extra_bytes(),
        "chat_template": chat_template_source(model.model()),
        "tokenizer": tokenizer_kind(model.model()),
    });
    if let Some(layers) = args.layers {
        let format = args.quantization.unwrap_or(model.shipped_format());
        let budget = shape
            .budget_for_layers(format, kv_tokens, layers, args.tracker)
            .with_context(|| format!("this model cannot be held as {format}"))?;
        info["memory_for_layers"] = budget.into();
    }
    println!("{}", serde_json::to_string_pretty(&info)?);
    Ok(())
}

/// The tokenizer a model file names, for `model-info`: GGUF's `tokenizer.ggml.model` and
/// `tokenizer.ggml.pre` (`gpt2/smollm`, `llama`), or a GPT-2 directory's `tokenizer.json`.
fn tokenizer_kind(model: &Model) -> String {
    let Model::Llama(gguf) = model else {
        return meshnet_model::GPT2_TOKENIZER_FILE.to_owned();
    };
    let text = |key: &str| {
        gguf.content()
            .metadata
            .get(key)
            .and_then(|value| value.to_string().ok().cloned())
    };
    match (text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")) {
        (Some(kind), Some(pre)) => format!("{kind}/{pre}"),
        (Some(kind), None) => kind,
        (None, _) => "none".to_owned(),
    }
}

/// Where the chat template of `model` comes from, for `model-info` (or why it is unusable).
fn chat_template_source(model: &Model) -> Option<String> {
    match TextSide::of(model, None) {
        Ok(text) => text.template.map(|template| template.source().to_string()),
        Err(error) => Some(format!("unusable: {error}")),
    }
}

fn run_peer(args: RunArgs) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libp2p=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = PeerConfig::try_from(args)?;
    let _lock = lock_data_dir(&config.data_dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(config))
}

/// Runs a member until a stop signal (then leaves the mesh cleanly) or a fatal failure.
async fn serve(config: PeerConfig) -> anyhow::Result<()> {
    let leave_timeout = config.leave_timeout;
    let mut peer = meshnet_peer::start(config).await?;
    if let Err(error) = print_ready_line(&peer).await {
        // Standard output may be closed; the member serves all the same.
        tracing::warn!(error = %format!("{error:#}"), "could not print the ready line");
    }
    let progress = tokio::spawn(show_progress(peer.progress_handle()));
    let failure = tokio::select! {
        _ = wait_for_stop_signal() => None,
        reason = peer.failure() => Some(reason),
    };
    progress.abort();
    if failure.is_none() {
        leave(&mut peer, leave_timeout).await;
    }
    tracing::info!("stopping");
    // Open connections get a few seconds to finish; a second signal does not wait.
    tokio::select! {
        () = peer.shutdown() => {}
        () = tokio::time::sleep(SHUTDOWN_GRACE) => {
            tracing::warn!(grace = ?SHUTDOWN_GRACE, "connections still open; stopping anyway");
        }
        _ = wait_for_stop_signal(), if failure.is_none() => {
            tracing::warn!("second signal: stopping at once");
            std::process::exit(130);
        }
    }
    match failure {
        Some(reason) => bail!("{reason}"),
        None => Ok(()),
    }
}

/// Leaves the mesh: running sessions finish while others take over this member's layers,
/// for at most `timeout`; a second signal stops at once.
async fn leave(peer: &mut meshnet_peer::RunningPeer, timeout: Duration) {
    tracing::info!(
        ?timeout,
        "leaving the mesh: finishing running sessions while others take over this \
         peer's layers (a second signal stops at once)"
    );
    tokio::select! {
        outcome = peer.leave(timeout) => match outcome {
            meshnet_peer::LeaveOutcome::Clean { waited } => {
                tracing::info!(waited_ms = waited.as_millis() as u64, "left the mesh cleanly");
            }
            meshnet_peer::LeaveOutcome::TimedOut { sessions, covered } => {
                tracing::warn!(sessions, covered, "leaving timed out; stopping anyway");
            }
        },
        _ = wait_for_stop_signal() => {
            tracing::warn!("second signal: stopping at once");
            std::process::exit(130);
        }
    }
}

/// How long a stopping member waits for its connections to close.
/// Prints one JSON line on standard output once the member is up: its id, the HTTP base URL
/// others reach it at, the address its HTTP server is bound to and its libp2p listen
/// addresses. A script that starts it on port 0 reads the ports the system chose from here.
async fn print_ready_line(peer: &meshnet_peer::RunningPeer) -> anyhow::Result<()> {
    let p2p: Vec<String> = peer
        .p2p_addrs()
        .await?
        .iter()
        .map(ToString::to_string)
        .collect();
    let line = serde_json::json!({
        "event": "ready",
        "peer": peer.peer_id(),
        "http": peer.http_url(),
        "http_bound": peer.http_addr().to_string(),
        "p2p": p2p,
    });
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}

const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Draws a progress bar on a terminal's stderr while a span loads.
async fn show_progress(progress: meshnet_peer::span_host::LoadProgress) {
    let terminal = std::io::stderr().is_terminal();
    let mut shown = false;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match progress.get() {
            Some((done, total)) if terminal && total > 0 => {
                let width = 30;
                let filled = done * width / total;
                eprint!(
                    "\rloading layers [{}{}] {done}/{total}",
                    "#".repeat(filled),
                    ".".repeat(width - filled)
                );
                shown = true;
            }
            _ if shown => {
                eprintln!();
                shown = false;
            }
            _ => {}
        }
    }
}

async fn wait_for_stop_signal() {
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Fails, naming the file and the problem, when the chat template file at `path` cannot be
/// read or does not compile.
/// Reads and checks the `--api-keys` file; a problem names the file and the line.
fn load_api_keys(path: &Path) -> anyhow::Result<Vec<meshnet_apikeys::KeyEntry>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --api-keys {}", path.display()))?;
    meshnet_apikeys::parse_key_file(&text)
        .map_err(|error| anyhow::anyhow!("--api-keys {}: {error}", path.display()))
}

/// `api-key hash`: the `sha256:HEX` of the key on standard input's first line.
fn hash_api_key() -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .context("reading a key from standard input")?;
    let key = line.trim();
    if key.is_empty() {
        bail!("no key on standard input: give the key as the first line");
    }
    if key.contains(char::is_whitespace) {
        bail!("a key is one word: it has no spaces or tabs");
    }
    println!("sha256:{}", meshnet_apikeys::hash_key(key).to_hex());
    Ok(())
}

fn check_chat_template(path: &Path) -> anyhow::Result<()> {
    meshnet_model::ChatTemplate::from_file(path, meshnet_model::SpecialTokens::default())
        .with_context(|| format!("--chat-template {}", path.display()))?;
    Ok(())
}

/// Loads the model at `path` (a Llama GGUF file or a Hugging Face GPT-2 directory) split at
/// `boundaries`, with its text side (its chat template replaced by the file `chat_template`
/// when given).
fn load_model(
    path: &Path,
    boundaries: &[usize],
    quantization: Option<Quantization>,
    chat_template: Option<&Path>,
) -> anyhow::Result<(SplitModel<meshnet_model::ModelSpan>, TextSide)> {
    let model = Model::open(path)?;
    let text = TextSide::of(&model, chat_template)?;
    let specs = split_specs(
        model.description().layers,
        boundaries,
        quantization,
        DEFAULT_KV_BUDGET_BYTES,
    )?;
    let spans = specs
        .iter()
        .map(|spec| model.load_span(spec, &mut |_, _| {}))
        .collect::<Result<Vec<_>, _>>()
        .context("loading the model's spans")?;
    Ok((SplitModel::from_spans(spans), text))
}

fn run_generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let path = model_path_or_default(args.model.clone())?;
    let quantization = parse_generate_format(&args.quantization)?;
    let (split, text_side) = load_model(
        &path,
        &args.boundaries,
        quantization,
        args.chat_template.as_deref(),
    )?;
    let tokenizer = &text_side.tokenizer;
    let policy = if args.boundaries.is_empty() {
        BoundaryPolicy::F32
    } else {
        BoundaryPolicy::Bf16
    };
    let route = split.route(policy)?;

    let text = if args.chat {
        let Some(mut template) = text_side.template.clone() else {
            bail!("{} has no chat template: leave out --chat", path.display());
        };
        if !args.template_system {
            template = template.without_default_system();
        }
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::system(system.clone()));
        }
        messages.push(ChatMessage::user(args.prompt.clone()));
        template.render(&messages)?
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode_prompt(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut stop_tokens = text_side.stop_tokens.clone();
    if args.chat {
        stop_tokens.extend(text_side.end_of_turn);
    }
    let request = GenerationRequest {
        sampling: SamplingConfig {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..SamplingConfig::greedy()
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
