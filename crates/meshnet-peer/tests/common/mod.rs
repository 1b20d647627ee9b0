//! Whole meshes in one process: peers on the libp2p memory transport, HTTP on port 0, the real
//! default model.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use meshnet_p2p::TransportChoice;
use meshnet_peer::mesh_model::MeshModel;
use meshnet_peer::status::StatusReport;
use meshnet_peer::{PeerConfig, RunningPeer};

/// Announcement interval in these tests; peers expire after three.
pub const ANNOUNCE: Duration = Duration::from_millis(300);

/// KV tokens reserved per layer in these tests.
pub const KV_TOKENS: u64 = 1024;

/// How long any condition may take to come true.
pub const DEADLINE: Duration = Duration::from_secs(90);

/// What `meshnet-peer generate ARGS` prints (without its final newline), split at
/// `boundaries`, at most `max_tokens` tokens (the default model unless ARGS name one).
pub fn reference_generation(
    args: &[&str],
    boundaries: &[impl ToString],
    max_tokens: usize,
) -> String {
    let boundaries: Vec<String> = boundaries.iter().map(ToString::to_string).collect();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_meshnet-peer"))
        .arg("generate")
        .args(args)
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(["--boundaries", &boundaries.join(",")])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_owned()
}

/// What `meshnet-peer generate --chat` prints for `prompt` with the default model split at
/// `boundaries`: the text a mesh whose route has those boundaries must answer. Runs off the
/// async workers.
pub async fn reference_chat(prompt: &str, boundaries: &[u32], max_tokens: usize) -> String {
    let (prompt, boundaries) = (prompt.to_owned(), boundaries.to_vec());
    let model = model_path().display().to_string();
    tokio::task::spawn_blocking(move || {
        let args = ["--chat", "--prompt", &prompt, "--model", &model];
        reference_generation(&args, &boundaries, max_tokens)
    })
    .await
    .unwrap()
}

/// A loopback URL that refuses connections for as long as the returned socket lives: its port is
/// bound, so no server started alongside can be given it, but never listened on. (A port bound and
/// then freed can be handed to another test's server, which then answers in its place.)
pub fn refusing_endpoint() -> (tokio::net::TcpSocket, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}", socket.local_addr().unwrap());
    (socket, url)
}

/// The default model, which `scripts/fetch-model.sh` puts in place.
pub fn model_path() -> PathBuf {
    let path = meshnet_model::default_model_path();
    assert!(
        path.is_file(),
        "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
        path.display()
    );
    path
}

/// The default model, opened once per test binary and shared by every member it starts.
pub fn model() -> &'static Arc<MeshModel> {
    static MODEL: OnceLock<Arc<MeshModel>> = OnceLock::new();
    MODEL.get_or_init(|| Arc::new(MeshModel::open(&model_path()).unwrap()))
}

/// The `--memory` that holds exactly `layers` layers in the shipped format with the test's KV
/// reservation (with `tracker`, also the embedding and head), as `model-info --layers` sizes it.
pub fn memory_for(layers: u32, tracker: bool) -> u64 {
    model()
        .shape()
        .budget_for_layers(model().shipped_format(), KV_TOKENS, layers, tracker)
        .unwrap()
}

/// Copies the tiny GPT-2 fixture to a temporary directory, with a byte-level tokenizer of its
/// 256-entry vocabulary (one token per byte, no merges) saved as `tokenizer.json`.
pub fn gpt2_dir_with_tokenizer(name: &str) -> std::path::PathBuf {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../meshnet-model/tests/fixtures/gpt2-tiny");
    let dir = std::env::temp_dir().join(format!("meshnet-{name}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let vocab: tokenizers::models::bpe::Vocab = alphabet
        .iter()
        .enumerate()
        .map(|(id, c)| (c.to_string(), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .unwrap();
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
    dir
}

/// A fresh memory-transport address.
pub fn memory_addr() -> Multiaddr {
    format!("/memory/{}", rand_port()).parse().unwrap()
}

fn rand_port() -> u64 {
    let (a, b) = uuid::Uuid::new_v4().as_u64_pair();
    (a ^ b) >> 1
}

/// A config for an in-process peer holding at most `layers` layers.
pub fn config(tracker: bool, layers: u32, bootstrap: Vec<Multiaddr>) -> PeerConfig {
    let mut config = PeerConfig::new(model_path(), std::env::temp_dir());
    config.model = Some(Arc::clone(model()));
    config.tracker = tracker;
    config.keypair = Some(Keypair::generate_ed25519());
    config.transport = TransportChoice::Memory;
    config.p2p_listen = vec![memory_addr()];
    config.bootstrap = bootstrap;
    config.memory_bytes = memory_for(layers, tracker);
    config.announce_interval = ANNOUNCE;
    config.kv_tokens = KV_TOKENS;
    config.assume_reachable = true;
    config
}

/// Starts a tracker able to hold `layers` layers.
pub async fn tracker(layers: u32) -> RunningPeer {
    meshnet_peer::start(config(true, layers, vec![]))
        .await
        .unwrap()
}

/// Starts a tracker able to hold `layers` layers, with a signer of its grants (for frames
/// sent to its members by hand).
pub async fn tracker_and_signer(layers: u32) -> (RunningPeer, meshnet_peer::grants::GrantSigner) {
    let key = Keypair::generate_ed25519();
    let mut config = config(true, layers, vec![]);
    config.keypair = Some(key.clone());
    let tracker = meshnet_peer::start(config).await.unwrap();
    (tracker, meshnet_peer::grants::GrantSigner::new(key))
}

/// `signer`'s grant for `session` to a frame for `layers` at `endpoint`, the last hop.
pub fn grant_to(
    signer: &meshnet_peer::grants::GrantSigner,
    session: uuid::Uuid,
    layers: meshnet_types::LayerSpan,
    endpoint: &str,
) -> Option<Arc<str>> {
    let route =
        meshnet_wire::Route::new(vec![meshnet_wire::Hop::new(layers, endpoint).unwrap()]).unwrap();
    let (value, _) = signer
        .issue(session, route, Duration::from_secs(60))
        .unwrap();
    Some(value.into())
}

/// A bare control-plane node that joins the mesh through `via` as an ordinary member: what a
/// hostile volunteer forging tracker messages would run. Returns its handle and events.
pub async fn outsider(
    via: &RunningPeer,
) -> (
    meshnet_p2p::P2pHandle,
    tokio::sync::mpsc::Receiver<meshnet_p2p::P2pEvent>,
) {
    let mut config = meshnet_p2p::P2pConfig::new(
        Keypair::generate_ed25519(),
        via.model_id(),
        meshnet_p2p::Role::Peer {
            pinned_tracker: None,
        },
    );
    config.transport = TransportChoice::Memory;
    config.listen = vec![memory_addr()];
    config.bootstrap = via.p2p_addrs().await.unwrap();
    config.assume_reachable = true;
    meshnet_p2p::spawn(config).await.unwrap()
}

/// Starts a peer able to hold `layers` layers, bootstrapping from `via`.
pub async fn peer(layers: u32, via: &RunningPeer) -> RunningPeer {
    let bootstrap = via.p2p_addrs().await.unwrap();
    meshnet_peer::start(config(false, layers, bootstrap))
        .await
        .unwrap()
}

/// Waits until `condition` holds for the tracker's status, or fails after the deadline with
/// the last status.
pub async fn wait_for(
    what: &str,
    tracker: &RunningPeer,
    mut condition: impl FnMut(&StatusReport) -> bool,
) -> StatusReport {
    let started = Instant::now();
    loop {
        let status = tracker.status();
        if condition(&status) {
            return status;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "timed out waiting for {what}; last status:\n{}",
            serde_json::to_string_pretty(&status).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the tracker's map covers every layer with ready holders and every listed peer
/// holds exactly what the map says.
pub fn converged(status: &StatusReport, peers: &[&RunningPeer]) -> bool {
    let Some(coverage) = &status.coverage else {
        return false;
    };
    coverage.complete
        && peers.iter().all(|peer| {
            let holding: Vec<u32> = coverage
                .layers
                .iter()
                .filter(|layer| {
                    layer
                        .holders
                        .iter()
                        .any(|holder| &holder.peer == peer.peer_id())
                })
                .map(|layer| layer.layer)
                .collect();
            match peer.current_span() {
                Some(span) => {
                    let loaded: Vec<u32> =
                        (span.target.layers.start..span.target.layers.end).collect();
                    loaded == holding
                }
                None => holding.is_empty(),
            }
        })
}
