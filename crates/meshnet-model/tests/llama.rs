#![allow(clippy::unwrap_used)]
//! Llama spans on the default model: split equals whole exactly, the KV cache equals
//! recomputation, and greedy tokens equal candle-transformers' own quantized Llama.

mod common;

use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use meshnet_model::{
    BoundaryPolicy, GenerationRequest, LlamaSpan, Route, SessionId, SpanSpec, Stage, argmax,
    generate,
};
use meshnet_types::{LayerSpan, Quantization};

/// The whole model in one span, loaded once per test binary.
fn whole() -> &'static LlamaSpan {
    static WHOLE: OnceLock<LlamaSpan> = OnceLock::new();
    WHOLE.get_or_init(|| {
        let model = common::model();
        LlamaSpan::load(model, &SpanSpec::whole(model.description())).unwrap()
    })
}

/// The whole model requantised to Q8_0 (candle's fast kernels), for the longer tests.
fn whole_q8() -> &'static LlamaSpan {
    static WHOLE: OnceLock<LlamaSpan> = OnceLock::new();
    WHOLE.get_or_init(|| {
        let model = common::model();
        let spec = SpanSpec::whole(model.description()).with_quantization(Quantization::Q8_0);
        LlamaSpan::load(model, &spec).unwrap()
    })
}

fn whole_q8_route() -> Route<'static> {
    Route {
        embedder: whole_q8(),
        stages: vec![whole_q8()],
        head: whole_q8(),
        boundary: BoundaryPolicy::F32,
    }
}

fn whole_route() -> Route<'static> {
    Route {
        embedder: whole(),
        stages: vec![whole()],
        head: whole(),
        boundary: BoundaryPolicy::F32,
    }
}

/// A prompt longer than one 128-token prefill chunk.
fn long_prompt() -> Vec<u32> {
    let text =
        "The history of the city begins with a small fishing village on the river. ".repeat(10);
    let ids = common::tokenizer().encode(&text).unwrap();
    assert!(ids.len() > 128 && ids.len() < 200, "{} tokens", ids.len());
    ids
}

#[test]
fn split_equals_whole_exactly_with_f32_hand_off() {
    let model = common::model();
    let spec = |layers: std::ops::Range<u32>, embedding, head| SpanSpec {
        embedding,
        head,
        ..SpanSpec::layers(LayerSpan::new(layers.start, layers.end))
            .with_quantization(Quantization::Q8_0)
    };
    let first = LlamaSpan::load(model, &spec(0..10, true, false)).unwrap();
    let middle = LlamaSpan::load(model, &spec(10..20, false, false)).unwrap();
    let last = LlamaSpan::load(model, &spec(20..30, false, true)).unwrap();
    assert!(first.has_embedding() && !first.has_head());
    assert!(!middle.has_embedding() && !middle.has_head());
    assert!(last.has_head() && !last.has_embedding());
    let split = Route {
        embedder: &first,
        stages: vec![&first, &middle, &last],
        head: &last,
        boundary: BoundaryPolicy::F32,
    };
    let mut request = GenerationRequest::greedy(long_prompt(), 5);
    request.record_logits = true;
    let whole_run = generate(&whole_q8_route(), &request, None).unwrap();
    let split_run = generate(&split, &request, None).unwrap();
    assert_eq!(whole_run.tokens, split_run.tokens);
    assert_eq!(whole_run.logits.len(), 5);
    for (step, (a, b)) in whole_run.logits.iter().zip(&split_run.logits).enumerate() {
        let same_bits = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same_bits, "logits differ at step {step}");
    }
    // Sessions were ended on every stage.
    assert_eq!(first.kv_store().used_bytes(), 0);
    assert_eq!(middle.kv_store().used_bytes(), 0);
}

#[test]
fn kv_cache_decoding_equals_recomputing() {
    let prompt = long_prompt();
    let route = whole_q8_route();
    let mut request = GenerationRequest::greedy(prompt.clone(), 4);
    request.record_logits = true;
    let cached = generate(&route, &request, None).unwrap();

    let mut worst = 0f32;
    for (step, logits) in cached.logits.iter().enumerate() {
        let mut sequence = prompt.clone();
        sequence.extend_from_slice(&cached.tokens[..step]);
        // Recompute from scratch in a single chunk, in a fresh session.
        let session = SessionId::new_v4();
        let fresh = route.forward(session, 0, &sequence).unwrap();
        route.end_session(session);
        let difference = logits
            .iter()
            .zip(&fresh)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        worst = worst.max(difference);
        assert!(
            difference < 1e-2,
            "step {step}: max logit difference {difference}"
        );
        assert_eq!(argmax(logits), argmax(&fresh), "step {step}");
    }
    println!("KV cache vs recompute: max logit difference {worst:e}");
}

#[test]
fn sessions_share_weights_without_interfering() {
    let span = whole_q8();
    let route = whole_q8_route();
    let prompts = common::prompts();
    let (a, b) = (SessionId::new_v4(), SessionId::new_v4());
    // Interleave two sessions on the same span.
    let first_a = route.forward(a, 0, &prompts[0]).unwrap();
    let first_b = route.forward(b, 0, &prompts[1]).unwrap();
    let next_a = route
        .forward(a, prompts[0].len(), &[argmax(&first_a)])
        .unwrap();
    let next_b = route
        .forward(b, prompts[1].len(), &[argmax(&first_b)])
        .unwrap();
    // Alone, each gives the same.
    let alone = SessionId::new_v4();
    route.forward(alone, 0, &prompts[1]).unwrap();
    let alone_b = route
        .forward(alone, prompts[1].len(), &[argmax(&first_b)])
        .unwrap();
    assert_eq!(alone_b, next_b);
    assert_ne!(next_a, next_b);
    // A gap in positions is an error that names the session.
    let error = route.forward(a, prompts[0].len() + 5, &[1]).unwrap_err();
    assert!(error.to_string().contains("gap"), "{error}");
    for session in [a, b, alone] {
        span.end_session(session);
    }
    assert_eq!(span.kv_store().used_bytes(), 0);
}

#[test]
fn matches_candle_transformers_quantized_llama() {
    use candle_core::quantized::gguf_file;
    use candle_transformers::models::quantized_llama::ModelWeights;

    let path = common::model_path();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut reference = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let steps = 32;
    for (index, prompt) in common::prompts().iter().enumerate() {
        let ours = generate(
            &whole_route(),
            &GenerationRequest::greedy(prompt.clone(), steps),
            None,
        )
        .unwrap()
        .tokens;

        reference.clear_kv_cache();
        let mut theirs = Vec::new();
        let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mut logits = reference.forward(&input, 0).unwrap();
        let mut position = prompt.len();
        while theirs.len() < steps {
            let values = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
            let token = argmax(&values);
            theirs.push(token);
            let input = Tensor::new(&[token], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            logits = reference.forward(&input, position).unwrap();
            position += 1;
        }
        println!(
            "prompt {index}: {:?}",
            common::tokenizer().decode(&ours).unwrap()
        );
        assert_eq!(ours, theirs, "prompt {index}");
    }
}
